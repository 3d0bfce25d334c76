"""One member of a pooled staleness budget, as its client sees it (``controller/budget.py``).

The member counts its own rollouts here, under its lock, in the order its callbacks run, and
reports the counts whole to the controller. A callback only updates the counts and, when no
report is scheduled yet, schedules one on the client's IO loop: it never waits for the
controller, so it costs microseconds, and a burst of callbacks goes out as one report. A question
(capacity, stats) sends the counts with it, so the answer counts every callback made before it,
whatever reports are still on the way: the controller keeps the newest report by number.

A scheduled report that fails is repaired by the next one (each carries the whole counts), and a
failure that persists is the next question's. If the process dies between a callback and its
report, the member leaves the budget with its connection anyway, and its counts with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import weakref
from typing import TYPE_CHECKING, Any

from tqstream.client.core import ClientCore
from tqstream.protocol.messages import AdmissionReply, BudgetReport

if TYPE_CHECKING:
    from tqstream.client.client import Client

State = dict[str, int | float | str]


class BudgetMember:
    """A member of budget ``name`` with its share of the limits; ``enqueued``, ``running``,
    ``accepted``, ``rejected``: its own counts (AReaL's ``RolloutStat``), ``unmatched``: its
    callbacks that had nothing to match. Mutate the counts under ``lock``, then :meth:`changed`.
    """

    def __init__(
        self, client: Client, name: str, max_concurrent: int, consumer_batch_size: int,
        max_staleness: int,
    ) -> None:  # fmt: skip
        self.client, self.name = client, name
        self.limits = (max_concurrent, consumer_batch_size, max_staleness)
        self.key = secrets.randbits(62) + 1
        self.lock = threading.Lock()
        self.enqueued = self.running = self.accepted = self.rejected = self.unmatched = 0
        self._seq = 0
        self._scheduled = False
        self._left = False
        self._loop: asyncio.AbstractEventLoop = client._io.loop
        self._core: ClientCore = client._core
        self.report()  # joins: a refused share raises here
        self._finalizer = weakref.finalize(
            self, _leave_soon, self._loop, self._core, self._message(leave=True, seq=1 << 62)
        )

    def _message(self, version: int | None = None, leave: bool = False, seq: int = 0) -> Any:
        """The report of the counts as they are (call under ``lock``, or before sharing self)."""
        if not seq:
            self._seq += 1
            seq = self._seq
        mc, bs, staleness = self.limits
        return BudgetReport(
            rid=0, name=self.name, member=self.key, seq=seq, max_concurrent=mc,
            consumer_batch_size=bs, max_staleness=staleness, enqueued=self.enqueued,
            running=self.running, accepted=self.accepted, rejected=self.rejected,
            unmatched=self.unmatched, version=version, leave=leave,
        )  # fmt: skip

    # --- after a callback: report soon, without waiting ---
    def changed(self) -> None:
        """The counts changed (call under ``lock``): schedule a report unless one is."""
        if not self._scheduled and not self._left:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: the next call raises
                self._loop.call_soon_threadsafe(self._send)

    def _send(self) -> None:
        """On the IO loop: report the counts as they are now."""
        with self.lock:
            self._scheduled = False
            if self._left:
                return
            msg = self._message()
        task = self._loop.create_task(
            self._core.call(msg, AdmissionReply), name="tqstream-budget-report"
        )
        _keep(task)

    # --- questions: the counts go with them ---
    def report(self, version: int | None = None) -> AdmissionReply:
        """Report now and return the budget's state (and capacity at ``version``)."""
        with self.lock:
            msg = self._message(version)
        return self.client._sync(ClientCore.call, msg, AdmissionReply)  # type: ignore[no-any-return]

    async def async_report(self, version: int | None = None) -> AdmissionReply:
        with self.lock:
            msg = self._message(version)
        return await self.client._async(ClientCore.call, msg, AdmissionReply)  # type: ignore[no-any-return]

    def state(self) -> State:
        return self.report().state

    def leave(self) -> None:
        """Leave the budget (its share and counts stop counting). Idempotent."""
        with self.lock:
            if self._left:
                return
            self._left = True
            msg = self._message(leave=True)
        self._finalizer.detach()
        if not self.client.closed:
            self.client._sync(ClientCore.call, msg, AdmissionReply)


_reports: set[asyncio.Task[Any]] = set()  # in flight: the loop keeps only weak references


def _keep(task: asyncio.Task[Any]) -> None:
    _reports.add(task)
    task.add_done_callback(_done)


def _done(task: asyncio.Task[Any]) -> None:
    _reports.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: the next report repairs what this one failed to do


def _leave_soon(loop: asyncio.AbstractEventLoop, core: ClientCore, msg: BudgetReport) -> None:
    """A member collected without ``leave()``: leave in the background (best effort; the
    connection's end makes it leave anyway)."""

    def send() -> None:
        _keep(loop.create_task(core.call(msg, AdmissionReply), name="tqstream-budget-leave"))

    with contextlib.suppress(RuntimeError):  # the loop is closed
        loop.call_soon_threadsafe(send)
