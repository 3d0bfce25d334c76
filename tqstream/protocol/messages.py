"""Wire messages: typed, frozen msgspec Structs in two tagged unions (requests and replies).

A message on the wire is a ZMQ multipart message whose frame 0 is the msgpack encoding of one of
these Structs and whose frames 1..n are raw tensor buffers, referenced by index from
:class:`BufferRef`. Every request carries ``rid``; its reply echoes it, so one socket carries many
concurrent requests. Evolve by adding fields with defaults only, and bump ``PROTOCOL_VERSION`` for
anything else; the version is checked at the ``Hello`` handshake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from tqstream.types import (
    AdmissionStyle,
    BatchMeta,
    CheckpointSummary,
    FieldSchema,
    Measure,
    OnStale,
    RowListing,
    RowShapes,
    Scalar,
    SlotOutcome,
    Stats,
    UnitStats,
)

PROTOCOL_VERSION = 3

# --- bounds of every number a request carries: checked when a server decodes it (a request out of
# them is refused with MalformedMessageError naming the field) and by the client before sending
MAX_PUT_ROWS = 1 << 20
"""Rows of one put, one batch, one admission request: the controller keeps ~400 bytes per row."""
MAX_LIST = 1 << 22
"""Entries of one request's list (row ids, keys, slot ids)."""
MAX_BYTES = 1 << 50
MAX_SECONDS = 1e7
"""Timeouts, lease timeouts and ttls: finite, 0 to ~115 days."""
MAX_ID = (1 << 63) - 1

# a lower bound the controller checks itself (with a message of its own: "batch_size must be a
# positive number of rows, got -3") is left to it: the wire keeps numbers finite and bounded above
Seconds = Annotated[float, msgspec.Meta(ge=-MAX_SECONDS, le=MAX_SECONDS)]
Rows = Annotated[int, msgspec.Meta(le=MAX_PUT_ROWS)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
Ids = Annotated[list[Id], msgspec.Meta(max_length=MAX_LIST)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_PUT_ROWS)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Signed = Annotated[int, msgspec.Meta(ge=-MAX_ID, le=MAX_ID)]
Names = Annotated[list[str], msgspec.Meta(max_length=MAX_LIST)]

MAX_TAGS = 64
"""Entries of one row's tags."""
MAX_TAG_LIST = 1024
"""Items of a list-valued tag."""
WireTags = Annotated[
    dict[str, Scalar | Annotated[list[Scalar], msgspec.Meta(max_length=MAX_TAG_LIST)]],
    msgspec.Meta(max_length=MAX_TAGS),
]
"""A row's tags as a request carries them: what else a peer sends is refused at decoding."""
RowTags = Annotated[list[WireTags | None], msgspec.Meta(max_length=MAX_PUT_ROWS)]
"""Per row, tags to merge into the row's (None: leave them)."""


class BufferRef(msgspec.Struct, frozen=True):
    """A tensor carried in frame ``frame`` (1-based: frame 0 is the header): the whole frame, or
    with ``offset >= 0`` its bytes from there (small messages pack their tensors in one frame)."""

    frame: Annotated[int, msgspec.Meta(ge=1, le=MAX_LIST)]
    dtype: str
    shape: tuple[Bytes, ...]
    offset: Annotated[int, msgspec.Meta(ge=-1, le=MAX_BYTES)] = -1


class Region(msgspec.Struct, frozen=True, array_like=True):
    """``nbytes`` bytes at ``offset`` of shared-memory segment ``name`` (see ``shm.py``)."""

    name: str
    offset: Bytes
    nbytes: Bytes


class Spare(msgspec.Struct, frozen=True, array_like=True):
    """A recycled shared-memory segment of ``nbytes`` a client may claim for its next chunk;
    ``inode`` tells its writer it still maps it (0: not known)."""

    name: str
    nbytes: int
    inode: int = 0


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
    replica: int = -1  # the unit that stores a second copy (same chunk id); -1: none


class _Msg(msgspec.Struct, frozen=True, tag=True, tag_field="op"):
    rid: int


# --- handshake (both servers) ---
class Hello(_Msg, frozen=True, tag="hello"):
    protocol: int
    role: str = "client"
    # the client this connection belongs to (a client opens several: one per thread or loop);
    # what the client held is given back when its last connection drops. b"": this one alone
    session: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class Welcome(_Msg, frozen=True, tag="welcome"):
    protocol: int
    server: str
    max_message_bytes: int
    units: list[str] = []
    shm: str = ""  # a storage unit's shared-memory token; "" when it has none
    inproc_units: list[str] = []  # units' inproc:// addresses (embedded), "" where none
    # units' shared-memory tokens (from the controller), "" where none: a client that reaches a
    # unit's token shares its host's /dev/shm, and puts there first (locality)
    unit_shm: list[str] = []
    cluster: str = ""  # the controller's token for this cluster ("" from a unit)
    controller: str = ""  # a storage unit's controller address ("" from the controller)
    durable: bool = False  # a controller with a journal: a client sends its requests again
    boot: str = ""  # a storage unit's token for its process (a restarted unit has another)


# --- controller requests ---
class RegisterUnit(_Msg, frozen=True, tag="register_unit"):
    address: str
    max_bytes: Bytes = 0  # the unit's byte quota; 0: unlimited
    inproc: str = ""  # the unit's inproc:// address when it runs embedded
    shm: str = ""  # the unit's shared-memory token ("" without): which clients share its host
    boot: str = ""  # the unit's token for its process: a restart at the address has another


class UnitStopping(_Msg, frozen=True, tag="unit_stopping"):
    """From a storage unit told to stop (SIGTERM, ``close``): its connection will drop on purpose,
    which the controller then reports as a shutdown, not as a loss."""

    unit: Id


class CreatePartition(_Msg, frozen=True, tag="create_partition"):
    partition: str
    fields: Names = []
    tasks: Names | None = None  # registered consumer tasks: a row all of them acked is freed
    ttl: Seconds | None = None  # seconds a committed row lives before it is evicted
    admission: str | None = None  # the admission feeding it: stale evictions return budget
    producers: Rows | None = None  # close_partition calls that close it (None: unchanged / 1)
    replicas: Annotated[int, msgspec.Meta(ge=1, le=2)] | None = None  # copies of each row


class ClosePartition(_Msg, frozen=True, tag="close_partition"):
    """One producer is done: no new rows once every declared producer closed the partition."""

    partition: str


class CountRejected(_Msg, frozen=True, tag="count_rejected"):
    partition: str
    count: Count


class Pair(msgspec.Struct, frozen=True, array_like=True):
    """A one-exchange put of a partition that keeps two copies: the client sends the same rows
    to ``units`` (the first keeps them, the second the copy) under one ``token``; each unit has
    the controller commit them, which it does once both hold them."""

    token: Annotated[int, msgspec.Meta(gt=0)]
    units: Annotated[list[Id], msgspec.Meta(min_length=2, max_length=2)]


class PreparePut(_Msg, frozen=True, tag="prepare_put"):
    partition: str
    n_rows: Rows
    schemas: dict[str, FieldSchema]
    nbytes: Bytes
    keys: Names | None = None
    groups: list[str | None] | None = None
    group_size: Rows | None = None
    version: int | None = None
    version_start: list[int | None] | None = None  # per row, derived from per-token versions
    version_end: list[int | None] | None = None
    dispatch_version: list[int | None] | None = None
    rejected: Count = 0  # rows of this put refused by the producer (mixed versions)
    timeout: Seconds | None = None  # wait this long for storage room (byte quotas)
    tags: RowTags | None = None  # per row, its tags
    # units on the writer's host (it reaches their shared memory): placement prefers them
    near: list[Id] = []
    pair: Pair | None = None  # (PutRows only) the put goes to two units at once
    shapes: dict[str, RowShapes] | None = None  # the TransferQueue layer's record of its fields


class PrepareFields(_Msg, frozen=True, tag="prepare_fields"):
    """Write fields of existing rows, named by ``row_ids`` or by ``keys``; with ``keys`` and
    ``create``, keys not in the partition become new rows (committed with the fields, or not at
    all). ``overwrite``: fields the rows have are replaced, else refused. ``tags`` are merged into
    the rows' at the commit."""

    partition: str
    row_ids: Ids
    schemas: dict[str, FieldSchema]
    nbytes: Bytes
    keys: Names | None = None
    create: bool = False
    overwrite: bool = False
    tags: RowTags | None = None
    # per row, for rows that have no versions yet (created by this write, or without fields)
    version_start: list[int | None] | None = None
    version_end: list[int | None] | None = None
    shapes: dict[str, RowShapes] | None = None  # as PreparePut.shapes


class CommitPut(_Msg, frozen=True, tag="commit_put"):
    put_id: Id


class AbortPut(_Msg, frozen=True, tag="abort_put"):
    put_id: Id


class GetMeta(_Msg, frozen=True, tag="get_meta"):
    partition: str
    fields: Names
    batch_size: Rows
    task: str
    whole_groups: bool = False
    lease_timeout: Seconds | None = None
    timeout: Seconds | None = None
    current_version: int | None = None
    max_staleness: int | None = None
    # the fields of a StalenessPolicy: head = version_start, tail and token = version_end
    measure: Measure = "head"
    on_stale: OnStale = "keep"


class GetByKeys(_Msg, frozen=True, tag="get_by_keys"):
    """Metadata of rows named by ``keys`` or, when ``keys`` is empty, by ``row_ids``; with
    ``missing_ok`` rows that do not exist are left out instead of refused."""

    partition: str
    keys: Names
    fields: Names | None = None
    row_ids: Ids = []
    missing_ok: bool = False


class ListKeys(_Msg, frozen=True, tag="list_keys"):
    partition: str


class UpsertRows(_Msg, frozen=True, tag="upsert_rows"):
    """Merge ``tags`` into the rows of ``keys`` (or, when ``keys`` is empty, of ``row_ids``); with
    ``create``, keys not in the partition become new rows without fields (the partition is
    created if needed)."""

    partition: str
    keys: Names
    tags: RowTags | None = None
    create: bool = True
    row_ids: Ids = []


class ListRows(_Msg, frozen=True, tag="list_rows"):
    """Every committed row of ``partition`` (None: of every partition): a scan."""

    partition: str | None = None
    fields: Names = []
    task: str | None = None


class ResetConsumption(_Msg, frozen=True, tag="reset_consumption"):
    """Every row ``task`` (None: every task) leased or acked is available to it again."""

    partition: str
    task: str | None = None


class Ack(_Msg, frozen=True, tag="ack"):
    partition: str
    task: str
    lease_id: Id
    row_ids: Ids
    tokens_masked: Tokens = 0  # generated tokens of these rows outside a token-measure window
    # the meta came from a checkpoint: rows of its ended lease still available are consumed
    resumed: bool = False


class Release(_Msg, frozen=True, tag="release"):
    partition: str
    task: str
    lease_id: Id
    row_ids: Ids


class Consume(_Msg, frozen=True, tag="consume"):
    """Acks and releases of one client sent together (coalesced): each is carried out as if it
    came alone, in order, and answered alone (``Results``)."""

    items: list[Ack | Release]


class ClearSamples(_Msg, frozen=True, tag="clear_samples"):
    partition: str
    row_ids: Ids


class ClearPartition(_Msg, frozen=True, tag="clear_partition"):
    partition: str


class GetStats(_Msg, frozen=True, tag="get_stats"):
    partition: str | None = None


# --- storage requests ---
class Store(_Msg, frozen=True, tag="store"):
    partition: str
    chunk: Id
    row_ids: Ids  # the chunk's rows; [] when they are the run first_row .. + n_rows - 1
    columns: list[ColumnRef]
    shared: list[Region] = []  # frames 1..n are in shared memory instead of attached
    reused: str = ""  # the spare segment the client claimed (renamed) for this chunk
    # fields the rows hold already are staged: they replace the old values at the Publish the
    # controller sends once the write committed (a put_fields that may overwrite)
    overwrite: bool = False
    local: bool = False  # the writer is on the unit's host (counted in UnitStats.local_bytes)
    first_row: Id = 0
    n_rows: Rows = 0
    # the incarnation of the partition the rows belong to (PutPlan.generation): a unit refuses a
    # write of an older one than it holds, and drops what it holds of an older one at a newer's
    generation: Id = 0

    def rows(self) -> Sequence[int]:
        return self.row_ids or range(self.first_row, self.first_row + self.n_rows)


class Fetch(_Msg, frozen=True, tag="fetch"):
    partition: str
    row_ids: Ids
    fields: Names
    shared: bool = False  # the client reads the unit's shared memory: answer with regions
    local: bool = False  # the reader is on the unit's host (counted in UnitStats.local_read_bytes)
    # the client's receive segments tqs-<token>-r<n> nobody holds: gathered rows go into one
    into: list[Spare] = []
    # BatchMeta.generation of the metadata read: rows written under another are not served
    generation: Id = 0


class PutRows(_Msg, frozen=True, tag="put_rows"):
    """A small put in one exchange: the client sends rows and their metadata to a storage unit,
    which holds the columns, has the controller prepare and commit the put at once
    (``PutStored``) and answers with the committed rows' metadata."""

    put: PreparePut
    columns: list[ColumnRef]
    # frames 1..n are in the client's segment tqs-<token>-d<n> (a unit on the same host): the unit
    # takes the segment over by renaming it, and it becomes the chunk's memory
    shared: list[Region] = []
    reused: str = ""  # the spare segment the client claimed (renamed) for it
    local: bool = False  # the writer is on the unit's host (counted in UnitStats.local_bytes)


class PutStored(_Msg, frozen=True, tag="put_stored"):
    """From a storage unit: the columns of ``puts`` are held by unit ``unit``; place each put's
    rows there and commit them (each waiting for room under the unit's quota like any put). A unit
    sends the puts that reached it together in one message."""

    unit: Annotated[int, msgspec.Meta(ge=0)]
    puts: list[PreparePut]


class DropRows(_Msg, frozen=True, tag="drop_rows"):
    partition: str
    row_ids: Ids


class DropChunks(_Msg, frozen=True, tag="drop_chunks"):
    chunks: Ids


class DropPartition(_Msg, frozen=True, tag="drop_partition"):
    partition: str
    before_chunk: Id = 0  # only chunks with smaller ids (the cleared incarnation); 0: all


class ResetUnit(_Msg, frozen=True, tag="reset_unit"):
    """The controller gave this unit's rows up (it was lost): drop every chunk older than
    ``before_chunk``, in every partition (chunks of puts placed since its revival are younger)."""

    before_chunk: Id


class GetUnitStats(_Msg, frozen=True, tag="get_unit_stats"):
    pass


class GetInventory(_Msg, frozen=True, tag="get_inventory"):
    """From a restarted controller: which rows this storage unit holds (it frees the rows that no
    row of its journal names)."""


class HeldRows(msgspec.Struct, frozen=True):
    """The rows a storage unit holds of one partition: all of ``generation``, as runs
    ``[start0, stop0, start1, stop1, ...]`` of row ids (each ``start .. stop - 1``)."""

    partition: str
    generation: Id
    runs: Ids

    @classmethod
    def of(cls, partition: str, generation: int, ids: Any) -> HeldRows:
        """From row ids ascending (a numpy array)."""
        import numpy as np

        if not len(ids):
            return cls(partition, generation, [])
        cut = np.flatnonzero(np.diff(ids) != 1) + 1
        starts, stops = ids[np.r_[0, cut]], ids[np.r_[cut - 1, len(ids) - 1]] + 1
        return cls(partition, generation, np.column_stack([starts, stops]).ravel().tolist())

    def count(self) -> int:
        """How many rows the runs hold."""
        return sum(self.runs[1::2]) - sum(self.runs[::2])

    def row_ids(self) -> Any:
        """The row ids, ascending (a numpy array)."""
        import numpy as np

        runs = np.asarray(self.runs, dtype=np.int64).reshape(-1, 2)
        lengths = runs[:, 1] - runs[:, 0]
        # row k of the whole is start + (k - rows before its run), for the run holding it
        base = runs[:, 0] - (np.cumsum(lengths) - lengths)
        return np.repeat(base, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


class Publish(_Msg, frozen=True, tag="publish"):
    """To a storage unit: the writes of ``chunks`` committed; their overwritten values (held
    apart until now, see ``Store.overwrite``) replace the old ones."""

    chunks: Ids


# --- admission (producer flow control) ---
class CreateAdmission(_Msg, frozen=True, tag="create_admission"):
    name: str
    style: AdmissionStyle
    config: dict[str, int]


class Acquire(_Msg, frozen=True, tag="acquire"):
    """Ask for up to ``n`` slots; waits (parked) until at least one is granted unless ``wait`` is
    false; ``force`` grants one regardless of capacity (AReaL's on_rollout_submitted)."""

    name: str
    n: Rows = 1
    version: int = 0
    wait: bool = True
    timeout: Seconds | None = None
    force: bool = False


class ReleaseSlots(_Msg, frozen=True, tag="release_slots"):
    name: str
    slot_ids: Ids
    outcome: SlotOutcome = "accepted"


class AdmissionVersion(_Msg, frozen=True, tag="admission_version"):
    """The trainer published ``version`` (``recovered``: restarted from a checkpoint at it)."""

    name: str
    version: int
    recovered: bool = False
    reset: bool = False  # verl's reset_staleness: reopen the version window unconditionally


class AdmissionInfo(_Msg, frozen=True, tag="admission_info"):
    name: str
    version: int | None = None
    enqueued: Count = 0


class BudgetReport(_Msg, frozen=True, tag="budget_report"):
    """Member ``member`` (a key its client chose) of budget ``name`` reports its share of the
    limits and its own counts (AReaL's ``RolloutStat``), whole and numbered ``seq``: a report that
    arrives after a newer one changes no count. The first report joins; ``leave`` leaves. With
    ``version``, the reply carries the budget's capacity at that version."""

    name: str
    member: Id
    seq: Id
    max_concurrent: Signed
    consumer_batch_size: Signed
    max_staleness: Signed
    enqueued: Signed = 0
    running: Signed = 0
    accepted: Signed = 0
    rejected: Signed = 0
    unmatched: Id = 0  # callbacks with nothing to match (see controller/budget.py)
    version: Id | None = None
    leave: bool = False


# --- checkpoints ---
class SaveCheckpoint(_Msg, frozen=True, tag="save_checkpoint"):
    """Write a consistent snapshot of the buffer to directory ``path`` (absolute, on the
    filesystem the controller and every storage unit see)."""

    path: str
    metadata: bytes = b""  # the caller's JSON object, kept as given and returned by the load
    timeout: Seconds | None = None  # for the storage units' writes; None: as long as they take


class LoadCheckpoint(_Msg, frozen=True, tag="load_checkpoint"):
    """Restore the checkpoint at ``path`` into a cluster that holds no rows."""

    path: str
    timeout: Seconds | None = None


class SaveUnit(_Msg, frozen=True, tag="save_unit"):
    """To a storage unit: write the fields of ``rows`` (partition -> row ids) under ``directory``,
    from its chunks with ids below ``before_chunk`` except ``skip_chunks`` (puts in flight at the
    snapshot), as they are when this order arrives."""

    directory: str
    rows: dict[str, Ids]
    before_chunk: Id
    skip_chunks: Ids = []


class LoadUnit(_Msg, frozen=True, tag="load_unit"):
    """To a storage unit: hold the chunks of ``files`` (written by ``SaveUnit``s), each under its
    saved id plus ``chunk_base`` (ids of this cluster's, never issued before)."""

    files: Names
    chunk_base: Id = 0
    generation: Id = 0  # of the partitions loaded: the load's own incarnation id (chunk_base)


Request = (
    Hello
    | RegisterUnit
    | UnitStopping
    | CreatePartition
    | PreparePut
    | PrepareFields
    | CommitPut
    | AbortPut
    | GetMeta
    | GetByKeys
    | ListKeys
    | UpsertRows
    | ListRows
    | ResetConsumption
    | Ack
    | Release
    | Consume
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
    | ResetUnit
    | GetUnitStats
    | GetInventory
    | Publish
    | CountRejected
    | CreateAdmission
    | Acquire
    | ReleaseSlots
    | AdmissionVersion
    | AdmissionInfo
    | BudgetReport
    | SaveCheckpoint
    | LoadCheckpoint
    | SaveUnit
    | LoadUnit
)


# --- replies ---
class Ok(_Msg, frozen=True, tag="ok"):
    count: int = 0
    spare: list[Spare] = []  # a storage unit's answer to a shared Store: segments to reuse


class Registered(_Msg, frozen=True, tag="registered"):
    unit: int


class PutPlan(_Msg, frozen=True, tag="put_plan"):
    """A put's placement: its rows are ``first_row .. first_row + n_rows - 1``; ``segments``."""

    put_id: int
    first_row: int
    n_rows: int
    segments: list[PlanSegment]
    generation: int = 0  # the partition's incarnation: every Store of the put carries it

    def rows(self) -> range:
        return range(self.first_row, self.first_row + self.n_rows)


class PackedMeta(msgspec.Struct, frozen=True, array_like=True):
    """A put's metadata as it travels when its rows are plain (consecutive ids, generated keys,
    no group, no tags, one version range), in O(units) bytes rather than O(rows): the controller
    builds no key per row and encodes no per-row lists, a relaying storage unit reads the ids as
    one range, and the client expands it (:meth:`expand`) into the ``BatchMeta`` a put returns."""

    partition: str
    first: int  # the row ids are first .. first + n - 1
    n: int
    key_prefix: str  # each row's key: key_prefix + its row id
    units: list[int]  # runs: unit, count, unit, count, ...
    replicas: list[int]  # runs like units; [] when no row has a second copy
    version_start: int | None
    version_end: int | None
    dispatch_version: int | None
    fields: list[str]
    schemas: dict[str, FieldSchema]
    generation: int = 0  # BatchMeta.generation

    def row_ids(self) -> range:
        return range(self.first, self.first + self.n)

    def expand(self) -> BatchMeta:
        ids = list(self.row_ids())
        prefix, n = self.key_prefix, self.n
        return BatchMeta(
            partition=self.partition,
            row_ids=ids,
            keys=[f"{prefix}{rid}" for rid in ids],
            units=_unrun(self.units),
            groups=[None] * n,
            version_start=[self.version_start] * n,
            version_end=[self.version_end] * n,
            fields=self.fields,
            schemas=self.schemas,
            dispatch_version=[self.dispatch_version] * n,
            replicas=_unrun(self.replicas),
            generation=self.generation,
        )


def _unrun(runs: list[int]) -> list[int]:
    out: list[int] = []
    for i in range(0, len(runs), 2):
        out += [runs[i]] * runs[i + 1]
    return out


class StoredReply(_Msg, frozen=True, tag="stored"):
    """One put of a ``PutStored``, committed: its rows (``meta``, or ``packed`` when they are
    plain), and the chunk id and generation under which the unit indexes them."""

    chunk: int
    meta: BatchMeta | None = None
    packed: PackedMeta | None = None
    generation: int = 0  # the rows' (meta.generation), read by a unit that does not decode meta

    @classmethod
    def of(cls, rid: int, chunk: int, meta: BatchMeta | PackedMeta) -> StoredReply:
        if isinstance(meta, PackedMeta):
            return cls(rid=rid, chunk=chunk, packed=meta, generation=meta.generation)
        return cls(rid=rid, chunk=chunk, meta=meta, generation=meta.generation)


class ErrorReply(_Msg, frozen=True, tag="error"):
    """A failure; the client raises ``tqstream.errors.error_class(code)(message, **details)``."""

    code: str
    message: str
    details: dict[str, Any] = {}


class StoredResults(_Msg, frozen=True, tag="stored_results"):
    """The controller's answer to ``PutStored``: one result per put, in order."""

    results: list[StoredReply | ErrorReply]


class Results(_Msg, frozen=True, tag="results"):
    """The controller's answer to ``Consume``: one result per item, in order."""

    results: list[Ok | ErrorReply]


class FieldsPlan(_Msg, frozen=True, tag="fields_plan"):
    """``put_fields`` placement: the rows of ``segments[i]`` are ``positions[i]`` of the batch;
    ``row_ids``: the batch's rows, for a write that named them by key."""

    put_id: int
    segments: list[PlanSegment]
    positions: list[list[int]]
    row_ids: list[int] = []
    generation: int = 0  # as PutPlan.generation


class MetaReply(_Msg, frozen=True, tag="meta"):
    """Rows' metadata: ``meta``, or for a put of plain rows ``packed`` (read :meth:`batch`)."""

    meta: BatchMeta | None = None
    spare: list[Spare] = []  # a storage unit's answer to a shared PutRows: segments to reuse
    packed: PackedMeta | None = None

    @classmethod
    def of(cls, rid: int, meta: BatchMeta | PackedMeta) -> MetaReply:
        if isinstance(meta, PackedMeta):
            return cls(rid=rid, packed=meta)
        return cls(rid=rid, meta=meta)

    def batch(self) -> BatchMeta:
        if self.meta is not None:
            return self.meta
        if self.packed is None:
            from tqstream.errors import InternalError

            raise InternalError(
                "a MetaReply carried neither meta nor packed rows' metadata: the peer that sent "
                "it speaks another version of the protocol"
            )
        return self.packed.expand()


class KeysReply(_Msg, frozen=True, tag="keys"):
    keys: list[str]


class RowsReply(_Msg, frozen=True, tag="rows"):
    rows: dict[str, RowListing]


class StatsReply(_Msg, frozen=True, tag="stats"):
    stats: Stats


class Columns(_Msg, frozen=True, tag="columns"):
    columns: list[ColumnRef]
    shared: dict[int, Region] = {}  # frame index -> region; that frame is sent empty


class UnitStatsReply(_Msg, frozen=True, tag="unit_stats"):
    stats: UnitStats


class InventoryReply(_Msg, frozen=True, tag="inventory"):
    partitions: list[HeldRows]


class Slots(_Msg, frozen=True, tag="slots"):
    slot_ids: list[int]


class AdmissionReply(_Msg, frozen=True, tag="admission"):
    state: dict[str, int | float | str]
    capacity: int | None = None


class SavedFile(msgspec.Struct, frozen=True):
    """A file a storage unit wrote for a ``SaveUnit``: the chunks of some rows of one partition."""

    name: str  # relative to the unit's directory
    partition: str
    row_ids: list[int]
    nbytes: int


class UnitSaved(_Msg, frozen=True, tag="unit_saved"):
    files: list[SavedFile]


class CheckpointReply(_Msg, frozen=True, tag="checkpoint"):
    summary: CheckpointSummary


Reply = (
    Ok
    | ErrorReply
    | Welcome
    | Registered
    | PutPlan
    | StoredReply
    | StoredResults
    | Results
    | FieldsPlan
    | MetaReply
    | KeysReply
    | RowsReply
    | StatsReply
    | Columns
    | UnitStatsReply
    | InventoryReply
    | Slots
    | AdmissionReply
    | UnitSaved
    | CheckpointReply
)


NIL = b"\xc0"
"""msgpack's nil: a ``Raw`` field the sender left out."""


class StoredRelay(_Msg, frozen=True, tag="stored"):
    """A ``StoredReply`` as the storage unit that relays it decodes it: the rows' metadata stays
    the encoded bytes the controller sent (the unit passes them on to the client in its
    ``MetaReply`` without decoding or encoding 10⁶ keys); ``row_ids`` reads just the rows."""

    chunk: int
    meta: msgspec.Raw = msgspec.Raw(NIL)
    packed: msgspec.Raw = msgspec.Raw(NIL)
    generation: int = 0

    def row_ids(self) -> Sequence[int]:
        if bytes(self.packed) != NIL:
            ids = _packed_ids_decoder.decode(self.packed)
            return range(ids.first, ids.first + ids.n)
        return _row_ids_decoder.decode(self.meta).row_ids


class StoredRelays(_Msg, frozen=True, tag="stored_results"):
    results: list[StoredRelay | ErrorReply]


class _RowIds(msgspec.Struct):
    row_ids: list[int]


class _PackedIds(msgspec.Struct, array_like=True):
    """The leading fields of a :class:`PackedMeta` (the others are skipped)."""

    partition: str
    first: int
    n: int


UnitReply = (
    Ok
    | ErrorReply
    | Welcome
    | Registered
    | StoredRelay
    | StoredRelays
    | Results
    | StatsReply
    | Slots
    | AdmissionReply
    | CheckpointReply
)
"""What a storage unit reads from its controller (``StoredRelays`` for ``StoredResults``)."""

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_unit_reply_decoder = msgspec.msgpack.Decoder(UnitReply)
_row_ids_decoder = msgspec.msgpack.Decoder(_RowIds)
_packed_ids_decoder = msgspec.msgpack.Decoder(_PackedIds)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes | memoryview) -> Any:
    """Decode frame 0 of a request; raises ``msgspec.DecodeError`` / ``ValidationError``."""
    return _request_decoder.decode(data)


def check_request(data: bytes, op: str) -> None:
    """What a server will check of an encoded request, checked before it is sent: a number out of
    its bounds (a NaN or infinite timeout, a negative count, a put of more than ``MAX_PUT_ROWS``
    rows...) is an :class:`~tqstream.errors.InvalidRequestError` naming the field."""
    try:
        _request_decoder.decode(data)
    except msgspec.ValidationError as exc:
        from tqstream.errors import InvalidRequestError

        raise InvalidRequestError(
            f"{op} request refused before sending: {exc} (timeouts and ttls are finite, at most "
            f"{MAX_SECONDS:g} seconds; sizes and ids non-negative; at most {MAX_PUT_ROWS} rows "
            f"per put or batch and {MAX_LIST} entries per list)",
            op=op,
        ) from None


def decode_reply(data: bytes | memoryview) -> Any:
    return _reply_decoder.decode(data)


def decode_unit_reply(data: bytes | memoryview) -> Any:
    """A reply from the controller to a storage unit (see :class:`StoredRelay`)."""
    return _unit_reply_decoder.decode(data)
