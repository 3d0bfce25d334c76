"""Request cost is O(batch x fields), independent of the partition's size.

Deterministic, not timed: after the views exist, the rows of a 50k-row partition refuse to be
listed and the partition refuses to build a view (its one whole scan), and every per-request path
must still work.
"""

from __future__ import annotations

import pytest

from tqstream.controller.partition import Partition
from tqstream.controller.rows import Rows
from tqstream.controller.state import ControllerState
from tqstream.protocol.messages import GetMeta, PrepareFields, PreparePut
from tqstream.types import FieldSchema

ROWS = 50_000
X = FieldSchema("dense", "float32", (4,))


def _refuse(*a: object) -> None:
    raise AssertionError("a per-request path scanned the whole partition")


class NoScan(Rows):
    ids = values = items = __iter__ = _refuse  # type: ignore[assignment]


def forbid_scans(p: Partition) -> None:
    p.rows.__class__ = NoScan
    p.tasks._ready_for = _refuse  # type: ignore[method-assign,assignment]


def test_requests_never_scan_the_partition() -> None:
    s = ControllerState(lease_timeout=10, put_timeout=10)
    s.add_unit("u")
    for i in range(0, ROWS, 1000):
        plan = s.prepare_put(
            PreparePut(
                rid=0,
                partition="p",
                n_rows=1000,
                schemas={"x": X},
                nbytes=16_000,
                groups=[f"g{j // 4}" for j in range(i, i + 1000)],
            ),
            0,
        )
        s.commit(plan.put_id, 0)

    def get(task: str, size: int, whole: bool = False, fields: tuple[str, ...] = ("x",)):
        return s.get_meta(
            GetMeta(
                rid=0,
                partition="p",
                fields=list(fields),
                batch_size=size,
                task=task,
                whole_groups=whole,
            ),
            object(),
            1,
        )[0]

    for task in ("a", "b"):  # build the views once (the only scan)
        get(task, 1)
        get(task, 4, True)
    p = s.partitions["p"]
    forbid_scans(p)

    m = get("a", 64)
    assert m is not None and len(m) == 64
    assert s.ack("p", "a", m.lease_id, m.row_ids)[0] == 64  # type: ignore[arg-type]
    g = get("a", 8, True)
    assert g is not None and len(g) == 8
    n, _ = s.release("p", "a", g.lease_id, g.row_ids, 2)  # type: ignore[arg-type]
    assert n == 8
    plan = s.prepare_put(
        PreparePut(rid=0, partition="p", n_rows=8, schemas={"x": X}, nbytes=128), 2
    )
    s.commit(plan.put_id, 2)
    fp = s.prepare_fields(
        PrepareFields(rid=0, partition="p", row_ids=m.row_ids[:4], schemas={"adv": X}, nbytes=64), 2
    )
    s.commit(fp.put_id, 2)
    s.expire(10**6)  # every lease expires
    s.clear_samples("p", m.row_ids)
    assert get("b", 512) is not None


def test_first_request_of_a_new_kind_builds_its_view_once() -> None:
    s = ControllerState()
    s.add_unit("u")
    plan = s.prepare_put(
        PreparePut(rid=0, partition="p", n_rows=10, schemas={"x": X}, nbytes=160), 0
    )
    s.commit(plan.put_id, 0)
    p = s.partitions["p"]
    forbid_scans(p)
    with pytest.raises(AssertionError, match="scanned"):
        s.get_meta(
            GetMeta(rid=0, partition="p", fields=["x"], batch_size=1, task="new"), object(), 0
        )
