"""``MessageQueue`` / ``MessageQueueClient`` against verl's own: the same surface, opaque bytes in
and out (a pickle is never loaded), back-pressure or ``drop_oldest``, every drop counted, bad input
refused with nothing stored. On the embedded and the multi-process deployment; the Ray job, as
verl's recipe runs it, is in test_verl_fully_async.py.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip(
    "verl.experimental.fully_async_policy.detach_utils",
    reason="verl's RolloutSample module needs: pip install cachetools fastapi uvicorn",
)

import ray  # verl depends on Ray
from conftest import run_python
from verl.experimental.fully_async_policy import message_queue as verl_mq
from verl.experimental.fully_async_policy.detach_utils import (
    assemble_batch_from_rollout_samples,
)
from verl_samples import rollout_sample, same_sample

import tqstream
from tqstream.adapters.verl import MessageQueue, MessageQueueClient


def make(client: tqstream.Client, name: str, size: int = 8, **options: Any) -> MessageQueueClient:
    """What verl's driver does (``MessageQueue.remote`` + ``MessageQueueClient``), in ``client``'s
    cluster, under the test's own name."""
    return MessageQueueClient(MessageQueue.remote(None, size, name=name, cluster=client, **options))


def put(mq: MessageQueueClient, sample: Any) -> bool:
    return asyncio.run(mq.put_sample(sample=sample))


def rows(client: tqstream.Client, partition: str) -> int:
    return client.stats(partition).partitions[partition].rows


def running(client: tqstream.Client, mq: MessageQueueClient) -> int:
    return int(client.stats().admissions[mq.queue_actor.admission]["running"])


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
    init = list(inspect.signature(verl_mq.MessageQueueClient).parameters)
    assert list(inspect.signature(MessageQueueClient).parameters) == init == ["queue_actor"]
    # MessageQueue.remote(config, max_queue_size): what verl's actor's __init__ takes, as it does
    actor = verl_mq.MessageQueue.__ray_metadata__.modified_class.__init__
    verl_params = [
        (p.name, p.default)
        for p in inspect.signature(actor).parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"
    ]
    params = list(inspect.signature(MessageQueue.remote).parameters.values())
    assert [(p.name, p.default) for p in params[:2]] == [("config", None), ("max_queue_size", 1000)]
    assert [name for name, _ in verl_params] == ["config", "max_queue_size"]
    assert verl_params[1] == ("max_queue_size", 1000)


# --- opaque bytes --------------------------------------------------------------------------------
def test_pickled_rollout_samples_come_back_as_the_same_bytes(
    client: tqstream.Client, partition: str
) -> None:
    """What verl's rollouter puts (``ray.cloudpickle.dumps(rollout_sample)``) comes back as the
    same bytes, oldest first, and the trainer's ``ray.cloudpickle.loads`` + its own batch
    assembly take them as from verl's queue."""
    mq = make(client, partition)
    sent = [ray.cloudpickle.dumps(rollout_sample(i)) for i in range(3)]
    for blob in sent:
        assert put(mq, blob) is True
    assert mq.get_queue_size_sync() == 3
    got = []
    for left in (2, 1, 0):
        blob, queue_len = mq.get_sample_sync()
        assert type(blob) is bytes and queue_len == left
        got.append(blob)
    assert got == sent
    samples = [ray.cloudpickle.loads(x) for x in got]  # the trainer's call, where verl has it
    assert all(same_sample(s, rollout_sample(i)) for i, s in enumerate(samples))
    batch = assemble_batch_from_rollout_samples(samples, tokenizer=None, config=None)
    assert len(batch) == 6 and batch.meta_info["param_version_diversity"] == 1
    stats = mq.get_statistics_sync()
    assert stats == {
        "queue_size": 0, "total_produced": 3, "total_consumed": 3, "dropped_samples": 0,
        "max_queue_size": 8,
    }  # fmt: skip
    assert rows(client, partition) == 0 and running(client, mq) == 0  # taken samples are freed


def test_a_pickle_is_never_loaded(client: tqstream.Client, partition: str, tmp_path: Path) -> None:
    """Bytes that would run code when unpickled are stored and handed back untouched: neither the
    client nor a server loads them (only the caller's own ``loads`` would)."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (open, (str(marker), "w"))

    blob = pickle.dumps(Payload())
    mq = make(client, partition)
    assert put(mq, bytearray(blob)) is True  # bytearray: handed back as bytes
    assert asyncio.run(mq.put_validate(blob)) is True
    assert mq.get_sample_sync() == (blob, 0)
    assert mq.get_validate_sync() == blob
    assert not marker.exists()
    pickle.loads(blob)
    assert marker.exists()  # the payload was live all along


def test_empty_and_large_samples(client: tqstream.Client, partition: str) -> None:
    mq = make(client, partition)
    big = bytes(range(256)) * 20_000  # 5 MB: shared memory on one host
    assert put(mq, b"") and put(mq, big)
    assert mq.get_sample_sync() == (b"", 1)
    assert mq.get_sample_sync() == (big, 0)


def test_validation_results(client: tqstream.Client, partition: str) -> None:
    mq = make(client, partition)
    assert mq.get_validate_sync() is None  # never waits
    for i in range(2):
        assert asyncio.run(mq.put_validate(ray.cloudpickle.dumps({"val/acc": i / 2}))) is True
    assert ray.cloudpickle.loads(mq.get_validate_sync()) == {"val/acc": 0.0}
    assert ray.cloudpickle.loads(mq.get_validate_sync()) == {"val/acc": 0.5}
    assert mq.get_validate_sync() is None
    assert mq.get_queue_size_sync() == 0  # validation results are not samples


# --- a full queue: back-pressure (default) or drop_oldest ---------------------------------------
def test_a_full_queue_makes_put_wait_then_time_out_storing_nothing(
    client: tqstream.Client, partition: str
) -> None:
    mq = make(client, partition, 2, put_timeout=0.3)
    assert put(mq, b"0") and put(mq, b"1")
    start = time.monotonic()
    assert put(mq, b"2") is False  # verl's "not put"
    assert time.monotonic() - start >= 0.25
    assert mq.get_statistics_sync()["dropped_samples"] == 0 and rows(client, partition) == 2
    assert [mq.get_sample_sync()[0] for _ in range(2)] == [b"0", b"1"]  # nothing evicted


def test_a_blocked_producer_resumes_when_the_trainer_takes_a_sample(
    client: tqstream.Client, partition: str
) -> None:
    async def main() -> None:
        mq = make(client, partition, 2)

        async def produce() -> list[bool]:
            return [await mq.put_sample(str(i).encode()) for i in range(5)]

        task = asyncio.create_task(produce())
        await asyncio.sleep(0.3)
        assert not task.done() and await mq.get_queue_size() == 2  # waiting for room
        got = [(await mq.get_sample())[0] for _ in range(5)]
        assert await task == [True] * 5
        assert got == [str(i).encode() for i in range(5)]  # every sample, in order
        stats = await mq.get_statistics()
        assert (stats["total_produced"], stats["dropped_samples"]) == (5, 0)

    asyncio.run(main())


def test_drop_oldest_evicts_counts_and_frees_the_oldest(
    client: tqstream.Client, partition: str
) -> None:
    """verl's behaviour: a put into a full queue evicts the oldest sample and returns False; the
    new one is stored. Every eviction is counted (verl's ``dropped_samples``, and the admission's
    ``dropped`` in tqstream's stats and metrics), and leaves nothing behind in storage."""
    mq = make(client, partition, 3, drop_oldest=True)
    assert [put(mq, bytes([i]) * 1000) for i in range(7)] == [True] * 3 + [False] * 4
    stats = mq.get_statistics_sync()
    assert (stats["queue_size"], stats["total_produced"], stats["dropped_samples"]) == (3, 7, 4)
    cluster = client.stats()
    assert cluster.admissions[mq.queue_actor.admission]["dropped"] == 4
    assert rows(client, partition) == 3 and running(client, mq) == 3
    assert [mq.get_sample_sync()[0][0] for _ in range(3)] == [4, 5, 6]  # the newest, in order
    assert rows(client, partition) == 0 and running(client, mq) == 0
    assert mq.get_statistics_sync()["total_consumed"] == 3


def test_drop_oldest_never_evicts_a_sample_being_taken(
    client: tqstream.Client, partition: str
) -> None:
    """A sample a getter has leased is not the queue's to drop: the put waits for its room."""
    mq = make(client, partition, 1, drop_oldest=True, put_timeout=0.3)
    assert put(mq, b"a")
    taking = client.get_meta(partition, ["sample"], 1, "trainer")  # a get_sample in flight
    assert put(mq, b"b") is False  # nothing could be dropped and no room came: not stored
    assert mq.get_statistics_sync()["dropped_samples"] == 0
    client.release(taking)  # the getter gives it back (e.g. it died): now it can be dropped
    assert put(mq, b"b") is False and mq.get_sample_sync() == (b"b", 0)
    assert mq.get_statistics_sync()["dropped_samples"] == 1


# --- end of stream, clearing, the rest of verl's surface -----------------------------------------
def test_end_of_stream(client: tqstream.Client, partition: str) -> None:
    """The rollouter's ``put_sample(None)``: the trainer drains what is queued, then gets
    ``(None, 0)``, as its loop expects (``if sample is None: break``); a trainer already waiting
    wakes up with it."""

    async def main() -> None:
        mq = make(client, partition)
        waiting = asyncio.create_task(mq.get_sample())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await mq.put_sample(b"0")
        assert await asyncio.wait_for(waiting, 10) == (b"0", 0)
        await mq.put_sample(b"1")
        waiting = asyncio.create_task(mq.get_sample())
        assert await asyncio.wait_for(waiting, 10) == (b"1", 0)
        await mq.put_sample(b"2")
        assert await mq.put_sample(None) is True
        assert await mq.get_sample() == (b"2", 0)
        waiting = asyncio.create_task(mq.get_sample())
        assert await asyncio.wait_for(waiting, 10) == (None, 0)
        assert mq.get_sample_sync() == (None, 0)
        with pytest.raises(tqstream.PartitionClosedError):
            await mq.put_sample(b"3")
        await mq.shutdown()  # again: harmless

    asyncio.run(main())


def test_clear_queue_gives_the_room_back_and_keeps_the_counters(
    client: tqstream.Client, partition: str
) -> None:
    mq = make(client, partition, 2, put_timeout=0.2)
    assert put(mq, b"0") and put(mq, b"1")
    assert mq.get_sample_sync() == (b"0", 1)
    asyncio.run(mq.clear_queue())
    stats = mq.get_statistics_sync()
    assert (stats["queue_size"], stats["total_produced"], stats["total_consumed"]) == (0, 2, 1)
    assert rows(client, partition) == 0 and running(client, mq) == 0
    assert put(mq, b"2") and put(mq, b"3")  # the room is back
    assert mq.get_sample_sync() == (b"2", 1)
    asyncio.run(mq.clear_queue())
    asyncio.run(mq.clear_queue())  # an empty queue: nothing to do


def test_memory_usage(client: tqstream.Client, partition: str) -> None:
    mq = make(client, partition)
    put(mq, b"x" * 10_000)
    usage = asyncio.run(mq.get_memory_usage())
    assert usage["queue_samples"] == 1 and usage["estimated_memory_bytes"] >= 10_000
    assert usage["estimated_memory_mb"] == usage["estimated_memory_bytes"] / 2**20


def test_the_same_queue_is_made_again_by_name(client: tqstream.Client, partition: str) -> None:
    mq = make(client, partition, 4)
    put(mq, b"kept")
    again = make(client, partition, 4)
    assert again.get_sample_sync() == (b"kept", 0)
    with pytest.raises(
        tqstream.AdmissionError,
        match=r"a queue named 'p\d+-\d+' already exists in this cluster with another max_queue_",
    ):
        make(client, partition, 5)


def test_pickles_as_the_queue_and_connects_in_another_process(
    client: tqstream.Client, partition: str
) -> None:
    """verl's driver hands the client to its actors, which Ray pickles: what travels is the
    queue's address and settings (no socket), and the copy connects where it is unpickled."""
    mq = make(client, partition, 3)
    put(mq, b"from the driver")
    blob = pickle.dumps(mq)
    assert len(blob) < 1000 and b"tcp://" in blob
    copy = pickle.loads(blob)
    assert copy.queue_actor == mq.queue_actor and copy.client is mq.client  # one per process
    out = run_python(
        f"import asyncio, pickle\n"
        f"mq = pickle.loads({blob!r})\n"
        f"print(mq.get_sample_sync())\n"
        f"print(asyncio.run(mq.put_sample(b'from another process')))\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["(b'from the driver', 0)", "True"]
    assert mq.get_sample_sync() == (b"from another process", 0)


# --- bad input: typed errors, nothing stored, no room taken --------------------------------------
@pytest.mark.parametrize(
    "sample", [rollout_sample(0), "a str", {"sample": b"x"}, memoryview(b"x"), 7]
)
def test_a_sample_that_is_not_bytes_is_refused(
    client: tqstream.Client, partition: str, sample: Any
) -> None:
    mq = make(client, partition, 1)
    kind = type(sample).__name__
    with pytest.raises(
        tqstream.InvalidRequestError,
        match=rf"put_sample stores bytes \(verl 0.9.1's rollouter passes "
        rf"ray.cloudpickle.dumps\(...\)\), got {kind}: pass ray.cloudpickle.dumps\(value\)",
    ):
        put(mq, sample)
    with pytest.raises(tqstream.InvalidRequestError, match=rf"put_validate stores bytes.*{kind}"):
        asyncio.run(mq.put_validate(sample))
    assert rows(client, partition) == 0 and running(client, mq) == 0
    assert put(mq, b"ok") is True  # the one place is still free


def test_a_sample_too_big_for_the_cluster_is_refused_and_gives_its_room_back(
    partition: str,
) -> None:
    with tqstream.init(storage_max_bytes=4096) as small:
        mq = make(small, partition, 1)
        with pytest.raises(tqstream.CapacityError, match=r"can never fit: the storage units"):
            put(mq, b"x" * 10_000)
        assert rows(small, partition) == 0 and running(small, mq) == 0
        assert put(mq, b"x" * 100) is True
    limit = tqstream.ClientConfig(max_message_bytes=2000)
    with tqstream.init(client_config=limit, storage_max_bytes=1 << 20) as capped:
        mq = make(capped, partition, 1)
        with pytest.raises(tqstream.MessageTooLargeError, match=r"exceeds the limit of 2000"):
            put(mq, b"x" * 10_000)
        assert rows(capped, partition) == 0 and running(capped, mq) == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_queue_size": None}, r"max_queue_size must be an int >= 1 .* got None"),
        ({"max_queue_size": 0}, r"max_queue_size must be an int >= 1 .* got 0"),
        ({"max_queue_size": 2.5}, r"max_queue_size must be an int >= 1 .* got 2.5"),
        ({"max_queue_size": True}, r"max_queue_size must be an int >= 1 .* got True"),
        ({"drop_oldest": "yes"}, r"drop_oldest must be True or False, got 'yes'"),
        ({"put_timeout": -1}, r"put_timeout must be None .* or seconds >= 0, got -1"),
        ({"cluster": 5}, r"cluster must be a tqstream Client, an address .* got int"),
    ],
)
def test_bad_settings_are_refused(
    client: tqstream.Client, partition: str, options: dict[str, Any], message: str
) -> None:
    kwargs: dict[str, Any] = {"name": partition, "cluster": client, **options}
    with pytest.raises(tqstream.InvalidRequestError, match=message):
        MessageQueue.remote(None, **kwargs)
    assert partition not in client.stats().partitions  # nothing made


def test_the_client_wants_tqstreams_queue() -> None:
    with pytest.raises(tqstream.InvalidRequestError, match=r"import both MessageQueue and Mess"):
        MessageQueueClient(object())  # type: ignore[arg-type]  # e.g. verl's own actor handle
