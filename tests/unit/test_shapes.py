"""A field's shape record (``tqstream.controller.shapes``) against TransferQueue 0.1.11's own
``FieldMeta``: any sequence of regular and nested writes and removals gives the same
``is_nested``, ``shape`` and per-sample shapes. One difference is by design: once every row is
removed tqstream forgets the record, where TransferQueue keeps an empty one whose next regular
write records no shape; the model starts a new ``FieldMeta`` there."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.controller.shapes import Shapes
from tqstream.types import RowShapes

controller = pytest.importorskip("transfer_queue.controller")

SHAPES = st.sampled_from([(2,), (3,), (2, 2)])
Op = tuple[str, Any]


@st.composite
def ops(draw: Any) -> list[Op]:
    out: list[Op] = []
    next_id = 0
    live: list[int] = []
    for _ in range(draw(st.integers(1, 12))):
        if live and draw(st.booleans()):
            gone = draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            live = [r for r in live if r not in gone]
            out.append(("remove", gone))
            continue
        n = draw(st.integers(1, 3))
        ids = list(range(next_id, next_id + n))
        next_id += n
        live += ids
        if draw(st.booleans()):
            out.append(("nested", (ids, [draw(SHAPES) for _ in ids])))
        else:
            out.append(("regular", (ids, draw(SHAPES))))
    return out


def _incoming(kind: str, shapes: Any, ids: list[int]) -> dict[str, Any]:
    if kind == "nested":
        return {"dtype": "f", "is_nested": True, "is_non_tensor": False,
                "per_sample_shapes": dict(zip(ids, shapes, strict=True))}  # fmt: skip
    return {"dtype": "f", "shape": shapes, "is_nested": False, "is_non_tensor": False}


@settings(max_examples=300, deadline=None)
@given(ops())
def test_the_record_is_transferqueues(sequence: list[Op]) -> None:
    ours = Shapes()
    theirs: Any = None
    for kind, arg in sequence:
        if kind == "remove":
            ours.forget(arg)
            theirs.remove_samples(arg)
            if not theirs.global_indexes:
                theirs = None
        else:
            ids, shapes = arg
            ours.write(ids, {"x": RowShapes(kind == "nested", None, shapes) if kind == "nested"
                             else RowShapes(False, shapes)})  # fmt: skip
            incoming = _incoming(kind, shapes, ids)
            if theirs is None:
                theirs = controller.FieldMeta(
                    global_indexes=set(ids), dtype="f", shape=incoming.get("shape"),
                    is_nested=incoming["is_nested"], is_non_tensor=False,
                    per_sample_shapes=incoming.get("per_sample_shapes", {}),
                )  # fmt: skip
            else:
                theirs.update(incoming, ids)
        if theirs is None:
            assert not ours
            continue
        ids = sorted(theirs.global_indexes)
        want = theirs.to_batch_schema(ids)
        got = ours.of(["x"], ids)["x"]
        assert got.nested == bool(want["is_nested"])
        if got.nested:
            assert got.rows == [tuple(s) for s in want["per_sample_shapes"]]
        else:
            assert got.shape == tuple(want["shape"])


def test_a_checkpoint_keeps_the_records_of_the_rows_it_holds() -> None:
    s = Shapes()
    s.write([0, 1], {"a": RowShapes(False, (4,)), "b": RowShapes(True, None, [(1,), (1,)])})
    s.write([2], {"a": RowShapes(False, (6,))})
    back = Shapes.load(s.save({0, 1, 2}))
    assert back.of(["a", "b"], [0, 2]) == s.of(["a", "b"], [0, 2])
    assert back.of(["b"], [0])["b"].nested  # nested of one shape stays nested
    partial = Shapes.load(s.save({0}))  # rows in flight or gone are left out
    assert partial.of(["a"], [0])["a"] == RowShapes(True, None, [(4,)])
