"""The plain PyTorch adapter against real servers, DataLoader workers and trainer processes."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch.utils.data import DataLoader

import tqstream
from tqstream import Client, StalenessPolicy
from tqstream.adapters.torch import ExperienceDataset, ExperienceWriter, meta_of

HERE = Path(__file__).parent


def write(client: Client, partition: str, n: int, *, start: int = 0, close: bool = True) -> None:
    """One trajectory per put, as rollout workers produce: row i is [i, i, ...] of length i%5+1."""
    with ExperienceWriter(client, partition=partition) as writer:
        for i in range(start, start + n):
            writer.put_experience(
                {"x": [torch.full((i % 5 + 1,), i)], "reward": [float(i)]}, current_version=0
            )
        if not close:
            writer.closed = True  # leave the partition open for later puts


def firsts(batch: TensorDict) -> list[int]:
    return [int(row[0]) for row in batch["x"].unbind()]


def test_batches_are_tensordicts_acked_by_the_next_step(client: Client, partition: str) -> None:
    write(client, partition, 7)
    ds = ExperienceDataset(client, ["x", "reward"], 3, partition=partition, finite=True)
    seen: list[int] = []
    for batch in DataLoader(ds, batch_size=None, collate_fn=ExperienceDataset.collate):
        assert isinstance(batch, TensorDict) and batch["x"].is_nested
        assert batch["reward"].dtype == torch.float32
        task = client.stats(partition).partitions[partition].tasks["actor"]
        assert task.leased == len(batch)  # this batch is leased until the next one is asked for
        seen += firsts(batch)
    assert sorted(seen) == list(range(7)) and len(seen) == 7  # 3 + 3 + the short last batch
    task = client.stats(partition).partitions[partition].tasks["actor"]
    assert (task.acked, task.leased) == (7, 0)


def test_padded_batches_with_lengths(client: Client, partition: str) -> None:
    write(client, partition, 4)
    ds = ExperienceDataset(
        client.address, ["x"], 4, partition=partition, padded=True, pad_values=-1, finite=True
    )
    (batch,) = list(ds.loader())
    assert batch["x"].shape == (4, 4) and batch["x_lengths"].tolist() == [1, 2, 3, 4]
    assert batch["x"][0].tolist() == [0, -1, -1, -1]


@pytest.mark.parametrize("workers", [1, 3])
def test_dataloader_workers_share_rows_without_duplicates(
    client: Client, partition: str, workers: int
) -> None:
    write(client, partition, 40)
    ds = ExperienceDataset(client, ["x"], 4, partition=partition, ack="manual", finite=True)
    seen: list[int] = []
    for batch in ds.loader(num_workers=workers):
        seen += firsts(batch)
        assert ds.ack(batch) == len(batch)  # after the "step", from the main process
    assert sorted(seen) == list(range(40))
    assert client.stats(partition).partitions[partition].tasks["actor"].acked == 40


def test_ack_next_is_refused_in_workers(client: Client, partition: str) -> None:
    write(client, partition, 2)
    ds = ExperienceDataset(client, ["x"], 2, partition=partition, finite=True)
    with pytest.raises(tqstream.InvalidRequestError, match="build the dataset with ack='manual'"):
        ds.loader(num_workers=1)  # refused at once, in the trainer's process
    loader = DataLoader(ds, batch_size=None, num_workers=1, collate_fn=ExperienceDataset.collate)
    it = iter(loader)
    try:  # a DataLoader built by hand: the worker refuses it on its first batch
        next(it)
        raise AssertionError("ack='next' was accepted in a DataLoader worker")
    except tqstream.InvalidRequestError as e:  # no pytest.raises: its traceback would keep `it`
        assert "with num_workers > 0 build the dataset with ack='manual'" in str(e)
    # torch joins a worker that raised only after a 5 s timeout: do it here, not in a garbage
    # collection that might run on a server thread of this process during a later test
    del it, loader
    gc.collect()


def test_a_killed_trainer_loses_nothing(client: Client, partition: str) -> None:
    write(client, partition, 6)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "torch_crash_worker.py"), client.address, partition],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lost = json.loads(proc.stdout.readline())  # its batch is leased, then it dies mid-step
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    ds = ExperienceDataset(client, ["x"], 2, partition=partition, finite=True, timeout=20)
    seen = [v for batch in ds for v in firsts(batch)]
    assert len(lost) == 3 and sorted(seen) == list(range(6))  # the killed lease came back


def test_staleness_window_from_version_fn(client: Client, partition: str) -> None:
    with ExperienceWriter(client, partition=partition) as writer:
        for v in (0, 1, 2, 3):
            writer.put_experience({"x": [torch.full((2,), v)]}, current_version=v)
    version = {"now": 3}
    ds = ExperienceDataset(
        client, ["x"], 2, partition=partition, finite=True, version_fn=lambda: version["now"],
        staleness=StalenessPolicy(max_staleness=1, on_stale="drop"),
    )  # fmt: skip
    batches = list(ds)
    assert [firsts(b) for b in batches] == [[2, 3]]
    st_ = client.stats(partition).partitions[partition]
    assert st_.stale_dropped == 2 and st_.tasks["actor"].lag == {0: 1, 1: 1}


def test_stateful_dataloader_resumes_where_the_checkpoint_was(
    client: Client, partition: str
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    write(client, partition, 9)

    def loader() -> StatefulDataLoader:
        ds = ExperienceDataset(client, ["x"], 3, partition=partition, finite=True)
        return StatefulDataLoader(ds, batch_size=None, collate_fn=ExperienceDataset.collate)

    first = loader()
    it = iter(first)
    trained = firsts(next(it))  # step 1 trained, then a checkpoint
    state = first.state_dict()
    assert client.stats(partition).partitions[partition].tasks["actor"].leased == 3
    del it, first  # the job dies here; its lease is still held
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [v for b in resumed for v in firsts(b)]
    assert sorted(trained + rest) == list(range(9))  # the checkpointed batch is not read again
    task = client.stats(partition).partitions[partition].tasks["actor"]
    assert (task.acked, task.leased) == (9, 0)


def test_async_get_and_put(client: Client, partition: str) -> None:
    import asyncio

    async def main() -> list[int]:
        writer = ExperienceWriter(client, partition=partition)
        await writer.async_put_experience({"x": [torch.arange(3)] * 2}, current_version=1)
        ds = ExperienceDataset(client, ["x"], 2, partition=partition, ack="manual")
        batch = await ds.async_get_experience(current_version=1)
        ds.ack(batch)
        return firsts(batch)

    assert asyncio.run(main()) == [0, 0]
    assert ExperienceDataset(client, ["x"], 1, partition=partition).get_experience is not None


def test_ranks_sharing_a_dp_rank_get_identical_batches(client: Client, partition: str) -> None:
    """dp=2 x tp=2 trainer processes over gloo: tp peers train on the same rows, dp ranks on
    disjoint ones, and together they read every row once."""
    write(client, partition, 12)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "torch_rank_worker.py"),
                client.address,
                partition,
                init,
                str(rank),
                "2",
                "2",
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
        )
        for rank in range(4)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    by_rank = {o["rank"]: o["batches"] for o in outs}
    assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3]
    rows0 = [v for b in by_rank[0] for v in b]
    rows2 = [v for b in by_rank[2] for v in b]
    assert not set(rows0) & set(rows2) and sorted(rows0 + rows2) == list(range(12))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    workers=st.integers(0, 2),
    n=st.integers(1, 30),
    batch=st.integers(1, 7),
    dropped=st.sets(st.integers(0, 10), max_size=2),
)
def test_workers_and_crashed_steps_never_lose_or_duplicate(
    deployment: tuple[str, str], workers: int, n: int, batch: int, dropped: set[int]
) -> None:
    """Batches whose step "crashes" (never acked) come back after their lease; every row is
    trained exactly once in the end, whatever the number of workers."""
    gc.collect()  # loaders of earlier tests are shut down now, not while a lease runs
    address = deployment[1]
    partition = f"prop-{os.getpid()}-{workers}-{n}-{batch}-{sorted(dropped)}-{os.urandom(4).hex()}"
    with tqstream.connect(address) as client:
        write(client, partition, n)
        ds = ExperienceDataset(
            address, ["x"], batch, partition=partition, ack="manual", finite=True,
            lease_timeout=5.0, timeout=30,
        )  # fmt: skip
        trained: Counter[int] = Counter()
        for step, b in enumerate(ds.loader(num_workers=workers)):
            if step in dropped:
                continue  # the step crashed: no ack, the lease expires
            trained.update(firsts(b))
            ds.ack(b)
        assert sorted(trained.elements()) == list(range(n))
        client.clear_partition(partition)
    gc.collect()


def test_bad_input(client: Client, partition: str) -> None:
    with pytest.raises(tqstream.InvalidRequestError, match=r"^ack must be 'next' or 'manual'"):
        ExperienceDataset(client, ["x"], 2, ack="sometimes")
    with pytest.raises(tqstream.InvalidRequestError, match=r"needs the trainer's version"):
        ExperienceDataset(client, ["x"], 2, staleness=StalenessPolicy(max_staleness=1))
    with pytest.raises(tqstream.InvalidRequestError, match=r"batch_size must be a positive int"):
        ExperienceDataset(client, ["x"], 0)
    with pytest.raises(tqstream.InvalidRequestError, match=r"pass the cluster's address"):
        ExperienceDataset(42, ["x"], 2)  # type: ignore[arg-type]
    write(client, partition, 2)
    ds = ExperienceDataset(client, ["x"], 2, partition=partition, version_fn=lambda: "3")  # type: ignore[arg-type,return-value]
    with pytest.raises(tqstream.InvalidRequestError, match=r"a policy version: .*; got '3'"):
        next(iter(ds))
    with pytest.raises(tqstream.InvalidRequestError, match=r"carries no tqstream lease"):
        meta_of(TensorDict({"x": torch.zeros(2)}, batch_size=[2]))
    writer = ExperienceWriter(client, partition=partition)
    with pytest.raises(tqstream.InvalidRequestError, match=r"current_version must be"):
        writer.put_experience({"x": [torch.zeros(2)]}, current_version=None)  # type: ignore[arg-type]
    assert client.stats(partition).partitions[partition].rows == 2  # nothing more stored


def test_a_checkpoint_taken_just_before_a_kill_resumes_without_rereading(
    client: Client, partition: str
) -> None:
    """Killed after its checkpoint and before asking for the next batch (ack="next"): the
    resumed run acks the checkpoint's batch although its lease ended, and reads only the rest."""
    client.put({"x": torch.arange(4)}, partition)
    first = ExperienceDataset(client, ["x"], 2, partition=partition, lease_timeout=0.3)
    trained = next(iter(first))
    state = first.state_dict()  # the checkpoint, then the process dies
    deadline = time.monotonic() + 5
    while client.stats(partition).partitions[partition].tasks["actor"].leased:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    resumed = ExperienceDataset(client, ["x"], 2, partition=partition, timeout=5)
    resumed.load_state_dict(state)
    rest = next(iter(resumed))
    assert sorted(rest["x"].tolist() + trained["x"].tolist()) == [0, 1, 2, 3]
    resumed.ack(rest)
    assert client.stats(partition).partitions[partition].tasks["actor"].consumed == 4
