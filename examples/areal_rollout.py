"""AReaL rollouts through tqstream, on the embedded default, on CPU, in seconds.

AReaL's own machinery produces: a ``WorkflowExecutor`` runs a ``RolloutWorkflow`` (a toy one:
each sample counts up from its prompt and is rewarded when it stops at the answer), grouped by
AReaL's ``GroupedRolloutWorkflow``. After ``tqstream.adapters.areal.install()`` the executor
builds tqstream's ``StalenessManager`` itself, its budget at the controller; its
``prepare_batch`` keeps as many episodes in flight as AReaL's capacity formula allows.
``ExperienceWorkflow`` stores each accepted group the moment it finishes. A trainer loop reads
whole groups through the head-version window (``prepare_batch``'s shape: one padded dict per
group), "trains", acks and publishes the next policy version, which moves the staleness budget.

    python examples/areal_rollout.py [--steps 5] [--prompts 2] [--group-size 4]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import threading
from typing import Any

import torch
from areal.api.cli_args import InferenceEngineConfig
from areal.api.workflow_api import RolloutWorkflow
from areal.infra.remote_inf_engine import GroupedRolloutWorkflow
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils.data import concat_padded_tensors
from torchdata.stateful_dataloader import StatefulDataLoader

import tqstream
from tqstream.adapters.areal import ArealExperience, ExperienceWorkflow, install


class Engine:
    """Stands in for AReaL's ``RemoteSGLangEngine``: only its policy version matters here."""

    def __init__(self) -> None:
        self.version = 0

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version


class CountingWorkflow(RolloutWorkflow):
    """One sample, as AReaL's RLVRWorkflow returns it: ``[1, L]`` tensors, ``versions`` -1 on
    the prompt and the engine's version on generated tokens, int32 token ids."""

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        await asyncio.sleep(random.uniform(0.005, 0.03))  # generation time
        version = engine.get_version()
        prompt = data["prompt"]
        steps = random.randint(1, 6)
        gen = list(range(prompt[-1] + 1, prompt[-1] + 1 + steps))
        seq, p, g = prompt + gen, len(prompt), len(gen)
        return {
            "input_ids": torch.tensor([seq], dtype=torch.int32),
            "loss_mask": torch.tensor([[0] * p + [1] * g], dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * p + [-1.0] * g]),
            "versions": torch.tensor([[-1] * p + [version] * g], dtype=torch.int32),
            "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
            "rewards": torch.tensor([float(gen[-1] == data["answer"])]),
        }


def run(steps: int = 5, prompts: int = 2, group_size: int = 4) -> str:
    """The whole loop once; returns its summary (the last lines it prints)."""
    install()  # AReaL's WorkflowExecutor now builds tqstream's StalenessManager
    client = tqstream.default_client()  # the cluster the manager uses: embedded in this process
    engine = Engine()
    # AReaL's settings; consumer_batch_size counts episodes (prompts), as in AReaL
    config = InferenceEngineConfig(
        consumer_batch_size=prompts, max_concurrent_rollouts=4, max_head_offpolicyness=1
    )
    experience = ArealExperience.from_config(client, config)  # window = max_head_offpolicyness
    executor = WorkflowExecutor(config, engine)  # unchanged AReaL
    executor.initialize(train_data_parallel_size=1)
    manager = executor.staleness_manager
    grouped = GroupedRolloutWorkflow(CountingWorkflow(), group_size, logging.getLogger())
    workflow = ExperienceWorkflow(grouped, experience)
    data = [{"prompt": [k, k + 1], "answer": k + 4} for k in range(64)]
    loader = StatefulDataLoader(data, batch_size=prompts, collate_fn=list)

    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():  # the groups it returns are already stored in tqstream
            executor.prepare_batch(loader, workflow)

    producer = threading.Thread(target=produce, name="areal-producer")
    producer.start()
    try:
        for step in range(steps):
            version = engine.get_version()
            batch = experience.get_experience(
                prompts * group_size, current_version=version, timeout=60
            )
            out = concat_padded_tensors(list(batch))  # what AReaL's actor trains on
            rewards = out["rewards"].view(len(batch), -1)
            advantages = rewards - rewards.mean(dim=1, keepdim=True)  # GRPO, per group
            lags = sorted({version - v for v in batch.versions if v is not None})
            print(
                f"step {step}: version {version}, {len(batch)} groups, {len(batch.meta)} samples "
                f"of shape {list(out['input_ids'].shape)} {out['input_ids'].dtype}, lag {lags}, "
                f"mean reward {rewards.mean():.2f}, |advantage| {advantages.abs().mean():.2f}"
            )
            batch.ack()  # the actor was the only task: the rows are freed
            # the weight update, as AReaL's trainer does it: pause submissions, publish the next
            # version, resume. resume() wakes AReaL's dispatcher, which waits for capacity without
            # a timeout: a version set without it would leave a dispatcher that found no capacity
            # asleep, though the new version gave it some
            executor.pause()
            engine.set_version(version + 1)
            executor.resume()
    finally:
        stop.set()
        producer.join()  # its last prepare_batch completes: the new version gave it budget
        executor.destroy()

    stats = client.stats(experience.partition).partitions[experience.partition]
    summary = (
        f"rollouts: {manager.get_stats()}\n"
        f"partition: produced {stats.produced}, freed {stats.freed}, stale_dropped "
        f"{stats.stale_dropped}, still stored {stats.rows}, lag at consumption "
        f"{stats.tasks['actor'].lag}"
    )
    client.clear_partition(experience.partition)
    manager.close()
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="trainer steps (default 5)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt (default 4)")
    args = ap.parse_args()
    random.seed(0)
    print(run(args.steps, args.prompts, args.group_size))
    tqstream.default_client().close()


if __name__ == "__main__":
    main()
