"""The client contract, run against the embedded and the multi-process deployment."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tqstream
from tqstream import Client


def ragged(n: int, start: int = 0) -> list[torch.Tensor]:
    return [torch.arange(start + i, start + i + (i % 5) + 1, dtype=torch.int64) for i in range(n)]


def batch(n: int, start: int = 0) -> dict[str, object]:
    return {
        "input_ids": ragged(n, start),
        "rewards": torch.arange(start, start + n, dtype=torch.float32),
        "mask": torch.ones(n, 3, dtype=torch.bool),
        "prompt": [f"prompt {start + i}" for i in range(n)],
    }


# --- put / get round trips ---
def test_put_get_roundtrip_all_kinds(client: Client, partition: str) -> None:
    meta = client.put(batch(6), partition, version=3)
    assert len(meta) == 6 and meta.version_start == [3] * 6
    got = client.get(partition, ["input_ids", "rewards", "mask", "prompt"], 6, "actor")
    td = got.data
    assert isinstance(td, TensorDict) and td.batch_size == torch.Size([6])
    assert torch.equal(td["rewards"], torch.arange(6, dtype=torch.float32))
    assert td["mask"].dtype == torch.bool and td["mask"].shape == (6, 3)
    ids = td["input_ids"]
    assert ids.is_nested and ids.layout == torch.jagged
    for i, row in enumerate(ragged(6)):
        assert torch.equal(ids[i], row)
    assert td.get("prompt").tolist() == [f"prompt {i}" for i in range(6)]
    assert got.meta.keys == meta.keys
    assert got.ack() == 6


def test_batch_columns_are_the_packed_rows_data_is_built_from(
    client: Client, partition: str
) -> None:
    client.put({"input_ids": ragged(5), "rewards": torch.arange(5.0)}, partition)
    got = client.get(partition, ["input_ids", "rewards"], 5, "actor")
    assert got.columns is not None and got._data is None  # nothing built yet
    ids = got.columns["input_ids"]
    assert isinstance(ids, tqstream.Column) and ids.schema.kind == "ragged"
    assert ids.offsets is not None
    assert ids.offsets.tolist() == [0, *torch.tensor([len(r) for r in ragged(5)]).cumsum(0)]
    assert torch.equal(ids.values, torch.cat(ragged(5)))
    assert torch.equal(got.columns["rewards"].values, torch.arange(5.0))
    td = got.data  # built on first use, from the same memory
    assert td is got.data
    assert td["input_ids"].values().data_ptr() == ids.values.data_ptr()
    for i, row in enumerate(ragged(5)):
        assert torch.equal(td["input_ids"][i], row)
    # an ExperienceBatch of the read does not build it either
    exp = tqstream.Experience(client, partition=partition, fields=["rewards"])
    client.put({"rewards": torch.arange(3.0)}, partition)
    read = exp.get_experience(3, 0, task="other")
    assert read._data is None and torch.equal(read.data["rewards"], torch.arange(3.0))
    got.ack()
    read.ack()


def test_padded_ragged_with_lengths(client: Client, partition: str) -> None:
    client.put({"tokens": ragged(4)}, partition)
    td = client.get(partition, "tokens", 4, "t", padded=True, pad_values={"tokens": -1}).data
    lengths = torch.tensor([len(r) for r in ragged(4)])
    assert torch.equal(td["tokens_lengths"], lengths)
    assert td["tokens"].shape == (4, int(lengths.max()))
    for i, row in enumerate(ragged(4)):
        assert torch.equal(td["tokens"][i, : len(row)], row)
        assert (td["tokens"][i, len(row) :] == -1).all()


def test_tensordict_input_and_jagged_input(client: Client, partition: str) -> None:
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(10.0), torch.tensor([0, 3, 3, 10]))
    td = TensorDict({"x": torch.randn(3, 2), "y": nt}, batch_size=[3])
    client.put(td, partition)
    out = client.get(partition, ["x", "y"], 3, "t").data
    assert torch.equal(out["x"], td["x"])
    assert torch.equal(out["y"].values(), torch.arange(10.0))
    assert out["y"][1].numel() == 0


def test_bfloat16_and_trailing_dims(client: Client, partition: str) -> None:
    x = torch.randn(5, 2, 3).to(torch.bfloat16)
    rows = [torch.randn(i + 1, 4) for i in range(5)]
    client.put({"x": x, "h": rows}, partition)
    out = client.get(partition, ["x", "h"], 5, "t").data
    assert out["x"].dtype == torch.bfloat16 and torch.equal(out["x"], x)
    for i in range(5):
        assert torch.equal(out["h"][i], rows[i])


def test_non_contiguous_input_is_made_contiguous(client: Client, partition: str) -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    assert not x.is_contiguous()
    client.put({"x": x}, partition)
    assert torch.equal(client.get(partition, "x", 4, "t").data["x"], x)


def test_json_and_bytes_objects(client: Client, partition: str) -> None:
    values = [{"a": 1}, [1, 2], None, "s"]
    client.put({"meta": values, "raw": [b"\x00\x01", b"", b"x", b"yz"]}, partition)
    td = client.get(partition, ["meta", "raw"], 4, "t").data
    assert td.get("meta").tolist() == values
    assert td.get("raw").tolist() == [b"\x00\x01", b"", b"x", b"yz"]


# --- leases and tasks ---
def test_tasks_are_independent_and_ack_consumes(client: Client, partition: str) -> None:
    client.put(batch(4), partition)
    a = client.get_meta(partition, ["rewards"], 4, "actor")
    b = client.get_meta(partition, ["rewards"], 4, "critic")
    assert sorted(a.row_ids) == sorted(b.row_ids)
    assert client.ack(a) == 4
    assert client.ack(a) == 0  # twice is harmless
    with pytest.raises(tqstream.RequestTimeoutError, match="already consumed by 'actor'"):
        client.get_meta(partition, ["rewards"], 1, "actor", timeout=0)
    st = client.stats(partition).partitions[partition]
    assert st.tasks["actor"] == tqstream.TaskStats(available=0, leased=0, acked=4, consumed=4)
    assert st.tasks["critic"] == tqstream.TaskStats(available=0, leased=4, acked=0)


def test_auto_ack(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(3)}, partition)
    assert client.get(partition, "x", 3, "t", auto_ack=True).data["x"].tolist() == [0, 1, 2]
    assert client.stats(partition).partitions[partition].tasks["t"].acked == 3


def test_release_returns_rows_in_their_order(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(6)}, partition)
    first = client.get_meta(partition, "x", 2, "t")
    client.get_meta(partition, "x", 2, "t")
    assert client.release(first) == 2
    again = client.get(partition, "x", 4, "t")
    assert again.data["x"].tolist() == [0, 1, 4, 5]


def test_lease_expiry_makes_rows_available(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(3)}, partition)
    meta = client.get_meta(partition, "x", 3, "t", lease_timeout=0.3)
    again = client.get_meta(partition, "x", 3, "t", timeout=5)
    assert sorted(again.row_ids) == sorted(meta.row_ids)
    with pytest.raises(tqstream.LeaseExpiredError, match=r"expired \(lease_timeout\)"):
        client.ack(meta)
    assert client.ack(again) == 3


def test_a_late_ack_fails_even_after_another_reader_acked_the_rows(
    client: Client, partition: str
) -> None:
    """The first reader trained on rows that went to a second reader, which acked them: the
    first must learn it, not get a silent 0."""
    client.put({"x": torch.arange(3)}, partition)
    late = client.get_meta(partition, "x", 3, "t", lease_timeout=0.3)
    other = client.get_meta(partition, "x", 3, "t", timeout=5)  # after late's lease expired
    assert client.ack(other) == 3
    assert client.ack(other) == 0  # a repeat of an ack that succeeded: harmless
    with pytest.raises(tqstream.LeaseExpiredError, match=r"expired \(lease_timeout\)"):
        client.ack(late)
    with pytest.raises(tqstream.LeaseExpiredError, match="another reader"):
        client.release(late)


def test_a_partial_ack_repeated_after_expiry_is_harmless(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(4)}, partition)
    meta = client.get_meta(partition, "x", 4, "t", lease_timeout=0.3)
    assert client.ack(meta.select([0, 1])) == 2
    again = client.get_meta(partition, "x", 2, "t", timeout=5)  # the other two, after expiry
    assert sorted(again.row_ids) == sorted(meta.row_ids[2:])
    assert client.ack(meta.select([0, 1])) == 0  # what this lease acked itself
    with pytest.raises(tqstream.LeaseExpiredError, match="its 2 unacked rows"):
        client.ack(meta)
    assert client.ack(again) == 2


def test_a_resumed_ack_consumes_what_no_one_took_since_its_lease_ended(
    client: Client, partition: str
) -> None:
    """A trainer checkpointed after training a batch and died before acking it: the run resumed
    from the checkpoint acks it with resumed=True, and the rows are consumed, not read twice."""
    client.put({"x": torch.arange(3)}, partition)
    meta = client.get_meta(partition, "x", 3, "t", lease_timeout=0.3)
    deadline = time.monotonic() + 5
    while client.stats(partition).partitions[partition].tasks["t"].leased:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)
    with pytest.raises(tqstream.LeaseExpiredError):
        client.ack(meta)
    assert client.ack(meta, resumed=True) == 3
    assert client.ack(meta, resumed=True) == 0  # a repeat
    with pytest.raises(tqstream.RequestTimeoutError):
        client.get_meta(partition, "x", 1, "t", timeout=0)


def test_a_resumed_ack_of_rows_another_reader_took_fails(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(3)}, partition)
    meta = client.get_meta(partition, "x", 3, "t", lease_timeout=0.3)
    other = client.get_meta(partition, "x", 2, "t", timeout=5)  # after the lease expired
    with pytest.raises(tqstream.LeaseExpiredError, match="2 of its rows went to another reader"):
        client.ack(meta, resumed=True)
    assert client.ack(other) == 2
    assert client.stats(partition).partitions[partition].tasks["t"].available == 1


def test_ack_unknown_lease(client: Client, partition: str) -> None:
    meta = client.put({"x": torch.arange(2)}, partition)
    with pytest.raises(tqstream.InvalidRequestError, match="holds no lease"):
        client.ack(meta)
    leased = client.get_meta(partition, "x", 2, "t")
    forged = leased.select([0, 1])
    forged = tqstream.BatchMeta(
        **{**{f: getattr(forged, f) for f in forged.__struct_fields__}, "lease_id": 10**9}
    )
    with pytest.raises(tqstream.UnknownLeaseError, match="unknown to this controller"):
        client.ack(forged)


def test_partial_ack_with_select(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(4)}, partition)
    meta = client.get_meta(partition, "x", 4, "t")
    assert client.ack(meta.select([0, 1])) == 2
    assert client.release(meta.select(slice(2, 4))) == 2
    assert client.get(partition, "x", 2, "t").data["x"].tolist() == [2, 3]


# --- order, groups, waiting ---
def test_oldest_first_across_puts(client: Client, partition: str) -> None:
    for i in range(3):
        client.put({"x": torch.full((2,), i)}, partition)
    assert client.get(partition, "x", 6, "t").data["x"].tolist() == [0, 0, 1, 1, 2, 2]


def test_whole_groups_are_complete_and_adjacent(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(3)}, partition, groups=["a", "b", "a"], group_size=3)
    client.put({"x": torch.arange(3, 5)}, partition, groups=["b", "b"], group_size=3)
    with pytest.raises(tqstream.RequestTimeoutError, match="1 complete groups"):
        client.get_meta(partition, "x", 6, "t", whole_groups=True, timeout=0)
    meta = client.get_meta(partition, "x", 3, "t", whole_groups=True)
    assert meta.groups == ["b", "b", "b"]
    client.put({"x": torch.tensor([9])}, partition, groups=["a"])
    got = client.get(partition, "x", 3, "t", whole_groups=True)
    assert got.meta.groups == ["a"] * 3 and got.data["x"].tolist() == [0, 2, 9]


def test_group_overflow_is_refused(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(2)}, partition, groups=["g", "g"])
    with pytest.raises(tqstream.GroupError, match="holds 2 rows at most"):
        client.put({"x": torch.arange(1)}, partition, groups=["g"])


def test_parked_get_is_answered_by_a_later_put(client: Client, partition: str) -> None:
    client.create_partition(partition, ["x"])
    result: list[object] = []
    t = threading.Thread(
        target=lambda: result.append(client.get(partition, "x", 4, "t", timeout=20))
    )
    t.start()
    time.sleep(0.3)
    client.put({"x": torch.arange(2)}, partition)
    client.put({"x": torch.arange(2, 4)}, partition)
    t.join(20)
    assert result and result[0].data["x"].tolist() == [0, 1, 2, 3]  # type: ignore[attr-defined]


def test_get_timeout_says_what_is_missing(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(5)}, partition)
    client.create_partition(partition, ["rewards"])
    meta = client.get_meta(partition, "x", 2, "t")
    client.put_fields(meta, {"rewards": torch.ones(2)})
    t0 = time.monotonic()
    with pytest.raises(tqstream.RequestTimeoutError) as err:
        client.get_meta(partition, ["x", "rewards"], 8, "u", timeout=0.5)
    assert 0.4 < time.monotonic() - t0 < 5
    assert "2 of 8 rows ready; field 'rewards' not written for 3 available rows" in str(err.value)


def test_async_api(client: Client, partition: str) -> None:
    async def main() -> list[int]:
        waiter = asyncio.ensure_future(client.async_get(partition, "x", 3, "t", timeout=10))
        await asyncio.sleep(0.1)
        await client.async_put({"x": torch.arange(3)}, partition)
        got = await waiter
        await got.async_ack()
        return got.data["x"].tolist()

    client.create_partition(partition, ["x"])
    assert asyncio.run(main()) == [0, 1, 2]


def test_many_concurrent_async_requests(client: Client, partition: str) -> None:
    async def main() -> None:
        await asyncio.gather(
            *(client.async_put({"x": torch.full((2,), i)}, partition) for i in range(50))
        )
        got = await asyncio.gather(
            *(client.async_get(partition, "x", 2, f"t{i % 3}") for i in range(30))
        )
        assert sum(len(g) for g in got) == 60

    asyncio.run(main())


# --- put_fields, keys ---
def test_put_fields_adds_columns(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(4)}, partition)
    meta = client.get_meta(partition, "x", 4, "actor")
    client.put_fields(meta.select([3, 1]), {"adv": torch.tensor([30.0, 10.0])})
    got = client.get(partition, ["x", "adv"], 2, "critic")  # in the order they completed
    assert got.data["x"].tolist() == [3, 1] and got.data["adv"].tolist() == [30.0, 10.0]
    with pytest.raises(tqstream.FieldExistsError, match="field 'adv' is already written"):
        client.put_fields(meta.select([1]), {"adv": torch.tensor([0.0])})


def test_keys(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(3)}, partition, keys=["a", "b", "c"])
    client.put({"x": torch.arange(3, 5)}, partition)
    keys = client.list_keys(partition)
    assert keys[:3] == ["a", "b", "c"] and len(set(keys)) == 5
    got = client.get_by_keys(partition, ["c", "a"])
    assert got.data["x"].tolist() == [2, 0] and got.meta.lease_id is None
    with pytest.raises(tqstream.DuplicateKeyError, match="'b'"):
        client.put({"x": torch.arange(2)}, partition, keys=["z", "b"])
    with pytest.raises(tqstream.UnknownKeyError, match="1 of 2 keys are not in partition"):
        client.get_by_keys(partition, ["a", "nope"])
    # get_by_keys does not consume
    assert len(client.get_meta(partition, "x", 5, "t")) == 5


# --- clearing and bytes ---
def test_clear_returns_storage_bytes(client: Client, partition: str) -> None:
    def held() -> int:
        return client.stats().storage_bytes

    base = held()
    meta = client.put(batch(64), partition)
    client.put(batch(64, 64), partition)
    assert held() > base
    client.clear_samples(meta)
    assert client.stats(partition).partitions[partition].rows == 64
    assert client.clear_partition(partition) is True
    assert held() == base
    with pytest.raises(tqstream.UnknownPartitionError):
        client.stats(partition)
    # clearing is "make sure it is gone": again, or a name never used, is harmless
    assert client.clear_partition(partition) is False
    assert client.clear_partition(partition + "-never-created") is False


def test_clear_partition_fails_parked_gets(client: Client, partition: str) -> None:
    client.create_partition(partition, ["x"])
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.get_meta(partition, "x", 1, "t", timeout=20)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    client.clear_partition(partition)
    t.join(10)
    assert errors and isinstance(errors[0], tqstream.PartitionClearedError)


def test_stats_shape(client: Client, partition: str) -> None:
    client.put(batch(3), partition)
    st = client.stats(partition)
    p = st.partitions[partition]
    assert p.rows == 3 and p.fields["rewards"] == 3
    assert p.schemas["input_ids"].describe() == "ragged int64[*]"
    assert all(u.alive and u.bytes >= 0 for u in st.units)


# --- placement over several storage units ---
def test_large_put_is_split_over_units_and_read_back_in_order(
    client: Client, partition: str, deployment: tuple[str, str]
) -> None:
    rows, width = 160, 1 << 17  # 160 rows x 512 KiB = 80 MiB > the 64 MiB split threshold
    x = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, width).contiguous()
    meta = client.put({"x": x, "i": torch.arange(rows)}, partition)
    units = len(client.stats().units)
    assert len(set(meta.units)) == units  # one contiguous run per unit
    assert meta.units == sorted(meta.units)
    got = client.get(partition, ["x", "i"], rows, "t")
    assert torch.equal(got.data["i"], torch.arange(rows))
    assert torch.equal(got.data["x"], x)
    client.clear_partition(partition)


def test_small_puts_balance_over_units(client: Client, partition: str) -> None:
    units = len(client.stats().units)
    metas = [client.put({"x": torch.zeros(4, 256)}, partition) for _ in range(2 * units)]
    assert {m.units[0] for m in metas} == set(range(units))
    got = client.get(partition, "x", 8 * units, "t")  # rows from every unit, in put order
    assert got.meta.row_ids == [r for m in metas for r in m.row_ids]


@pytest.mark.gpu
def test_cuda_tensors_are_moved_to_cpu(client: Client, partition: str) -> None:
    x = torch.randn(8, 16, device="cuda")
    rows = [torch.arange(i + 1, device="cuda") for i in range(8)]
    client.put({"x": x, "r": rows}, partition)
    td = client.get(partition, ["x", "r"], 8, "t").data
    assert td["x"].device.type == "cpu" and torch.equal(td["x"], x.cpu())
    assert torch.equal(td["r"][7], rows[7].cpu())
    assert torch.equal(td.to("cuda")["x"], x)


def test_stats_print_one_line_per_part(client: Client, partition: str) -> None:
    client.put({"input_ids": [[1, 2, 3], [4, 5]], "r": [1.0, 2.0]}, partition, version=0)
    client.get(partition, ["input_ids"], 1, "actor").ack()
    text = str(client.stats(partition))
    lines = text.splitlines()
    assert lines[0].startswith(f"partition {partition!r}: 2 rows (produced 2, freed 0")
    assert "  field 'input_ids': ragged int64[*], written for 2 rows" in lines
    assert "  field 'r': dense float32[], written for 2 rows" in lines
    assert any(line.startswith("  task 'actor': available 1, leased 0, acked 1") for line in lines)
    assert any(line.startswith("storage unit 0 tcp://") for line in lines)
    part = [line for line in lines if not line.startswith("admission ")]
    assert all(len(line) < 160 for line in part)


def test_group_members_from_other_producers_must_agree_on_fields(
    deployment: tuple[str, str], partition: str
) -> None:
    """One trajectory per put from different producer processes: the controller refuses the
    member whose fields differ, so the group never waits forever for a field."""
    with tqstream.connect(deployment[1]) as one, tqstream.connect(deployment[1]) as two:
        one.put({"x": [torch.arange(3)], "lp": [torch.zeros(3)]}, partition,
                groups=["g"], group_size=2)  # fmt: skip
        with pytest.raises(tqstream.GroupError) as err:
            two.put({"x": [torch.arange(2)]}, partition, groups=["g"], group_size=2)
        assert str(err.value) == (
            "group 'g': this put's members disagree on fields with the group's earlier members "
            "(missing ['lp']); every member of a group needs the same fields, or a whole_groups "
            "read would wait for the group forever"
        )
        assert len(one.list_keys(partition)) == 1  # nothing stored by the refused put
        two.put({"x": [torch.arange(2)], "lp": [torch.ones(2)]}, partition, groups=["g"],
                group_size=2)  # fmt: skip
        assert len(one.get(partition, ["x", "lp"], 2, "t", whole_groups=True, timeout=5)) == 2
