"""A controller state rebuilt from a snapshot (:mod:`.snapshot`). Pure: no I/O.

:func:`prepare` checks a snapshot read back from disk and builds its state without changing
anything (a checkpoint that is not self-consistent raises ``CheckpointCorruptError``), before the
storage units load a byte; :func:`install` puts it in place in one step once they did. Row ids,
keys and the id counter (leases, puts, chunks) continue after the saved ones, so nothing issued
later can collide with a restored name; views are rebuilt lazily by the first get that needs
them. A restored partition is a new incarnation (``Partition.born``, its rows' generation at the
storage units): the load's id, never issued before in this cluster, so that metadata of an
earlier incarnation of its name here (cleared, or restored before) reads none of its rows, whose
ids it may reuse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tqstream.controller.admission import Admission, make_admission
from tqstream.controller.flow import AdmissionRecord
from tqstream.controller.partition import Partition
from tqstream.controller.records import Effects
from tqstream.controller.rows import COMMITTED, VERSION_MAX, VERSION_MIN, Row
from tqstream.controller.shapes import Shapes
from tqstream.controller.snapshot import (
    AdmissionEntry,
    ControllerSnapshot,
    FileEntry,
    PartitionEntry,
    TtlEntry,
    _mask_in,
)
from tqstream.controller.state import ControllerState
from tqstream.errors import AdmissionError, CheckpointCorruptError, CheckpointError

__all__ = [
    "Prepared",
    "assign_files",
    "install",
    "placement",
    "prepare",
    "replaceable",
    "reserve_ids",
    "restore",
]


Placement = list[tuple[int, int]]
"""Per file of a snapshot, the storage unit that loads it and the one that loads its second copy
(-1: none)."""


def assign_files(
    files: Sequence[FileEntry], saved_units: int, alive: Sequence[bool], copies: Sequence[int]
) -> Placement:
    """Where each file is loaded. With as many units as were saved, all alive, the file of unit
    i goes to unit i (each unit reads what it wrote: its own disk will do). Otherwise the files
    are spread over the live units by bytes: largest first, each to the unit holding the fewest
    bytes so far. A file holds every chunk of its rows, so a row's fields stay on one unit. A file
    of a partition keeping two copies (``copies``) is loaded a second time on the live unit with
    the fewest bytes but that one, when there is one."""
    live = [u for u, ok in enumerate(alive) if ok]
    if not live and files:
        raise CheckpointError("no live storage unit to load the checkpoint's rows into")
    same = len(alive) == saved_units and all(
        0 <= f.unit < len(alive) and alive[f.unit] for f in files
    )
    load = dict.fromkeys(live, 0)
    out = [(-1, -1)] * len(files)
    for i in sorted(range(len(files)), key=lambda i: -files[i].nbytes):
        n = files[i].nbytes
        unit = files[i].unit if same else min(live, key=lambda u: (load[u], u))
        load[unit] += n
        replica = -1
        others = [u for u in live if u != unit]
        if copies[i] > 1 and others:
            replica = min(others, key=lambda u: (load[u], u))
            load[replica] += n
        out[i] = (unit, replica)
    return out


def placement(state: ControllerState, snap: ControllerSnapshot) -> Placement:
    """:func:`assign_files` for ``state``'s units and each partition's copies."""
    copies = {e.name: e.replicas or state.replicas for e in snap.partitions}
    per_file = [copies.get(f.partition, 1) for f in snap.files]
    return assign_files(snap.files, snap.units, state.units.alive, per_file)


def reserve_ids(state: ControllerState, next_id: int) -> None:
    """Move the id counter past every id of a checkpoint before anything of it is loaded."""
    state.ids.skip_to(next_id)


class Prepared:
    """A checked snapshot, its partitions and admissions built, ready for :func:`install`."""

    def __init__(
        self,
        snap: ControllerSnapshot,
        partitions: list[tuple[Partition, list[TtlEntry]]],
        admissions: list[Admission],
        losses: dict[int, int],
    ) -> None:
        self.snap, self.partitions, self.admissions = snap, partitions, admissions
        self.losses = losses  # unit -> how often it was lost, for the units the rows go to


Replaceable = Mapping[str, tuple[Partition, int]]
"""Partitions of a checkpoint's names that were empty when its load began, with their next row
id then: a load replaces them if nobody put to them since."""


def check_admissions(state: ControllerState, snap: ControllerSnapshot, where: str) -> None:
    """Refuse a load whose admissions exist here with granted slots (``where``: the error's
    opening, e.g. the path)."""
    for entry in snap.admissions:
        existing = state.admissions.get(entry.name)
        if existing is not None and existing.admission.state()["granted"]:
            raise CheckpointError(
                f"{where}admission {entry.name!r} of the checkpoint exists in this cluster and "
                f"has granted slots; load the checkpoint before producers acquire any",
                name=entry.name,
            )


def replaceable(
    state: ControllerState, snap: ControllerSnapshot
) -> dict[str, tuple[Partition, int]]:
    """The partitions of ``snap``'s names that ``state`` holds now (call when the load begins and
    the cluster holds no rows)."""
    names = [e.name for e in snap.partitions]
    return {
        n: (state.partitions[n], state.partitions[n].next_row)
        for n in names
        if n in state.partitions
    }


def prepare(state: ControllerState, snap: ControllerSnapshot, where: Placement) -> Prepared:
    """Check ``snap`` (its files loaded where ``where`` says) and build its state, changing
    nothing: a snapshot that is not self-consistent raises ``CheckpointCorruptError``."""
    unit_of: dict[tuple[str, int], tuple[int, int]] = {}
    n = len(state.units)
    for f, (unit, replica) in zip(snap.files, where, strict=True):
        if not 0 <= unit < n or not -1 <= replica < n:
            raise _corrupt(f"file {f.name!r} belongs to storage unit {unit} of {n}")
        for rid in f.row_ids:
            if (f.partition, rid) in unit_of:
                raise _corrupt(f"row {rid} of partition {f.partition!r} is in two files")
            unit_of[f.partition, rid] = (unit, replica)
    live = state.units.live()
    bare = (live[0] if live else -1, -1)  # the unit of rows without fields (nothing to load)
    built = [_build(entry, unit_of, bare) for entry in snap.partitions]
    used = {u for pair in where for u in pair if u >= 0}
    losses = {u: state.units.losses[u] for u in used}
    return Prepared(snap, built, [_admission(entry) for entry in snap.admissions], losses)


def install(
    state: ControllerState,
    ready: Prepared,
    now: float,
    empty: Replaceable,
    born: int | None = None,
) -> Effects:
    """Install a prepared snapshot in one step. A partition of the checkpoint's names must not
    exist, or be one of ``empty`` that nobody has put to since: it is then replaced (cleared: the
    returned effects fail its waiting gets). An admission of the same name must not have granted
    slots. Otherwise ``CheckpointError``, and ``state`` is unchanged. ``born``: the restored
    partitions' incarnation id, the one their rows were loaded under (an id of ``state``'s the
    load took; None: the next one)."""
    clash = []
    for p, _ in ready.partitions:
        now_p, was = state.partitions.get(p.name), empty.get(p.name)
        if now_p is not None and (was is None or was != (now_p, now_p.next_row) or now_p.rows):
            clash.append(p.name)
    if clash:
        raise CheckpointError(
            f"partition(s) {', '.join(map(repr, clash))} of the checkpoint were put to while it "
            f"was loading; nothing of the checkpoint was kept: clear them and load again",
            partitions=clash,
        )
    gone = [
        u for u, n in ready.losses.items() if not state.units.alive[u] or state.units.losses[u] != n
    ]
    if gone:
        raise CheckpointError(
            f"storage unit(s) {gone} were lost while the checkpoint loaded; nothing of it was "
            f"kept: load it again",
            units=gone,
        )
    check_admissions(state, ready.snap, "")
    effects = Effects()
    born = next(state.ids) if born is None else born
    for p, ttls in ready.partitions:
        p.born = born
        if p.name in state.partitions:  # empty since before the load: nothing of it on the units
            replaced = state.clear_partition(p.name)
            replaced.drop_partitions.clear()  # which would drop the chunks just loaded
            effects.extend(replaced)
        state.catalog.install(p)
        for t in ttls:
            state.schedule(now + t.left, "ttl", (p, list(t.rows)))
    for entry, adm in zip(ready.snap.admissions, ready.admissions, strict=True):
        state.flow.install(entry.name, AdmissionRecord(adm, entry.style, dict(entry.config)))
    state.catalog.reserve_rows(ready.snap.next_rows)
    reserve_ids(state, ready.snap.next_id)
    return effects


def restore(state: ControllerState, snap: ControllerSnapshot, now: float) -> Effects:
    """:func:`prepare` and :func:`install` at once, the files placed by :func:`placement`,
    replacing the empty partitions of ``state`` of the checkpoint's names."""
    ready = prepare(state, snap, placement(state, snap))
    return install(state, ready, now, replaceable(state, snap))


def _corrupt(problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"the checkpoint's controller state is inconsistent: {problem}")


def _build(
    e: PartitionEntry, unit_of: dict[tuple[str, int], tuple[int, int]], bare: tuple[int, int]
) -> tuple[Partition, list[TtlEntry]]:
    t = e.rows
    n = len(t.ids)
    columns = (t.keys, t.groups, t.nbytes, t.version_start, t.version_end, t.dispatch_version,
               t.written, t.ready_seq, t.writes)  # fmt: skip
    if any(len(c) != n for c in columns) or (t.tags and len(t.tags) != n):
        raise _corrupt(f"partition {e.name!r} has row lists of different lengths")
    if len(set(e.fields)) != len(e.fields):
        raise _corrupt(f"partition {e.name!r} lists a field twice")
    p = Partition(e.name, e.key_prefix)
    p.declare(e.fields)
    full = (1 << len(e.fields)) - 1
    p.schemas = dict(e.schemas)
    if not all(0 <= rid < e.next_row for rid in t.ids) or len(set(t.ids)) < n:
        raise _corrupt(f"partition {e.name!r} has a row id twice or out of its range")
    p.next_row = min(t.ids, default=e.next_row)
    rows = p.rows
    rows.extend_to(e.next_row)  # holes, filled row by row below
    for i, rid in enumerate(t.ids):
        where = unit_of.get((e.name, rid))
        if where is None and not _mask_in(t.written[i]) and bare[0] >= 0:
            where = bare
        if where is None:
            raise _corrupt(f"row {rid} of partition {e.name!r} is in no storage unit's file")
        if p.row_of_key(t.keys[i]) is not None:
            raise _corrupt(f"row {rid} (key {t.keys[i]!r}) of partition {e.name!r} repeats")
        r = Row(rows, rid)
        j = rid - rows.base
        r.unit, r.replica, r.nbytes = where[0], where[1], t.nbytes[i]
        for v, what in ((t.version_start[i], "version_start"), (t.version_end[i], "version_end"),
                        (t.dispatch_version[i], "dispatch_version")):  # fmt: skip
            if v is not None and not VERSION_MIN <= v <= VERSION_MAX:
                raise _corrupt(f"row {rid} of partition {e.name!r} has a {what} out of range")
        r.version_start, r.version_end = t.version_start[i], t.version_end[i]
        r.dispatch_version = t.dispatch_version[i]
        written = rows.written[j] = _mask_in(t.written[i])
        writes = [(_mask_in(m), s) for m, s in t.writes[i]]
        if written & ~full or any(m & ~full for m, _ in writes):
            raise _corrupt(f"row {rid} of partition {e.name!r} names fields it does not have")
        if t.tags:
            r.merge_tags(t.tags[i])
        rows.state[j], rows.seq[j] = COMMITTED, t.ready_seq[i]
        rows.live += 1
        one = [(written, t.ready_seq[i])] if written else []
        if writes != one:  # see Rows.writes
            rows.writes[rid] = writes
        p.name_row(rid, t.keys[i])
        p.count_written(written, 1)
    p.committed = n
    for g in e.groups:
        if not 0 < len(g.members) <= g.size or not all(m in p.rows for m in g.members):
            raise _corrupt(f"group {g.name!r} of partition {e.name!r} has unknown members")
        group = p.groups[g.name] = p.new_group(g.name, g.size, frozenset(g.fields))
        group.members = list(g.members)
    for i, rid in enumerate(t.ids):
        name = t.groups[i]
        if name is not None:
            if name not in p.groups or rid not in p.groups[name].members:
                raise _corrupt(f"partition {e.name!r} has a row of a group it does not list")
            rows.group[rid - rows.base] = p.groups[name].number
    for te in e.tasks:
        if not all(rid in p.rows for rid in te.acked):
            raise _corrupt(f"task {te.name!r} of partition {e.name!r} acked unknown rows")
        task = p.tasks.task(te.name)
        task.set_acked(te.acked)
        task.stale_dropped, task.lag = te.stale_dropped, dict(te.lag)
        task.lost, task.consumed, task.tokens_masked = te.lost, te.consumed, te.tokens_masked
    if not all(rid in p.rows for ttl in e.ttl_left for rid in ttl.rows):
        raise _corrupt(f"partition {e.name!r} has a ttl for unknown rows")
    p.seq = e.seq  # born: the load's, at install
    p.registered, p.ttl, p.admission = list(e.registered), e.ttl, e.admission
    p.produced, p.rejected, p.stale_dropped = e.produced, e.rejected, e.stale_dropped
    p.expired, p.freed, p.producers, p.closes = e.expired, e.freed, e.producers, e.closes
    p.lost, p.replicas = e.lost, e.replicas
    if any(len(s.rows) != len(s.ids) for s in e.shapes.values() if s.rows is not None):
        raise _corrupt(f"partition {e.name!r} has a field's row shapes of another length")
    p.shapes = Shapes.load(e.shapes)
    return p, list(e.ttl_left)


def _admission(entry: AdmissionEntry) -> Admission:
    try:
        adm = make_admission(entry.style, **entry.config)
        adm.restore(entry.counters, entry.live)
    except AdmissionError as exc:
        raise _corrupt(f"admission {entry.name!r}: {exc}") from None
    return adm
