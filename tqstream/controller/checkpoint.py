"""Checkpoints at the controller: save the buffer to a directory, load it back into a cluster.

Save. In one loop step the controller takes its snapshot (``snapshot.take``) and sends every
storage unit holding rows a ``SaveUnit`` naming exactly the snapshot's rows on it; orders on a
unit's connection arrive in order, so each unit captures those rows before any later drop (see
``storage/checkpoint.py``). Puts keep flowing meanwhile; what they add is not in the checkpoint.
Everything is written under ``<path>.tmp-<token>``: a subdirectory per unit (``unit-<k>``), then
the controller's state (``controller.msgpack``) and ``manifest.json``, each file fsynced. Only
when every unit answered does the directory replace ``path`` (an older checkpoint there is moved
aside, then removed), so a failed or interrupted save leaves the older checkpoint, never half of
a new one. The reply comes after all of that.

Load. Into a cluster that holds no rows: the controller reads and checks the state, moves its id
counter past the checkpoint's, has each live unit load its files (``restore.assign_files``; the
rows of a partition keeping two copies go to two units) and, once all did, installs the state in
one step, replacing the empty partitions of the same names (declared by a client at start-up,
say) unless someone put to them meanwhile. If anything fails (a unit is lost meanwhile, too) the
units drop what they loaded: no row of the checkpoint is kept, and the cluster is as it was. One
checkpoint (save or load) runs at a time.

The path is on the filesystem of the controller and of every storage unit: with units on several
hosts, a filesystem they all share (each unit writes and reads its own subdirectory; loading onto
as many units as saved, each unit only reads its own).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
import zlib
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

import msgspec

from tqstream.controller import restore, snapshot
from tqstream.controller.records import Effects
from tqstream.controller.snapshot import ControllerSnapshot, FileEntry, Taken
from tqstream.controller.state import ControllerState
from tqstream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    InvalidRequestError,
    TQStreamError,
)
from tqstream.protocol.disk import fsync_dir, in_thread, write_durably
from tqstream.protocol.messages import (
    CheckpointReply,
    DropPartition,
    LoadCheckpoint,
    LoadUnit,
    SaveCheckpoint,
    SaveUnit,
    UnitSaved,
)
from tqstream.types import CheckpointSummary

__all__ = ["Checkpoints"]

KIND = "tqstream-checkpoint"
FORMAT = 1
"""Version of the directory layout and manifest; another version is refused, not guessed at."""
MANIFEST = "manifest.json"
STATE = "controller.msgpack"


class Unit(Protocol):
    """A storage unit, as a checkpoint asks it (``links.UnitLink``)."""

    def request(
        self, req: msgspec.Struct, timeout: float | None
    ) -> Awaitable[tuple[Any, list[Any]]]: ...


class Service(Protocol):
    """What of the controller service a checkpoint uses."""

    state: ControllerState

    @property
    def links(self) -> Sequence[Unit]: ...

    def _apply(self, effects: Effects) -> list[asyncio.Task[Any]]: ...
    def _rearm(self) -> None: ...
    def _clock(self) -> float: ...
    async def _loaded(self, key: Any = None, reply: Any = None) -> None: ...


class Manifest(msgspec.Struct, frozen=True):
    kind: str
    format: int
    created: float  # seconds since the epoch
    units: int
    partitions: list[str]
    rows: int
    nbytes: int
    state: str  # the controller state's file
    state_bytes: int
    state_crc32: int
    metadata: dict[str, Any] = {}


class Checkpoints:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.running: str | None = None  # "save" or "load" while one runs

    def _begin(self, what: str, path: str) -> str:
        if self.running is not None:
            raise CheckpointError(
                f"a checkpoint {self.running} is under way on this controller; {what} "
                f"{path!r} once it is over (checkpoints run one at a time)",
            )
        if not path or not os.path.isabs(path):
            raise InvalidRequestError(
                f"a checkpoint path must be absolute (the client resolves it), got {path!r}"
            )
        self.running = what
        return os.path.normpath(path)

    # --- save ---
    def save(self, msg: SaveCheckpoint) -> Awaitable[CheckpointReply]:
        """Take the snapshot and order the units now (this step); finish in the returned
        coroutine."""
        path = self._begin("save", msg.path)
        try:
            metadata = _metadata(msg.metadata)
            _check_target(path)
            s = self.service.state
            taken = snapshot.take(s, self.service._clock())
            tmp = f"{path}.tmp-{secrets.token_hex(4)}"
            jobs = {
                unit: asyncio.ensure_future(self._save_unit(unit, tmp, taken, msg.timeout))
                for unit in sorted(taken.rows)
            }
        except BaseException:
            self.running = None
            raise
        return self._finish_save(msg.rid, path, tmp, taken, jobs, metadata)

    async def _save_unit(self, unit: int, tmp: str, taken: Taken, timeout: float | None) -> Any:
        order = SaveUnit(
            rid=0,
            directory=os.path.join(tmp, f"unit-{unit}"),
            rows=taken.rows[unit],
            before_chunk=taken.before_chunk,
            skip_chunks=taken.skip_chunks.get(unit, []),
        )
        reply, _ = await self.service.links[unit].request(order, timeout)
        return reply

    async def _finish_save(
        self,
        rid: int,
        path: str,
        tmp: str,
        taken: Taken,
        jobs: dict[int, asyncio.Task[Any]],
        metadata: dict[str, Any],
    ) -> CheckpointReply:
        try:
            results = await asyncio.gather(*jobs.values(), return_exceptions=True)
            files: list[FileEntry] = []
            for unit, result in zip(jobs, results, strict=True):
                if isinstance(result, BaseException) or not isinstance(result, UnitSaved):
                    raise self._unit_failed(unit, "save its rows", result, path)
                files += [
                    FileEntry(unit, f"unit-{unit}/{f.name}", f.partition, f.row_ids, f.nbytes)
                    for f in result.files
                ]
            snap = msgspec.structs.replace(taken.snapshot, files=files)
            summary = CheckpointSummary(
                path=path,
                partitions=len(snap.partitions),
                rows=sum(len(p.rows.ids) for p in snap.partitions),
                nbytes=sum(f.nbytes for f in files),
                units=len(jobs),
                metadata=metadata,
            )
            await in_thread("tqstream-checkpoint-save", _install, tmp, path, snap, summary)
        except BaseException:
            await asyncio.shield(in_thread("tqstream-checkpoint-clean", _remove, tmp))
            raise
        finally:
            self.running = None
        return CheckpointReply(rid=rid, summary=summary)

    def _unit_failed(self, unit: int, what: str, exc: Any, path: str) -> CheckpointError:
        """The error of a unit's part, of the unit's checkpoint error class when it raised one
        (a missing or damaged file), naming the unit."""
        addresses = self.service.state.units.addresses
        address = addresses[unit] if unit < len(addresses) else "?"
        done = (
            f"no checkpoint was written at {path} (an older one there is kept)"
            if what.startswith("save")
            else "nothing of the checkpoint was kept"
        )
        cls = type(exc) if isinstance(exc, CheckpointError) else CheckpointError
        why = exc.message if isinstance(exc, TQStreamError) else f"{type(exc).__name__}: {exc}"
        return cls(
            f"storage unit {unit} ({address}) could not {what}: {why}; {done}",
            unit=unit,
            path=path,
        )

    # --- load ---
    def load(self, msg: LoadCheckpoint, key: Any = None) -> Awaitable[CheckpointReply]:
        """``key``: the request's (session, rid), under which a journal keeps its reply."""
        path = self._begin("load", msg.path)
        return self._load(msg, path, key)

    async def _load(self, msg: LoadCheckpoint, path: str, key: Any) -> CheckpointReply:
        s = self.service.state
        try:
            manifest, snap = await in_thread("tqstream-checkpoint-read", _read, path)
            empty = self._check_room(snap, path)
            if snap.files and not s.units.live():
                raise CheckpointError(
                    f"no storage unit is alive to load the checkpoint at {path} into; start the "
                    f"storage units first"
                )
            where = restore.placement(s, snap)
            ready = restore.prepare(s, snap, where)  # a damaged state: before any loading
            # The saved chunks take ids of this cluster's, never issued before (so no tombstone or
            # reset of a unit refuses them): saved id + base, all below the fence; every later
            # put's are above it. The restored partitions are incarnation base: their rows are
            # loaded under that generation, which no metadata issued here before carries.
            base = next(s.ids)
            restore.reserve_ids(s, base + snap.next_id)
            fence = next(s.ids)
            orders: dict[int, list[str]] = {}
            for f, pair in zip(snap.files, where, strict=True):
                for unit in pair:
                    if unit >= 0:
                        orders.setdefault(unit, []).append(os.path.join(path, f.name))
            jobs = {
                unit: asyncio.ensure_future(
                    self.service.links[unit].request(
                        LoadUnit(rid=0, files=files, chunk_base=base, generation=base), msg.timeout
                    )
                )
                for unit, files in sorted(orders.items())
            }
            try:
                results = await asyncio.gather(*jobs.values(), return_exceptions=True)
                for unit, result in zip(jobs, results, strict=True):
                    if isinstance(result, BaseException):
                        raise self._unit_failed(unit, f"load its files of {path}", result, path)
                # one step, with the check above
                effects = restore.install(s, ready, self.service._clock(), empty, base)
            except BaseException:
                await asyncio.shield(self._unload(snap, fence))
                # the ids it took are taken: a snapshot says so to a journal's replay
                await asyncio.shield(self.service._loaded())
                raise
            self.service._apply(effects)  # gets waiting on a replaced empty partition fail
            self.service._rearm()  # the restored ttls
            summary = CheckpointSummary(
                path=path,
                partitions=len(snap.partitions),
                rows=manifest.rows,
                nbytes=manifest.nbytes,
                units=len({u for pair in where for u in pair if u >= 0}),
                metadata=manifest.metadata,
            )
            reply = CheckpointReply(rid=msg.rid, summary=summary)
            # a restart must not replay the load (a snapshot), and answers it sent again
            await self.service._loaded(key, reply)
        finally:
            self.running = None
        return reply

    def _check_room(self, snap: ControllerSnapshot, path: str) -> restore.Replaceable:
        """Refuse a cluster that holds rows, or an admission of the checkpoint's that granted
        slots; returns the empty partitions the checkpoint will replace."""
        s = self.service.state
        full = {name: len(p.rows) for name, p in s.partitions.items() if p.rows}
        if full or s.puts:
            shown = ", ".join(f"{name!r} ({n} rows)" for name, n in sorted(full.items())[:5])
            raise CheckpointError(
                f"cannot load the checkpoint at {path}: this cluster holds rows "
                f"({shown or 'puts in flight'}); load into a fresh cluster, or clear its "
                f"partitions first",
                partitions=sorted(full),
            )
        restore.check_admissions(s, snap, f"cannot load the checkpoint at {path}: ")
        return restore.replaceable(s, snap)

    async def _unload(self, snap: ControllerSnapshot, fence: int) -> None:
        """Have every unit drop what it loaded of the checkpoint (chunk ids below ``fence``); a
        unit that cannot take the order is gone, and its memory with it (the load's own error is
        the one reported)."""
        orders = [
            link.request(DropPartition(rid=0, partition=p.name, before_chunk=fence), 60.0)
            for p in snap.partitions
            for link in self.service.links
        ]
        await asyncio.gather(*orders, return_exceptions=True)


def _metadata(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"checkpoint metadata is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"checkpoint metadata must be a JSON object, got {type(value).__name__}"
        )
    return value


def _check_target(path: str) -> None:
    """A save may replace a checkpoint (or an empty directory), never anything else."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and (
        not os.listdir(path) or os.path.isfile(os.path.join(path, MANIFEST))
    ):
        return
    raise CheckpointError(
        f"cannot save a checkpoint to {path}: it exists and is not a tqstream checkpoint (no "
        f"{MANIFEST}); choose another path or remove it",
        path=path,
    )


# --- files (on a thread) ---
def _install(tmp: str, path: str, snap: ControllerSnapshot, summary: CheckpointSummary) -> None:
    os.makedirs(tmp, exist_ok=True)
    state = msgspec.msgpack.encode(snap)
    write_durably(os.path.join(tmp, STATE), [state])
    manifest = Manifest(
        kind=KIND,
        format=FORMAT,
        created=time.time(),
        units=snap.units,
        partitions=[p.name for p in snap.partitions],
        rows=summary.rows,
        nbytes=summary.nbytes,
        state=STATE,
        state_bytes=len(state),
        state_crc32=zlib.crc32(state),
        metadata=summary.metadata,
    )
    write_durably(os.path.join(tmp, MANIFEST), [msgspec.json.format(msgspec.json.encode(manifest))])
    fsync_dir(tmp)
    parent = os.path.dirname(path)
    old = f"{path}.old-{secrets.token_hex(4)}"
    if os.path.lexists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(parent)
    _remove(old)


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _read(path: str) -> tuple[Manifest, ControllerSnapshot]:
    if not os.path.isdir(path):
        _recover(path)
    where = f"the checkpoint at {path}"
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        what = f"it has no {MANIFEST}" if os.path.isdir(path) else "no such directory"
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: {what}; pass the directory save_checkpoint wrote",
            path=path,
        ) from None
    try:
        manifest = msgspec.json.decode(raw, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointCorruptError(
            f"{where} has an unreadable {MANIFEST} ({exc})", path=path
        ) from None
    if manifest.kind != KIND:
        raise CheckpointCorruptError(f"{path} holds no tqstream checkpoint", path=path)
    if manifest.format != FORMAT:
        raise CheckpointVersionError(
            f"{where} has format {manifest.format}; this tqstream reads format {FORMAT}: load it "
            f"with the tqstream version that saved it",
            path=path,
            format=manifest.format,
        )
    try:
        with open(os.path.join(path, manifest.state), "rb") as f:
            state = f.read()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} lacks its {manifest.state}", path=path) from None
    if len(state) != manifest.state_bytes or zlib.crc32(state) != manifest.state_crc32:
        raise CheckpointCorruptError(
            f"{where} is damaged: {manifest.state} has {len(state)} bytes (CRC-32 "
            f"{zlib.crc32(state)}), its manifest says {manifest.state_bytes} bytes (CRC-32 "
            f"{manifest.state_crc32})",
            path=path,
        )
    try:
        snap = msgspec.msgpack.decode(state, type=ControllerSnapshot)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointCorruptError(
            f"{where} has an unreadable {manifest.state} ({exc})", path=path
        ) from None
    if snap.format != snapshot.FORMAT:
        raise CheckpointVersionError(
            f"{where} has controller state format {snap.format}; this tqstream reads "
            f"{snapshot.FORMAT}",
            path=path,
        )
    return manifest, snap


def _recover(path: str) -> None:
    """A save interrupted between moving the old checkpoint aside and moving the new one in
    leaves ``<path>.old-<token>``: put it back."""
    parent, base = os.path.split(path)
    try:
        olds = [n for n in os.listdir(parent or ".") if n.startswith(f"{base}.old-")]
    except OSError:
        return
    for name in olds:
        old = os.path.join(parent, name)
        if os.path.isfile(os.path.join(old, MANIFEST)):
            os.rename(old, path)
            return
