"""verl 0.9.1's TransferQueue path on tqstream, as a job: a driver, an agent-loop Ray actor and a
``tqbridge``-wrapped worker Ray actor, with ``TQSTREAM_TRANSFER_QUEUE=1`` set by the caller.

verl's own code does every TransferQueue call: the agent-loop worker runs verl's
``AgentLoopWorkerTQ.generate_sequences`` / ``_run_prompt`` / ``_agent_loop_postprocess`` (only the
LLM call is scripted: a worker without a model or a reward service), the driver samples with
verl's ``ReplayBuffer`` and the worker method is wrapped by verl's ``tqbridge``. Run by
tests/compat/test_verl.py; prints one ``ok: <what>`` line per checked property.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import NonTensorData, NonTensorStack, TensorDict

N_PROMPTS, N_SESSIONS, STEP = 4, 2, 1
CONF = {"backend": {"SimpleStorage": {"num_data_storage_units": 2, "total_storage_size": 64}}}
ROLLOUT = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "calculate_log_probs": True, "n": N_SESSIONS,
    "val_kwargs": {"top_p": 1.0, "top_k": -1, "temperature": 0.0, "n": 1},
    "agent": {"default_agent_loop": "scripted"},
}  # fmt: skip


def response_of(uid: str, session: int) -> list[int]:
    """The scripted LLM's answer to prompt ``uid`` in session ``session``: 3..10 tokens."""
    seed = sum(map(ord, uid)) + 7 * session
    return [100 + (seed + i) % 50 for i in range(3 + seed % 8)]


def prompt_of(i: int) -> list[int]:
    return [1 + i, 2 + i, 3 + i]


def scripted_worker_class() -> Any:
    """verl's AgentLoopWorkerTQ with its TransferQueue code, minus the LLM and reward services."""
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopMetrics,
        AgentLoopOutput,
        AgentLoopWorker,
    )
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    worker_tq = AgentLoopWorkerTQ.__ray_metadata__.modified_class

    class ScriptedAgentLoopWorker:
        generate_sequences = worker_tq.generate_sequences
        _run_prompt = worker_tq._run_prompt
        _agent_loop_postprocess = worker_tq._agent_loop_postprocess
        _compute_score = AgentLoopWorker._compute_score
        _compute_teacher_logprobs = AgentLoopWorker._compute_teacher_logprobs
        _compute_multi_modal_inputs = AgentLoopWorker._compute_multi_modal_inputs
        _compute_position_ids = AgentLoopWorker._compute_position_ids

        def __init__(self, config: Any) -> None:
            tq.init()  # a bare init attaches to the driver's cluster, as verl's worker does
            self.config = config
            self.background_tasks: set[asyncio.Task[Any]] = set()
            self.processor = None
            self.reward_loop_worker_handles = None
            self.distillation_enabled = False

        async def _run_agent_loop(
            self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,
            agent_name: str, trace: bool = True, **kwargs: Any,
        ) -> Any:  # fmt: skip
            uid, session = kwargs["uid"], kwargs["session_id"]
            response = response_of(uid, session)
            output = AgentLoopOutput(
                prompt_ids=list(kwargs["prompt_ids"]),
                response_ids=response,
                response_mask=[1] * len(response),
                response_logprobs=[-0.5] * len(response),
                reward_score=float(session),
                num_turns=2,
                metrics=AgentLoopMetrics(),
                extra_fields={
                    "min_global_steps": STEP, "max_global_steps": STEP,
                    "reward_extra_info": {"acc": float(session)},
                },
            )  # fmt: skip
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)

        async def drain(self) -> int:
            """Wait for the fire-and-forget sessions verl's generate_sequences started."""
            while self.background_tasks:
                await asyncio.gather(*list(self.background_tasks), return_exceptions=True)
            return 0

    return ScriptedAgentLoopWorker


class LogProbWorker:
    """A trainer worker whose method verl's tqbridge wraps: KVBatchMeta in, columns back."""

    def __init__(self) -> None:
        from verl.utils.transferqueue_utils import tqbridge

        self.compute_log_prob = tqbridge()(self._compute_log_prob)
        self.pid = os.getpid()

    def _compute_log_prob(self, data: TensorDict) -> TensorDict:
        responses = data["responses"]  # jagged: one row per trajectory
        log_probs = [-(r.float() / 1000.0) for r in responses.unbind()]
        return TensorDict(
            {
                "log_probs": torch.nested.as_nested_tensor(log_probs, layout=torch.jagged),
                "entropy": torch.ones(len(log_probs)),
            },
            batch_size=[len(log_probs)],
        )

    def run(self, meta: Any) -> Any:
        return self.compute_log_prob(meta)

    def where(self) -> int:
        return self.pid


def submit_prompts(worker: Any) -> list[str]:
    """The trainer's _submit_batch_to_rollout (sync mode): prompt rows with tags only, then the
    agent-loop worker generates every session of every prompt."""
    uids = [f"u{i}" for i in range(N_PROMPTS)]
    tags = [{"is_prompt": True, "status": "pending", "global_steps": STEP} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)
    batch = TensorDict(
        {
            "uid": NonTensorStack(*uids),
            "index": torch.arange(N_PROMPTS),
            "prompt_ids": NonTensorStack(*[prompt_of(i) for i in range(N_PROMPTS)]),
            "data_source": NonTensorStack(*["arith"] * N_PROMPTS),
            "raw_prompt": NonTensorStack(*[[{"role": "user", "content": f"{i}+1"}]
                                           for i in range(N_PROMPTS)]),
            "global_steps": NonTensorData(STEP),
        },
        batch_size=[N_PROMPTS],
    )  # fmt: skip
    ray.get(worker.generate_sequences.remote(batch))
    ray.get(worker.drain.remote())
    return uids


def check(name: str, ok: bool, detail: Any = "") -> None:
    if not ok:
        print(f"FAILED: {name} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {name}", flush=True)


def main() -> None:
    check("transfer_queue is tqstream's layer", tq.__name__ == "tqstream.compat.transfer_queue")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create(CONF))
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": ROLLOUT}})
    agent = ray.remote(num_cpus=0)(scripted_worker_class()).remote(config)
    uids = submit_prompts(agent)

    listing = tq.kv_list("train")["train"]
    check("prompt tags merged: is_prompt kept through status updates", all(
        listing[u] == {"is_prompt": True, "status": "finished", "global_steps": STEP} for u in uids
    ), listing)  # fmt: skip
    keys = [f"{u}_{s}_0" for u in uids for s in range(N_SESSIONS)]
    check("one trajectory row per session, with verl's tags", all(
        listing[k]["status"] == "success" and listing[k]["response_len"] == len(
            response_of(k.split("_")[0], int(k.split("_")[1])))
        for k in keys
    ), listing)  # fmt: skip

    buffer = ReplayBuffer("sync", OmegaConf.create({}), None, "drop", OmegaConf.create({}),
                          poll_interval=0.1)  # fmt: skip
    batch, _ = buffer.sample(STEP, "train", N_PROMPTS)
    check("ReplayBuffer samples every finished group", sorted(batch.keys) == sorted(keys), batch)
    check("the sampled prompts are cleared", not set(uids) & set(tq.kv_list("train")["train"]))

    data = tq.kv_batch_get(keys=batch.keys, partition_id="train",
                           select_fields=["responses", "prompts", "rollout_log_probs"])  # fmt: skip
    expected = [response_of(k.split("_")[0], int(k.split("_")[1])) for k in batch.keys]
    check("data back by key, in key order", [r.tolist() for r in data["responses"].unbind()]
          == expected)  # fmt: skip
    check("responses are jagged nested tensors", data["responses"].is_nested)

    worker = ray.remote(num_cpus=0)(LogProbWorker).remote()
    out = ray.get(worker.run.remote(batch))
    check("tqbridge returns the keys it wrote", sorted(out.keys) == sorted(batch.keys), out)
    check("the worker ran in another process", ray.get(worker.where.remote()) != os.getpid())
    later = tq.kv_batch_get(keys=batch.keys, partition_id="train",
                            select_fields=["log_probs", "entropy"])  # fmt: skip
    check("columns a worker added are visible to the driver", all(
        torch.equal(lp, -(torch.tensor(r).float() / 1000.0))
        for lp, r in zip(later["log_probs"].unbind(), expected, strict=True)
    ))  # fmt: skip
    tq.kv_batch_put(keys=batch.keys, partition_id="train",
                    fields=TensorDict({"entropy": torch.full((len(keys),), 2.0)},
                                      batch_size=[len(keys)]))  # fmt: skip
    check(
        "a column written again is replaced",
        bool(
            (
                tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields="entropy")[
                    "entropy"
                ]
                == 2.0
            ).all()
        ),
    )

    before = tq.kv_list()
    with tempfile.TemporaryDirectory() as tmp:
        tq.save_checkpoint(os.path.join(tmp, "ck"), metadata={"global_steps": STEP})
        tq.close()
        tq.init(OmegaConf.create(CONF))
        check("a new cluster starts empty", tq.kv_list() == {})
        tq.load_checkpoint(os.path.join(tmp, "ck"))
    check("checkpoint -> close -> init -> load restores keys and tags", tq.kv_list() == before)
    restored = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields="responses")
    check("... and the data", [r.tolist() for r in restored["responses"].unbind()] == expected)

    held = len(tq.kv_list("train")["train"])
    room = CONF["backend"]["SimpleStorage"]["total_storage_size"] - held
    fill = [f"fill{i}" for i in range(room)]
    tq.kv_batch_put(keys=fill, partition_id="train", tags=[{"i": i} for i in range(room)])
    try:
        tq.kv_batch_put(keys=["one-more"], partition_id="train", tags=[{}])
        check("total_storage_size caps the rows", False)
    except MemoryError as exc:
        check("total_storage_size caps the rows", "max_rows" in str(exc), exc)
    tq.kv_clear(keys=batch.keys, partition_id="train")
    tq.kv_batch_put(keys=["one-more"], partition_id="train", tags=[{}])
    check("clear frees room for new keys", "one-more" in tq.kv_list("train")["train"])
    tq.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
