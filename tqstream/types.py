"""Public value types shared by the client, the controller and the storage units.

They are frozen ``msgspec.Struct`` s so the same objects travel on the wire unchanged: a
:class:`BatchMeta` returned by ``get_meta`` is exactly what the controller sent. The closed sets of
values a request carries are ``Literal`` types, defined here once for the messages, the client
and the controller.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Literal, cast, get_args

import msgspec

from tqstream.errors import AdmissionError

__all__ = [
    "AdmissionStyle",
    "BatchMeta",
    "CheckpointSummary",
    "FieldSchema",
    "Measure",
    "OnStale",
    "PartitionStats",
    "RowListing",
    "SlotOutcome",
    "Stats",
    "TagValue",
    "Tags",
    "TaskStats",
    "UnitStats",
]

FieldKind = Literal["dense", "ragged", "object"]
ObjectType = Literal["str", "bytes", "json"]

# --- closed sets a request carries: the server's decoder refuses any other value (a
# MalformedMessageError naming the field); the client checks them first, with its own message
Measure = Literal["head", "tail", "dispatch", "token"]
"""Which policy version a staleness window compares (see ``StalenessPolicy``)."""
OnStale = Literal["keep", "drop"]
"""What a read does with the stale rows it meets: leave them stored, or evict them for all tasks."""
AdmissionStyle = Literal["capacity", "per_version", "slots"]
"""How an admission limits producers (see ``Client.admission``)."""
SlotOutcome = Literal["accepted", "rejected", "dropped"]
"""How an admission slot ended: its sample stored, discarded, or stored then evicted unread."""


def check_style(style: object) -> AdmissionStyle:
    """``style`` if it names an admission style, else ``AdmissionError`` listing them."""
    styles = get_args(AdmissionStyle)
    if style not in styles:
        valid = ", ".join(repr(s) for s in styles)
        raise AdmissionError(f"unknown admission style {style!r}; valid styles: {valid}")
    return cast(AdmissionStyle, style)


def check_outcome(outcome: object) -> SlotOutcome:
    """``outcome`` if it is a slot outcome, else ``AdmissionError`` listing them."""
    if outcome not in get_args(SlotOutcome):
        raise AdmissionError(
            f"release outcome must be 'accepted', 'rejected' or 'dropped' (got {outcome!r})"
        )
    return cast(SlotOutcome, outcome)


Scalar = str | int | float | bool | None
TagValue = Scalar | list[Scalar]
"""A tag's value: a scalar, or a flat list of scalars."""
Tags = dict[str, TagValue]
"""A row's tags: small user bookkeeping kept by the controller with the row (e.g. ``status``,
``global_steps``), merged key by key when written again, listed without reading the row's data."""


class FieldSchema(msgspec.Struct, frozen=True):
    """The schema of a field, fixed by its first write.

    ``dense``: every row is a tensor of ``shape`` and ``dtype`` (a torch dtype name, ``"int64"``).
    ``ragged``: every row is a tensor ``[L_i, *shape]``; the first dimension varies per row.
    ``object``: every row is a Python value; ``dtype`` is ``"str"``, ``"bytes"`` or ``"json"``.
    """

    kind: FieldKind
    dtype: str
    shape: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.kind == "object":
            return f"object<{self.dtype}>"
        dims = ",".join(str(d) for d in self.shape)
        if self.kind == "ragged":
            dims = "*" + ("," + dims if dims else "")
        return f"{self.kind} {self.dtype}[{dims}]"


class RowShapes(msgspec.Struct, frozen=True, array_like=True):
    """The shapes of a tensor field's rows, as TransferQueue's metadata reports them: ``nested``
    False and ``shape`` the one shape all the rows have, or ``nested`` True and ``rows`` each
    row's shape, in the order of the rows described. A put made through the TransferQueue
    compatibility layer sends its record; the controller keeps one per field and partition (a
    field turns nested when rows of another shape arrive, and back when removals leave one
    shape) and returns it in :attr:`BatchMeta.shapes`."""

    nested: bool
    shape: tuple[int, ...] | None = None
    rows: list[tuple[int, ...]] | None = None

    def select(self, pick: Any) -> RowShapes:
        return self if self.rows is None else RowShapes(True, None, pick(self.rows))


class BatchMeta(msgspec.Struct, frozen=True):
    """Metadata of a batch of rows of one partition, in batch order.

    Returned by ``put`` (the rows it created), ``get_meta`` (rows leased to ``task`` under
    ``lease_id``) and ``get_by_keys`` (no lease). ``row_ids`` and ``units`` are the controller's
    handles for the rows (which storage unit holds each); ``keys`` are the user-visible identities.
    A lease is acknowledged with ``ack(meta)``; a sub-batch (``meta.select([...])``) acks only its
    rows.
    """

    partition: str
    row_ids: list[int]
    keys: list[str]
    units: list[int]
    groups: list[str | None]
    version_start: list[int | None]
    version_end: list[int | None]
    fields: list[str]
    schemas: dict[str, FieldSchema]
    task: str | None = None
    lease_id: int | None = None
    dispatch_version: list[int | None] = msgspec.field(default_factory=list)
    stale_dropped: int = 0  # rows this request evicted as stale (on_stale="drop")
    rejected: int = 0  # rows of this put refused (reject_mixed_versions)
    replicas: list[int] = []  # per row, the unit holding its second copy (-1: none); [] if none
    tags: list[Tags] = []  # per row, its tags; [] when no row of the batch has any
    tokens_masked: int = 0  # a token-measure read: generated tokens outside its window
    token_window: list[int] | None = None  # a token-measure read: [current_version, max_staleness]
    # per field put through the TransferQueue compatibility layer, its rows' shapes (RowShapes)
    shapes: dict[str, RowShapes] = {}
    # the incarnation of the partition the rows belong to (a clear or a restore makes a new one):
    # a storage unit serves the rows only to a read of the generation they were written with
    generation: int = 0

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def size(self) -> int:
        return len(self.row_ids)

    def select(self, indices: Sequence[int] | slice) -> BatchMeta:
        """A sub-batch (same lease) holding the rows at ``indices``."""
        if isinstance(indices, slice):  # a list slice each (coalesced puts' answers: per put)
            pick: Any = operator.itemgetter(indices)
            opt = pick
        else:
            idx = indices
            pick = lambda seq: [seq[i] for i in idx]  # noqa: E731
            opt = lambda seq: pick(seq) if seq else []  # noqa: E731 (lists empty when unused)
        return BatchMeta(
            partition=self.partition,
            row_ids=pick(self.row_ids),
            keys=pick(self.keys),
            units=pick(self.units),
            groups=pick(self.groups),
            version_start=pick(self.version_start),
            version_end=pick(self.version_end),
            fields=list(self.fields),
            schemas=dict(self.schemas),
            task=self.task,
            lease_id=self.lease_id,
            dispatch_version=opt(self.dispatch_version),
            replicas=opt(self.replicas),
            tags=opt(self.tags),
            shapes={f: s.select(pick) for f, s in self.shapes.items()},
            generation=self.generation,
        )


class RowListing(msgspec.Struct, frozen=True):
    """Every row of a partition (``list_rows``): ``meta`` holds them in put order (keys, tags,
    where they are stored, ``fields`` the fields asked about); per row, ``ready``: every asked field
    is written, and ``consumed``: the asked task has it leased or acked (all False without a
    task)."""

    meta: BatchMeta
    ready: list[bool]
    consumed: list[bool]


class TaskStats(msgspec.Struct, frozen=True):
    """Per consumer task: rows available to it (committed, not leased, not acked), leased, acked."""

    available: int
    leased: int
    acked: int
    stale_dropped: int = 0
    lag: dict[int, int] = {}  # version lag at consumption (ack) -> rows
    lost: int = 0  # rows lost with a storage unit before this task acked them
    consumed: int = 0  # rows acked, ever (``acked`` counts only those still held)
    tokens_masked: int = 0  # generated tokens of acked rows outside a token-measure window


class PartitionStats(msgspec.Struct, frozen=True):
    rows: int
    fields: dict[str, int]
    schemas: dict[str, FieldSchema]
    tasks: dict[str, TaskStats]
    pending_puts: int = 0
    parked_requests: int = 0
    produced: int = 0  # rows committed, ever
    rejected: int = 0  # rows refused at put (reject_mixed_versions)
    stale_dropped: int = 0  # rows evicted as stale
    expired: int = 0  # rows evicted by the partition's ttl
    freed: int = 0  # rows freed once every registered task acked them
    tasks_registered: list[str] = []
    producers_open: int = 1  # producers that have not closed it yet; 0: closed, no new rows
    lost: int = 0  # rows lost with a storage unit that held their only copy
    replicas: int = 1  # copies kept of each row


class UnitStats(msgspec.Struct, frozen=True):
    address: str
    bytes: int
    chunks: int
    rows: int
    alive: bool = True
    max_bytes: int = 0  # byte quota; 0: unlimited
    spare_bytes: int = 0  # recycled shared-memory segments kept for reuse (not in ``bytes``)
    # bytes stored since the unit started, from writers on its host (which reach its shared
    # memory) and from writers elsewhere (over the network)
    local_bytes: int = 0
    remote_bytes: int = 0
    local_read_bytes: int = 0  # bytes read since the unit started, by readers on its host
    remote_read_bytes: int = 0  # and by readers elsewhere


class Stats(msgspec.Struct, frozen=True):
    partitions: dict[str, PartitionStats]
    units: list[UnitStats]
    admissions: dict[str, dict[str, int | float | str]] = {}
    uptime: float = 0.0  # seconds since the controller started serving

    @property
    def storage_bytes(self) -> int:
        return sum(u.bytes for u in self.units)

    def __str__(self) -> str:
        """One line per partition, field, task, storage unit and admission (``print(stats)``)."""
        lines = []
        for name, p in self.partitions.items():
            lines.append(
                f"partition {name!r}: {p.rows} rows (produced {p.produced}, freed {p.freed}, "
                f"rejected {p.rejected}, stale-dropped {p.stale_dropped}, expired {p.expired}); "
                f"{p.pending_puts} pending puts, {p.parked_requests} parked gets"
                + ("; closed" if p.producers_open == 0 else "")
            )
            for field, written in p.fields.items():
                schema = p.schemas.get(field)
                kind = schema.describe() if schema is not None else "declared"
                lines.append(f"  field {field!r}: {kind}, written for {written} rows")
            for task, t in p.tasks.items():
                registered = " (registered)" if task in p.tasks_registered else ""
                lag = ", ".join(f"{k}: {n}" for k, n in sorted(t.lag.items())) or "-"
                lines.append(
                    f"  task {task!r}{registered}: available {t.available}, leased {t.leased}, "
                    f"acked {t.acked} (consumed {t.consumed} in all), stale-dropped "
                    f"{t.stale_dropped}; version lag -> rows {lag}"
                )
        for i, u in enumerate(self.units):
            quota = _size(u.max_bytes) if u.max_bytes else "unlimited"
            lost = "" if u.alive else " LOST"
            lines.append(
                f"storage unit {i} {u.address}{lost}: {_size(u.bytes)} in {u.chunks} chunks, "
                f"{u.rows} rows, quota {quota}, shared-memory spare {_size(u.spare_bytes)}"
            )
        for name, state in self.admissions.items():
            lines.append(f"admission {name!r}: " + ", ".join(f"{k}={v}" for k, v in state.items()))
        return "\n".join(lines) or "no partitions, no storage units"


class CheckpointSummary(msgspec.Struct, frozen=True):
    """What ``save_checkpoint`` wrote or ``load_checkpoint`` restored."""

    path: str
    partitions: int
    rows: int  # committed rows (rows leased at the save are in it, available)
    nbytes: int  # bytes of row data in the storage units' files
    units: int  # storage units that wrote (save) or hold (load) the data
    metadata: dict[str, Any] = {}  # the caller's JSON given to save_checkpoint

    def __str__(self) -> str:
        return (
            f"checkpoint {self.path}: {self.partitions} partitions, {self.rows} rows, "
            f"{_size(self.nbytes)} on {self.units} storage units"
        )


def _size(n: int) -> str:
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
