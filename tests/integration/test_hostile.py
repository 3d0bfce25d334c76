"""Type-valid requests with extreme values, and values outside a closed set, sent raw (a ZMQ
DEALER socket, no tqstream client in between) to a controller and a storage unit running as
processes: each is refused with ``MalformedMessageError`` naming the field, the servers keep
answering, and their memory stays bounded. The client refuses the same values before sending."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tqstream
from tqstream.errors import error_class
from tqstream.protocol import messages as m
from tqstream.protocol.messages import ErrorReply, decode_reply, encode
from tqstream.types import FieldSchema

F32 = FieldSchema("dense", "float32", (2,))
NASTY_FLOATS = [math.nan, math.inf, -math.inf, -1.0, 1e308, -0.0, 1e7 + 1]
NASTY_INTS = [-(2**63), -1, 2**62, 2**63 - 1, 1 << 20 | 1, 1 << 22 | 1]


@pytest.fixture(scope="module")
def cluster() -> Any:
    c = tqstream.ProcessCluster(storage_units=1, put_timeout=3.0)
    with tqstream.connect(c.address) as client:
        client.create_partition("p", ["a"], tasks=["t"])
    yield c
    c.close()


class Raw:
    """A DEALER socket speaking frame 0 only."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)

    def ask(self, msg: Any, timeout: float = 10.0) -> Any:
        self.sock.send_multipart([encode(msg)])
        assert self.sock.poll(int(timeout * 1000)), f"no answer to {type(msg).__name__}"
        return decode_reply(self.sock.recv_multipart()[0])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


CASES = [
    (m.GetMeta(rid=1, partition="p", fields=["a"], batch_size=1, task="t",
               lease_timeout=math.nan), "Expected `float` >= -10000000.0 - at `$.lease_timeout`"),
    (m.GetMeta(rid=1, partition="p", fields=["a"], batch_size=1, task="t", timeout=math.inf),
     "Expected `float` <= 10000000.0 - at `$.timeout`"),
    (m.GetMeta(rid=1, partition="p", fields=["a"], batch_size=2**40, task="t"),
     "Expected `int` <= 1048576 - at `$.batch_size`"),
    (m.PreparePut(rid=1, partition="p", n_rows=2**62, schemas={"a": F32}, nbytes=8),
     "Expected `int` <= 1048576 - at `$.n_rows`"),
    (m.PreparePut(rid=1, partition="p", n_rows=2, schemas={"a": F32}, nbytes=-8),
     "Expected `int` >= 0 - at `$.nbytes`"),
    (m.PreparePut(rid=1, partition="p", n_rows=2, schemas={"a": F32}, nbytes=16,
                  timeout=-math.inf), "Expected `float` >= -10000000.0 - at `$.timeout`"),
    (m.CreatePartition(rid=1, partition="q", ttl=math.nan),
     "Expected `float` >= -10000000.0 - at `$.ttl`"),
    (m.Acquire(rid=1, name="default", n=2**62), "Expected `int` <= 1048576 - at `$.n`"),
    (m.Ack(rid=1, partition="p", task="t", lease_id=-1, row_ids=[0]),
     "Expected `int` >= 0 - at `$.lease_id`"),
    (m.CountRejected(rid=1, partition="p", count=-1), "Expected `int` >= 0 - at `$.count`"),
    (m.SaveCheckpoint(rid=1, path="/nonexistent/ck", timeout=math.nan),
     "Expected `float` >= -10000000.0 - at `$.timeout`"),
]  # fmt: skip


@pytest.mark.parametrize(("msg", "why"), CASES, ids=[f"{type(c[0]).__name__}-{i}"
                                                    for i, c in enumerate(CASES)])  # fmt: skip
def test_extreme_values_are_refused_by_the_controller(cluster: Any, msg: Any, why: str) -> None:
    raw = Raw(cluster.address)
    try:
        reply = raw.ask(msg)
        assert isinstance(reply, ErrorReply) and reply.code == "malformed", reply
        assert why in reply.message
    finally:
        raw.close()


# values outside a closed set (a Literal in messages.py), as a peer that skipped the client's
# checks would send them
OUTSIDE = [
    (m.GetMeta(rid=1, partition="p", fields=["a"], batch_size=1, task="t", measure="sideways"),
     "`$.measure`", "sideways"),
    (m.GetMeta(rid=1, partition="p", fields=["a"], batch_size=1, task="t", on_stale="evict"),
     "`$.on_stale`", "evict"),
    (m.CreateAdmission(rid=1, name="q", style="fifo", config={}), "`$.style`", "fifo"),
    (m.ReleaseSlots(rid=1, name="q", slot_ids=[1], outcome="done"), "`$.outcome`", "done"),
]  # fmt: skip


@pytest.mark.parametrize(("msg", "field", "value"), OUTSIDE, ids=[c[2] for c in OUTSIDE])
def test_values_outside_a_closed_set_are_refused_by_the_controller(
    cluster: Any, msg: Any, field: str, value: str
) -> None:
    raw = Raw(cluster.address)
    try:
        reply = raw.ask(msg)
        assert isinstance(reply, ErrorReply) and reply.code == "malformed", reply
        assert f"Invalid enum value '{value}' - at {field}" in reply.message
        error = error_class(reply.code)(reply.message, **reply.details)  # what a client raises
        assert isinstance(error, tqstream.MalformedMessageError)
    finally:
        raw.close()
    with tqstream.connect(cluster.address) as client:
        assert "q" not in client.stats().admissions  # the server kept serving, nothing made


def test_extreme_values_are_refused_by_a_storage_unit(cluster: Any) -> None:
    raw = Raw(cluster.unit_addresses[0])
    try:
        bad = m.Fetch(rid=1, partition="p", row_ids=[-5], fields=["a"])
        reply = raw.ask(bad)
        assert isinstance(reply, ErrorReply) and reply.code == "malformed"
        assert "Expected `int` >= 0 - at `$.row_ids[0]`" in reply.message
    finally:
        raw.close()


def test_the_client_refuses_them_before_sending(cluster: Any) -> None:
    with tqstream.connect(cluster.address) as client:
        with pytest.raises(tqstream.InvalidRequestError) as err:
            client.get_meta("p", ["a"], 1, task="t", timeout=math.nan)
        assert str(err.value).startswith(
            "get_meta request refused before sending: Expected `float` >= -10000000.0 - at "
            "`$.timeout` (timeouts and ttls are finite, at most 1e+07 seconds"
        )
        with pytest.raises(tqstream.InvalidRequestError, match=r"at `\$\.ttl`"):
            client.create_partition("q", ["a"], ttl=math.inf)
        assert client.stats().partitions["p"].produced == 0  # the cluster is untouched


def _nasty(tp: Any) -> st.SearchStrategy[Any]:
    """Values of ``tp``'s type ignoring its bounds, leaning on the extremes."""
    info = msgspec.inspect.type_info(tp) if not isinstance(tp, msgspec.inspect.Type) else tp
    if isinstance(info, msgspec.inspect.IntType):
        return st.sampled_from(NASTY_INTS) | st.integers(-(2**63), 2**63 - 1)
    if isinstance(info, msgspec.inspect.FloatType):
        return st.sampled_from(NASTY_FLOATS) | st.floats()
    if isinstance(info, msgspec.inspect.StrType):
        return st.sampled_from(["p", "t", "a", "", "default"])
    if isinstance(info, msgspec.inspect.LiteralType):  # a closed set: its values, and one outside
        return st.sampled_from([*info.values, "sideways"])
    if isinstance(info, msgspec.inspect.BoolType):
        return st.booleans()
    if isinstance(info, msgspec.inspect.NoneType):
        return st.none()
    if isinstance(info, msgspec.inspect.UnionType):
        return st.one_of(*[_nasty(t) for t in info.types])
    if isinstance(info, msgspec.inspect.ListType):
        return st.lists(_nasty(info.item_type), max_size=3)
    if isinstance(info, msgspec.inspect.DictType):
        return st.dictionaries(st.just("a"), st.just(F32), max_size=1)
    if isinstance(info, msgspec.inspect.VarTupleType):
        return st.lists(_nasty(info.item_type), max_size=2).map(tuple)
    if isinstance(info, msgspec.inspect.StructType) and info.cls is not FieldSchema:
        parts = {f.name: _nasty(f.type) for f in info.fields}  # nested: ColumnRef, Region, ...
        return st.fixed_dictionaries(parts).map(lambda kw: info.cls(**kw))
    return st.just(F32)  # a FieldSchema: a valid one


# requests a client sends (a storage unit's registration and PutStored are unit-to-controller)
CLIENT_REQUESTS = [
    m.CreatePartition, m.PreparePut, m.PrepareFields, m.CommitPut, m.AbortPut, m.GetMeta,
    m.GetByKeys, m.Ack, m.Release, m.ClearSamples, m.GetStats, m.CountRejected, m.Acquire,
    m.ReleaseSlots, m.AdmissionInfo,
]  # fmt: skip


@st.composite
def requests(draw: st.DrawFn, types: list[Any] = CLIENT_REQUESTS) -> Any:
    """A request of one of ``types`` whose every field is drawn by :func:`_nasty`."""
    cls = draw(st.sampled_from(types))
    fields = {f.name: draw(_nasty(f.type)) for f in msgspec.inspect.type_info(cls).fields}
    fields["rid"] = 1
    if cls in (m.GetMeta, m.Acquire) and fields.get("timeout") is None:
        fields["timeout"] = 0.2  # a valid wait parks until data comes: bound it, to get an answer
    return cls(**fields)  # a Struct's constructor checks no bounds: the server is the one to


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(msgs=st.lists(requests(), min_size=1, max_size=4))
def test_the_controller_answers_every_extreme_request_and_stays_small(
    cluster: Any, msgs: list[Any]
) -> None:
    raw = Raw(cluster.address)
    try:
        for msg in msgs:
            raw.ask(msg, timeout=30.0)  # an answer (an error or a result), never silence
    finally:
        raw.close()
    with tqstream.connect(cluster.address) as client:
        assert "p" in client.stats().partitions  # still serving
    assert rss_mib(cluster.procs[0].pid) < 1024


# requests a storage unit serves (from clients, and from the controller: drops and resets)
UNIT_REQUESTS = [
    m.Store, m.Fetch, m.PutRows, m.DropRows, m.DropChunks, m.DropPartition, m.ResetUnit,
    m.GetUnitStats, m.GetInventory, m.LoadUnit,
]  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(msgs=st.lists(requests(UNIT_REQUESTS), min_size=1, max_size=4))
def test_a_storage_unit_answers_every_extreme_request_and_stays_small(
    cluster: Any, msgs: list[Any]
) -> None:
    raw = Raw(cluster.unit_addresses[0])
    try:
        for msg in msgs:
            raw.ask(msg, timeout=30.0)  # an answer, never silence, and the unit lives on
        assert isinstance(raw.ask(m.GetUnitStats(rid=2)), m.UnitStatsReply)
    finally:
        raw.close()
    assert rss_mib(cluster.procs[1].pid) < 1024
