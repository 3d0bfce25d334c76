"""Weight sync to receivers that come and go: a rollout worker joins by address at any time, a dead
one is dropped at the next sync, and the trainer goes on with the others.

::

    trainer: WeightHub (hosts the rendezvous store)        rollout worker m
      send(weights, v):                                      WeightSubscription: registers -> m
        admit new members: a 2-rank group each                 next() -> v   (waits, any length)
        announce "w{m}/sync/{k}" = v to each member            member_receiver(m).receive()
        control, table, header (to members that lack it),        -> (v, weights)
        ranges: each packed once, broadcast on every group
        a member whose group fails is dropped (SyncStats.lost)

Every member has a group of its own (rank 0: the hub, rank 1: the member), so one member's death
fails only its own broadcasts: the others take the sync as if nothing happened. The announcement
lets a member wait for the next sync as long as a training step takes — its group's timeout only
bounds the sync itself — and lets a process other than the receiving one do the waiting (vLLM's
engine receives inside its worker process while the rollout process pauses and resumes it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from tqstream.errors import WeightSyncError
from tqstream.reference.weightsync.collective import (
    TorchCollective,
    backend_device,
    connect_store,
)
from tqstream.reference.weightsync.layout import WeightMeta
from tqstream.reference.weightsync.sync import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DIRECT_BYTES,
    SyncStats,
    WeightReceiver,
    _Packer,
)

__all__ = ["WeightHub", "WeightSubscription", "member_receiver"]

MEMBERS = "tqstream/members"


def _member_prefix(member: int) -> str:
    return f"tqstream/w{member}/"


@dataclasses.dataclass
class _Member:
    id: int
    group: TorchCollective
    known: int | None = None  # fingerprint of the metadata this member holds
    syncs: int = 0  # announced so far


class WeightHub:
    """The trainer's side. Receivers register with :class:`WeightSubscription` at ``host``/``port``
    (``port`` 0: a free one, read :attr:`port`); each :meth:`send` reaches every member registered
    by then. ``timeout``: seconds a member may take to assemble its group or to take a sync before
    it is dropped."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        direct_bytes: int = DEFAULT_DIRECT_BYTES,
    ) -> None:
        self.host, self.backend, self.timeout = host, backend, timeout
        self._device = device
        self._packer = _Packer(bucket_bytes, direct_bytes, backend_device(backend, device))
        self.store = connect_store(host, port, timeout, host_it=True)
        self.port: int = self.store.port
        self.store.add(MEMBERS, 0)
        self._members: dict[int, _Member] = {}
        self._registered = 0
        self.lost: dict[int, str] = {}  # member -> why it was dropped

    @property
    def registered(self) -> int:
        """Members that ever registered (live or dropped)."""
        return int(self.store.add(MEMBERS, 0))

    @property
    def members(self) -> list[int]:
        """Members a sync reaches (registered, not dropped)."""
        self._admit()
        return sorted(self._members)

    def wait_members(self, n: int, timeout: float | None = None) -> None:
        """Block until ``n`` members registered (rollout workers starting up)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while self.registered < n:
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{self.registered} of {n} weight receivers registered at "
                    f"{self.host}:{self.port} within {timeout or self.timeout}s"
                )
            time.sleep(0.05)

    def _admit(self) -> None:
        registered = self.registered
        for m in range(self._registered, registered):
            store = dist.PrefixStore(_member_prefix(m), self.store)
            group = TorchCollective(0, 2, backend=self.backend, device=self._device,
                                    timeout=self.timeout, store=store)  # fmt: skip
            self._members[m] = _Member(m, group)
        self._registered = registered

    def _drop(self, member: _Member, why: str) -> None:
        self._members.pop(member.id, None)
        self.lost[member.id] = f"member {member.id}: {why}"
        member.group.close()

    def send(self, weights: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Broadcast ``weights`` as ``version`` to every member; members that fail are dropped and
        named in the result's ``lost``. Blocks until every other member took every range."""
        t0 = time.perf_counter()
        self._admit()
        packer = self._packer
        meta = packer.update(weights)
        lacking = any(m.known != meta.fingerprint for m in self._members.values())
        header = meta.encode() if lacking else b""  # only members that lack it get it
        started: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
        lost: list[int] = []
        for m in list(self._members.values()):
            key = f"{_member_prefix(m.id)}sync/{m.syncs}"
            self.store.set(key, str(version))
            if m.syncs:  # the member finished the previous sync: its key is no longer read
                self.store.delete_key(f"{_member_prefix(m.id)}sync/{m.syncs - 1}")
            m.syncs += 1
            try:
                started[m.id] = packer.start_head(
                    m.group, version, header if m.known != meta.fingerprint else b""
                )
            except WeightSyncError as exc:
                self._drop(m, str(exc))
                lost.append(m.id)
        for part in packer.parts(weights):  # packed once, on every member's group
            for mid, (waits, held) in list(started.items()):
                try:
                    waits.append(self._members[mid].group.start_broadcast(part))
                    held.append(part)
                except WeightSyncError as exc:
                    self._drop(self._members[mid], str(exc))
                    del started[mid]
                    lost.append(mid)
        header_bytes = took = 0
        for mid, (waits, _held) in started.items():
            member = self._members[mid]
            try:
                for wait in waits:
                    wait()
            except WeightSyncError as exc:
                self._drop(member, str(exc))
                lost.append(mid)
                continue
            if member.known != meta.fingerprint:
                header_bytes = len(header)
            member.known = meta.fingerprint
            took += 1
        return SyncStats(version, meta.total, len(packer.plan), header_bytes,
                         time.perf_counter() - t0, receivers=took, lost=tuple(lost))  # fmt: skip

    def close(self) -> None:
        for m in list(self._members.values()):
            m.group.close()
        self._members.clear()
        self.store = None  # type: ignore[assignment]


class WeightSubscription:
    """A rollout worker's registration with a :class:`WeightHub`: :attr:`member` is its id, and
    :meth:`next` waits for the hub to announce the member's next sync."""

    def __init__(self, host: str, port: int, timeout: float = 300.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.store = connect_store(host, port, timeout)
        self.member: int = int(self.store.add(MEMBERS, 1)) - 1
        self._syncs = 0

    def next(self, stop: Any = None, poll: float = 0.005) -> int | None:
        """The version of the member's next sync, once the hub announced it (then receive it with
        :func:`member_receiver`'s receiver); ``None`` when ``stop`` (an event) is set first."""
        key = f"{_member_prefix(self.member)}sync/{self._syncs}"
        while True:
            try:
                if self.store.check([key]):
                    break
            except dist.DistError as exc:
                raise WeightSyncError(
                    f"the weight hub at {self.host}:{self.port} is gone (member {self.member}): "
                    f"{str(exc).splitlines()[0]}"
                ) from exc
            if stop is not None and stop.is_set():
                return None
            time.sleep(poll)
        self._syncs += 1
        return int(self.store.get(key))


def member_receiver(
    host: str,
    port: int,
    member: int,
    *,
    backend: str = "gloo",
    device: torch.device | str | None = None,
    timeout: float = 300.0,
    expected: WeightMeta | None = None,
) -> WeightReceiver:
    """The receiver of ``member`` (a :class:`WeightSubscription`'s id): its own group with the
    hub, assembled at the first receive. Runs in whichever process holds the model."""
    store = dist.PrefixStore(_member_prefix(member), connect_store(host, port, timeout))
    group = TorchCollective(1, 2, backend=backend, device=device, timeout=timeout, store=store)
    return WeightReceiver(group, expected)
