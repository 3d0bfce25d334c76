"""Freshness and flow control through the public client, on the embedded and the multi-process
deployment: per-row versions and mixed-version rejection, staleness windows (keep / drop, whole
groups), the lag histogram, registered tasks and ttl, storage byte quotas, producer admission."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import tqstream
from tqstream import Client, StalenessPolicy
from tqstream.client.admission import AdmissionHandle
from tqstream.config import ControllerConfig, StorageConfig
from tqstream.launch.embedded import EmbeddedCluster
from tqstream.launch.processes import ProcessCluster


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Storage drops ordered by evictions run after the reply; wait for them to land."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def tokens(*rows: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.int64) for r in rows]


def stats(client: Client, partition: str) -> tqstream.PartitionStats:
    return client.stats(partition).partitions[partition]


def put_versions(
    client: Client, partition: str, versions: list[int | None], first: int = 0, **kw: Any
) -> tqstream.BatchMeta:
    """One row per entry (x = first, first + 1, ...), each with a prompt token and one generated
    token of that version (None: prompt only, so no version)."""
    rows = [[-1, -1] if v is None else [-1, v] for v in versions]
    x = torch.arange(first, first + len(versions))
    return client.put({"x": x, "versions": tokens(*rows)}, partition, **kw)


# --- per-row versions at put ---
def test_versions_come_from_the_per_token_field(client: Client, partition: str) -> None:
    ragged = tokens([-1, -1, 3, 3], [-1, 2, 3], [-1, -1], [], [7])
    meta = client.put(
        {"x": torch.arange(5), "versions": ragged},
        partition,
        version=5,
        dispatch_version=[1, 2, None, 4, 6],
    )
    assert meta.version_start == [3, 2, 5, 5, 7]  # prompt tokens ignored; none generated: version=
    assert meta.version_end == [3, 3, 5, 5, 7]
    assert meta.dispatch_version == [1, 2, None, 4, 6]
    assert meta.rejected == 0
    got = client.get_meta(partition, "x", 5, "t")
    assert (got.version_start, got.version_end) == (meta.version_start, meta.version_end)
    assert got.dispatch_version == [1, 2, None, 4, 6]
    # a dense [B, L] versions field, another field name, and no version= for prompt-only rows
    dense = torch.tensor([[-1, 4, 6], [-1, -1, -1]])
    meta = client.put({"x": torch.arange(2), "vv": dense}, partition, versions_field="vv")
    assert (meta.version_start, meta.version_end) == ([4, None], [6, None])
    # versions_field=None: the field is plain data, version= applies to every row
    meta = client.put({"x": torch.arange(1), "versions": tokens([9])}, partition, version=2,
                      versions_field=None)  # fmt: skip
    assert (meta.version_start, meta.version_end, meta.dispatch_version) == ([2], [2], [2])
    st = stats(client, partition)
    assert st.produced == 8 and st.rows == 8 and st.rejected == 0


def test_reject_mixed_versions_refuses_and_counts_rows(client: Client, partition: str) -> None:
    base = client.stats().storage_bytes
    meta = client.put(
        {
            "x": torch.arange(4),
            "versions": tokens([-1, 1, 1], [-1, 1, 2], [-1, -1], [0, 2]),
        },
        partition,
        keys=["a", "b", "c", "d"],
        groups=["g", "g", "h", "h"],
        version=3,
        reject_mixed_versions=True,
    )
    assert meta.rejected == 2 and len(meta) == 2
    assert meta.keys == ["a", "c"] and meta.groups == ["g", "h"]
    assert (meta.version_start, meta.version_end) == ([1, 3], [1, 3])
    st = stats(client, partition)
    assert (st.produced, st.rejected, st.rows) == (2, 2, 2)
    assert client.list_keys(partition) == ["a", "c"]
    # the survivors make whole groups of their own (size = rows of the put that were kept)
    got = client.get(partition, ["x", "versions"], 2, "t", whole_groups=True)
    assert got.data["x"].tolist() == [0, 2]
    assert [r.tolist() for r in got.data["versions"].unbind()] == [[-1, 1, 1], [-1, -1]]
    # every row refused: nothing stored, the count still reaches the partition
    bytes_before = client.stats().storage_bytes
    meta = client.put({"x": torch.arange(3), "versions": tokens([0, 1], [1, 2], [3, 4])},
                      partition, reject_mixed_versions=True)  # fmt: skip
    assert (len(meta), meta.rejected, meta.row_ids) == (0, 3, [])
    assert client.stats().storage_bytes == bytes_before > base
    st = stats(client, partition)
    assert (st.produced, st.rejected, st.rows) == (2, 5, 2)
    # to a partition that does not exist yet: it is created to hold the count
    other = partition + "-new"
    meta = client.put({"versions": tokens([0, 1])}, other, reject_mixed_versions=True)
    assert meta.rejected == 1 and stats(client, other).rejected == 1
    assert stats(client, other).rows == 0
    client.clear_partition(other)


@pytest.mark.parametrize(
    ("data", "kw", "error", "message"),
    [
        (
            {"x": torch.arange(2)},
            {"reject_mixed_versions": True},
            tqstream.InvalidRequestError,
            "reject_mixed_versions=True needs the per-token versions field 'versions' in the data "
            "(or name it with versions_field=)",
        ),
        (
            {"x": torch.arange(2), "versions": tokens([0], [1])},
            {"reject_mixed_versions": True, "versions_field": None},
            tqstream.InvalidRequestError,
            "reject_mixed_versions=True needs a per-token versions field, but versions_field=None",
        ),
        (
            {"x": torch.arange(2), "versions": [torch.zeros(2), torch.ones(3)]},
            {},
            tqstream.SchemaError,
            "the versions field 'versions' must hold one integer per token (ragged or dense "
            "int[L]), got ragged float32[*]; pass versions_field=None to use only version=",
        ),
        (
            {"x": torch.arange(2), "versions": torch.tensor([1, 2])},
            {},
            tqstream.SchemaError,
            "the versions field 'versions' must hold one integer per token (ragged or dense "
            "int[L]), got dense int64[]; pass versions_field=None to use only version=",
        ),
        (
            {"x": torch.arange(2), "versions": ["1", "2"]},
            {},
            tqstream.SchemaError,
            "the versions field 'versions' must hold one integer per token (ragged or dense "
            "int[L]), got object<str>; pass versions_field=None to use only version=",
        ),
        (
            {"x": torch.arange(2)},
            {"dispatch_version": [1]},
            tqstream.BatchShapeError,
            "dispatch_version= has 1 entries but the data has 2 rows",
        ),
    ],
)
def test_put_version_errors(
    client: Client, partition: str, data: dict[str, Any], kw: dict[str, Any], error: type,
    message: str,
) -> None:  # fmt: skip
    with pytest.raises(error) as err:
        client.put(data, partition, **kw)
    assert str(err.value) == message
    with pytest.raises(tqstream.UnknownPartitionError):  # nothing reached the controller
        client.stats(partition)


# --- staleness windows ---
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"measure": "middle"},
            "StalenessPolicy.measure must be 'head', 'tail', 'dispatch' or 'token', got 'middle'",
        ),
        ({"on_stale": "evict"}, "StalenessPolicy.on_stale must be 'drop' or 'keep', got 'evict'"),
        (
            {"current_version": 3, "max_staleness": -1},
            "StalenessPolicy.max_staleness must be an int >= 0 or None (no window), got -1",
        ),
        (
            {"staleness": StalenessPolicy(1), "current_version": 3, "on_stale": "drop"},
            "pass the staleness window as staleness=StalenessPolicy(...) or as max_staleness=, "
            "measure= and on_stale=, not both",
        ),
        (
            {"staleness": {"max_staleness": 1}, "current_version": 3},
            "staleness must be a tqstream.StalenessPolicy, got dict",
        ),
        (
            {"max_staleness": 1},
            "max_staleness needs current_version (the trainer's policy version) to place the "
            "window: pass current_version=v",
        ),
    ],
)
def test_window_argument_errors(
    client: Client, partition: str, kw: dict[str, Any], message: str
) -> None:
    put_versions(client, partition, [0])
    with pytest.raises(tqstream.InvalidRequestError) as err:
        client.get_meta(partition, "x", 1, "t", timeout=0, **kw)
    assert str(err.value) == message
    with pytest.raises(tqstream.InvalidRequestError) as err:
        client.get(partition, "x", 1, "t", timeout=0, **kw)
    assert str(err.value) == message
    assert stats(client, partition).tasks == {}  # nothing leased, nothing dropped


def test_window_keep_selects_fresh_rows_and_leaves_stale_ones(
    client: Client, partition: str
) -> None:
    put_versions(client, partition, [0, 1, None, 2, 3])
    win = {"current_version": 3, "max_staleness": 1}
    got = client.get(partition, "x", 3, "t", **win)  # v - version <= 1, or no version
    assert got.data["x"].tolist() == [2, 3, 4]
    assert got.meta.version_start == [None, 2, 3] and got.meta.stale_dropped == 0
    got.ack()
    with pytest.raises(tqstream.RequestTimeoutError) as err:
        client.get_meta(partition, "x", 1, "t", timeout=0, **win)
    assert str(err.value) == (
        f"get_meta(partition={partition!r}, task='t', fields=['x'], batch_size=1) timed out "
        f"after 0.0s: 2 of 1 rows ready; 3 rows already consumed by 't'; 2 of the ready rows are "
        f"outside the staleness window (head version < 2 = current_version 3 - max_staleness 1)"
    )
    st = stats(client, partition)
    assert st.tasks["t"] == tqstream.TaskStats(
        available=2, leased=0, acked=3, lag={0: 1, 1: 1}, consumed=3
    )
    assert (st.rows, st.stale_dropped) == (5, 0)
    # kept: a reader with an older version (or another task) still gets them
    old = client.get(partition, "x", 2, "t", current_version=1, max_staleness=1)
    assert old.data["x"].tolist() == [0, 1]
    assert len(client.get_meta(partition, "x", 5, "critic")) == 5


def test_a_window_given_as_one_staleness_policy(client: Client, partition: str) -> None:
    """``staleness=`` is the window the keywords make; a policy's own default is "drop"."""
    put_versions(client, partition, [0, 1, 2, 3])
    window = StalenessPolicy(max_staleness=1)
    got = client.get(partition, "x", 2, "t", current_version=3, staleness=window)
    assert got.data["x"].tolist() == [2, 3] and got.meta.stale_dropped == 2
    assert stats(client, partition).stale_dropped == 2


@pytest.mark.parametrize(
    ("measure", "picked"),
    [("head", [2]), ("tail", [0, 2]), ("dispatch", [1, 2])],
)
def test_window_measures(client: Client, partition: str, measure: str, picked: list[int]) -> None:
    # row 0: tokens of versions 1..3, dispatched at 1; row 1: tokens 1..2, dispatched at 3;
    # row 2: tokens 3, dispatched at 0 (rows without a dispatch version use version_start)
    client.put(
        {"x": torch.arange(3), "versions": tokens([-1, 1, 3], [1, 2], [3])},
        partition,
        dispatch_version=[1, 3, None],
    )
    win = {"current_version": 4, "max_staleness": 1, "measure": measure}
    meta = client.get_meta(partition, "x", len(picked), "t", **win)
    assert sorted(meta.row_ids) == picked
    with pytest.raises(tqstream.RequestTimeoutError):
        client.get_meta(partition, "x", 1, "t", timeout=0, **win)


def test_token_measure_reads_rows_with_a_fresh_token_and_masks_the_rest(
    client: Client, partition: str
) -> None:
    # a trajectory that spans weight updates (partial rollouts): versions per generated token
    client.create_partition(partition, tasks=["actor"])
    client.put(
        {"x": torch.arange(4), "versions": tokens([-1, 1, 2, 3], [0, 0], [2, 2, 4], [-1, -1])},
        partition,
        version=0,
    )
    win = {"current_version": 4, "max_staleness": 1, "measure": "token"}
    batch = client.get(partition, "x", 2, "actor", timeout=5, on_stale="drop", **win)
    # row 1 (only version 0) has no token inside: dropped on the way, as the head measure drops
    # a row; row 3 has no generated token (its version is the put's, 0): stale at the next read
    assert batch.meta.row_ids == [0, 2] and batch.meta.stale_dropped == 1
    assert sorted(batch.data.keys()) == ["fresh_mask", "versions", "x"]
    fresh = [m.tolist() for m in batch.data["fresh_mask"].unbind()]
    assert fresh == [[False, False, False, True], [False, False, True]]  # prompt tokens: False
    assert batch.meta.tokens_masked == 4  # 1, 2 and 2, 2: generated outside the window
    assert stats(client, partition).tasks["actor"].tokens_masked == 0  # counted at ack
    batch.ack()
    assert stats(client, partition).tasks["actor"].tokens_masked == 4
    # the head measure would have dropped both: their oldest tokens are 3 and 2 versions old
    assert stats(client, partition).tasks["actor"].lag == {1: 1, 0: 1}
    with pytest.raises(tqstream.RequestTimeoutError):
        client.get(partition, "x", 1, "actor", timeout=0, on_stale="drop", **win)
    assert stats(client, partition).stale_dropped == 2


def test_token_measure_two_steps_and_padded(client: Client, partition: str) -> None:
    client.put({"versions": tokens([5, 6], [4, 6, 6])}, partition, version=4)
    meta = client.get_meta(partition, [], 2, "t", current_version=6, max_staleness=0,
                           measure="token")  # fmt: skip
    assert meta.token_window == [6, 0] and meta.fields == ["versions"]
    data = client.get_data(meta, padded=True)
    assert data["fresh_mask"].tolist() == [[False, True, False], [False, True, True]]
    assert data["fresh_mask_lengths"].tolist() == [2, 3]
    from tqstream.client.versions import tokens_outside

    assert tokens_outside(data, "versions") == 2
    client.ack(meta)


def test_token_measure_errors(client: Client, partition: str) -> None:
    client.put({"x": torch.arange(2), "fresh_mask": torch.zeros(2)}, partition)
    win = {"current_version": 0, "max_staleness": 0, "measure": "token"}
    with pytest.raises(tqstream.InvalidRequestError, match="adds the field 'fresh_mask'"):
        client.get(partition, ["x", "fresh_mask"], 1, "t", **win)
    other = partition + "-no-versions"
    client.put({"x": torch.arange(2), "v": torch.tensor([0.5, 1.5])}, other, version=0)
    with pytest.raises(tqstream.SchemaError, match="per-token versions field 'v'"):
        client.get(other, "x", 2, "t", versions_field="v", timeout=5, **win)
    wait_for(lambda: stats(client, other).tasks["t"].leased == 0)  # the lease went back


def test_window_drop_evicts_stale_rows_for_every_task(client: Client, partition: str) -> None:
    base = client.stats().storage_bytes
    for i, v in enumerate([0, 1, 5, 2, 6, None]):  # one put (one chunk) per row: bytes free
        put_versions(client, partition, [v], first=i)
    per_row = (client.stats().storage_bytes - base) // 6
    assert client.stats().storage_bytes - base == 6 * per_row > 0
    critic = client.get_meta(partition, "x", 1, "critic")  # row 0, leased by another task
    got = client.get(partition, "x", 2, "actor", current_version=6, max_staleness=1,
                     on_stale="drop")  # fmt: skip
    # the rows met before the batch was full: 0, 1 (stale: dropped), 2 (fresh), 3 (stale:
    # dropped), 4 (fresh); row 5 was not looked at
    assert got.data["x"].tolist() == [2, 4] and got.meta.stale_dropped == 3
    st = stats(client, partition)
    assert (st.rows, st.stale_dropped, st.produced) == (3, 3, 6)
    assert st.tasks["actor"] == tqstream.TaskStats(available=1, leased=2, acked=0,
                                                   stale_dropped=3)  # fmt: skip
    assert st.tasks["critic"] == tqstream.TaskStats(available=3, leased=0, acked=0)
    assert client.ack(critic) == 0  # its row was evicted: nothing to consume
    wait_for(lambda: client.stats().storage_bytes - base == 3 * per_row)
    assert client.get(partition, "x", 3, "critic").data["x"].tolist() == [2, 4, 5]
    # versionless rows are never stale
    got.ack()
    last = client.get_meta(partition, "x", 1, "actor", current_version=100, max_staleness=0,
                           on_stale="drop")  # fmt: skip
    assert last.version_start == [None] and last.stale_dropped == 0
    assert stats(client, partition).tasks["actor"].lag == {0: 1, 1: 1}


def test_window_drop_is_reported_by_a_parked_request(client: Client, partition: str) -> None:
    put_versions(client, partition, [0, 0, 3])
    result: list[tqstream.BatchMeta] = []
    win = {"current_version": 3, "max_staleness": 0, "on_stale": "drop"}
    t = threading.Thread(
        target=lambda: result.append(client.get_meta(partition, "x", 2, "t", timeout=20, **win))
    )
    t.start()
    wait_for(lambda: stats(client, partition).parked_requests == 1)
    st = stats(client, partition)
    assert (st.rows, st.stale_dropped) == (1, 2)  # dropped while trying, then parked
    put_versions(client, partition, [1], first=3)  # retried at the commit: dropped, not served
    wait_for(lambda: stats(client, partition).stale_dropped == 3)
    assert t.is_alive()
    put_versions(client, partition, [3], first=4)
    t.join(20)
    # the meta reports every row the request evicted while it waited
    assert result and result[0].version_start == [3, 3] and result[0].stale_dropped == 3
    st = stats(client, partition)
    assert (st.rows, st.stale_dropped, st.tasks["t"].stale_dropped) == (2, 3, 3)


def test_window_whole_groups_drops_a_whole_group(client: Client, partition: str) -> None:
    # group "a" has one stale member (version 0) and one fresh: the group is stale
    put_versions(client, partition, [0, 3], groups=["a", "a"])
    put_versions(client, partition, [2, 3], first=2, groups=["b", "b"])
    put_versions(client, partition, [None], first=4, groups=["c"])
    put_versions(client, partition, [3, 3], first=5, groups=["d", "d"])
    window = {"current_version": 3, "max_staleness": 1}
    got = client.get_meta(partition, "x", 3, "t", whole_groups=True, **window)
    assert got.groups == ["b", "b", "c"] and got.stale_dropped == 0
    client.release(got)
    assert stats(client, partition).rows == 7
    got = client.get_meta(partition, "x", 2, "t", whole_groups=True, on_stale="drop", **window)
    assert got.groups == ["b", "b"] and got.stale_dropped == 2  # both members of "a"
    st = stats(client, partition)
    assert (st.rows, st.stale_dropped, st.tasks["t"].stale_dropped) == (5, 2, 2)
    assert len(client.list_keys(partition)) == 5
    with pytest.raises(tqstream.RequestTimeoutError):  # "a" is gone for every task
        client.get_meta(partition, "x", 7, "critic", timeout=0)
    rest = client.get(partition, "x", 3, "t", whole_groups=True)
    assert rest.meta.groups == ["c", "d", "d"] and rest.data["x"].tolist() == [4, 5, 6]


# --- consumption accounting ---
def test_lag_histogram_at_ack(client: Client, partition: str) -> None:
    put_versions(client, partition, [5, 4, 4, 2, None, 1])
    meta = client.get_meta(partition, "x", 5, "actor", current_version=5)  # no max_staleness
    assert client.ack(meta.select([0, 1, 2])) == 3
    assert stats(client, partition).tasks["actor"].lag == {0: 1, 1: 2}
    assert client.ack(meta) == 2  # the rest; a versionless row has no lag
    assert client.ack(meta) == 0  # acking again counts nothing twice
    assert stats(client, partition).tasks["actor"].lag == {0: 1, 1: 2, 3: 1}
    released = client.get_meta(partition, "x", 1, "actor", current_version=9)
    client.release(released)  # released rows are not consumed: no lag
    client.get(partition, "x", 1, "plain").ack()  # no current_version: no lag
    st = stats(client, partition)
    assert st.tasks["actor"].lag == {0: 1, 1: 2, 3: 1} and st.tasks["plain"].lag == {}
    # the lag uses the request's measure: a row whose tokens span versions 1..3
    other = partition + "-m"
    client.put({"x": torch.arange(1), "versions": tokens([-1, 1, 3])}, other)
    for measure, lag in (("head", 5), ("tail", 3)):
        client.get(other, "x", 1, measure, current_version=6, measure=measure).ack()
        assert stats(client, other).tasks[measure].lag == {lag: 1}
    client.clear_partition(other)


def test_registered_tasks_free_rows(client: Client, partition: str) -> None:
    base = client.stats().storage_bytes
    client.create_partition(partition, ["x"], tasks=["actor", "critic"])
    for _ in range(4):  # one chunk per row, so that freed rows free bytes
        client.put({"x": torch.zeros(1, 64)}, partition)
    assert client.stats().storage_bytes - base == 4 * 256
    client.get(partition, "x", 4, "actor").ack()
    client.get(partition, "x", 4, "eval").ack()  # not registered: frees nothing
    st = stats(client, partition)
    assert (st.rows, st.freed, st.tasks_registered) == (4, 0, ["actor", "critic"])
    critic = client.get_meta(partition, "x", 4, "critic")
    assert client.ack(critic.select([0, 2])) == 2
    st = stats(client, partition)
    assert (st.rows, st.freed, st.produced) == (2, 2, 4)
    wait_for(lambda: client.stats().storage_bytes - base == 2 * 256)
    assert client.ack(critic) == 2
    st = stats(client, partition)
    assert (st.rows, st.freed) == (0, 4)
    wait_for(lambda: client.stats().storage_bytes == base)
    # calling create_partition again updates the registration
    client.create_partition(partition, tasks=["actor"])
    client.put({"x": torch.zeros(1, 64)}, partition)
    client.get(partition, "x", 1, "actor").ack()
    assert stats(client, partition).freed == 5
    with pytest.raises(tqstream.InvalidRequestError) as err:
        client.create_partition(partition, tasks=["actor", ""])
    assert str(err.value) == "registered task names must be non-empty strings"


def test_ttl_evicts_rows(client: Client, partition: str) -> None:
    base = client.stats().storage_bytes
    with pytest.raises(tqstream.InvalidRequestError) as err:
        client.create_partition(partition, ["x"], ttl=-1.0)
    assert str(err.value) == "ttl must be > 0 seconds, got -1.0"
    client.create_partition(partition, ["x"], ttl=0.5)
    client.put({"x": torch.zeros(3, 16)}, partition)
    leased = client.get_meta(partition, "x", 1, "t")
    assert stats(client, partition).rows == 3
    wait_for(lambda: stats(client, partition).expired == 3)
    st = stats(client, partition)
    assert (st.rows, st.expired, st.produced, st.freed) == (0, 3, 3, 0)
    assert client.ack(leased) == 0  # evicted under the lease: nothing to consume
    wait_for(lambda: client.stats().storage_bytes == base)
    with pytest.raises(tqstream.RequestTimeoutError):
        client.get_meta(partition, "x", 1, "t", timeout=0)


# --- storage byte quotas ---
ROW = 256 * 4  # bytes of one row of float32[256]


@pytest.fixture(params=["embedded", "processes"])
def quota(request: pytest.FixtureRequest) -> Iterator[Client]:
    """A cluster with one storage unit holding at most 4 rows; put_timeout 1 s."""
    cluster: EmbeddedCluster | ProcessCluster
    if request.param == "embedded":
        storage = StorageConfig(max_bytes=4 * ROW)
        cluster = EmbeddedCluster(ControllerConfig(put_timeout=1.0), storage)
    else:
        cluster = ProcessCluster(1, put_timeout=1.0, storage_max_bytes=4 * ROW)
    try:
        with tqstream.connect(cluster.address) as c:
            yield c
    finally:
        cluster.close()


def rows(n: int) -> dict[str, torch.Tensor]:
    return {"x": torch.zeros(n, 256)}


def test_quota_put_that_can_never_fit_raises_at_once(quota: Client) -> None:
    t0 = time.monotonic()
    with pytest.raises(tqstream.CapacityError) as err:
        quota.put(rows(5), "q")  # timeout=None: would wait forever if it could ever fit
    assert time.monotonic() - t0 < 2
    assert str(err.value) == (
        f"a put of {5 * ROW} bytes can never fit: the storage units' quotas total {4 * ROW} "
        f"bytes; split the batch or raise max_bytes on the units"
    )
    assert err.value.details == {"nbytes": 5 * ROW, "quota": 4 * ROW}
    assert isinstance(err.value, MemoryError)
    assert quota.stats().units[0].max_bytes == 4 * ROW
    assert "q" not in quota.stats().partitions


def test_quota_put_waits_then_raises_with_the_numbers(quota: Client) -> None:
    quota.put(rows(3), "q")
    message = (
        f"a put of 2 rows ({2 * ROW} bytes) to partition 'q' did not fit in storage within "
        f"{{}}s: {ROW} bytes free under the units' quotas ({4 * ROW} in all); consume and ack "
        f"(registered tasks free rows), clear rows, or raise max_bytes on the storage units"
    )
    with pytest.raises(tqstream.CapacityError) as err:
        quota.put(rows(2), "q", timeout=0)
    assert str(err.value) == message.format("0.0")
    assert err.value.details == {"nbytes": 2 * ROW, "free": ROW}
    t0 = time.monotonic()
    with pytest.raises(tqstream.CapacityError) as err:
        quota.put(rows(2), "q", timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.45 < elapsed < 3
    waited = str(err.value).split("within ")[1].split("s:")[0]
    assert 0.5 <= float(waited) < 1.5
    assert str(err.value) == message.format(waited)
    st = quota.stats()
    assert st.partitions["q"].rows == 3 and st.storage_bytes == 3 * ROW
    quota.put(rows(1), "q", timeout=0)  # what fits goes in without waiting


def test_quota_waiting_put_proceeds_when_rows_are_freed(quota: Client) -> None:
    quota.create_partition("q", ["x"], tasks=["actor"])
    quota.put(rows(4), "q")
    results: list[Any] = []

    def put_in_thread(n: int) -> threading.Thread:
        def run() -> None:
            try:
                results.append(quota.put(rows(n), "q", timeout=20))
            except Exception as exc:  # pragma: no cover - reported by the asserts below
                results.append(exc)

        t = threading.Thread(target=run)
        t.start()
        return t

    # it waits longer than put_timeout (1 s) before room appears: stored all the same
    waiter = put_in_thread(2)
    time.sleep(1.5)
    assert waiter.is_alive() and not results
    meta = quota.get_meta("q", "x", 2, "actor")
    t0 = time.monotonic()
    quota.ack(meta)  # the only registered task consumed 2 rows: they are freed
    waiter.join(10)
    assert time.monotonic() - t0 < 2
    assert len(results) == 1 and isinstance(results[0], tqstream.BatchMeta), results
    assert len(results[0]) == 2
    # clearing rows lets a waiting put in too
    waiter = put_in_thread(3)
    time.sleep(0.3)
    assert waiter.is_alive() and len(results) == 1
    quota.clear_samples(quota.get_meta("q", "x", 3, "eval"))
    waiter.join(10)
    assert len(results) == 2 and isinstance(results[1], tqstream.BatchMeta), results
    st = quota.stats("q").partitions["q"]
    assert (st.rows, st.produced, st.freed) == (4, 9, 2)
    assert quota.get("q", "x", 4, "reader").data["x"].shape == (4, 256)
    # clear_partition frees everything; a put waiting for room gets in (a new partition "q")
    waiter = put_in_thread(4)
    time.sleep(0.3)
    assert waiter.is_alive() and len(results) == 2
    quota.clear_partition("q")
    waiter.join(10)
    assert len(results) == 3 and isinstance(results[2], tqstream.BatchMeta), results
    assert quota.stats().storage_bytes == 4 * ROW


# --- producer admission ---
def adm_name(partition: str) -> str:
    return f"adm-{partition}"  # admissions are global at the controller: one name per test


REFUSED = [
    (
        "capacity",
        {"max_concurrent": 0, "max_staleness": 1, "consumer_batch_size": 4},
        "capacity admission needs max_concurrent >= 1 (got 0): no rollout could ever run, so the "
        "trainer would wait forever; set it to the number of rollouts all producers together "
        "may run at once",
    ),
    (
        "capacity",
        {"max_concurrent": 4, "max_staleness": -1, "consumer_batch_size": 4},
        "capacity admission needs max_staleness >= 0 (got -1): at version 0 the bound "
        "(max_staleness + 1) * consumer_batch_size would admit nothing, so the trainer would "
        "never publish version 1; set 0 for on-policy samples or the number of versions a "
        "sample may lag behind the trainer",
    ),
    (
        "capacity",
        {"max_concurrent": 4, "max_staleness": 1, "consumer_batch_size": 0},
        "capacity admission needs consumer_batch_size >= 1 (got 0): the staleness bound "
        "(max_staleness + version + 1) * consumer_batch_size would admit nothing; set it to the "
        "trainer's global batch size in samples (all data-parallel ranks together, not per "
        "rank)",
    ),
    (
        "slots",
        {"max_pending_slots": 8, "max_version_slots": 4, "consumer_batch_size": 6},
        "slots admission would deadlock: max_version_slots=4 < consumer_batch_size=6: the "
        "trainer syncs weights (which resets the window) only after consuming 6 samples, but "
        "only 4 can start per window; set max_version_slots >= 6",
    ),
    (
        "per_version",
        {"max_per_version": 3, "update_interval": 5},
        "per_version admission would deadlock: max_per_version=3 < update_interval=5: producers "
        "stop after 3 prompts under a version while the trainer publishes the next version only "
        "after 5 prompts, so both wait forever; set max_per_version >= 5 (JAX-vLLM's rule "
        "MAX_STALENESS >= UPDATE_INTERVAL)",
    ),
    (
        "fifo",
        {"max_concurrent": 4},
        "unknown admission style 'fifo'; valid styles: 'capacity', 'per_version', 'slots'",
    ),
    (
        "capacity",
        {"max_concurrent": 4, "max_staleness": 1, "consumer_batch_size": 4, "dp_size": 2},
        "admission style 'capacity': unknown config key(s) ['dp_size']; valid keys: "
        "consumer_batch_size, max_concurrent, max_staleness",
    ),
    (
        "slots",
        {"max_pending_slots": 4},
        "admission style 'slots': missing config key(s) ['max_version_slots']; valid keys: "
        "consumer_batch_size, max_pending_slots, max_version_slots",
    ),
]


@pytest.mark.parametrize(("style", "config", "message"), REFUSED)
def test_admission_refused_configurations(
    client: Client, partition: str, style: str, config: dict[str, int], message: str
) -> None:
    with pytest.raises(tqstream.AdmissionError) as err:
        client.admission(style, name=adm_name(partition), **config)
    assert str(err.value) == message
    assert adm_name(partition) not in client.stats().admissions


def test_admission_misuse_messages(client: Client, partition: str) -> None:
    name = adm_name(partition)
    cfg = {"max_concurrent": 2, "max_staleness": 0, "consumer_batch_size": 4}
    adm = client.admission("capacity", name=name, **cfg)
    assert client.admission("capacity", name=name, **cfg).name == name  # again: harmless
    cases: list[tuple[Callable[[], Any], type, str]] = [
        (
            lambda: client.admission("capacity", name=name, **{**cfg, "max_concurrent": 3}),
            tqstream.AdmissionError,
            f"admission {name!r} already exists as capacity {cfg}; it cannot be re-created as "
            f"capacity { ({**cfg, 'max_concurrent': 3}) } (use another name)",
        ),
        (
            lambda: AdmissionHandle(client, name + "-nope", "capacity").try_acquire(),
            tqstream.AdmissionError,
            f"admission {name + '-nope'!r} does not exist; create it first with "
            f"client.admission(style, name={name + '-nope'!r}, ...)",
        ),
        (
            lambda: AdmissionHandle(client, name + "-nope", "capacity").state(),
            tqstream.AdmissionError,
            f"admission {name + '-nope'!r} does not exist; create it first with "
            f"client.admission(style, name={name + '-nope'!r}, ...)",
        ),
        (
            lambda: adm.release([1]),
            tqstream.AdmissionError,
            "release of slot id(s) [1] that this capacity admission never issued (issued: none "
            "yet); pass the ids returned by try_acquire",
        ),
        (
            lambda: adm.acquire(0),
            tqstream.InvalidRequestError,
            "acquire needs n >= 1, got 0",
        ),
        (
            lambda: adm.try_acquire(1, version=-1),
            tqstream.AdmissionError,
            "policy version must be an int in 0..2147483647 (got -1); pass the weight version the "
            "trainer published",
        ),
        (
            lambda: adm.on_version(-2),
            tqstream.AdmissionError,
            "policy version must be an int in 0..2147483647 (got -2); pass the weight version the "
            "trainer published",
        ),
        (
            adm.reset_staleness,
            tqstream.AdmissionError,
            f"reset_staleness is for slots admission; {name!r} is capacity: call on_version(v) "
            f"after each weight sync",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error) as err:
            call()
        assert str(err.value) == message
    ids = adm.try_acquire(1)
    with pytest.raises(tqstream.AdmissionError) as err:
        adm.release(ids, "done")
    assert str(err.value) == (
        "release outcome must be 'accepted', 'rejected' or 'dropped' (got 'done')"
    )
    with pytest.raises(tqstream.AdmissionError) as err:
        adm.release([ids[0], 9])
    assert str(err.value) == (
        "release of slot id(s) [9] that this capacity admission never issued (issued: 1..1); "
        "pass the ids returned by try_acquire"
    )
    assert adm.state()["running"] == 1  # a refused release changes nothing
    slots = client.admission("slots", name=name + "-s", max_pending_slots=2, max_version_slots=2)
    with pytest.raises(tqstream.AdmissionError) as err:
        slots.on_rollout_submitted()
    assert str(err.value) == "force= (on_rollout_submitted) is for capacity admission"


def test_try_acquire_never_waits_and_release_is_idempotent(client: Client, partition: str) -> None:
    name = adm_name(partition)
    adm = client.admission("capacity", name=name, max_concurrent=3, max_staleness=0,
                           consumer_batch_size=4)  # fmt: skip
    t0 = time.monotonic()
    assert adm.try_acquire(5) == [1, 2, 3]  # concurrency-bound
    assert adm.try_acquire(1) == []
    assert time.monotonic() - t0 < 2
    adm.release([1, 2], "accepted")
    adm.release([1, 2], "accepted")  # twice: counted once
    adm.release([2], "rejected")  # already ended: no-op, whatever the outcome
    adm.release([3], "rejected")  # a rejected slot gives its budget back
    state = adm.state()
    assert state == {
        "style": "capacity",
        "version": 0,
        "running": 0,
        "granted": 3,
        "accepted": 2,
        "rejected": 1,
        "enqueued": 0,
        "dropped": 0,
        "capacity": 2,  # (0 + 0 + 1) * 4 - 2 accepted
        "max_concurrent": 3,
        "max_staleness": 0,
        "consumer_batch_size": 4,
    }
    assert client.stats().admissions[name] == state
    assert adm.try_acquire(5) == [4, 5]  # the staleness bound now
    assert adm.try_acquire(1) == []
    adm.on_version(1)  # the bound moves with the trainer's version
    assert adm.try_acquire(5) == [6]  # concurrency-bound again (3 running)


def test_acquire_waits_until_another_client_releases(
    client: Client, partition: str, deployment: tuple[str, str]
) -> None:
    name = adm_name(partition)
    adm = client.admission("slots", name=name, max_pending_slots=1, max_version_slots=10)
    held = adm.acquire()
    result: list[Any] = []
    woken: list[float] = []

    def wait() -> None:
        result.append(adm.acquire(timeout=30))
        woken.append(time.monotonic())

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not result  # parked at the controller
    with tqstream.connect(deployment[1]) as other:
        released = time.monotonic()
        AdmissionHandle(other, name, "slots").release(held)
    t.join(10)
    assert result == [[2]] and woken[0] - released < 2
    assert adm.state()["pending"] == 1


def test_acquire_timeout_says_what_is_full(client: Client, partition: str) -> None:
    name = adm_name(partition)
    adm = client.admission("capacity", name=name, max_concurrent=1, max_staleness=0,
                           consumer_batch_size=1)  # fmt: skip
    adm.acquire()
    state = adm.state()
    with pytest.raises(tqstream.RequestTimeoutError) as err:
        adm.acquire(timeout=0)
    assert str(err.value) == (
        f"no admission slot of {name!r} (capacity) was free within 0.0s for version 0: {state}; "
        f"the trainer must consume and publish a new version (on_version) or producers release "
        f"slots"
    )
    t0 = time.monotonic()
    with pytest.raises(tqstream.RequestTimeoutError, match=r"was free within 0\.[3-9]s"):
        adm.acquire(timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    assert adm.acquire_slot(timeout=0.1) is None  # verl's face returns None instead
    assert adm.state() == state  # timed-out waits took nothing


def test_on_version_wakes_a_parked_acquire(client: Client, partition: str) -> None:
    """A producer parked on a full staleness bound is woken by the trainer's next version, even
    if it asked with an older version (it holds the published weights by then)."""
    name = adm_name(partition)
    adm = client.admission("capacity", name=name, max_concurrent=4, max_staleness=0,
                           consumer_batch_size=2)  # fmt: skip
    adm.release(adm.acquire(2), "accepted")  # version 0's batch is complete
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(adm.acquire(2, version=0, timeout=30)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()
    t0 = time.monotonic()
    adm.on_version(1)
    t.join(10)
    assert result == [[3, 4]] and time.monotonic() - t0 < 2
    # per_version: a waiter parked on an exhausted version gets the next version's budget
    pv = client.admission("per_version", name=name + "-pv", max_per_version=2, update_interval=2)
    assert pv.acquire(3) == [1, 2]  # partial grant: version 0's budget
    t = threading.Thread(target=lambda: result.append(pv.acquire(1, timeout=30)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()
    pv.on_version(1)
    t.join(10)
    assert result[-1] == [3] and pv.state()["remaining"] == 1


def test_areal_face(client: Client, partition: str) -> None:
    name = adm_name(partition)
    adm = client.admission("capacity", name=name, max_concurrent=4, max_staleness=1,
                           consumer_batch_size=2)  # fmt: skip
    assert adm.get_capacity(0) == 4  # min(4 - 0, (1 + 0 + 1) * 2 - 0)
    adm.on_rollout_enqueued(3)
    slots = [adm.on_rollout_submitted() for _ in range(5)]  # regardless of capacity
    assert slots == [1, 2, 3, 4, 5] and adm.get_capacity(0) == -1
    adm.on_rollout_accepted(1)
    adm.on_rollout_accepted(2)
    adm.on_rollout_rejected(3)
    adm.on_rollout_rejected(3)
    state = adm.state()
    assert (state["enqueued"], state["running"], state["accepted"], state["rejected"]) == (
        3,
        2,
        2,
        1,
    )
    assert adm.get_capacity(2) == 2  # min(4 - 2, (1 + 2 + 1) * 2 - 4)
    adm.on_version_recovered(3)  # restart from the checkpoint at version 3
    state = adm.state()
    assert (state["version"], state["running"], state["accepted"]) == (3, 0, 6)
    adm.on_rollout_accepted(4)  # issued before the restart: void, a no-op
    assert adm.state()["accepted"] == 6 and adm.get_capacity(3) == 4


def test_verl_face(client: Client, partition: str) -> None:
    name = adm_name(partition)
    adm = client.admission("slots", name=name, max_pending_slots=3, max_version_slots=2,
                           consumer_batch_size=2)  # fmt: skip
    a, b = adm.acquire_slot(timeout=0), adm.acquire_slot(timeout=0)
    assert (a, b) == (1, 2)
    assert adm.acquire_slot(timeout=0.1) is None  # the window (2 per version) is full
    adm.release_slot(a)
    adm.release_slot(b, "rejected")  # counted in this window: its window slot comes back
    assert adm.acquire_slot(timeout=0) == 3
    assert adm.acquire_slot(timeout=0) is None
    adm.reset_staleness()
    assert adm.try_acquire(5) == [4, 5]
    adm.on_version(1)  # a new version opens one new window ...
    adm.on_version(1)  # ... a repeated notice opens none
    state = adm.state()
    assert (state["resets"], state["version_slots"], state["pending"]) == (2, 0, 3)
    assert adm.try_acquire(1) == []  # layer 1: 3 pending
    adm.release([3, 4, 5])
    assert adm.try_acquire(5) == [6, 7]
    assert client.stats().admissions[name]["granted"] == 7


PRODUCER = """
import json, sys, tqstream
from tqstream.client.admission import AdmissionHandle
address, name = sys.argv[1], sys.argv[2]
with tqstream.connect(address) as c:
    adm = c.admission("capacity", name=name, max_concurrent=2, max_staleness=0,
                      consumer_batch_size=4)
    got = []
    while True:
        try:
            ids = adm.acquire(1, timeout=2)
        except tqstream.RequestTimeoutError:
            break
        got += ids
        adm.release(ids, "accepted")
    print(json.dumps(got))
"""


def test_admission_shared_by_two_processes(
    client: Client, partition: str, deployment: tuple[str, str]
) -> None:
    """Two producer processes draw from one global bound: (0 + 0 + 1) * 4 samples at version 0,
    4 more at version 1; never 4 per process."""
    name = adm_name(partition)
    adm = client.admission("capacity", name=name, max_concurrent=2, max_staleness=0,
                           consumer_batch_size=4)  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, deployment[1], name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        wait_for(lambda: adm.state()["accepted"] == 4, timeout=60)
        time.sleep(0.3)  # the producers are parked on the full bound now
        assert adm.state()["accepted"] == 4 and adm.state()["capacity"] == 0
        adm.on_version(1)  # the trainer consumed version 0's batch
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    got = [json.loads(out) for out, _ in outs]
    every = sorted(got[0] + got[1])
    assert every == list(range(1, 9))  # 8 distinct slots in all: the bound is global
    state = adm.state()
    assert (state["granted"], state["accepted"], state["running"], state["capacity"]) == (
        8,
        8,
        0,
        0,
    )


def test_admission_async_twins(client: Client, partition: str) -> None:
    import asyncio

    cap = client.admission("capacity", name=f"cap-{partition}", max_concurrent=4,
                           max_staleness=0, consumer_batch_size=2)  # fmt: skip
    slots = client.admission("slots", name=f"slots-{partition}", max_version_slots=1,
                             max_pending_slots=4)  # fmt: skip

    async def main() -> None:
        await cap.async_on_rollout_enqueued(2)
        slot = await cap.async_on_rollout_submitted()
        assert cap.state()["running"] == 1
        await cap.async_release([slot], "accepted")
        await cap.async_on_version_recovered(3)
        assert cap.state()["running"] == 0 and cap.state()["version"] == 3
        first = await slots.async_acquire_slot(timeout=1)
        assert first is not None and await slots.async_acquire_slot(timeout=0.2) is None
        slots.release_slot(first)
        await slots.async_reset_staleness()  # a new version window
        assert await slots.async_acquire_slot(timeout=1) is not None

    asyncio.run(main())
