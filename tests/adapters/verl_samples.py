"""Real verl ``RolloutSample`` s as the fully-async rollouter queues them, made reproducibly from a
number (in any process: Ray actors rebuild the one they expect), and their comparison.

verl's ``RolloutSample`` module imports verl's trainer, which needs ``cachetools``, ``fastapi`` and
``uvicorn`` that verl 0.9.1 does not declare; test modules skip without them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl.experimental.fully_async_policy.detach_utils import RolloutSample
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask

PROMPT_LENGTH, RESPONSE_LENGTH = 6, 8


def rollout_sample(i: int, n: int = 2, filler: int = 0) -> RolloutSample:
    """Prompt ``i`` 's ``n`` responses as verl's agent loop pads them (left-padded prompts,
    right-padded responses, masks, positions, ``rollout_log_probs``), with the ``uid``, versions,
    metrics and ``rollout_status`` the trainer reads; ``filler`` adds that many float32 values per
    row (bigger samples)."""
    gen = torch.Generator().manual_seed(i)
    prompts = torch.zeros(n, PROMPT_LENGTH, dtype=torch.int64)
    responses = torch.zeros(n, RESPONSE_LENGTH, dtype=torch.int64)
    mask = torch.zeros(n, PROMPT_LENGTH + RESPONSE_LENGTH, dtype=torch.int64)
    logprobs = torch.zeros(n, RESPONSE_LENGTH)
    p = int(torch.randint(2, PROMPT_LENGTH + 1, (1,), generator=gen))
    prompt = torch.randint(1, 1000, (p,), generator=gen)
    for row in range(n):
        r = int(torch.randint(1, RESPONSE_LENGTH + 1, (1,), generator=gen))
        prompts[row, PROMPT_LENGTH - p :] = prompt
        responses[row, :r] = torch.randint(1, 1000, (r,), generator=gen)
        mask[row, PROMPT_LENGTH - p : PROMPT_LENGTH + r] = 1
        logprobs[row, :r] = -torch.rand(r, generator=gen)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": mask[:, PROMPT_LENGTH:].clone(),
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask),
        "rollout_log_probs": logprobs,
    }
    if filler:
        batch["filler"] = torch.rand(n, filler, generator=gen)
    full_batch = DataProto(
        batch=TensorDict(batch, batch_size=[n]),
        non_tensor_batch={
            "uid": np.array([f"uid_sample_{i}"] * n, dtype=object),
            "__num_turns__": np.full(n, 2, dtype=np.int32),
            "min_global_steps": np.array([i // 4] * n, dtype=object),
            "max_global_steps": np.array([i // 4] * n, dtype=object),
        },
        meta_info={"metrics": [{"generate_sequences": 0.5, "tool_calls": 0.0}] * n},
    )
    return RolloutSample(
        full_batch=full_batch,
        sample_id=f"sample_{i}",
        epoch=0,
        rollout_status={"count/total_generated_samples": i, "static/max_queue_size": None},
    )


def number(sample: RolloutSample) -> int:
    return int(sample.sample_id.removeprefix("sample_"))


def same_sample(a: Any, b: Any) -> bool:
    """Whether two ``RolloutSample`` s hold the same data: tensors, object arrays, metadata."""
    if not (isinstance(a, RolloutSample) and isinstance(b, RolloutSample)):
        return False
    if (a.sample_id, a.epoch, a.rollout_status) != (b.sample_id, b.epoch, b.rollout_status):
        return False
    x, y = a.full_batch, b.full_batch
    if set(x.batch.keys()) != set(y.batch.keys()) or x.meta_info != y.meta_info:
        return False
    if any(
        x.batch[k].dtype != y.batch[k].dtype or not torch.equal(x.batch[k], y.batch[k])
        for k in x.batch.keys()  # noqa: SIM118  (iterating a TensorDict yields its rows)
    ):
        return False
    if set(x.non_tensor_batch) != set(y.non_tensor_batch):
        return False
    return all(
        x.non_tensor_batch[k].dtype == y.non_tensor_batch[k].dtype
        and x.non_tensor_batch[k].tolist() == y.non_tensor_batch[k].tolist()
        for k in x.non_tensor_batch
    )
