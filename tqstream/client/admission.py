"""Producer flow control as seen by a producer or trainer: one handle, three faces.

The state lives at the controller (``tqstream/controller/admission.py``), so it is global across
data-parallel ranks and producer processes and survives a client restart; a handle is only a name.
Blocking calls wait at the controller (parked, no polling) until a slot frees up.

- generic: ``acquire`` / ``try_acquire`` → slot ids, ``release(ids, outcome)``, ``on_version(v)``
- AReaL (capacity): ``get_capacity``, ``on_rollout_enqueued/submitted/accepted/rejected``,
  ``on_version_recovered``
- verl fully-async (slots): ``acquire_slot``, ``release_slot``, ``reset_staleness``
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from tqstream.client.core import ClientCore
from tqstream.errors import RequestTimeoutError
from tqstream.protocol.messages import (
    Acquire,
    AdmissionInfo,
    AdmissionReply,
    AdmissionVersion,
    Ok,
    ReleaseSlots,
    Slots,
)
from tqstream.types import check_outcome

State = dict[str, int | float | str]


class Caller(Protocol):
    """What a handle needs of its client (``tqstream.Client``): run a ``ClientCore`` call, blocking
    or awaited. A protocol, so this module does not import the client's (which imports it)."""

    def _sync(self, method: Callable[..., Any], *args: Any) -> Any: ...

    async def _async(self, method: Callable[..., Any], *args: Any) -> Any: ...


class AdmissionHandle:
    def __init__(self, client: Caller, name: str, style: str) -> None:
        self.client = client
        self.name = name
        self.style = style

    def __repr__(self) -> str:
        return f"AdmissionHandle(name={self.name!r}, style={self.style!r})"

    def _call(self, msg: Any, expect: type, timeout: float | None = -1.0) -> Any:
        return self.client._sync(ClientCore.call, msg, expect, timeout)

    async def _acall(self, msg: Any, expect: type, timeout: float | None = -1.0) -> Any:
        return await self.client._async(ClientCore.call, msg, expect, timeout)

    @staticmethod
    def _wait(timeout: float | None) -> float | None:
        return None if timeout is None else timeout + 10.0

    # --- generic ---
    def acquire(self, n: int = 1, *, version: int = 0, timeout: float | None = None) -> list[int]:
        """Wait until at least one slot is free; returns up to ``n`` slot ids (``timeout``:
        seconds, None forever; then RequestTimeoutError with the admission state)."""
        msg = Acquire(rid=0, name=self.name, n=n, version=version, timeout=timeout)
        return self._call(msg, Slots, self._wait(timeout)).slot_ids

    async def async_acquire(
        self, n: int = 1, *, version: int = 0, timeout: float | None = None
    ) -> list[int]:
        msg = Acquire(rid=0, name=self.name, n=n, version=version, timeout=timeout)
        return (await self._acall(msg, Slots, self._wait(timeout))).slot_ids

    def try_acquire(self, n: int = 1, *, version: int = 0) -> list[int]:
        """Up to ``n`` slot ids, possibly none; never waits."""
        return self._call(Acquire(rid=0, name=self.name, n=n, version=version, wait=False),
                          Slots).slot_ids  # fmt: skip

    async def async_try_acquire(self, n: int = 1, *, version: int = 0) -> list[int]:
        msg = Acquire(rid=0, name=self.name, n=n, version=version, wait=False)
        return (await self._acall(msg, Slots)).slot_ids

    def release(self, slot_ids: Iterable[int], outcome: str = "accepted") -> None:
        """The samples of these slots were put ("accepted") or discarded ("rejected").
        Releasing a slot twice is harmless: a slot never counts twice."""
        ids, ended = list(slot_ids), check_outcome(outcome)
        msg = ReleaseSlots(rid=0, name=self.name, slot_ids=ids, outcome=ended)
        self._call(msg, Ok)

    async def async_release(self, slot_ids: Iterable[int], outcome: str = "accepted") -> None:
        ids, ended = list(slot_ids), check_outcome(outcome)
        msg = ReleaseSlots(rid=0, name=self.name, slot_ids=ids, outcome=ended)
        await self._acall(msg, Ok)

    def on_version(self, version: int) -> None:
        """The trainer published ``version`` (after the weight sync)."""
        self._call(AdmissionVersion(rid=0, name=self.name, version=version), Ok)

    async def async_on_version(self, version: int) -> None:
        await self._acall(AdmissionVersion(rid=0, name=self.name, version=version), Ok)

    def on_version_recovered(self, version: int) -> None:
        """Restarted from a checkpoint at ``version``: counters restart consistently (no
        inflated capacity), slots issued before are void."""
        msg = AdmissionVersion(rid=0, name=self.name, version=version, recovered=True)
        self._call(msg, Ok)

    async def async_on_version_recovered(self, version: int) -> None:
        msg = AdmissionVersion(rid=0, name=self.name, version=version, recovered=True)
        await self._acall(msg, Ok)

    def state(self) -> State:
        return self._call(AdmissionInfo(rid=0, name=self.name), AdmissionReply).state

    async def async_state(self) -> State:
        return (await self._acall(AdmissionInfo(rid=0, name=self.name), AdmissionReply)).state

    # --- AReaL's StalenessManager face ---
    def get_capacity(self, version: int) -> int:
        reply = self._call(AdmissionInfo(rid=0, name=self.name, version=version), AdmissionReply)
        return int(reply.capacity)

    async def async_get_capacity(self, version: int) -> int:
        msg = AdmissionInfo(rid=0, name=self.name, version=version)
        return int((await self._acall(msg, AdmissionReply)).capacity)

    def on_rollout_enqueued(self, n: int = 1) -> None:
        self._call(AdmissionInfo(rid=0, name=self.name, enqueued=n), AdmissionReply)

    async def async_on_rollout_enqueued(self, n: int = 1) -> None:
        await self._acall(AdmissionInfo(rid=0, name=self.name, enqueued=n), AdmissionReply)

    def on_rollout_submitted(self) -> int:
        """One running slot, granted regardless of capacity (AReaL checks get_capacity first)."""
        return self._call(Acquire(rid=0, name=self.name, force=True), Slots).slot_ids[0]

    async def async_on_rollout_submitted(self) -> int:
        return (await self._acall(Acquire(rid=0, name=self.name, force=True), Slots)).slot_ids[0]

    def on_rollout_accepted(self, slot_id: int) -> None:
        self.release([slot_id], "accepted")

    def on_rollout_rejected(self, slot_id: int) -> None:
        self.release([slot_id], "rejected")

    # --- verl fully-async face ---
    def acquire_slot(self, timeout: float | None = None) -> int | None:
        """One slot id, or None if ``timeout`` passed first (verl returns False then)."""
        try:
            return self.acquire(1, timeout=timeout)[0]
        except RequestTimeoutError:
            return None

    async def async_acquire_slot(self, timeout: float | None = None) -> int | None:
        try:
            return (await self.async_acquire(1, timeout=timeout))[0]
        except RequestTimeoutError:
            return None

    def release_slot(self, slot_id: int, outcome: str = "accepted") -> None:
        self.release([slot_id], outcome)

    def reset_staleness(self) -> None:
        """After a weight sync: reopen the version window (verl's Layer 2)."""
        self._call(AdmissionVersion(rid=0, name=self.name, version=0, reset=True), Ok)

    async def async_reset_staleness(self) -> None:
        await self._acall(AdmissionVersion(rid=0, name=self.name, version=0, reset=True), Ok)
