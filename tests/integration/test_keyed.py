"""Key-value writes, tags, lookups, row listings and consumption resets, run against the embedded
and the multi-process deployment (the operations TransferQueue's API maps onto)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tqstream
from tqstream import Client
from tqstream.launch.processes import ProcessCluster


def test_put_by_keys_creates_rows_adds_and_replaces_fields(client: Client, partition: str) -> None:
    meta = client.put_by_keys(
        partition, ["a", "b"], {"ids": [torch.arange(3), torch.arange(5)]}, tags=[{"n": 1}, None]
    )
    assert meta.keys == ["a", "b"] and meta.fields == ["ids"]
    assert meta.tags == [{"n": 1}, {}]
    # a later write by key adds a field to existing rows and creates the missing one
    meta = client.put_by_keys(partition, ["b", "c"], {"score": torch.tensor([1.0, 2.0])})
    assert meta.keys == ["b", "c"] and meta.fields == ["score"]  # c has no ids: not common
    # a field the rows have is replaced: readers see the new values
    client.put_by_keys(partition, ["a", "b"], {"ids": [torch.tensor([7]), torch.tensor([8, 9])]})
    got = client.get_by_keys(partition, ["b", "a"], ["ids"]).data["ids"]
    assert got[0].tolist() == [8, 9] and got[1].tolist() == [7]
    assert client.get_by_keys(partition, ["b"]).meta.fields == ["ids", "score"]
    stats = client.stats(partition).partitions[partition]
    assert stats.rows == 3 and stats.fields == {"ids": 2, "score": 2}


def test_replacing_every_field_of_a_chunk_frees_it(client: Client, partition: str) -> None:
    client.put_by_keys(partition, ["a", "b"], {"x": torch.zeros(2, 1000)})
    before = client.stats(partition).units
    held = sum(u.bytes for u in before)
    for _ in range(3):
        client.put_by_keys(partition, ["a", "b"], {"x": torch.ones(2, 1000)})
    after = sum(u.bytes for u in client.stats(partition).units)
    assert after == held  # the replaced chunks were released, not kept beside the new ones
    assert client.get_by_keys(partition, ["a"]).data["x"].sum().item() == 1000
    client.clear_partition(partition)
    assert sum(u.bytes for u in client.stats().units) < held


def test_tags_merge_key_by_key_and_tag_only_rows(client: Client, partition: str) -> None:
    client.put_by_keys(partition, ["p0", "p1"], tags=[{"is_prompt": True, "status": "pending"}] * 2)
    client.put_by_keys(partition, ["p0"], tags=[{"status": "running"}])
    listing = client.list_rows(partition)[partition]
    assert listing.meta.keys == ["p0", "p1"] and listing.meta.fields == []
    assert listing.meta.tags == [
        {"is_prompt": True, "status": "running"},
        {"is_prompt": True, "status": "pending"},
    ]
    # a row created with tags only takes its fields later, wherever it was placed
    client.put_by_keys(partition, ["p1"], {"prompt": ["2+2="]}, tags=[{"status": "done"}])
    got = client.get_by_keys(partition, ["p1"])
    assert got.data.get("prompt").tolist() == ["2+2="]
    assert got.meta.tags == [{"is_prompt": True, "status": "done"}]
    # put and put_fields take tags too; set_tags merges into rows named by metadata
    meta = client.put(
        {"x": torch.arange(2)}, partition, keys=["q0", "q1"], tags=[{"v": [1, 2]}, None]
    )
    client.put_fields(meta, {"y": torch.ones(2)}, tags=[None, {"w": 1.5}])
    client.set_tags(meta, [{"v": None}, {"z": "s"}])
    assert client.lookup(partition, ["q0", "q1"]).tags == [{"v": None}, {"w": 1.5, "z": "s"}]


def test_lookup_by_key_or_row_and_missing_rows(client: Client, partition: str) -> None:
    meta = client.put({"x": torch.arange(3)}, partition, keys=["a", "b", "c"])
    found = client.lookup(partition, ["c", "a"])
    assert found.keys == ["c", "a"] and found.row_ids == [meta.row_ids[2], meta.row_ids[0]]
    assert found.fields == ["x"]
    assert client.lookup(partition, row_ids=[meta.row_ids[1]]).keys == ["b"]
    with pytest.raises(tqstream.UnknownKeyError, match=r"1 of 2 keys are not in partition"):
        client.lookup(partition, ["a", "nope"])
    with pytest.raises(tqstream.UnknownRowError, match="do not exist"):
        client.lookup(partition, row_ids=[10**9])
    assert client.lookup(partition, ["nope", "b"], missing_ok=True).keys == ["b"]
    assert len(client.lookup("no-such-partition", ["a"], missing_ok=True)) == 0
    with pytest.raises(tqstream.UnknownPartitionError):
        client.lookup("no-such-partition", ["a"])


def test_list_rows_ready_and_consumed(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(4)}, partition, keys=["a", "b", "c", "d"])
    client.put_by_keys(partition, ["a", "b"], {"y": torch.ones(2)})
    leased = client.get_meta(partition, ["x"], 1, "t")
    acked = client.get(partition, ["x"], 1, "t")
    acked.ack()
    listing = client.list_rows(partition, fields=["x", "y"], task="t")[partition]
    assert listing.meta.keys == ["a", "b", "c", "d"]
    assert listing.ready == [True, True, False, False]
    consumed = {k for k, c in zip(listing.meta.keys, listing.consumed, strict=True) if c}
    assert consumed == {leased.keys[0], acked.meta.keys[0]}
    everywhere = client.list_rows()
    assert partition in everywhere
    with pytest.raises(tqstream.UnknownFieldError):
        client.list_rows(partition, fields=["nope"])


def test_reset_consumption_serves_the_rows_again(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(4)}, partition)
    first = client.get(partition, ["x"], 4, "t")
    first.ack()
    with pytest.raises(tqstream.RequestTimeoutError):
        client.get_meta(partition, ["x"], 1, "t", timeout=0)
    assert client.reset_consumption(partition, "t") == 4
    again = client.get(partition, ["x"], 4, "t", timeout=5)
    assert sorted(again.meta.keys) == sorted(first.meta.keys)
    assert client.reset_consumption(partition) == 4  # every task; the lease ends
    assert again.ack() == 0  # acking a lease that a reset ended does nothing
    assert len(client.get(partition, ["x"], 4, "t", timeout=5)) == 4


def test_keyed_writes_refuse_bad_input_and_store_nothing(client: Client, partition: str) -> None:
    client.put_by_keys(partition, ["a"], {"x": torch.zeros(1, 2)})
    with pytest.raises(tqstream.TagError, match="tag 'nested' of row 0 is a dict"):
        client.put_by_keys(partition, ["b"], {"x": torch.zeros(1, 2)}, tags=[{"nested": {"a": 1}}])
    with pytest.raises(tqstream.TagError, match=r"\.item\(\) gives its number"):
        client.put_by_keys(partition, ["b"], tags=[{"t": torch.tensor(1.0)}])
    with pytest.raises(tqstream.TagError, match="must be a mapping"):
        client.put_by_keys(partition, ["b"], tags=["status"])  # type: ignore[list-item]
    with pytest.raises(tqstream.UnknownKeyError, match="'b'"):
        client.put_by_keys(partition, ["b"], {"x": torch.zeros(1, 2)}, create=False)
    with pytest.raises(tqstream.FieldExistsError, match="pass overwrite=True"):
        client.put_by_keys(partition, ["a"], {"x": torch.zeros(1, 2)}, overwrite=False)
    with pytest.raises(tqstream.SchemaError, match="stored as dense float32"):
        client.put_by_keys(partition, ["a", "b"], {"x": torch.zeros(2, 3)})
    with pytest.raises(tqstream.BatchShapeError, match="2 rows of data for 1 keys"):
        client.put_by_keys(partition, ["b"], {"x": torch.zeros(2, 2)})
    with pytest.raises(tqstream.InvalidRequestError, match="more than once"):
        client.put_by_keys(partition, ["b", "b"], {"x": torch.zeros(2, 2)})
    assert client.list_keys(partition) == ["a"]  # none of the refused writes created a row
    assert client.lookup(partition, ["a"]).tags == []


@pytest.fixture(params=["embedded", "processes"])
def fresh(request: pytest.FixtureRequest) -> Iterator[Client]:
    """A cluster of its own (a checkpoint loads into a cluster that holds no rows)."""
    if request.param == "embedded":
        client = tqstream.init(storage_units=2)
        yield client
        client.close()
    else:
        with ProcessCluster(2) as cluster, tqstream.connect(cluster.address) as client:
            yield client


def test_rows_without_fields_and_tags_survive_a_checkpoint(fresh: Client, tmp_path: Path) -> None:
    client, part = fresh, "ckpt-keyed"
    client.put_by_keys(part, ["prompt"], tags=[{"is_prompt": True, "steps": 3}])
    client.put_by_keys(part, ["traj"], {"x": torch.arange(3).reshape(1, 3)}, tags=[{"ok": 1}])
    client.put_by_keys(part, ["traj"], {"x": torch.tensor([[7, 8, 9]])})  # replaced: latest kept
    client.save_checkpoint(tmp_path / "ck")
    client.clear_partition(part)
    summary = client.load_checkpoint(tmp_path / "ck")
    assert summary.rows == 2
    listing = client.list_rows(part)[part]
    assert listing.meta.keys == ["prompt", "traj"]
    assert listing.meta.tags == [{"is_prompt": True, "steps": 3}, {"ok": 1}]
    assert client.get_by_keys(part, ["traj"]).data["x"].tolist() == [[7, 8, 9]]
    client.put_by_keys(part, ["prompt"], {"x": torch.zeros(1, 3, dtype=torch.int64)})
    assert client.get_by_keys(part, ["prompt", "traj"]).meta.fields == ["x"]


def test_max_rows_caps_the_cluster() -> None:
    client = tqstream.init(max_rows=3)
    try:
        client.put({"x": torch.arange(2)}, "p")
        with pytest.raises(tqstream.CapacityError, match="max_rows=3"):
            client.put({"x": torch.arange(2)}, "p")
        with pytest.raises(tqstream.CapacityError, match="max_rows=3"):
            client.put_by_keys("q", ["a", "b"], tags=[None, None])
        client.put_by_keys("q", ["a"])
        client.clear_partition("p")
        client.put_by_keys("q", ["b", "c"], {"x": torch.arange(2)})
        assert client.stats().partitions["q"].rows == 3
    finally:
        client.close()
