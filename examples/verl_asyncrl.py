"""The AsyncRL recipe's experience calls, and DataProto experience, on tqstream (embedded, CPU).

Part 1 is the recipe's TransferQueue adapter surface: ``async_put_experience(data, version)`` and
``async_get_experience(count, current_version)``. Where the recipe asked TransferQueue for one
``global_step`` after another, here one get returns the oldest rows inside the staleness window
and evicts, and counts, the ones that fell out of it. Part 2 puts verl ``DataProto`` rollouts
(stored unpadded, ``uid`` as the group) and reads one back re-padded to the trainer's widths.
Run: ``python examples/verl_asyncrl.py``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask

import tqstream
from tqstream import StalenessPolicy
from tqstream.adapters.verl import AsyncRLExperience, VerlExperience

COLUMNS = ["input_ids", "attention_mask", "old_logprobs", "token_policy_versions", "rewards"]


def rollout(version: int, n: int = 4, length: int = 6) -> dict[str, torch.Tensor]:
    """What the recipe's rollout manager puts: padded per-token tensors, tagged with the version."""
    return {
        "input_ids": torch.randint(1, 1000, (n, length)),
        "attention_mask": torch.ones(n, length, dtype=torch.int64),
        "old_logprobs": -torch.rand(n, length),
        "token_policy_versions": torch.full((n, length), version),
        "rewards": torch.rand(n),
    }


async def asyncrl(client: tqstream.Client) -> None:
    exp = AsyncRLExperience(client, COLUMNS, max_staleness=1, partition="async_rl")
    for version in range(4):  # the rollout side ran ahead: 4 rows under each of versions 0..3
        await exp.async_put_experience(rollout(version), current_version=version)
    for current in (2, 3):  # the trainer at versions 2 and 3 (window: 1 version)
        batch = await exp.async_get_experience(4, current_version=current, timeout=10)
        versions = batch["token_policy_versions"][:, 0].tolist()
        print(f"asyncrl: trainer at version {current} got rows of versions {versions}")
    part = client.stats("async_rl").partitions["async_rl"]
    print(f"asyncrl: {part.produced} rows put, {part.freed} consumed, {part.stale_dropped} "
          f"evicted as stale, {part.rows} still stored")  # fmt: skip


def group(uid: str, prompt: list[int], responses: list[list[int]], width: int = 6) -> DataProto:
    """One prompt's samples padded as verl's agent loop pads them (prompt width 4)."""
    n = len(responses)
    prompts = torch.zeros(n, 4, dtype=torch.int64)
    prompts[:, 4 - len(prompt) :] = torch.tensor(prompt)
    resp = torch.zeros(n, width, dtype=torch.int64)
    mask = torch.zeros(n, 4 + width, dtype=torch.int64)
    mask[:, 4 - len(prompt) : 4] = 1
    for i, r in enumerate(responses):
        resp[i, : len(r)] = torch.tensor(r)
        mask[i, 4 : 4 + len(r)] = 1
    batch = {
        "prompts": prompts,
        "responses": resp,
        "response_mask": mask[:, 4:].clone(),
        "input_ids": torch.cat([prompts, resp], dim=1),
        "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask),
    }
    return DataProto(
        batch=TensorDict(batch, batch_size=[n]),
        non_tensor_batch={"uid": np.array([uid] * n, dtype=object)},
        meta_info={"global_steps": 1},
    )


def dataproto(client: tqstream.Client) -> None:
    exp = VerlExperience(
        client, partition="verl", fields=["responses", "response_mask", "uid"],
        staleness=StalenessPolicy(max_staleness=1, measure="dispatch"),
        prompt_length=6, response_length=8,  # the trainer's widths
    )  # fmt: skip
    exp.put_experience(group("uid-0", [5, 6], [[7, 8, 9], [10]]), current_version=1)
    exp.put_experience(group("uid-1", [11], [[12, 13], [14, 15, 16, 17]]), current_version=1)
    stored = client.stats("verl").partitions["verl"].schemas
    print(f"dataproto: stored fields {sorted(stored)} (prompts {stored['prompts'].describe()})")
    batch = exp.get_experience(4, current_version=2, timeout=10)
    dp = batch.data
    print(f"dataproto: got uids {dp.non_tensor_batch['uid'].tolist()}, input_ids "
          f"{list(dp.batch['input_ids'].shape)}, meta_info {dp.meta_info}")  # fmt: skip
    print(f"dataproto: row 0 attention_mask {dp.batch['attention_mask'][0].tolist()}")
    print(f"dataproto: row 0 position_ids   {dp.batch['position_ids'][0].tolist()}")
    batch.ack()


def main() -> None:
    client = tqstream.init()
    try:
        asyncio.run(asyncrl(client))
        dataproto(client)
    finally:
        client.close()


if __name__ == "__main__":
    main()
