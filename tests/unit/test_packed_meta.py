"""A put of many plain rows answers with PackedMeta (O(units) bytes); the client's expansion is
exactly the BatchMeta the controller would have sent, and anything not plain is sent whole."""

from __future__ import annotations

from typing import Any

import pytest

from tqstream.controller.catalog import Catalog
from tqstream.controller.state import ControllerState
from tqstream.errors import InternalError
from tqstream.protocol.messages import (
    MetaReply,
    PackedMeta,
    PreparePut,
    StoredReply,
    StoredResults,
    decode_reply,
    decode_unit_reply,
    encode,
)
from tqstream.types import BatchMeta, FieldSchema

F32 = FieldSchema("dense", "float32", (2,))
N = 300  # more than the 64 rows below which metadata is always sent whole


def state(units: int = 3, replicas: int | None = None) -> ControllerState:
    s = ControllerState(lease_timeout=100.0, put_timeout=10.0)
    for u in range(units):
        s.add_unit(f"tcp://unit{u}")
    s.create_partition("p", ["a"], replicas=replicas)
    return s


def commit(s: ControllerState, n: int = N, **kw: Any) -> tuple[Any, BatchMeta]:
    """The put's committed metadata as sent, and the whole BatchMeta of its rows."""
    req = PreparePut(rid=0, partition="p", n_rows=n, schemas={"a": F32}, nbytes=8 * n, **kw)
    plan = s.prepare_put(req, 0.0)
    sent, _ = s.commit(plan.put_id, 0.0)
    return sent, Catalog.meta(s.partitions["p"], plan.rows(), ["a"])


@pytest.mark.parametrize(
    "kw",
    [{}, {"version": 7}, {"version_start": [3] * N, "version_end": [5] * N,
                          "dispatch_version": [3] * N}],
)  # fmt: skip
def test_plain_rows_are_packed_and_expand_to_the_whole_meta(kw):
    s = state()
    commit(s)  # rows before: the ids of the second put do not start at 0
    sent, whole = commit(s, **kw)
    assert isinstance(sent, PackedMeta)
    assert sent.expand() == whole
    assert whole.keys[0] == f"{s.partitions['p'].key_prefix}{whole.row_ids[0]}"


def test_rows_on_several_units_and_replicas_pack_as_runs():
    s = state(units=3, replicas=2)
    sent, whole = commit(s)
    assert isinstance(sent, PackedMeta) and sent.expand() == whole
    assert sent.replicas and all(r >= 0 for r in whole.replicas)


@pytest.mark.parametrize(
    "kw",
    [
        {"keys": [f"k{i}" for i in range(N)]},
        {"groups": [f"g{i // 4}" for i in range(N)], "group_size": 4},
        {"tags": [{"i": i} for i in range(N)]},
        {"version_start": list(range(N)), "version_end": list(range(N)),
         "dispatch_version": list(range(N))},
    ],
)  # fmt: skip
def test_rows_that_are_not_plain_are_sent_whole(kw):
    s = state()
    sent, whole = commit(s, **kw)
    assert isinstance(sent, BatchMeta) and sent == whole


def test_few_rows_are_sent_whole():
    sent, whole = commit(state(), 64)
    assert isinstance(sent, BatchMeta) and sent == whole


def test_a_row_named_like_a_generated_key_keeps_the_put_whole():
    s = state()
    first, _ = commit(s)
    prefix, nxt = s.partitions["p"].key_prefix, first.first + N
    commit(s, 1, keys=[f"{prefix}{nxt + 1 + 10}"])  # a user key that a later row would get
    sent, whole = commit(s)
    assert isinstance(sent, BatchMeta) and sent == whole
    assert f"{prefix}{nxt + 11}" not in whole.keys  # that row's generated key took a suffix


def test_packed_meta_on_the_wire_and_through_a_relaying_unit():
    s = state()
    sent, whole = commit(s)
    data = encode(StoredResults(rid=1, results=[StoredReply.of(0, 9, sent)]))
    assert len(data) < 200  # O(units), not O(rows)
    relay = decode_unit_reply(data).results[0]
    assert relay.row_ids() == range(whole.row_ids[0], whole.row_ids[-1] + 1)
    passed = encode(MetaReply(rid=2, meta=relay.meta, packed=relay.packed))  # as the unit does
    assert decode_reply(passed).batch() == whole
    small, small_whole = commit(s, 3)
    relay = decode_unit_reply(encode(StoredResults(rid=1, results=[StoredReply.of(0, 9, small)])))
    assert relay.results[0].row_ids() == small_whole.row_ids
    assert decode_reply(encode(MetaReply.of(3, small))).batch() == small_whole


def test_a_meta_reply_with_no_rows_metadata_is_an_internal_error():
    with pytest.raises(InternalError, match="carried neither meta nor packed"):
        decode_reply(encode(MetaReply(rid=1))).batch()
