"""``MessageQueueClient`` against verl's own: same surface, real ``RolloutSample`` s, no drops.

verl's ``RolloutSample`` module imports verl's trainer, which needs ``cachetools``, ``fastapi`` and
``uvicorn`` that verl 0.9.1 does not declare: without them the file is skipped, saying so.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import time
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip(
    "verl.experimental.fully_async_policy.detach_utils",
    reason="verl's RolloutSample module needs: pip install cachetools fastapi uvicorn",
)

import numpy as np
import torch
from test_verl_dataproto import assert_dataproto_equal, make_dataproto
from verl.experimental.fully_async_policy import message_queue as verl_mq
from verl.experimental.fully_async_policy.detach_utils import (
    RolloutSample,
    assemble_batch_from_rollout_samples,
)

import tqstream
from tqstream.adapters.verl import MessageQueueClient


def rollout_sample(i: int, n: int = 2) -> RolloutSample:
    """What the fully-async rollouter queues: one prompt's ``n`` samples as verl's agent loop
    returns them, with the uid, versions and per-sample metrics the trainer reads."""
    full_batch = make_dataproto(
        [[10 + i, 11 + i]] * n,
        [[20 + i] * (k + 1) for k in range(n)],
        prompt_length=4,
        response_length=n + 1,
        non_tensor={
            "uid": np.array([f"uid_sample_0_{i}"] * n, dtype=object),
            "__num_turns__": np.full(n, 2, dtype=np.int32),
            "min_global_steps": np.array([i] * n, dtype=object),
            "max_global_steps": np.array([i] * n, dtype=object),
        },
        meta_info={"metrics": [{"generate_sequences": 0.5, "tool_calls": 0.0}] * n},
    )
    return RolloutSample(
        full_batch=full_batch,
        sample_id=f"sample_0_{i}",
        epoch=0,
        rollout_status={"count/total_generated_samples": i, "static/max_concurrent_samples": None},
    )


def assert_same_sample(a: RolloutSample, b: RolloutSample) -> None:
    assert isinstance(b, RolloutSample)
    assert (a.sample_id, a.epoch, a.rollout_status) == (b.sample_id, b.epoch, b.rollout_status)
    assert_dataproto_equal(a.full_batch, b.full_batch)


def rows_stored(client: tqstream.Client, mq: MessageQueueClient) -> int:
    return client.stats(mq.rows).partitions[mq.rows].rows


# --- the surface ---------------------------------------------------------------------------------
def _public(cls: type) -> dict[str, Any]:
    return {k: v for k, v in vars(cls).items() if callable(v) and not k.startswith("_")}


def test_same_methods_signatures_and_async_ness_as_verls() -> None:
    theirs, ours = _public(verl_mq.MessageQueueClient), _public(MessageQueueClient)
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    for name, fn in theirs.items():
        mine = ours[name]
        assert inspect.iscoroutinefunction(fn) == inspect.iscoroutinefunction(mine), name
        expected = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(mine).parameters.values()]
        assert got == expected, name


# --- samples in, samples out ---------------------------------------------------------------------
def test_rollout_samples_round_trip_into_verls_own_batch_assembly(
    client: tqstream.Client, partition: str
) -> None:
    async def main() -> None:
        mq = MessageQueueClient(client, name=partition, max_queue_size=8)
        sent = [rollout_sample(i) for i in range(3)]
        for s in sent:
            assert await mq.put_sample(s) is True
        assert await mq.get_queue_size() == 3
        got = []
        for left in (2, 1, 0):
            sample, queue_len = await mq.get_sample()
            assert queue_len == left
            got.append(sample)
        for a, b in zip(sent, got, strict=True):
            assert_same_sample(a, b)
        # the trainer's own assembly (verl's detach_utils) takes what the queue gives back
        batch = assemble_batch_from_rollout_samples(got, tokenizer=None, config=None)
        assert len(batch) == 6 and batch.meta_info["param_version_diversity"] == 3
        stats = await mq.get_statistics()
        assert stats["total_produced"] == 3 and stats["total_consumed"] == 3
        assert stats["dropped_samples"] == 0 and stats["queue_size"] == 0
        assert rows_stored(client, mq) == 0  # taken samples are freed

    asyncio.run(main())


def test_sync_getters(client: tqstream.Client, partition: str) -> None:
    mq = MessageQueueClient(client, name=partition)
    asyncio.run(mq.put_sample(rollout_sample(0)))
    assert mq.get_queue_size_sync() == 1
    assert mq.get_statistics_sync()["queue_size"] == 1
    sample, left = mq.get_sample_sync()
    assert_same_sample(rollout_sample(0), sample)
    assert left == 0


def test_end_of_stream(client: tqstream.Client, partition: str) -> None:
    """The rollouter's ``put_sample(None)``: the trainer drains what is queued, then gets
    ``(None, 0)``, as verl's trainer loop expects (``if sample is None: break``); a trainer
    already waiting for a sample wakes up with it."""

    async def main() -> None:
        mq = MessageQueueClient(client, name=partition)
        await mq.put_sample(rollout_sample(0))
        sample, _ = await mq.get_sample()
        waiting = asyncio.create_task(mq.get_sample())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await mq.put_sample(rollout_sample(1))
        assert (await asyncio.wait_for(waiting, 10))[0].sample_id == "sample_0_1"
        await mq.put_sample(rollout_sample(2))
        waiting = asyncio.create_task(mq.get_sample())
        assert (await asyncio.wait_for(waiting, 10))[0].sample_id == "sample_0_2"
        waiting = asyncio.create_task(mq.get_sample())
        await asyncio.sleep(0.2)
        assert await mq.put_sample(None) is True
        assert await asyncio.wait_for(waiting, 10) == (None, 0)
        assert sample.sample_id == "sample_0_0"
        assert await mq.get_sample() == (None, 0)
        assert mq.get_sample_sync() == (None, 0)
        with pytest.raises(tqstream.PartitionClosedError):
            await mq.put_sample(rollout_sample(1))

    asyncio.run(main())


# --- back-pressure instead of dropping -----------------------------------------------------------
def test_a_full_queue_times_out_counts_and_stores_nothing(
    client: tqstream.Client, partition: str
) -> None:
    async def main() -> None:
        mq = MessageQueueClient(client, name=partition, max_queue_size=2, put_timeout=0.3)
        assert await mq.put_sample(rollout_sample(0)) and await mq.put_sample(rollout_sample(1))
        start = time.monotonic()
        assert await mq.put_sample(rollout_sample(2)) is False  # verl's "not put"
        assert time.monotonic() - start >= 0.25
        stats = await mq.get_statistics()
        assert (stats["queue_size"], stats["blocked_puts"], stats["put_timeouts"]) == (2, 1, 1)
        assert stats["dropped_samples"] == 0 and rows_stored(client, mq) == 4
        for i in (0, 1):  # nothing was evicted: the oldest samples are still there, in order
            assert (await mq.get_sample())[0].sample_id == f"sample_0_{i}"

    asyncio.run(main())


def test_a_blocked_producer_resumes_when_the_trainer_takes_a_sample(
    client: tqstream.Client, partition: str
) -> None:
    async def main() -> None:
        producer = MessageQueueClient(client, name=partition, max_queue_size=2)
        trainer = MessageQueueClient(client, name=partition, max_queue_size=2)

        async def produce() -> list[bool]:
            return [await producer.put_sample(rollout_sample(i)) for i in range(5)]

        task = asyncio.create_task(produce())
        await asyncio.sleep(0.3)
        assert not task.done() and await trainer.get_queue_size() == 2  # waiting for room
        got = [(await trainer.get_sample())[0].sample_id for _ in range(5)]
        assert await task == [True] * 5
        assert got == [f"sample_0_{i}" for i in range(5)]  # every sample, in order
        stats = await producer.get_statistics()
        assert stats["blocked_puts"] >= 1 and stats["put_timeouts"] == 0
        assert stats["total_produced"] == 5 and stats["dropped_samples"] == 0

    asyncio.run(main())


# --- bad input ----------------------------------------------------------------------------------
def test_pickled_samples_are_refused(client: tqstream.Client, partition: str) -> None:
    mq = MessageQueueClient(client, name=partition)
    blob = pickle.dumps({"x": 1})  # what verl 0.9.1's rollouter passes: cloudpickled bytes
    with pytest.raises(tqstream.InvalidRequestError, match=r"put_sample got \d+ bytes, a pickled"):
        asyncio.run(mq.put_sample(blob))
    with pytest.raises(tqstream.InvalidRequestError, match=r"needs a verl RolloutSample"):
        asyncio.run(mq.put_sample({"full_batch": None}))
    assert client.list_keys(partition) == [] and rows_stored(client, mq) == 0


def test_a_bad_sample_is_refused_before_taking_room(
    client: tqstream.Client, partition: str
) -> None:
    mq = MessageQueueClient(client, name=partition, max_queue_size=1)
    bad = rollout_sample(0)
    bad.full_batch.batch["response_mask"][0, -1] = 1  # beyond row 0's 1-token response
    with pytest.raises(tqstream.InvalidRequestError, match=r"response_mask row 0 holds 1"):
        asyncio.run(mq.put_sample(bad))
    status = rollout_sample(1)
    status.rollout_status = {"idle_ratio": np.float32(0.5)}
    with pytest.raises(tqstream.SchemaError, match=r"RolloutSample.rollout_status holds a numpy"):
        asyncio.run(mq.put_sample(status))
    assert client.list_keys(partition) == [] and rows_stored(client, mq) == 0
    assert client.stats().admissions[f"{partition}.queue"]["running"] == 0
    assert asyncio.run(mq.put_sample(rollout_sample(2))) is True  # the one place is still free


def test_max_queue_size_must_be_a_positive_int(client: tqstream.Client, partition: str) -> None:
    with pytest.raises(tqstream.InvalidRequestError, match=r"max_queue_size must be an int >= 1"):
        MessageQueueClient(client, name=partition, max_queue_size=None)  # type: ignore[arg-type]


# --- the rest of verl's surface ------------------------------------------------------------------
def test_clear_queue_gives_the_room_back(client: tqstream.Client, partition: str) -> None:
    async def main() -> None:
        mq = MessageQueueClient(client, name=partition, max_queue_size=2, put_timeout=0.2)
        await mq.put_sample(rollout_sample(0))
        await mq.put_sample(rollout_sample(1))
        await mq.clear_queue()
        stats = await mq.get_statistics()
        assert stats["queue_size"] == 0 and stats["cleared_samples"] == 2
        assert rows_stored(client, mq) == 0
        assert await mq.put_sample(rollout_sample(2)) and await mq.put_sample(rollout_sample(3))
        assert (await mq.get_sample())[0].sample_id == "sample_0_2"

    asyncio.run(main())


def test_validation_values(client: tqstream.Client, partition: str) -> None:
    mq = MessageQueueClient(client, name=partition)
    assert mq.get_validate_sync() is None
    assert asyncio.run(mq.put_validate({"val/acc": 0.5, "step": 3})) is True
    assert mq.get_validate_sync() == {"val/acc": 0.5, "step": 3}
    assert mq.get_validate_sync() is None
    with pytest.raises(tqstream.SchemaError, match=r"put_validate data holds a torch.Tensor"):
        asyncio.run(mq.put_validate(torch.ones(2)))


def test_memory_usage(client: tqstream.Client, partition: str) -> None:
    mq = MessageQueueClient(client, name=partition)
    asyncio.run(mq.put_sample(rollout_sample(0)))
    usage = asyncio.run(mq.get_memory_usage())
    assert usage["queue_samples"] == 1 and usage["estimated_memory_bytes"] > 0
    assert usage["estimated_memory_mb"] == usage["estimated_memory_bytes"] / 2**20


def test_pickles_as_its_address_as_ray_does_to_hand_it_to_actors(
    client: tqstream.Client, partition: str
) -> None:
    """verl's main hands the client to the rollouter and trainer actors (Ray pickles it); the
    copy connects to the same cluster and shares the queue."""
    mq = MessageQueueClient(client, name=partition, max_queue_size=3, task="trainer")
    copy = pickle.loads(pickle.dumps(mq))
    try:
        assert copy.client is not mq.client and copy.max_queue_size == 3
        asyncio.run(mq.put_sample(rollout_sample(0)))
        sample, _ = copy.get_sample_sync()
        assert sample.sample_id == "sample_0_0"
    finally:
        copy.close()


def test_sample_rows_keep_verls_dtypes(client: tqstream.Client, partition: str) -> None:
    mq = MessageQueueClient(client, name=partition)
    sample = rollout_sample(0)
    sample.full_batch.batch["rollout_log_probs"] = sample.full_batch.batch["rollout_log_probs"].to(
        torch.bfloat16
    )
    asyncio.run(mq.put_sample(sample))
    got, _ = mq.get_sample_sync()
    assert got.full_batch.batch["rollout_log_probs"].dtype == torch.bfloat16
    assert got.full_batch.non_tensor_batch["__num_turns__"].dtype == np.int32
