"""Finite streams: producers close a partition; readers get the last short batch, then the end."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tqstream
from tqstream import Client


def rows(n: int, start: int = 0) -> dict[str, object]:
    return {"x": [torch.arange(start + i + 1) for i in range(n)]}


def test_put_after_close_is_refused_and_stores_nothing(client: Client, partition: str) -> None:
    client.create_partition(partition, ["x"], producers=2)
    client.put(rows(2), partition)
    assert client.close_partition(partition) == 1  # one producer still open: puts go on
    client.put(rows(1, 2), partition)
    assert client.stats(partition).partitions[partition].producers_open == 1
    assert client.close_partition(partition) == 0
    with pytest.raises(tqstream.PartitionClosedError) as err:
        client.put(rows(1, 3), partition)
    assert str(err.value) == (
        f"partition {partition!r} is closed: its 2 producer(s) called close_partition, so it "
        f"takes no new rows (put_fields to its rows still works); put to another partition, or "
        f"clear_partition({partition!r}) to start over"
    )
    st = client.stats(partition).partitions[partition]
    assert st.rows == 3 and st.pending_puts == 0 and st.producers_open == 0
    assert client.stats().storage_bytes > 0
    # put_fields to the rows of a closed partition still works (consumers add columns)
    meta = client.get_meta(partition, ["x"], 3, "critic")
    client.put_fields(meta, {"v": torch.zeros(3)})
    assert client.stats(partition).partitions[partition].fields["v"] == 3


def test_last_short_batch_then_drained(client: Client, partition: str) -> None:
    client.put(rows(5), partition)
    client.close_partition(partition)
    first = client.get(partition, ["x"], 2, "t", timeout=5)
    first.ack()
    second = client.get(partition, ["x"], 2, "t", timeout=5)
    second.ack()
    last = client.get(partition, ["x"], 2, "t", timeout=5)
    assert len(last) == 1  # the short last batch, served at once
    last.ack()
    with pytest.raises(tqstream.PartitionDrainedError) as err:
        client.get(partition, ["x"], 2, "t", timeout=5)
    assert isinstance(err.value, EOFError)
    assert str(err.value) == (
        f"partition {partition!r} is closed and drained for task 't': every row it could serve "
        f"with fields ['x'] was consumed"
    )
    # another task still reads everything
    assert len(client.get(partition, ["x"], 8, "other", timeout=5)) == 5


def test_parked_get_is_woken_by_close(client: Client, partition: str) -> None:
    client.create_partition(partition, ["x"])
    client.put(rows(1), partition)
    got: list[object] = []

    def reader() -> None:
        try:
            b = client.get(partition, ["x"], 4, "t", timeout=20)
            got.append(len(b))
            b.ack()
            client.get(partition, ["x"], 4, "t", timeout=20)
        except tqstream.PartitionDrainedError:
            got.append("drained")

    th = threading.Thread(target=reader)
    th.start()
    time.sleep(0.3)
    assert got == []  # waiting for 4 rows
    client.close_partition(partition)
    th.join(10)
    assert got == [1, "drained"]


def test_leased_rows_keep_the_stream_open(client: Client, partition: str) -> None:
    """Rows leased to another reader may come back (release, crash): drained only once acked."""
    client.put(rows(2), partition)
    client.close_partition(partition)
    held = client.get(partition, ["x"], 2, "t", timeout=5)
    got: list[object] = []

    def reader() -> None:
        try:
            b = client.get(partition, ["x"], 2, "t", timeout=20)
            got.append(len(b))
            b.ack()
            client.get(partition, ["x"], 2, "t", timeout=20)
        except tqstream.PartitionDrainedError:
            got.append("drained")

    th = threading.Thread(target=reader)
    th.start()
    time.sleep(0.3)
    assert got == []
    client.release(held.meta.select([1]))  # one row comes back: served as the short last batch
    time.sleep(0.3)
    assert got[:1] == [1]
    client.ack(held.meta.select([0]))  # the last leased row acked: the parked get learns the end
    th.join(10)
    assert got == [1, "drained"]


def test_whole_groups_of_a_closed_partition(client: Client, partition: str) -> None:
    client.put(rows(3), partition, groups=["a", "a", "b"], group_size=2)
    client.put(rows(2, 3), partition, groups=["c", "c"], group_size=2)
    client.close_partition(partition)
    b = client.get(partition, ["x"], 3, "t", whole_groups=True, timeout=5)
    assert sorted(b.meta.groups) == ["a", "a"]  # whole groups only: 2 of 3 requested rows
    b.ack()
    b = client.get(partition, ["x"], 3, "t", whole_groups=True, timeout=5)
    assert b.meta.groups == ["c", "c"]
    b.ack()
    # group "b" can never complete: it is not served, and does not hold the stream open
    with pytest.raises(tqstream.PartitionDrainedError):
        client.get(partition, ["x"], 3, "t", whole_groups=True, timeout=5)


def test_rows_missing_a_field_keep_it_open_until_written(client: Client, partition: str) -> None:
    client.create_partition(partition, ["x", "v"])
    meta = client.put(rows(2), partition)
    client.close_partition(partition)
    with pytest.raises(tqstream.RequestTimeoutError):  # "v" may still be written
        client.get(partition, ["x", "v"], 2, "t", timeout=0.2)
    client.put_fields(meta, {"v": torch.ones(2)})
    assert len(client.get(partition, ["x", "v"], 2, "t", timeout=5, auto_ack=True)) == 2
    with pytest.raises(tqstream.PartitionDrainedError):
        client.get(partition, ["x", "v"], 2, "t", timeout=5)


def test_close_validation(client: Client, partition: str) -> None:
    with pytest.raises(tqstream.UnknownPartitionError):
        client.close_partition(partition)
    with pytest.raises(tqstream.InvalidRequestError, match=r"producers must be >= 1 .* got 0"):
        client.create_partition(partition, ["x"], producers=0)
