"""The experience API (tqstream/experience.py), against the embedded and the process deployment."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict

import tqstream
from tqstream import (
    Client,
    Experience,
    ExperienceBatch,
    InvalidRequestError,
    RequestTimeoutError,
    SchemaError,
    StalenessPolicy,
)

FIELDS = ["input_ids", "rewards"]
_uid = itertools.count()


def rollout(n: int, *, reward: float = 0.0, versions: list[list[int]] | None = None) -> dict:
    """``n`` samples: ragged token ids, a reward each, and optionally per-token versions."""
    data: dict = {
        "input_ids": [torch.arange(i + 2, dtype=torch.int64) for i in range(n)],
        "rewards": torch.full((n,), reward),
    }
    if versions is not None:
        data["versions"] = [torch.tensor(v, dtype=torch.int64) for v in versions]
    return data


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Byte counts reach the storage units after the reply that caused them: wait briefly."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def admission_name() -> str:
    return f"adm-{next(_uid)}"


# --- round trip ---
def test_round_trip_with_groups(client: Client, partition: str) -> None:
    exp = Experience(client, partition=partition, fields=FIELDS)
    for g in range(3):
        meta = exp.put_experience(rollout(4, reward=float(g)), 7, group=f"prompt-{g}")
        assert len(meta) == 4 and meta.groups == [f"prompt-{g}"] * 4
        assert meta.version_start == meta.version_end == [7] * 4
    batch = exp.get_experience(8, 7, task="actor", timeout=10)
    assert isinstance(batch, ExperienceBatch) and len(batch) == 8
    assert batch.meta.groups == ["prompt-0"] * 4 + ["prompt-1"] * 4  # whole groups, oldest first
    assert batch.versions == [7] * 8 and batch.stale_dropped == 0
    assert torch.equal(batch.data["rewards"], torch.tensor([0.0] * 4 + [1.0] * 4))
    ids = batch.data["input_ids"]
    assert [len(ids[i]) for i in range(8)] == [2, 3, 4, 5] * 2
    assert batch.ack() == 8
    padded = exp.get_experience(4, 7, task="actor", padded=True, pad_values=-1, timeout=10)
    assert padded.data["input_ids"].shape == (4, 5)
    assert padded.data["input_ids_lengths"].tolist() == [2, 3, 4, 5]
    assert padded.release() == 4  # back in place: the same rows come again
    again = exp.get_experience(4, 7, task="actor", timeout=10)
    assert again.meta.keys == padded.meta.keys
    again.ack()


def test_per_row_groups_and_group_size_over_several_puts(client: Client, partition: str) -> None:
    exp = Experience(client, partition=partition, fields=FIELDS)
    exp.put_experience(rollout(2), 1, group="g", group_size=4)
    with pytest.raises(RequestTimeoutError, match="whole_groups: 0 complete groups ready"):
        exp.get_experience(4, 1, task="actor", timeout=0)
    exp.put_experience(rollout(2), 1, groups=["g", "g"])
    batch = exp.get_experience(4, 1, task="actor", timeout=10)
    assert batch.meta.groups == ["g"] * 4
    batch.ack()


# --- the window ---
def test_window_never_returns_stale_rows_and_counts_drops(client: Client, partition: str) -> None:
    exp = Experience(client, partition=partition, fields=FIELDS,
                     staleness=StalenessPolicy(max_staleness=1))  # fmt: skip
    for v in range(5):  # versions 0..4, one group of 2 each
        exp.put_experience(rollout(2, reward=float(v)), v, group=f"g{v}")
    batch = exp.get_experience(4, 4, task="actor", timeout=10)
    assert sorted(batch.versions) == [3, 3, 4, 4]  # 4 - version <= 1
    assert batch.stale_dropped == 6  # versions 0, 1, 2: evicted once, counted
    batch.ack()
    p = client.stats(partition).partitions[partition]
    assert p.stale_dropped == 6 and p.tasks["actor"].stale_dropped == 6
    assert p.produced == 10 and p.rows == 4
    assert p.tasks["actor"].lag == {0: 2, 1: 2}
    # dropped rows are gone for every task, not only for the one that read
    other = Experience(client, partition=partition, fields=FIELDS)  # no window
    assert sorted(other.get_experience(4, 4, task="critic", timeout=10).versions) == [3, 3, 4, 4]


def test_keep_leaves_stale_rows_for_other_readers(client: Client, partition: str) -> None:
    keep = StalenessPolicy(max_staleness=0, on_stale="keep")
    exp = Experience(client, partition=partition, fields=FIELDS, staleness=keep)
    exp.put_experience(rollout(2), 0, group="old")
    exp.put_experience(rollout(2), 3, group="new")
    batch = exp.get_experience(2, 3, task="actor", timeout=10)
    assert batch.versions == [3, 3] and batch.stale_dropped == 0
    batch.ack()
    with pytest.raises(RequestTimeoutError):  # the old group is outside the window, kept
        exp.get_experience(2, 3, task="actor", timeout=0.2)
    p = client.stats(partition).partitions[partition]
    assert p.stale_dropped == 0 and p.rows == 4
    plain = Experience(client, partition=partition, fields=FIELDS)
    assert plain.get_experience(2, 3, task="actor", timeout=10).versions == [0, 0]


@pytest.mark.parametrize(
    ("measure", "fresh"),
    [("head", False), ("tail", True), ("dispatch", False)],
)
def test_measures(client: Client, partition: str, measure: str, fresh: bool) -> None:
    """Tokens from versions 1..3 (prompt tokens -1), generation requested at version 0."""
    exp = Experience(client, partition=partition, fields=FIELDS,
                     staleness=StalenessPolicy(max_staleness=1, measure=measure))  # fmt: skip
    meta = exp.put_experience(rollout(1, versions=[[-1, 1, 2, 3]]), 3, dispatch_version=0)
    assert (meta.version_start, meta.version_end, meta.dispatch_version) == ([1], [3], [0])
    if fresh:  # tail: 4 - 3 <= 1
        assert exp.get_experience(1, 4, task="actor", timeout=10).versions == [1]
    else:  # the read that meets the stale row evicts it, even when it then has nothing to serve
        with pytest.raises(RequestTimeoutError):
            exp.get_experience(1, 4, task="actor", timeout=0)
        assert client.stats(partition).partitions[partition].stale_dropped == 1


def test_a_group_is_stale_if_any_member_is(client: Client, partition: str) -> None:
    exp = Experience(client, partition=partition, fields=FIELDS,
                     staleness=StalenessPolicy(max_staleness=2))  # fmt: skip
    # one member's tokens reach back to version 1 (a partial rollout resumed under new weights)
    exp.put_experience(rollout(3, versions=[[5, 5], [-1, 1, 5], [4]]), 5, group="mixed")
    exp.put_experience(rollout(3), 5, group="fresh")
    batch = exp.get_experience(3, 5, task="actor", timeout=10)
    assert batch.meta.groups == ["fresh"] * 3 and batch.stale_dropped == 3


def test_trainer_loop_bumping_versions(client: Client, partition: str) -> None:
    """A producer on the newest weights and a trainer that publishes a version per batch, with
    capacity admission (AReaL) and a window as wide as its staleness bound: nothing is dropped,
    nothing is older than the bound, and every slot ends accepted."""
    k, batch_size, steps = 1, 4, 6
    adm = client.admission("capacity", name=admission_name(), max_concurrent=8,
                           max_staleness=k, consumer_batch_size=batch_size)  # fmt: skip
    exp = Experience(client, partition=partition, fields=FIELDS, admission=adm,
                     staleness=StalenessPolicy(max_staleness=k))  # fmt: skip
    version = 0

    async def producer() -> None:
        while True:
            v = version
            slots = await adm.async_acquire(2, version=v)
            await asyncio.sleep(0.01)  # "generate" under weights v
            await exp.async_put_experience(rollout(len(slots), reward=v), v, slots=slots)

    async def trainer() -> list[list[int | None]]:
        nonlocal version
        seen = []
        for _ in range(steps):
            batch = await exp.async_get_experience(batch_size, version, task="actor",
                                                   whole_groups=False, timeout=30)  # fmt: skip
            assert all(v is not None and version - v <= k for v in batch.versions)
            seen.append(batch.versions)
            await batch.async_ack()
            version += 1  # optimizer step, then the weight sync
            await adm.async_on_version(version)
        return seen

    async def main() -> list[list[int | None]]:
        task = asyncio.ensure_future(producer())
        try:
            return await trainer()
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    seen = asyncio.run(main())
    assert len(seen) == steps and seen[-1][-1] is not None and seen[-1][-1] >= 1
    p = client.stats(partition).partitions[partition]
    assert p.stale_dropped == 0
    assert set(p.tasks["actor"].lag) <= set(range(k + 1))
    assert sum(p.tasks["actor"].lag.values()) == steps * batch_size
    state = adm.state()
    assert state["accepted"] + state["running"] + state["rejected"] == state["granted"]
    assert state["accepted"] <= (k + steps + 1) * batch_size  # AReaL's bound, never exceeded


# --- admission slots ---
def test_slots_released_through_admission_on_put(client: Client, partition: str) -> None:
    adm = client.admission("capacity", name=admission_name(), max_concurrent=100,
                           max_staleness=10, consumer_batch_size=8)  # fmt: skip
    exp = Experience(client, partition=partition, fields=FIELDS, admission=adm,
                     reject_mixed_versions=True)  # fmt: skip

    def counters() -> tuple[int | float | str, ...]:
        s = adm.state()
        return s["running"], s["accepted"], s["rejected"]

    # one slot per row: the mixed row's slot is rejected, the others accepted
    slots = adm.acquire(3)
    assert counters() == (3, 0, 0)
    meta = exp.put_experience(rollout(3, versions=[[0, 0], [0, 1], [-1, 1]]), 1, slots=slots)
    assert len(meta) == 2 and meta.rejected == 1
    assert counters() == (0, 2, 1)
    assert client.stats().admissions[adm.name]["accepted"] == 2
    exp.put_experience(rollout(3, versions=[[0], [1], [1]]), 1, slots=slots)  # ended: no-op
    assert counters() == (0, 2, 1)
    # one slot for a whole group put (a rollout of n samples): accepted if any row was stored
    slot = adm.acquire(1)
    exp.put_experience(rollout(3, versions=[[1, 2], [2], [2]]), 2, group="g", slots=slot)
    assert counters() == (0, 3, 1)
    # every row refused: the put stores nothing and rejects its slot
    slot = adm.acquire(1)
    meta = exp.put_experience(rollout(2, versions=[[1, 2], [2, 3]]), 3, slots=slot)
    assert len(meta) == 0 and meta.rejected == 2
    assert counters() == (0, 3, 2)
    # a put that fails rejects every slot (its budget comes back), and its error propagates
    slots = adm.acquire(2)
    bad = {"input_ids": [torch.zeros(2, dtype=torch.float32)] * 2, "rewards": torch.zeros(2),
           "versions": [torch.tensor([4])] * 2}  # fmt: skip
    with pytest.raises(SchemaError, match="field 'input_ids' of partition"):
        exp.put_experience(bad, 4, slots=slots)
    assert counters() == (0, 3, 4)
    p = client.stats(partition).partitions[partition]
    assert (p.produced, p.rejected) == (7, 4)


def test_verl_slots_and_async_put(client: Client, partition: str) -> None:
    adm = client.admission("slots", name=admission_name(), max_pending_slots=4,
                           max_version_slots=4, consumer_batch_size=4)  # fmt: skip
    exp = Experience(client, partition=partition, fields=FIELDS, admission=adm)
    ids = [adm.acquire_slot(timeout=1) for _ in range(4)]
    assert None not in ids and adm.acquire_slot(timeout=0.1) is None  # window full
    asyncio.run(exp.async_put_experience(rollout(4), 0, slots=[i for i in ids if i]))
    s = adm.state()
    assert (s["pending"], s["accepted"], s["version_slots"]) == (0, 4, 4)
    adm.on_version(1)  # the weight sync reopens the window
    assert adm.acquire_slot(timeout=1) is not None


# --- memory ---
def test_registered_tasks_free_storage_after_both_ack(client: Client, partition: str) -> None:
    baseline = client.stats().storage_bytes
    exp = Experience(client, partition=partition, fields=FIELDS, tasks=["actor", "critic"])
    exp.put_experience(rollout(4), 0, group="g")
    assert client.stats().storage_bytes > baseline
    actor = exp.get_experience(4, 0, task="actor", timeout=10)
    critic = exp.get_experience(4, 0, task="critic", timeout=10)
    actor.ack()
    p = client.stats(partition).partitions[partition]
    assert p.freed == 0 and p.rows == 4 and p.tasks_registered == ["actor", "critic"]
    critic.ack()
    p = client.stats(partition).partitions[partition]
    assert p.freed == 4 and p.rows == 0
    eventually(lambda: client.stats().storage_bytes == baseline)


def test_accounting_identity(client: Client, partition: str) -> None:
    """produced = rows still stored + freed + stale_dropped + expired; rejected rows were never
    produced."""
    window = StalenessPolicy(max_staleness=0)
    exp = Experience(client, partition=partition, fields=FIELDS, tasks=["actor"], ttl=1.5,
                     staleness=window, reject_mixed_versions=True)  # fmt: skip
    exp.put_experience(rollout(2, versions=[[0], [0, 1]]), 1)  # 1 stored, 1 rejected
    exp.put_experience(rollout(2, versions=[[1], [1]]), 1)
    exp.put_experience(rollout(2, versions=[[2], [2]]), 2)
    exp.get_experience(2, 2, task="actor", whole_groups=False, timeout=10).ack()  # drops 3
    exp.put_experience(rollout(2, versions=[[2], [2]]), 2)  # never read: expires
    eventually(lambda: client.stats(partition).partitions[partition].expired == 2, 10)
    p = client.stats(partition).partitions[partition]
    assert (p.produced, p.rejected, p.freed, p.stale_dropped, p.expired, p.rows) == (
        7, 1, 2, 3, 2, 0)  # fmt: skip
    assert p.produced == p.rows + p.freed + p.stale_dropped + p.expired


# --- put_fields through the batch ---
def test_put_fields_through_the_batch(client: Client, partition: str) -> None:
    exp = Experience(client, partition=partition, fields=FIELDS)
    exp.put_experience(rollout(4, reward=1.0), 0, group="g")
    scored = exp.get_experience(4, 0, task="advantage", timeout=10)
    scored.put_fields({"advantages": scored.data["rewards"] - 0.5})
    scored.ack()
    batch = exp.get_experience(4, 0, task="actor", fields=[*FIELDS, "advantages"], timeout=10)
    assert batch.meta.keys == scored.meta.keys
    assert torch.equal(batch.data["advantages"], torch.full((4,), 0.5))

    async def more() -> ExperienceBatch:
        b = await exp.async_get_experience(4, 0, task="ref", timeout=10)
        await b.async_put_fields({"ref_logp": torch.zeros(4)})
        await b.async_ack()
        return b

    assert len(asyncio.run(more())) == 4
    assert client.stats(partition).partitions[partition].fields["ref_logp"] == 4


def test_trainer_waits_for_declared_fields_before_any_put(client: Client, partition: str) -> None:
    exp = Experience(client, partition=partition, fields=FIELDS)

    async def main() -> ExperienceBatch:
        get = asyncio.ensure_future(exp.async_get_experience(2, 0, task="actor", timeout=10))
        await asyncio.sleep(0.2)
        assert not get.done()
        await exp.async_put_experience(rollout(2), 0, group="g")
        return await get

    assert asyncio.run(main()).meta.groups == ["g", "g"]


# --- errors ---
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"measure": "middle"},
         "StalenessPolicy.measure must be 'head', 'tail', 'dispatch' or 'token', got 'middle'"),
        ({"on_stale": "evict"}, "StalenessPolicy.on_stale must be 'drop' or 'keep', got 'evict'"),
        ({"max_staleness": -1},
         "StalenessPolicy.max_staleness must be an int >= 0 or None (no window), got -1"),
        ({"max_staleness": 1.5},
         "StalenessPolicy.max_staleness must be an int >= 0 or None (no window), got 1.5"),
    ],
)  # fmt: skip
def test_invalid_policy(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StalenessPolicy(**kwargs)
    assert str(info.value) == message


def test_errors(client: Client, partition: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        Experience(client, partition=partition, versions_field=None, reject_mixed_versions=True)
    assert str(info.value) == (
        "reject_mixed_versions=True needs a per-token versions field to find mixed rows; "
        "pass versions_field='<name>' (the default is 'versions')"
    )
    exp = Experience(client, partition=partition, reject_mixed_versions=True)
    with pytest.raises(InvalidRequestError) as info:
        exp.put_experience(rollout(2), 0)  # no per-token versions in the data
    assert str(info.value) == (
        "reject_mixed_versions=True needs the per-token versions field 'versions' in the data "
        "(or name it with versions_field=)"
    )
    with pytest.raises(InvalidRequestError) as info:
        exp.put_experience(rollout(2), 0, group="a", groups=["a", "b"])
    assert str(info.value) == "pass group= (one id for every row) or groups=, not both"
    with pytest.raises(InvalidRequestError) as info:
        exp.put_experience(rollout(2), 0, slots=[1, 2])
    assert str(info.value) == (
        "slots= needs an admission to release them to: build the Experience with "
        "admission=client.admission(style, ...)"
    )
    with pytest.raises(InvalidRequestError) as info:
        exp.put_experience(rollout(2), "v1")  # type: ignore[arg-type]
    assert str(info.value) == (
        "current_version must be a policy version: an int in 0..2147483647 (the trainer's weight "
        "version, bumped at each update); got 'v1'"
    )
    with pytest.raises(InvalidRequestError) as info:
        exp.get_experience(2, 0, task="actor")
    assert str(info.value) == (
        "get_experience needs the fields to read: pass fields=[...] to it or to Experience"
    )
    with pytest.raises(InvalidRequestError) as info:
        exp.get_experience(2, None, task="actor", fields=FIELDS)  # type: ignore[arg-type]
    assert str(info.value) == (
        "current_version must be a policy version: an int in 0..2147483647 (the trainer's weight "
        "version, bumped at each update); got None"
    )


def test_public_names() -> None:
    assert tqstream.Experience is Experience and "StalenessPolicy" in tqstream.__all__
    assert repr(StalenessPolicy(2)) == (
        "StalenessPolicy(max_staleness=2, measure='head', on_stale='drop')"
    )


def test_tensordict_data_with_one_slot_per_row(client: Client, partition: str) -> None:
    adm = client.admission("per_version", name=admission_name(), max_per_version=8,
                           update_interval=4)  # fmt: skip
    exp = Experience(client, partition=partition, fields=["tokens"], admission=adm,
                     reject_mixed_versions=True)  # fmt: skip
    versions = torch.nested.nested_tensor(
        [torch.tensor([-1, 2]), torch.tensor([1, 2]), torch.tensor([2])], layout=torch.jagged
    )
    td = TensorDict({"tokens": torch.ones(3, 2), "versions": versions}, batch_size=[3])
    slots = adm.acquire(3, version=2)
    meta = exp.put_experience(td, 2, group="g", slots=slots)
    assert len(meta) == 2 and meta.groups == ["g", "g"] and meta.rejected == 1
    s = adm.state()  # the refused row's slot gives its version budget back
    assert (s["running"], s["accepted"], s["rejected"], s["admitted"]) == (0, 2, 1, 2)
