"""Rollout engines: the contract (:class:`RolloutEngine`) and an engine in plain torch over a
Hugging Face causal LM (:class:`TorchEngine`: batched sampling that tags every generated token with
the policy version that sampled it, and takes new weights between two decoding steps). The vLLM
engine (``vllm_engine.VLLMEngine``) keeps the same contract.

The contract: ``generate`` token ids → tokens, behaviour logprobs (of the distribution actually
sampled: temperature applied, no top-k/top-p filters) and per-token versions; ``pause``/``resume``;
``connect_weights`` (become a member of the trainer's :class:`~.weightsync.WeightHub`) and
``sync_weights(version)`` (take part in the announced sync and load it); ``version``. A weight
update during a generation is handled in one of two modes, as vLLM's ``pause_generation`` does:

- ``"keep"``: the requests stay where they are and continue under the new weights (their KV cache
  computed by the old ones is kept); tokens from then on carry the new version;
- ``"abort"``: the requests end with ``finish_reason="abort"`` and what they generated so far;
  :meth:`TorchEngine.generate_resumed` submits prompt + partial output again (AReaL's
  interruptible generation), so one trajectory's ``versions`` span the update.

Thread safety: ``generate`` runs on one thread; ``pause``, ``resume`` and ``load_weights`` may be
called from another (a weight-sync thread), and take effect at the next step boundary.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tqstream.errors import WeightSyncError

__all__ = ["Completion", "RolloutEngine", "TorchEngine"]


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (eos), "length" (max_new_tokens) or "abort" (a weight update)


class RolloutEngine(abc.ABC):
    """What the rollout worker needs of an engine (see the module's docstring)."""

    version: int
    update_mode: str

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Completion]:
        """Sample a completion for each prompt (token ids)."""

    @abc.abstractmethod
    def pause(self) -> None: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def connect_weights(self, host: str, port: int, member: int, *, backend: str = "gloo",
                        timeout: float = 300.0) -> None:  # fmt: skip
        """Receive weights as ``member`` of the :class:`~.weightsync.WeightHub` at host:port."""

    @abc.abstractmethod
    def sync_weights(self, version: int) -> None:
        """Take part in the hub's announced sync of ``version`` and load it (``update_mode``
        decides what becomes of generations in flight)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (idempotent)."""

    def rollout(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Completion]:
        """:meth:`generate`, or in ``"abort"`` mode :meth:`generate_resumed`: a completion each,
        whatever weight updates happen meanwhile."""
        if self.update_mode == "abort":
            return self.generate_resumed(prompts, max_new_tokens)
        return self.generate(prompts, max_new_tokens)

    def generate_resumed(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[Completion]:
        """``generate``, submitting aborted requests again with their partial output appended to
        the prompt until each stops or reaches ``max_new_tokens`` in all."""
        done: list[Completion | None] = [None] * len(prompts)
        parts = [Completion([], [], [], "") for _ in prompts]
        todo = list(range(len(prompts)))
        while todo:
            batch = [list(prompts[i]) + parts[i].tokens for i in todo]
            outs = self.generate(batch, max_new_tokens - min(len(parts[i].tokens) for i in todo))
            left = []
            for i, out in zip(todo, outs, strict=True):
                p = parts[i]
                room = max_new_tokens - len(p.tokens)
                p.tokens += out.tokens[:room]
                p.logprobs += out.logprobs[:room]
                p.versions += out.versions[:room]
                if out.finish_reason == "abort" and len(p.tokens) < max_new_tokens:
                    left.append(i)
                else:
                    reason = out.finish_reason
                    if len(p.tokens) >= max_new_tokens and reason != "stop":
                        reason = "length"
                    done[i] = Completion(p.tokens, p.logprobs, p.versions, reason)
            todo = left
        return [d for d in done if d is not None]


class TorchEngine(RolloutEngine):
    def __init__(
        self,
        model: Any,
        *,
        eos_id: int,
        pad_id: int,
        temperature: float = 1.0,
        version: int = 0,
        update_mode: str = "keep",
        seed: int | None = None,
    ) -> None:
        if update_mode not in ("keep", "abort"):
            raise ValueError(f"update_mode must be 'keep' or 'abort', got {update_mode!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.model = model.eval()
        self.eos_id, self.pad_id, self.temperature = eos_id, pad_id, temperature
        self.update_mode = update_mode
        self.version = version
        self._gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self._cond = threading.Condition()
        self._paused = False
        self._pending: tuple[Mapping[str, torch.Tensor], int] | None = None
        self._busy = False  # a generate is running: weights change only at its step boundaries
        self._receiver: Any = None

    # --- control (any thread) ---
    def pause(self) -> None:
        """Generation stops at the next step boundary until :meth:`resume`."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights: copied in now if nothing generates, else at the next step boundary."""
        with self._cond:
            self._pending = (weights, version)
            if not self._busy:
                self._swap()

    def _swap(self) -> bool:
        """Copy pending weights in (call holding ``_cond``); True if there were any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        weights, version = pending
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=True)
        self.version = version
        return True

    def connect_weights(self, host: str, port: int, member: int, *, backend: str = "gloo",
                        timeout: float = 300.0) -> None:  # fmt: skip
        from tqstream.reference.weightsync import WeightMeta, member_receiver

        expected = WeightMeta.of(self.model.state_dict())
        self._receiver = member_receiver(host, port, member, backend=backend, timeout=timeout,
                                         expected=expected)  # fmt: skip

    def sync_weights(self, version: int) -> None:
        if self._receiver is None:
            raise WeightSyncError("sync_weights before connect_weights: connect to the hub first")
        got, weights = self._receiver.receive(announced=version)
        # the receiver's buffer is reused by the next sync: the engine takes copies
        self.load_weights({k: t.clone() for k, t in weights.items()}, got)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.collective.close()
            self._receiver = None

    def _boundary(self) -> bool:
        """Between two steps: wait while paused, take new weights. True if the weights changed."""
        with self._cond:
            while self._paused:
                self._cond.wait()
            return self._swap()

    # --- generation (one thread) ---
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Completion]:
        """Sample a completion for each prompt (token ids), all in one batch."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        with self._cond:
            self._busy = True
        try:
            return self._generate(prompts, max_new_tokens)
        finally:
            with self._cond:
                self._busy = False
                self._swap()

    def _generate(self, prompts: Sequence[Sequence[int]], max_new: int) -> list[Completion]:
        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: the next token is at the end for all
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        outs = [Completion([], [], [], "length") for _ in range(n)]
        live = torch.ones(n, dtype=torch.bool)
        past = None
        step_ids = ids
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        step_pos = positions
        with torch.no_grad():
            for _ in range(max_new):
                if self._boundary() and self.update_mode == "abort":
                    for i in range(n):
                        if live[i]:
                            outs[i].finish_reason = "abort"
                    break
                out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                 past_key_values=past, use_cache=True)  # fmt: skip
                past = out.past_key_values
                logits = out.logits[:, -1, :].float() / self.temperature
                logp = torch.log_softmax(logits, dim=-1)
                tokens = torch.multinomial(logp.exp(), 1, generator=self._gen).squeeze(-1)
                chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
                for i in range(n):
                    if not live[i]:
                        continue
                    t = int(tokens[i])
                    outs[i].tokens.append(t)
                    outs[i].logprobs.append(float(chosen[i]))
                    outs[i].versions.append(self.version)
                    if t == self.eos_id:
                        outs[i].finish_reason = "stop"
                        live[i] = False
                if not live.any():
                    break
                tokens = torch.where(live, tokens, torch.full_like(tokens, self.pad_id))
                step_ids = tokens[:, None]
                mask = torch.cat([mask, live.long()[:, None]], dim=1)
                step_pos = positions[:, -1:] + 1
                positions = torch.cat([positions, step_pos], dim=1)
        return outs
