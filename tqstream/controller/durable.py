"""What makes the controller durable: its journal of requests and events, the replay that
rebuilds its state from it, and the table of answers that makes a retried request take effect
once.

The state (:class:`~tqstream.controller.state.ControllerState`) is deterministic: what it becomes
depends only on the calls made to it and their arguments, time included (``now`` is an
argument). So the journal records the calls, not their effects: each request that may change the
state (its frame 0 as it came, the time it was handled, the session and the ``rid`` it came with)
and each event that changes it outside a request (a timer that fired, a peer or a storage unit
that went away or came back, a unit that registered). A restarted controller feeds them to a new
state in the same order, through the same code (:meth:`Durable.replay`), and reaches the state
its clients were told about. Parked requests come back parked, under a :class:`Stub` that keeps
their answer until their client asks again; leases keep their deadlines (the clock is the wall
clock, so a deadline means the same in every process of a controller).

A snapshot (the whole state, pickled, with every handle of a request as a reference to its session
and ``rid``) stands for every record before it: one is written every ``snapshot_records`` records
and after a checkpoint is loaded, so a restart replays at most that many; and sooner once the
requests since the last one took ``REPLAY_SECONDS`` to handle (a replay costs what handling them
did) — unless the snapshot itself, which holds the loop while it pickles the state, would then take
more than a tenth of the controller's time. It is the one place tqstream uses pickle: a file the
controller wrote in its own journal directory, never anything from the wire, and read back by an
unpickler that builds only tqstream's own classes and plain containers (anything else is refused as
a damaged snapshot).

Answers. Every request a client sends carries an ``rid`` unique in its process, and every client
names its session in its connections' routing ids, so ``(session, rid)`` names a request across
connections and restarts. The controller keeps the answers of journaled requests (:class:`Answers`,
the latest ``ANSWERS`` of them): a request sent again, because the connection dropped before its
answer came, gets the answer it had, or, if it is still being handled (parked), the one it will
get. A put sent twice is stored once; a get sent twice leases one batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copyreg
import importlib
import io
import os
import pickle
import secrets
import time
from typing import Any

import msgspec

from tqstream.controller.journal import Journal, JournalConfig, Replay
from tqstream.errors import JournalClusterError, JournalCorruptError
from tqstream.protocol.messages import (
    GetByKeys,
    GetStats,
    ListKeys,
    ListRows,
    LoadCheckpoint,
    RegisterUnit,
    SaveCheckpoint,
    UnitStopping,
    decode_reply,
    decode_request,
    encode,
)
from tqstream.protocol.server import Responder
from tqstream.protocol.transport import error_reply

__all__ = ["ANSWERS", "Answers", "Durable", "Later", "Stub", "Tracked", "cluster_of", "journaled"]

REQUEST, EXPIRE, PEER_GONE, UNIT_DOWN, UNIT_UP, UNIT_ADD = range(1, 7)
"""Record kinds."""

ANSWERS = 65536
"""Answers kept for requests sent again (the oldest go first)."""

SNAPSHOT_FORMAT = 1

UNJOURNALED = (GetStats, ListKeys, ListRows, GetByKeys, SaveCheckpoint, LoadCheckpoint,
               RegisterUnit, UnitStopping)  # fmt: skip
"""Requests that change nothing a restart must know (a load is followed by a snapshot instead;
a registration is journaled as the event that adds the unit)."""

_CLUSTER_FILE = "cluster"


def cluster_of(directory: str) -> str:
    """The identity of the cluster whose journal ``directory`` holds, made on its first start."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, _CLUSTER_FILE)
    try:
        with open(path) as f:
            cluster = f.read().strip()
    except FileNotFoundError:
        cluster = secrets.token_hex(8)
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        with open(tmp, "w") as f:
            f.write(cluster + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return cluster
    if not cluster:
        raise JournalCorruptError(
            f"{path} is empty: it names the cluster whose journal {directory} holds; restore it "
            f"or start the controller on a fresh directory",
            path=path,
        )
    return cluster


class Stub:
    """The handle of a request replayed from the journal (or restored from a snapshot): it keeps
    its answer until the request's client sends it again (:meth:`bind`), and passes it on then."""

    __slots__ = ("answered", "answers", "key", "op", "peer", "reply_msg", "rid", "target")

    def __init__(self, peer: Any, rid: int, op: str, answers: Answers | None = None) -> None:
        self.peer, self.rid, self.op = peer, rid, op
        self.key = (peer, rid)
        self.answers = answers
        self.answered = False
        self.reply_msg: Any = None
        self.target: Any = None

    def reply(self, msg: Any, buffers: Any = ()) -> None:
        self.answered = True
        self.reply_msg = msg
        if self.answers is not None:
            self.answers.done(self.key, msg)  # a snapshot keeps the answer, not the stub
        if self.target is not None:
            self.target.reply(msg)

    def fail(self, exc: BaseException) -> None:
        self.reply(error_reply(exc, f"the controller failed on {self.op} (request {self.rid})"))

    def bind(self, responder: Any) -> None:
        """The client asked again: answer it (now, if the answer is in)."""
        if self.answered:
            responder.reply(self.reply_msg)
        else:
            self.target = responder


class Tracked:
    """A live request's handle: answers its responder and keeps the answer (:class:`Answers`)."""

    __slots__ = ("answers", "key", "op", "peer", "responder", "rid")

    def __init__(self, responder: Any, answers: Answers) -> None:
        self.responder, self.answers = responder, answers
        self.peer, self.rid, self.op = responder.peer, responder.rid, responder.op
        self.key = (self.peer, self.rid)

    @property
    def answered(self) -> bool:
        return bool(self.responder.answered)

    def reply(self, msg: Any, buffers: Any = ()) -> None:
        self.answers.done(self.key, msg)
        self.responder.reply(msg, buffers)

    def fail(self, exc: BaseException) -> None:
        where = f"the controller failed on {self.op} (request {self.rid})"
        self.reply(error_reply(exc, where, self.rid))


class Answers:
    """The answers of the latest journaled requests, by ``(session, rid)``: a finished one's
    reply, encoded (compact, and a snapshot copies its bytes instead of pickling ~65,536 structs:
    a 1.3 s pause when full), or the handle of one still being handled."""

    def __init__(self, limit: int = ANSWERS) -> None:
        self.limit = limit
        self.table: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        # the replies of requests whose state change is done, sent once the storage units
        # carried out its orders: a restart answers them (its reconciliation frees the bytes)
        self.promised: dict[Any, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        """A snapshot keeps the finished answers, and a request still being handled as None: the
        state holds its handle (a parked request), or it has a promised reply, or a restart
        forgets it (sent again, it runs again: it changed nothing the snapshot holds)."""
        table = collections.OrderedDict(
            (k, None if isinstance(v, Stub | Tracked) else v) for k, v in self.table.items()
        )
        return {"limit": self.limit, "table": table, "promised": dict(self.promised)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.limit, self.table = state["limit"], state["table"]
        self.promised = state.get("promised", {})

    def resolve(self, stubs: dict[Any, Stub]) -> None:
        """After a restore: each request that was being handled gets its handle back from the
        state (``stubs``), or its promised reply, or is forgotten."""
        for key in [k for k, v in self.table.items() if v is None]:
            stub = stubs.get(key)
            if stub is not None:
                self.table[key] = stub
            elif key in self.promised:
                self.table[key] = self.promised.pop(key)
            else:
                del self.table[key]
        self.promised.clear()

    def promise(self, key: Any, msg: Any) -> None:
        """``msg`` is the reply of the request ``key`` once its orders are carried out."""
        if key in self.table:
            self.promised[key] = encode(msg)

    def seen(self, key: Any, responder: Any) -> bool:
        """Whether the request ``key`` was handled already (or is being handled): then it is
        answered through ``responder`` as it was (or will be)."""
        entry = self.table.get(key)
        if entry is None:
            return False
        if isinstance(entry, Stub):
            entry.bind(responder)
        elif isinstance(entry, Tracked):
            pass  # still being handled: its answer goes to the same session and rid
        else:  # the reply, encoded (a struct in a snapshot written before they were)
            responder.reply(decode_reply(entry) if isinstance(entry, bytes) else entry)
        return True

    def start(self, key: Any, handle: Any) -> None:
        self.table[key] = handle
        if len(self.table) > self.limit:
            self.table.popitem(last=False)

    def done(self, key: Any, msg: Any) -> None:
        self.promised.pop(key, None)
        if key in self.table:
            self.table[key] = encode(msg)

    def forget(self, key: Any) -> None:
        """The request failed before it changed anything: a retry runs it again."""
        self.promised.pop(key, None)
        self.table.pop(key, None)


def _stub(peer: Any, rid: int, op: str) -> Stub:
    """What a request handle is pickled as (the unpickler keeps one per request)."""
    return Stub(peer, rid, op)


def _as_stub(handle: Any) -> tuple[Any, tuple[Any, int, str]]:
    return _stub, (handle.peer, handle.rid, handle.op)


_HANDLES = {Stub: _as_stub, Tracked: _as_stub, Responder: _as_stub}


def _pickler(buf: io.BytesIO) -> pickle.Pickler:
    """A pickler of the state that writes each request handle as its (session, rid, op). Through
    a dispatch table, which only the handles' types look up: a ``persistent_id`` would be a
    Python call for each of the state's millions of objects (~0.4 µs each: a 1 s pause at 10⁶
    rows)."""
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, **_HANDLES}  # type: ignore[misc]
    return pickler


_SAFE = {
    "builtins": {"bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                 "object", "range", "set", "slice", "str", "tuple"},
    "array": {"_array_reconstructor", "array"},
    "collections": {"OrderedDict", "defaultdict", "deque"},
    "itertools": {"count"},
    "copyreg": {"_reconstructor"},
    "numpy": {"dtype", "ndarray"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.numeric": {"_frombuffer"},
    "numpy._core.numeric": {"_frombuffer"},
}  # fmt: skip
"""What a snapshot may name besides tqstream's own classes: containers and numpy arrays."""


class _Unpickler(pickle.Unpickler):
    """Reads a snapshot, and refuses one that names anything but tqstream's classes and the
    containers of :data:`_SAFE`: loading it builds data, never runs a function of its choice."""

    def __init__(self, file: Any, directory: str) -> None:
        super().__init__(file)
        self.stubs: dict[Any, Stub] = {}
        self.directory = directory

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, "_stub"):
            return self._stub
        found = None
        if name in _SAFE.get(module, ()) or module.startswith("tqstream."):
            with contextlib.suppress(Exception):
                found = getattr(importlib.import_module(module), name)
        if found is not None and (module in _SAFE or isinstance(found, type)):
            return found
        raise JournalCorruptError(
            f"the snapshot in {self.directory} names {module}.{name}, which a tqstream snapshot "
            f"never holds: it is damaged or was not written by tqstream; move it away (the "
            f"cluster's state goes with it) or restore the directory from a backup",
            directory=self.directory,
        )

    def _stub(self, peer: Any, rid: int, op: str) -> Stub:
        key = (peer, rid)
        stub = self.stubs.get(key)
        if stub is None:
            stub = self.stubs[key] = Stub(peer, rid, op)
        return stub

    def persistent_load(self, pid: Any) -> Any:  # the handles of a snapshot of before 2026-12
        _, peer, rid, op = pid
        return self._stub(peer, rid, op)


REPLAY_SECONDS = 1.0
"""Handling time of the journaled requests after which a snapshot is due (see above)."""


class Durable:
    """The journal of one controller service, and its answers table."""

    def __init__(
        self,
        directory: str,
        durability: str,
        fsync_interval: float,
        snapshot_records: int,
    ) -> None:
        self.directory = os.path.abspath(directory)
        self.cluster = cluster_of(self.directory)
        config = JournalConfig(durability, fsync_interval)  # type: ignore[arg-type]
        self.journal, replay = Journal.open(self.directory, self.cluster, config)
        self._replay: Replay | None = replay
        self.snapshot_records = snapshot_records
        self.answers = Answers()
        # the sessions a journaled request came from, until they are gone: a restart waits for
        # them to reconnect (recovery.reconnect_grace)
        self.peers: set[Any] = set()
        self.replaying = False
        self._since_snapshot = 0
        self._work = 0.0  # seconds spent handling the requests since the last snapshot
        self.pause = 0.0  # what the last snapshot held the loop for (its pickling)
        self._enc = msgspec.msgpack.Encoder()

    @property
    def to_replay(self) -> Replay | None:
        """What a start must replay (None once done)."""
        return self._replay

    # --- recording ---
    def request(self, now: float, peer: Any, rid: int, header: Any) -> None:
        self.peers.add(peer)
        self._append(REQUEST, [now, peer, rid, bytes(header)])

    def event(self, kind: int, *args: Any) -> None:
        self._append(kind, list(args))

    def _append(self, kind: int, record: list[Any]) -> None:
        if self.replaying:
            return
        self.journal.append(kind, self._enc.encode(record))
        self._since_snapshot += 1

    def worked(self, seconds: float) -> None:
        """A journaled request took ``seconds`` to handle: a restart would take about as long."""
        self._work += seconds

    def due(self) -> bool:
        """Whether a snapshot is due (and none is being written): ``snapshot_records`` records
        since the last, or ``REPLAY_SECONDS`` of their handling (at least 10 snapshot pauses)."""
        if self.journal.rebasing:
            return False
        return self._since_snapshot >= self.snapshot_records or self._work >= max(
            REPLAY_SECONDS, 10.0 * self.pause
        )

    def snapshot(self, payload: dict[str, Any]) -> Any:
        """Start writing a snapshot of ``payload`` (the state and what goes with it): the task
        of its rebase (True once it landed)."""
        started = time.perf_counter()
        buf = io.BytesIO()
        pickler = _pickler(buf)
        pickler.dump({"format": SNAPSHOT_FORMAT, "cluster": self.cluster, **payload,
                      "answers": self.answers, "peers": self.peers})  # fmt: skip
        self._since_snapshot, self._work = 0, 0.0
        self.pause = time.perf_counter() - started
        return self.journal.rebase(buf.getvalue())

    # --- replaying ---
    def restored(self) -> dict[str, Any] | None:
        """The newest snapshot's payload, None without one."""
        assert self._replay is not None
        data = self._replay.snapshot
        if data is None:
            return None
        unpickler = _Unpickler(io.BytesIO(data), self.directory)
        payload: dict[str, Any] = unpickler.load()
        if payload.get("format") != SNAPSHOT_FORMAT or payload.get("cluster") != self.cluster:
            raise JournalClusterError(
                f"the snapshot in {self.directory} is of format {payload.get('format')!r} for "
                f"cluster {payload.get('cluster')!r}; this controller reads format "
                f"{SNAPSHOT_FORMAT} of cluster {self.cluster!r}",
                directory=self.directory,
            )
        self.answers = payload["answers"]
        self.peers = set(payload.get("peers", ()))
        for stub in unpickler.stubs.values():  # requests in flight at the snapshot
            stub.answers = self.answers
        self.answers.resolve(unpickler.stubs)
        return payload

    def records(self) -> Any:
        """The records after the snapshot, decoded: (kind, values)."""
        assert self._replay is not None
        dec = msgspec.msgpack.Decoder()
        for kind, payload in self._replay:
            yield kind, dec.decode(payload)
        self._replay = None

    @staticmethod
    def decode(header: bytes) -> Any:
        return decode_request(header)

    def stub(self, peer: Any, rid: int, op: str) -> Stub:
        """The handle of a replayed request, answers kept under its key."""
        stub = Stub(peer, rid, op, self.answers)
        self.peers.add(peer)
        self.answers.start(stub.key, stub)
        return stub

    def close(self) -> None:
        self.journal.close()


def journaled(msg: Any) -> bool:
    """Whether a request is recorded (it may change the state)."""
    return not isinstance(msg, UNJOURNALED)


class Later:
    """A reply known now, sent once the storage units carried out ``tasks`` (their failures
    propagate): a journal keeps it promised (a restart answers it)."""

    __slots__ = ("reply", "tasks")

    def __init__(self, tasks: list[asyncio.Task[Any]], reply: Any) -> None:
        self.tasks, self.reply = tasks, reply

    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> Any:
        await asyncio.gather(*self.tasks)
        return self.reply
