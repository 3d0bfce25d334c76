"""verl's fully-async recipe on tqstream: a rollouter and a trainer, embedded, on CPU.

The two sides talk as verl's ``FullyAsyncRollouter`` and ``FullyAsyncTrainer`` do, through the
same calls: the rollouter takes a slot (``acquire_slot``), generates one prompt's ``rollout.n``
samples, queues the ``RolloutSample`` (``put_sample``) and frees the slot (``release_slot``); the
trainer takes samples (``get_sample``), trains on their ``DataProto``, syncs weights and reopens the
version window (``reset_staleness``). The queue is tqstream's ``MessageQueue`` and
``MessageQueueClient``, made and used as the recipe does (only the import differs): the rollouter
puts ``ray.cloudpickle.dumps(sample)``, the trainer ``ray.cloudpickle.loads`` what it gets. It is
kept small here so that the rollouter runs into it: it waits instead of dropping.

Generation is simulated (random tokens padded exactly as verl's agent loop pads them), so the
example needs no model: ``python examples/verl_fully_async.py``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import ray
import torch
from tensordict import TensorDict
from verl.experimental.fully_async_policy.detach_utils import RolloutSample
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask

import tqstream
from tqstream.adapters.verl import MessageQueue, MessageQueueClient, ReplayBufferSlots

N = 4  # rollout.n: samples per prompt (one GRPO group, one RolloutSample)
PROMPTS_PER_STEP = 2  # the trainer's required samples per step
STEPS = 3
PROMPT_LENGTH, RESPONSE_LENGTH, PAD = 8, 10, 0


def generate(prompt_id: int, version: int) -> DataProto:
    """One prompt's N samples as verl's agent loop returns them: left-padded prompts, right-padded
    responses, attention_mask, input_ids, position_ids, response_mask, rollout_log_probs."""
    gen = torch.Generator().manual_seed(prompt_id)
    prompt = torch.randint(1, 1000, (int(torch.randint(3, PROMPT_LENGTH, (1,), generator=gen)),),
                           generator=gen)  # fmt: skip
    prompts = torch.full((N, PROMPT_LENGTH), PAD)
    responses = torch.full((N, RESPONSE_LENGTH), PAD)
    mask = torch.zeros(N, PROMPT_LENGTH + RESPONSE_LENGTH, dtype=torch.int64)
    logprobs = torch.zeros(N, RESPONSE_LENGTH)
    for i in range(N):
        n = int(torch.randint(1, RESPONSE_LENGTH + 1, (1,), generator=gen))
        prompts[i, PROMPT_LENGTH - len(prompt) :] = prompt
        responses[i, :n] = torch.randint(1, 1000, (n,), generator=gen)
        mask[i, PROMPT_LENGTH - len(prompt) : PROMPT_LENGTH + n] = 1
        logprobs[i, :n] = -torch.rand(n, generator=gen)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": mask[:, PROMPT_LENGTH:].clone(),
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask),
        "rollout_log_probs": logprobs,
    }
    uid = f"uid_sample_0_{prompt_id}"
    return DataProto(
        batch=TensorDict(batch, batch_size=[N]),
        non_tensor_batch={
            "uid": np.array([uid] * N, dtype=object),
            "__num_turns__": np.full(N, 2, dtype=np.int32),
            "min_global_steps": np.array([version] * N, dtype=object),
            "max_global_steps": np.array([version] * N, dtype=object),
        },
        meta_info={"metrics": [{"generate_sequences": 0.01, "tool_calls": 0.0}] * N},
    )


def make_slots(client: tqstream.Client) -> ReplayBufferSlots:
    """Each side builds its own on the same name: the state lives at the controller."""
    return ReplayBufferSlots(client, max_version_slots=3 * PROMPTS_PER_STEP, max_pending_slots=2,
                             consumer_batch_size=PROMPTS_PER_STEP)  # fmt: skip


async def rollouter(
    client: tqstream.Client, queue: MessageQueueClient, versions: list[int]
) -> None:
    slots = make_slots(client)
    for prompt_id in range(PROMPTS_PER_STEP * STEPS):
        await slots.acquire_slot(uid=f"sample_0_{prompt_id}")  # blocks on either layer
        await asyncio.sleep(0.01)  # "generation"
        sample = RolloutSample(
            full_batch=generate(prompt_id, versions[-1]),
            sample_id=f"sample_0_{prompt_id}",
            epoch=0,
            rollout_status={"count/total_generated_samples": prompt_id},
        )
        # as verl's rollouter puts it; waits while the queue is full: never drops
        await queue.put_sample(sample=ray.cloudpickle.dumps(sample))
        await slots.release_slot()
    await queue.put_sample(sample=None)  # the end of the stream
    stats = await queue.get_statistics()
    print(f"rollouter: done; {stats['total_produced']} samples put, "
          f"dropped {stats['dropped_samples']}")  # fmt: skip


async def trainer(client: tqstream.Client, queue: MessageQueueClient, versions: list[int]) -> None:
    slots = make_slots(client)
    while True:
        samples = []
        while len(samples) < PROMPTS_PER_STEP:
            sample, left = await queue.get_sample()
            if sample is None:
                print(
                    f"trainer: end of stream at version {versions[-1]}; queue "
                    f"{await queue.get_statistics()}; slots {await slots.get_statistics()}"
                )
                return
            samples.append(sample)
        samples = [ray.cloudpickle.loads(x) for x in samples]  # where verl's trainer has it
        batch = DataProto.concat([s.full_batch for s in samples])
        lag = [versions[-1] - v for v in batch.non_tensor_batch["min_global_steps"]]
        tokens = int(batch.batch["response_mask"].sum())
        print(f"trainer: step at version {versions[-1]}: {len(batch)} samples of "
              f"{[s.sample_id for s in samples]}, {tokens} response tokens, "
              f"input_ids {list(batch.batch['input_ids'].shape)}, lag {set(lag)}, "
              f"{left} samples queued")  # fmt: skip
        await asyncio.sleep(0.2)  # "training": meanwhile the rollouter fills the queue
        versions.append(versions[-1] + 1)  # optimizer step + weight sync, then:
        timing = await slots.reset_staleness()
        print(f"trainer: reset_staleness -> version_time "
              f"{timing['fully_async/rollouter/version_time']:.3f}s")  # fmt: skip


async def main() -> None:
    client = tqstream.init()
    try:
        # verl's FullyAsyncTaskRunner: MessageQueue.remote(config, max_queue_size), then the client
        message_queue = MessageQueue.remote(None, 2, cluster=client)
        queue = MessageQueueClient(message_queue)
        versions = [0]
        await asyncio.gather(rollouter(client, queue, versions), trainer(client, queue, versions))
    finally:
        client.close()


if __name__ == "__main__":
    asyncio.run(main())
