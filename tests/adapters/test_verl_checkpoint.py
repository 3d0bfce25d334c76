"""verl's checkpoint calls on the queue: ``save_checkpoint(path, metadata=...)`` and
``load_checkpoint(path)`` with transfer_queue's signatures; samples queued at the save come back
from a fresh cluster, equal to what was put, with the queue's slots counting them."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip(
    "verl.experimental.fully_async_policy.detach_utils",
    reason="verl's RolloutSample module needs: pip install cachetools fastapi uvicorn",
)

import ray
from verl_samples import rollout_sample

import tqstream
from tqstream.adapters.verl import MessageQueue, MessageQueueClient
from tqstream.launch.processes import ProcessCluster


def test_same_signatures_as_transfer_queues() -> None:
    tq = pytest.importorskip("transfer_queue")
    for name in ("save_checkpoint", "load_checkpoint"):
        theirs = inspect.signature(getattr(tq, name)).parameters.values()
        ours = list(inspect.signature(getattr(MessageQueueClient, name)).parameters.values())[1:]
        assert [(p.name, p.kind, p.default) for p in ours] == [
            (p.name, p.kind, p.default) for p in theirs
        ], name
        assert not inspect.iscoroutinefunction(getattr(MessageQueueClient, name))


def test_queued_samples_survive_a_restart(tmp_path: Path) -> None:
    sent = [ray.cloudpickle.dumps(rollout_sample(i)) for i in range(3)]
    with ProcessCluster(2) as cluster:
        client = tqstream.connect(cluster.address)
        mq = MessageQueueClient(MessageQueue.remote(None, 3, cluster=client))
        for s in sent:
            assert asyncio.run(mq.put_sample(s)) is True
        assert mq.get_sample_sync() == (sent[0], 2)
        # as verl's trainer calls it: tq.save_checkpoint(path, metadata={"global_steps": ...})
        mq.save_checkpoint(str(tmp_path / "transfer_queue"), metadata={"global_steps": 7})
        for p in cluster.procs:
            p.kill()
        client.close()

    with ProcessCluster(1) as cluster, tqstream.connect(cluster.address) as client:
        mq = MessageQueueClient(MessageQueue.remote(None, 3, cluster=client))  # as at start-up
        summary = mq.load_checkpoint(str(tmp_path / "transfer_queue"))
        assert summary.metadata == {"global_steps": 7}
        assert mq.get_queue_size_sync() == 2
        state = client.stats().admissions["fully_async.queue"]
        assert state["running"] == 2  # the queued samples still hold their slots
        asyncio.run(mq.put_sample(b"3"))  # the one slot left of max_queue_size=3
        assert client.stats().admissions["fully_async.queue"]["running"] == 3
        assert [mq.get_sample_sync()[0] for _ in range(3)] == [*sent[1:], b"3"]
        stats = mq.get_statistics_sync()
        assert (stats["queue_size"], stats["total_produced"], stats["total_consumed"]) == (0, 4, 4)
        assert client.stats().admissions["fully_async.queue"]["running"] == 0
        assert client.stats().storage_bytes == 0
