"""Wire messages: typed, frozen msgspec Structs in two tagged unions (requests and replies).

A message on the wire is a ZMQ multipart message whose frame 0 is the msgpack encoding of one of
these Structs and whose frames 1..n are raw tensor buffers, referenced by index from
:class:`BufferRef`. Every request carries ``rid``; its reply echoes it, so one socket carries many
concurrent requests. Evolve by adding fields with defaults only, and bump ``PROTOCOL_VERSION`` for
anything else; the version is checked at the ``Hello`` handshake.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tqstream.types import BatchMeta, FieldSchema, Stats, UnitStats

PROTOCOL_VERSION = 1


class BufferRef(msgspec.Struct, frozen=True):
    """A tensor carried in frame ``frame`` (1-based: frame 0 is the header): the whole frame, or
    with ``offset >= 0`` its bytes from there (small messages pack their tensors in one frame)."""

    frame: int
    dtype: str
    shape: tuple[int, ...]
    offset: int = -1


class Region(msgspec.Struct, frozen=True, array_like=True):
    """``nbytes`` bytes at ``offset`` of shared-memory segment ``name`` (see ``shm.py``)."""

    name: str
    offset: int
    nbytes: int


class Spare(msgspec.Struct, frozen=True, array_like=True):
    """A recycled shared-memory segment of ``nbytes`` a client may claim for its next chunk."""

    name: str
    nbytes: int


class ColumnRef(msgspec.Struct, frozen=True):
    """One column of a chunk: ``values`` is ``[n, *shape]`` (dense) or ``[sum L_i, *shape]`` with
    ``offsets`` ``int64[n + 1]`` (ragged, and object columns as Arrow large-binary bytes)."""

    name: str
    schema: FieldSchema
    values: BufferRef
    offsets: BufferRef | None = None


class PlanSegment(msgspec.Struct, frozen=True):
    """Batch rows ``[start, stop)`` of a put go to storage unit ``unit`` as chunk ``chunk``."""

    unit: int
    chunk: int
    start: int
    stop: int


class _Msg(msgspec.Struct, frozen=True, tag=True, tag_field="op"):
    rid: int


# --- handshake (both servers) ---
class Hello(_Msg, frozen=True, tag="hello"):
    protocol: int
    role: str = "client"


class Welcome(_Msg, frozen=True, tag="welcome"):
    protocol: int
    server: str
    max_message_bytes: int
    units: list[str] = []
    shm: str = ""  # a storage unit's shared-memory token; "" when it has none
    inproc_units: list[str] = []  # units' inproc:// addresses (embedded), "" where none


# --- controller requests ---
class RegisterUnit(_Msg, frozen=True, tag="register_unit"):
    address: str
    max_bytes: int = 0  # the unit's byte quota; 0: unlimited
    inproc: str = ""  # the unit's inproc:// address when it runs embedded


class CreatePartition(_Msg, frozen=True, tag="create_partition"):
    partition: str
    fields: list[str] = []
    tasks: list[str] | None = None  # registered consumer tasks: a row all of them acked is freed
    ttl: float | None = None  # seconds a committed row lives before it is evicted
    admission: str | None = None  # the admission feeding it: stale evictions return budget
    producers: int | None = None  # close_partition calls that close it (None: unchanged / 1)


class ClosePartition(_Msg, frozen=True, tag="close_partition"):
    """One producer is done: no new rows once every declared producer closed the partition."""

    partition: str


class CountRejected(_Msg, frozen=True, tag="count_rejected"):
    partition: str
    count: int


class PreparePut(_Msg, frozen=True, tag="prepare_put"):
    partition: str
    n_rows: int
    schemas: dict[str, FieldSchema]
    nbytes: int
    keys: list[str] | None = None
    groups: list[str | None] | None = None
    group_size: int | None = None
    version: int | None = None
    version_start: list[int | None] | None = None  # per row, derived from per-token versions
    version_end: list[int | None] | None = None
    dispatch_version: list[int | None] | None = None
    rejected: int = 0  # rows of this put refused by the producer (mixed versions)
    timeout: float | None = None  # wait this long for storage room (byte quotas)


class PrepareFields(_Msg, frozen=True, tag="prepare_fields"):
    partition: str
    row_ids: list[int]
    schemas: dict[str, FieldSchema]
    nbytes: int


class CommitPut(_Msg, frozen=True, tag="commit_put"):
    put_id: int


class AbortPut(_Msg, frozen=True, tag="abort_put"):
    put_id: int


class GetMeta(_Msg, frozen=True, tag="get_meta"):
    partition: str
    fields: list[str]
    batch_size: int
    task: str
    whole_groups: bool = False
    lease_timeout: float | None = None
    timeout: float | None = None
    current_version: int | None = None
    max_staleness: int | None = None
    measure: str = "head"  # "head" (version_start) | "tail" (version_end) | "dispatch"
    on_stale: str = "keep"  # "keep" | "drop"


class GetByKeys(_Msg, frozen=True, tag="get_by_keys"):
    partition: str
    keys: list[str]
    fields: list[str] | None = None


class ListKeys(_Msg, frozen=True, tag="list_keys"):
    partition: str


class Ack(_Msg, frozen=True, tag="ack"):
    partition: str
    task: str
    lease_id: int
    row_ids: list[int]


class Release(_Msg, frozen=True, tag="release"):
    partition: str
    task: str
    lease_id: int
    row_ids: list[int]


class ClearSamples(_Msg, frozen=True, tag="clear_samples"):
    partition: str
    row_ids: list[int]


class ClearPartition(_Msg, frozen=True, tag="clear_partition"):
    partition: str


class GetStats(_Msg, frozen=True, tag="get_stats"):
    partition: str | None = None


# --- storage requests ---
class Store(_Msg, frozen=True, tag="store"):
    partition: str
    chunk: int
    row_ids: list[int]
    columns: list[ColumnRef]
    shared: list[Region] = []  # frames 1..n are in shared memory instead of attached
    reused: str = ""  # the spare segment the client claimed (renamed) for this chunk


class Fetch(_Msg, frozen=True, tag="fetch"):
    partition: str
    row_ids: list[int]
    fields: list[str]
    shared: bool = False  # the client reads the unit's shared memory: answer with regions


class PutRows(_Msg, frozen=True, tag="put_rows"):
    """A small put in one exchange: the client sends rows and their metadata to a storage unit,
    which holds the columns, has the controller prepare and commit the put at once
    (``PutStored``) and answers with the committed rows' metadata."""

    put: PreparePut
    columns: list[ColumnRef]


class PutStored(_Msg, frozen=True, tag="put_stored"):
    """From a storage unit: the columns of ``puts`` are held by unit ``unit``; place each put's
    rows there and commit them (each waiting for room under the unit's quota like any put). A unit
    sends the puts that reached it together in one message."""

    unit: int
    puts: list[PreparePut]


class DropRows(_Msg, frozen=True, tag="drop_rows"):
    partition: str
    row_ids: list[int]


class DropChunks(_Msg, frozen=True, tag="drop_chunks"):
    chunks: list[int]


class DropPartition(_Msg, frozen=True, tag="drop_partition"):
    partition: str
    before_chunk: int = 0  # only chunks with smaller ids (the cleared incarnation); 0: all


class GetUnitStats(_Msg, frozen=True, tag="get_unit_stats"):
    pass


# --- admission (producer flow control) ---
class CreateAdmission(_Msg, frozen=True, tag="create_admission"):
    name: str
    style: str
    config: dict[str, int]


class Acquire(_Msg, frozen=True, tag="acquire"):
    """Ask for up to ``n`` slots; waits (parked) until at least one is granted unless ``wait`` is
    false; ``force`` grants one regardless of capacity (AReaL's on_rollout_submitted)."""

    name: str
    n: int = 1
    version: int = 0
    wait: bool = True
    timeout: float | None = None
    force: bool = False


class ReleaseSlots(_Msg, frozen=True, tag="release_slots"):
    name: str
    slot_ids: list[int]
    outcome: str = "accepted"


class AdmissionVersion(_Msg, frozen=True, tag="admission_version"):
    """The trainer published ``version`` (``recovered``: restarted from a checkpoint at it)."""

    name: str
    version: int
    recovered: bool = False
    reset: bool = False  # verl's reset_staleness: reopen the version window unconditionally


class AdmissionInfo(_Msg, frozen=True, tag="admission_info"):
    name: str
    version: int | None = None
    enqueued: int = 0


Request = (
    Hello
    | RegisterUnit
    | CreatePartition
    | PreparePut
    | PrepareFields
    | CommitPut
    | AbortPut
    | GetMeta
    | GetByKeys
    | ListKeys
    | Ack
    | Release
    | ClearSamples
    | ClearPartition
    | ClosePartition
    | GetStats
    | Store
    | PutRows
    | PutStored
    | Fetch
    | DropRows
    | DropChunks
    | DropPartition
    | GetUnitStats
    | CountRejected
    | CreateAdmission
    | Acquire
    | ReleaseSlots
    | AdmissionVersion
    | AdmissionInfo
)


# --- replies ---
class Ok(_Msg, frozen=True, tag="ok"):
    count: int = 0
    spare: list[Spare] = []  # a storage unit's answer to a shared Store: segments to reuse


class Registered(_Msg, frozen=True, tag="registered"):
    unit: int


class PutPlan(_Msg, frozen=True, tag="put_plan"):
    put_id: int
    row_ids: list[int]
    segments: list[PlanSegment]


class StoredReply(_Msg, frozen=True, tag="stored"):
    """One put of a ``PutStored``, committed: its rows, and the chunk id under which the unit
    indexes them."""

    chunk: int
    meta: BatchMeta


class ErrorReply(_Msg, frozen=True, tag="error"):
    """A failure; the client raises ``tqstream.errors.error_class(code)(message, **details)``."""

    code: str
    message: str
    details: dict[str, Any] = {}


class StoredResults(_Msg, frozen=True, tag="stored_results"):
    """The controller's answer to ``PutStored``: one result per put, in order."""

    results: list[StoredReply | ErrorReply]


class FieldsPlan(_Msg, frozen=True, tag="fields_plan"):
    """``put_fields`` placement: the rows of ``segments[i]`` are ``positions[i]`` of the batch."""

    put_id: int
    segments: list[PlanSegment]
    positions: list[list[int]]


class MetaReply(_Msg, frozen=True, tag="meta"):
    meta: BatchMeta


class KeysReply(_Msg, frozen=True, tag="keys"):
    keys: list[str]


class StatsReply(_Msg, frozen=True, tag="stats"):
    stats: Stats


class Columns(_Msg, frozen=True, tag="columns"):
    columns: list[ColumnRef]
    shared: dict[int, Region] = {}  # frame index -> region; that frame is sent empty


class UnitStatsReply(_Msg, frozen=True, tag="unit_stats"):
    stats: UnitStats


class Slots(_Msg, frozen=True, tag="slots"):
    slot_ids: list[int]


class AdmissionReply(_Msg, frozen=True, tag="admission"):
    state: dict[str, int | float | str]
    capacity: int | None = None


Reply = (
    Ok
    | ErrorReply
    | Welcome
    | Registered
    | PutPlan
    | StoredReply
    | StoredResults
    | FieldsPlan
    | MetaReply
    | KeysReply
    | StatsReply
    | Columns
    | UnitStatsReply
    | Slots
    | AdmissionReply
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes | memoryview) -> Any:
    """Decode frame 0 of a request; raises ``msgspec.DecodeError`` / ``ValidationError``."""
    return _request_decoder.decode(data)


def decode_reply(data: bytes | memoryview) -> Any:
    return _reply_decoder.decode(data)
