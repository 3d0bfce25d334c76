"""The slot API of verl's fully-async TransferQueue recipe, with its exact signatures.

verl's PR #6628 puts flow control in a ``ReplayBuffer`` Ray actor with two layers: at most
``max_pending_slots`` samples in flight (memory) and at most ``max_version_slots`` started per
weight version (staleness). Its rollouter calls ``acquire_slot(timeout=None, uid=...) -> bool``
before feeding a prompt and ``release_slot()`` (no argument: *a* slot) once the sample is written;
the trainer calls ``reset_staleness() -> dict`` after each weight sync. tqstream keeps the same
two layers at the controller (``client.admission("slots", ...)``), global across processes, but
its slots are ids, and its ``release_slot`` needs one, so a verl caller could not use it unchanged.
:class:`ReplayBufferSlots` closes that gap: it remembers the ids it acquired and ``release_slot()``
ends the oldest, so the recipe's calls work as they are.

Methods are coroutines, as on verl's actor (``await slots.acquire_slot()`` where verl awaits
``replay_buffer.acquire_slot.remote()``), with ``*_sync`` twins, verl's naming for blocking calls.
One difference to know: tqstream's ``reset_staleness`` opens an empty window (``version_slots``
becomes 0), while verl's ReplayBuffer restarts it at the samples still in flight plus those queued
and not yet consumed; docs/adapters/verl.md says what that means for ``max_version_slots``.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any

from tqstream.client.client import Client, connect
from tqstream.errors import AdmissionError, RequestTimeoutError

__all__ = ["ReplayBufferSlots"]


class ReplayBufferSlots:
    """``acquire_slot`` / ``release_slot`` / ``reset_staleness`` of verl's fully-async recipe.

    ``client``: a tqstream client or its address (then this object owns the connection).
    ``max_version_slots`` / ``max_pending_slots``: verl's two layers (``max_pending_slots``
    defaults to the ReplayBuffer's 256). ``consumer_batch_size``: the trainer's samples per weight
    version, which lets the controller refuse a ``max_version_slots`` that would deadlock.
    ``name``: the admission; every process (rollouter, trainer) builds one with the same name and
    settings and shares its state. The ids a ``release_slot()`` ends are the ones this object's
    ``acquire_slot`` took: acquire and release on the same object, as the recipe's rollouter does.
    """

    def __init__(
        self,
        client: Client | str,
        max_version_slots: int,
        max_pending_slots: int = 256,
        *,
        consumer_batch_size: int | None = None,
        name: str = "verl_slots",
    ) -> None:
        self._owns = isinstance(client, str)
        self.client = connect(client) if isinstance(client, str) else client
        self.name = name
        self.max_version_slots, self.max_pending_slots = max_version_slots, max_pending_slots
        self.consumer_batch_size = consumer_batch_size
        config = dict(max_pending_slots=max_pending_slots, max_version_slots=max_version_slots)
        if consumer_batch_size is not None:
            config["consumer_batch_size"] = consumer_batch_size
        try:
            self.admission = self.client.admission("slots", name=name, **config)
        except BaseException:
            self.close()
            raise
        self._held: collections.deque[int] = collections.deque()  # ids acquired, oldest first
        self._last_reset = time.monotonic()

    def __reduce__(self) -> tuple[Any, tuple[str, int, int]]:
        build = functools.partial(
            ReplayBufferSlots, consumer_batch_size=self.consumer_batch_size, name=self.name
        )
        return build, (self.client.address, self.max_version_slots, self.max_pending_slots)

    def close(self) -> None:
        """Close the connection if this object opened it (built from an address)."""
        if self._owns and hasattr(self, "client"):
            self.client.close()

    # --- verl's calls ---
    async def acquire_slot(self, timeout: float | None = None, uid: str = "") -> bool:
        """Wait until both layers have room and take a slot: True; False if ``timeout`` seconds
        passed first (None: wait as long as it takes). ``uid`` is accepted for verl's callers,
        which pass the sample id for their logs; tqstream does not need it."""
        try:
            ids = await self.admission.async_acquire(1, timeout=timeout)
        except RequestTimeoutError:
            return False
        self._held.extend(ids)
        return True

    def acquire_slot_sync(self, timeout: float | None = None, uid: str = "") -> bool:
        try:
            ids = self.admission.acquire(1, timeout=timeout)
        except RequestTimeoutError:
            return False
        self._held.extend(ids)
        return True

    def _oldest(self) -> int:
        try:
            return self._held.popleft()
        except IndexError:
            raise AdmissionError(
                f"release_slot() on slots {self.name!r}: this object holds no slot (every slot it "
                f"acquired was released already); release each slot once, on the object that "
                f"acquired it"
            ) from None

    async def release_slot(self) -> None:
        """End the oldest slot this object holds (the sample was written, or given up): the
        in-flight layer gets it back; the version window keeps counting it, as in verl."""
        slot = self._oldest()
        try:
            await self.admission.async_release([slot], "accepted")
        except BaseException:
            self._held.appendleft(slot)
            raise

    def release_slot_sync(self) -> None:
        slot = self._oldest()
        try:
            self.admission.release([slot], "accepted")
        except BaseException:
            self._held.appendleft(slot)
            raise

    def _timing(self, state: dict[str, Any]) -> dict[str, float]:
        now = time.monotonic()
        version_time, self._last_reset = max(now - self._last_reset, 1e-6), now
        out = {"fully_async/rollouter/version_time": version_time}
        numbers = {k: v for k, v in state.items() if isinstance(v, int | float)}
        out.update({f"tqstream/slots/{k}": float(v) for k, v in numbers.items()})
        return out

    async def reset_staleness(self) -> dict:
        """After a weight sync: open a new version window (waiting ``acquire_slot`` calls wake).
        Returns metrics for the trainer's logger: the time since this object's previous reset
        (``fully_async/rollouter/version_time``) and the admission's counters."""
        await self.admission.async_reset_staleness()
        return self._timing(await self.admission.async_state())

    def reset_staleness_sync(self) -> dict:
        self.admission.reset_staleness()
        return self._timing(self.admission.state())

    def _statistics(self, state: dict[str, Any]) -> dict[str, Any]:
        pending, version = int(state["pending"]), int(state["version_slots"])
        return {
            "pending_slots": pending,
            "max_pending_slots": self.max_pending_slots,
            "available_physical_slots": max(0, self.max_pending_slots - pending),
            "version_slots": version,
            "max_version_slots": self.max_version_slots,
            "available_version_slots": max(0, self.max_version_slots - version),
            "held_slots": len(self._held),
        }

    async def get_statistics(self) -> dict:
        """The ReplayBuffer's slot statistics (both layers, global) and ``held_slots`` (this
        object's)."""
        return self._statistics(await self.admission.async_state())

    def get_statistics_sync(self) -> dict:
        return self._statistics(self.admission.state())
