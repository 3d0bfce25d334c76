"""verl 0.9.1's fully-async recipe with only its import changed, in a real Ray job.

Two parts:

- The recipe's own queue tests (``recipe/fully_async_policy/unittest/test_mq.py``, the last version
  in verl's history, before the recipe moved into ``verl/experimental``), adapted to 0.9.1's API:
  ``put_sample(sample)`` / ``get_sample()`` are coroutines, a sample is the rollouter's
  ``ray.cloudpickle.dumps(rollout_sample)``, and ``get_samples(min_batch_count=k)`` is k
  ``get_sample`` calls. Its ``update_param_version`` and put-time staleness check left the queue
  before 0.9.1, so those two cases have no counterpart. Every case runs against verl's own
  ``MessageQueue`` and against tqstream's, built by the same lines.
- The recipe's rollouter → queue → trainer sequence: a driver that does with the queue what
  ``fully_async_main.py`` does (``MessageQueue.remote(config, max_queue_size)``,
  ``MessageQueueClient(message_queue)``, the client handed to a rollouter and a trainer actor), a
  rollouter actor that builds real ``RolloutSample`` s and puts ``ray.cloudpickle.dumps(sample)``,
  a trainer actor that gets and ``ray.cloudpickle.loads`` them; then ``drop_oldest``, and a
  rollouter SIGKILLed mid-stream.

One Ray session for the module, with few CPUs; the queue starts its tqstream cluster as Ray actors.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")
pytest.importorskip(
    "verl.experimental.fully_async_policy.detach_utils",
    reason="verl's RolloutSample module needs: pip install cachetools fastapi uvicorn",
)

import verl_samples  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from verl.experimental.fully_async_policy import message_queue as verl_mq  # noqa: E402
from verl_samples import number, rollout_sample, same_sample  # noqa: E402

import tqstream  # noqa: E402
import tqstream.ray  # noqa: E402
from tqstream.adapters.verl import MessageQueue, MessageQueueClient  # noqa: E402
from tqstream.adapters.verl.queue import RAY_CLUSTER  # noqa: E402

MB = 1 << 20
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def ray_job() -> Iterator[None]:
    # a cluster of its own: never one another run left on this machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * MB)  # fmt: skip
    # the actors below are defined in modules Ray's workers cannot import by name
    for module in (sys.modules[__name__], verl_samples):
        ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        tqstream.ray.shutdown(RAY_CLUSTER)  # the queues started it, in this process
        ray.shutdown()


def wait_until(what: Callable[[], bool], limit: float = 30.0) -> None:
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < limit, "condition not met in time"
        time.sleep(0.05)


# --- the recipe's test_mq.py, adapted to 0.9.1, on verl's queue and on tqstream's ---------------
def blob(i: int) -> bytes:
    return ray.cloudpickle.dumps(rollout_sample(i))


class Sync:
    """The recipe's tests call the client without ``await`` (its API was synchronous then)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)
        return lambda *a, **k: asyncio.run(method(*a, **k))

    def get_samples(self, min_batch_count: int) -> list[Any]:
        return [self.get_sample()[0] for _ in range(min_batch_count)]


@pytest.fixture(params=["verl", "tqstream"])
def make(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sync]]:
    """A fresh queue of capacity 10, as the recipe's fixture made it (``drop_oldest`` asks
    tqstream's for verl's behaviour when full; verl's always drops)."""
    made: list[Sync] = []

    def build(max_queue_size: int = 10, drop_oldest: bool = False) -> Sync:
        config = DictConfig({"async_training": {"staleness_threshold": 3}})
        if request.param == "verl":
            actor = verl_mq.MessageQueue.remote(config, max_queue_size=max_queue_size)
            client = Sync(verl_mq.MessageQueueClient(actor))
        else:
            name = f"mq{next(_names)}"
            actor = MessageQueue.remote(
                config, max_queue_size=max_queue_size, drop_oldest=drop_oldest, name=name
            )
            client = Sync(MessageQueueClient(actor))
        made.append(client)
        return client

    yield build
    for client in made:
        client.shutdown()


def test_put_sample_success(make: Callable[..., Sync]) -> None:
    mq = make()
    assert mq.put_sample(sample=blob(0)) is True
    assert mq.get_queue_size() == 1
    stats = mq.get_statistics()
    assert stats["total_produced"] == 1 and stats["queue_size"] == 1


def test_put_multiple_samples(make: Callable[..., Sync]) -> None:
    mq = make()
    for i in range(3):
        assert mq.put_sample(sample=blob(i)) is True
    assert mq.get_queue_size() == 3
    stats = mq.get_statistics()
    assert stats["total_produced"] == 3 and stats["queue_size"] == 3


def test_put_sample_queue_overflow(make: Callable[..., Sync]) -> None:
    mq = make(drop_oldest=True)
    results = [mq.put_sample(sample=blob(i)) for i in range(12)]
    assert results == [True] * 10 + [False] * 2  # a put that dropped a sample says so
    assert mq.get_queue_size() == 10
    assert mq.get_statistics()["dropped_samples"] == 2
    assert [number(ray.cloudpickle.loads(s)) for s in mq.get_samples(10)] == list(range(2, 12))


def test_get_samples_success(make: Callable[..., Sync]) -> None:
    mq = make()
    for i in range(3):
        mq.put_sample(sample=blob(i))
    retrieved = mq.get_samples(min_batch_count=2)
    assert retrieved == [blob(0), blob(1)]
    assert mq.get_queue_size() == 1
    assert mq.get_statistics()["total_consumed"] == 2


def test_get_samples_blocking_behavior(make: Callable[..., Sync]) -> None:
    mq = make()
    result: list[list[Any]] = []
    consumer = threading.Thread(target=lambda: result.append(mq.get_samples(min_batch_count=2)))
    consumer.start()
    time.sleep(0.5)
    assert not result  # waiting: nothing was put yet
    mq.put_sample(sample=blob(0))
    mq.put_sample(sample=blob(1))
    consumer.join(timeout=10)
    assert result == [[blob(0), blob(1)]]


def test_clear_queue(make: Callable[..., Sync]) -> None:
    mq = make()
    for i in range(3):
        mq.put_sample(sample=blob(i))
    mq.clear_queue()
    assert mq.get_queue_size() == 0


def test_get_queue_size(make: Callable[..., Sync]) -> None:
    mq = make()
    assert mq.get_queue_size() == 0
    mq.put_sample(sample=blob(0))
    assert mq.get_queue_size() == 1


def test_get_statistics(make: Callable[..., Sync]) -> None:
    stats = make().get_statistics()
    # 0.9.1's keys (current_param_version and staleness_threshold left with the version check)
    expected = {"queue_size", "total_produced", "total_consumed", "dropped_samples",
                "max_queue_size"}  # fmt: skip
    assert set(stats) == expected
    assert all(type(stats[k]) is int for k in expected)


def test_get_memory_usage(make: Callable[..., Sync]) -> None:
    mq = make()
    for i in range(2):
        mq.put_sample(sample=blob(i))
    memory = mq.get_memory_usage()
    assert set(memory) == {"queue_samples", "estimated_memory_bytes", "estimated_memory_mb"}
    assert memory["queue_samples"] == 2
    assert memory["estimated_memory_bytes"] > 0 and memory["estimated_memory_mb"] > 0


def test_shutdown(make: Callable[..., Sync]) -> None:
    make().shutdown()  # does not raise


def test_concurrent_put_get(make: Callable[..., Sync]) -> None:
    mq = make()
    puts: list[bool] = []
    gets: list[Any] = []

    def producer() -> None:
        for i in range(20):
            puts.append(mq.put_sample(sample=blob(i)))
            time.sleep(0.02)

    def consumer() -> None:
        for _ in range(20):
            gets.append(mq.get_sample()[0])
            time.sleep(0.02)

    threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
    threads[0].start()
    time.sleep(0.01)
    threads[1].start()
    for t in threads:
        t.join(timeout=30)
    assert puts == [True] * 20
    assert gets == [blob(i) for i in range(20)]  # each once, in order


def test_consume_first_produce_later(make: Callable[..., Sync]) -> None:
    mq = make()
    consumed: list[list[Any]] = []

    def consumer_task() -> None:
        consumed.append(mq.get_samples(min_batch_count=3))

    def producer_task() -> None:
        time.sleep(0.5)
        for i in range(3):
            mq.put_sample(sample=blob(i))
            time.sleep(0.2)

    consumer = threading.Thread(target=consumer_task, name="Consumer")
    producer = threading.Thread(target=producer_task, name="Producer")
    consumer.start()
    time.sleep(0.1)
    producer.start()
    producer.join()
    consumer.join(timeout=30)
    assert consumed == [[blob(0), blob(1), blob(2)]]
    assert mq.get_queue_size() == 0
    stats = mq.get_statistics()
    assert stats["total_produced"] == 3 and stats["total_consumed"] == 3


# --- the recipe's sequence: driver, rollouter actor, trainer actor -------------------------------
@ray.remote(num_cpus=0)
class Rollouter:
    """What ``FullyAsyncRollouter`` does with the queue: ``set_message_queue_client``, then per
    sample ``put_sample(sample=ray.cloudpickle.dumps(rollout_sample))``, at the end
    ``put_sample(sample=None)``."""

    def __init__(self) -> None:
        self.message_queue_client: Any = None

    async def set_message_queue_client(self, message_queue_client: Any) -> None:
        self.message_queue_client = message_queue_client

    async def fit(self, first: int, count: int, end: bool = True, filler: int = 0) -> list[bool]:
        results = []
        for i in range(first, first + count):
            rollout_sample = verl_samples.rollout_sample(i, filler=filler)
            success = await self.message_queue_client.put_sample(
                sample=ray.cloudpickle.dumps(rollout_sample),
            )
            results.append(success)
        if end:
            await self.message_queue_client.put_sample(sample=None)
        return results

    async def put_validate(self, metrics: dict[str, float]) -> bool:
        return bool(await self.message_queue_client.put_validate(ray.cloudpickle.dumps(metrics)))

    async def get_statistics(self) -> dict[str, Any]:
        return dict(await self.message_queue_client.get_statistics())

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class Trainer:
    """What ``FullyAsyncTrainer._get_samples_from_queue`` does: ``get_sample`` until it has
    ``required`` or gets None, then ``ray.cloudpickle.loads`` each; here it also checks each
    sample against the one the rollouter built."""

    def __init__(self) -> None:
        self.message_queue_client: Any = None

    async def set_message_queue_client(self, message_queue_client: Any) -> None:
        self.message_queue_client = message_queue_client

    async def collect(
        self, required: int, delay: float = 0.0, filler: int = 0
    ) -> tuple[list[tuple[int, bool]], list[int]]:
        queue_samples, lengths = [], []
        while len(queue_samples) < required:
            sample, queue_len = await self.message_queue_client.get_sample()
            if sample is None:
                break
            queue_samples.append(sample)
            lengths.append(queue_len)
            await asyncio.sleep(delay)  # "training"
        queue_samples = [ray.cloudpickle.loads(x) for x in queue_samples]
        checked = [
            (number(s), same_sample(s, verl_samples.rollout_sample(number(s), filler=filler)))
            for s in queue_samples
        ]
        return checked, lengths

    def get_validate(self) -> Any:
        val_data = self.message_queue_client.get_validate_sync()
        return None if val_data is None else ray.cloudpickle.loads(val_data)

    def get_queue_size(self) -> int:
        return int(self.message_queue_client.get_queue_size_sync())


@pytest.fixture(scope="module")
def actors() -> tuple[Any, Any]:
    """One rollouter and one trainer for the module (each imports verl's trainer: seconds)."""
    return Rollouter.remote(), Trainer.remote()


def hand_over(message_queue_client: MessageQueueClient, *actors: Any) -> None:
    """fully_async_main.py: ``ray.get(actor.set_message_queue_client.remote(client))``."""
    for actor in actors:
        ray.get(actor.set_message_queue_client.remote(message_queue_client))


def queue_partition(mq: MessageQueueClient) -> tqstream.PartitionStats:
    name = mq.queue_actor.name
    return mq.client.stats(name).partitions[name]


def test_rollouter_queue_trainer_with_only_the_import_changed(actors: tuple[Any, Any]) -> None:
    rollouter, trainer = actors
    config = OmegaConf.create({"async_training": {"staleness_threshold": 0.5}})
    max_queue_size = 2
    # FullyAsyncTaskRunner._initialize_components, line for line
    message_queue = MessageQueue.remote(config, max_queue_size)
    message_queue_client = MessageQueueClient(message_queue)
    hand_over(message_queue_client, rollouter, trainer)

    produced = rollouter.fit.remote(0, 6)  # runs into the full queue: waits, drops nothing
    taken, lengths = ray.get(trainer.collect.remote(required=10, delay=0.2), timeout=120)
    assert ray.get(produced) == [True] * 6
    assert taken == [(i, True) for i in range(6)]  # every sample, equal, in order
    assert max(lengths) <= max_queue_size  # the room a take frees may be refilled at once
    stats = ray.get(rollouter.get_statistics.remote())
    assert stats == {
        "queue_size": 0, "total_produced": 6, "total_consumed": 6, "dropped_samples": 0,
        "max_queue_size": 2,
    }  # fmt: skip
    assert asyncio.run(message_queue_client.get_statistics()) == stats  # the driver sees the same

    # validation results, rollouter to trainer
    assert ray.get(rollouter.put_validate.remote({"val-core/acc": 0.75})) is True
    assert ray.get(trainer.get_validate.remote()) == {"val-core/acc": 0.75}
    assert ray.get(trainer.get_validate.remote()) is None

    # the end: the trainer sees (None, 0) again; the driver's finally clears the queue
    assert ray.get(trainer.collect.remote(required=1))[0] == []
    asyncio.run(message_queue_client.clear_queue())
    asyncio.run(message_queue_client.shutdown())
    part = queue_partition(message_queue_client)
    assert part.rows == 0 and part.pending_puts == 0


def test_drop_oldest_between_actors(actors: tuple[Any, Any]) -> None:
    rollouter, trainer = actors
    message_queue = MessageQueue.remote(None, 2, drop_oldest=True, name=f"drop{next(_names)}")
    message_queue_client = MessageQueueClient(message_queue)
    hand_over(message_queue_client, rollouter, trainer)
    assert ray.get(rollouter.fit.remote(0, 6)) == [True, True, False, False, False, False]
    taken, _ = ray.get(trainer.collect.remote(required=10))
    assert taken == [(4, True), (5, True)]  # the newest two; the four oldest were dropped
    stats = ray.get(rollouter.get_statistics.remote())
    assert (stats["total_produced"], stats["total_consumed"], stats["dropped_samples"]) == (6, 2, 4)
    cluster = message_queue_client.client.stats()
    assert cluster.admissions[message_queue.admission]["dropped"] == 4
    assert queue_partition(message_queue_client).rows == 0  # nothing left behind


def test_a_rollouter_killed_mid_stream_leaves_the_queue_consistent(
    actors: tuple[Any, Any],
) -> None:
    """SIGKILL of the rollouter's process while it streams samples of 512 KiB (through shared
    memory) into a full queue: what it committed is delivered, whole and once, in order; what it
    was putting is rolled back; nothing stays in storage; another rollouter carries on."""
    survivor, _ = actors
    filler = 65536  # float32 values per row: 2 rows x 256 KiB
    message_queue = MessageQueue.remote(None, 3, name=f"kill{next(_names)}")
    mq = MessageQueueClient(message_queue)
    victim = Rollouter.remote()
    hand_over(mq, victim)
    pid = ray.get(victim.pid.remote())
    stream = victim.fit.remote(0, 1000, end=False, filler=filler)
    taken = []
    for _ in range(5):
        sample, _ = mq.get_sample_sync()
        taken.append(ray.cloudpickle.loads(sample))
    os.kill(pid, signal.SIGKILL)  # woken by the last take: it is putting the next sample
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stream, timeout=60)
    # the controller notices the dead connection, rolls back its put in flight
    wait_until(lambda: queue_partition(mq).pending_puts == 0)
    while mq.get_queue_size_sync():
        taken.append(ray.cloudpickle.loads(mq.get_sample_sync()[0]))
    numbers = [number(s) for s in taken]
    assert numbers == list(range(len(numbers))) and len(numbers) >= 5  # none lost, none twice
    assert all(same_sample(s, rollout_sample(number(s), filler=filler)) for s in taken)
    part = queue_partition(mq)
    assert part.rows == 0 and part.produced == part.tasks["trainer"].consumed == len(numbers)
    assert mq.client.stats().admissions[message_queue.admission]["running"] == 0

    hand_over(mq, survivor)  # another rollouter carries on, to the end of the stream
    assert ray.get(survivor.fit.remote(100, 2, filler=filler)) == [True, True]
    assert [number(ray.cloudpickle.loads(mq.get_sample_sync()[0])) for _ in range(2)] == [100, 101]
    assert mq.get_sample_sync() == (None, 0)
    assert queue_partition(mq).rows == 0
