"""Coalescing: concurrent puts of one client merged into one put, and its answer split back.

Puts to one partition issued together (in one loop turn, or within ``ClientConfig.coalesce_window``)
that can travel as one — the same fields and schemas, the same ``group_size`` and ``timeout``, keys
and tags given by all or by none — go to a storage unit as one message and are committed as one
put; each caller gets the metadata of its own rows. The merged put is refused as a whole or not at
all (the controller validates before it changes anything), so a refusal costs one more round: each
put is then made on its own and gets its own answer, as if it had never been merged.

While a client has puts of one merge key in flight to every unit they go to, the next one waits
for one of them to end (:class:`Flights`) and the puts issued meanwhile go with it: group commit,
so that puts issued in loop turns of their own (rollouts ending one by one) coalesce under load,
and a lone put never waits. Callers that put again soon after their put returned (an agent loop's
rollouts, ending at random times) are waited for too, so that they go as one put again instead of
splitting into groups that take turns (:class:`Flights`, ``ClientConfig.coalesce_rejoin``); a put
knows its caller (the task that awaited it, the thread that called it) for that.

Puts whose encoding was deferred (``deferred.py``) are encoded at the merge, as one batch for each
run of them: a merged put costs one encoding, not one per caller.

Merging never changes what a put means: rows keep their own versions, tags and groups. A group
named without ``group_size`` takes its size from its rows in that put, so such puts that name the
same group are never merged with each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

import msgspec

from tqstream.client.deferred import Deferred, encode_batch
from tqstream.protocol.columns import Column
from tqstream.protocol.messages import PreparePut
from tqstream.types import BatchMeta


@dataclasses.dataclass(eq=False)
class Pending:
    """A put waiting to be sent, and where its caller waits for the answer."""

    req: PreparePut
    columns: dict[str, Column] | Deferred
    answer: Any  # asyncio.Future[BatchMeta]
    caller: Hashable = None
    """Who made it: the task that awaited ``async_put``, the thread that called ``put``
    (:class:`Flights` waits for the callers of a put that ended to put again)."""


def merge_key(req: PreparePut) -> Hashable:
    """Puts with equal keys can be merged (their other differences are per row)."""
    return (
        req.partition,
        tuple(req.schemas.items()),
        req.group_size,
        req.timeout,
        req.keys is None,
        req.tags is None,
    )


def batches(pending: Sequence[Pending]) -> list[list[Pending]]:
    """``pending`` (one merge key) as the puts to send: merged ones, and alone each put whose
    groups another put names too when their size is not given (see the module docstring)."""
    if pending[0].req.group_size is not None:
        return [list(pending)]
    seen: dict[str, int] = {}
    for i, p in enumerate(pending):
        for g in set(p.req.groups or ()):
            if g is not None:
                seen[g] = i if seen.get(g, i) == i else -1
    clash = {
        i
        for i, p in enumerate(pending)
        if any(g is not None and seen.get(g) == -1 for g in p.req.groups or ())
    }
    merged = [p for i, p in enumerate(pending) if i not in clash]
    return ([merged] if merged else []) + [[p] for i, p in enumerate(pending) if i in clash]


def merge(puts: Sequence[Pending]) -> tuple[PreparePut, dict[str, Column]]:
    """One put of every row of ``puts``, in order; each run of deferred puts among them is
    encoded as one batch (``SchemaError`` if its values are not what its signature promised:
    then each put is made on its own, and encoded on its own)."""
    reqs: list[PreparePut] = []
    blocks: list[dict[str, Column]] = []
    counts: list[int] = []
    for _, run in itertools.groupby(puts, lambda p: isinstance(p.columns, Deferred)):
        pending = list(run)
        inputs = [p.columns for p in pending if isinstance(p.columns, Deferred)]
        if inputs:
            encoded, block = encode_batch([p.req for p in pending], inputs)
            reqs += encoded
            blocks.append(block)
            counts.append(sum(r.n_rows for r in encoded))
        else:
            reqs += [p.req for p in pending]
            blocks += [p.columns for p in pending if not isinstance(p.columns, Deferred)]
            counts += [p.req.n_rows for p in pending]
    first = reqs[0]
    # in parts: each put's rows are copied once, by the writer that sends the merged put
    columns = {
        name: Column.concat([b[name] for b in blocks], counts, join=False) for name in first.schemas
    }

    def rows(name: str, default: Any, always: bool = False) -> list[Any] | None:
        if not always and all(getattr(r, name) is None for r in reqs):
            return None
        out: list[Any] = []
        for r in reqs:
            values = getattr(r, name)
            out += values if values is not None else [default(r)] * r.n_rows
        return out

    versions: dict[str, Any] = {"version": first.version}
    per_row = ("version_start", "version_end", "dispatch_version")
    if any(r.version != first.version for r in reqs) or any(
        getattr(r, f) is not None for r in reqs for f in per_row
    ):  # each row's own versions: a put's ``version`` is the default of its rows
        versions = {f: rows(f, lambda r: r.version, True) for f in per_row} | {"version": None}
    merged = msgspec.structs.replace(
        first,
        n_rows=sum(r.n_rows for r in reqs),
        nbytes=sum(r.nbytes for r in reqs),
        keys=rows("keys", lambda r: None),
        groups=rows("groups", lambda r: None),
        tags=rows("tags", lambda r: None),
        rejected=sum(r.rejected for r in reqs),
        **versions,
    )
    return merged, columns


def split(meta: BatchMeta, puts: Sequence[Pending]) -> list[BatchMeta]:
    """Each put's own rows of the merged put's ``meta`` (and its own rejected count)."""
    out, start = [], 0
    for p in puts:
        stop = start + p.req.n_rows
        mine = meta.select(slice(start, stop))
        out.append(msgspec.structs.replace(mine, rejected=p.req.rejected))
        start = stop
    return out


@dataclasses.dataclass(eq=False)
class Rejoin:
    """The callers of a merge key's flights that ended, and whether they come back soon with
    their next put."""

    owed: set[Hashable] = dataclasses.field(default_factory=set)
    """Callers of the flights that ended that have not put again since."""
    ended: float = 0.0
    """When the last of those flights ended (``time.monotonic``)."""
    flight: float = 0.0
    """How long the key's flights take, smoothed (``SMOOTHING``)."""
    quick: bool = False
    """The callers owed last time were all back within the window: the next ones are waited
    for."""
    back: asyncio.Future[None] | None = None
    """Where the put waiting for them waits; resolved when the last one is back."""


class Flights:
    """The puts of each merge key in flight, the one put of a key that waits for one of them to
    end, and the callers of the flights that ended (:class:`Rejoin`). Used from one event loop.

    Waiting for a flight alone splits callers that put again a little while after their put
    returned (an agent loop's rollouts, each ending at a random time): the first one back finds
    nothing in flight and goes alone, the others come back while it flies, wait for it and go
    together, and from then on the two groups take turns, each waiting for the other's flight —
    twice the flights for the same rows, each as long as the queue at the storage unit: half the
    rows a second. So, with a ``fraction`` above 0, the put that goes first after a flight ended
    also waits, at most ``fraction`` of a flight's time, until every caller of the flights that
    ended has put again — but only when no fewer of them are owed than puts wait to go, and those
    owed the last time were all back within that window: a loop of rollouts that end soon after
    their put returned. Callers that do not put again (a task per rollout, ended with its put) or
    only much later (rollouts that take longer than a put) are not waited for, nor is a lone
    caller putting in a loop: its own next put pays what it owes."""

    def __init__(self, fraction: float = 0.0) -> None:
        self._count: dict[Hashable, int] = {}
        self._ended: dict[Hashable, asyncio.Future[None]] = {}
        self._fraction = fraction
        self._rejoin: dict[Hashable, Rejoin] = {}
        self._sweep_at = SWEEP_AT  # entries at which those of idle keys are dropped

    async def below(self, key: Hashable, limit: int) -> None:
        """Return once fewer than ``limit`` puts of ``key`` are in flight."""
        while self._count.get(key, 0) >= limit:
            ended = self._ended.get(key)
            if ended is None or ended.done():  # done: cancelled with a waiter that was
                ended = self._ended[key] = asyncio.get_running_loop().create_future()
            await ended

    def issued(self, key: Hashable, caller: Hashable) -> None:
        """``caller`` issued a put of ``key``: it is owed no more."""
        r = self._rejoin.get(key)
        if r is None or caller not in r.owed:
            return
        r.owed.discard(caller)
        if r.owed:
            return
        r.quick = time.monotonic() - r.ended <= self._fraction * r.flight
        if r.back is not None and not r.back.done():
            r.back.set_result(None)

    async def rejoined(self, key: Hashable, waiting: int) -> None:
        """Return once every caller of the ended flights of ``key`` has put again, or the window
        after the last one's end has passed; at once unless no fewer callers are owed than the
        ``waiting`` puts and the ones owed last time were back in time."""
        r = self._rejoin.get(key)
        if r is None or not r.owed or len(r.owed) < waiting or not r.quick:
            return
        left = r.ended + self._fraction * r.flight - time.monotonic()
        if left > 0:
            loop = asyncio.get_running_loop()
            back = r.back = loop.create_future()
            timer = loop.call_later(left, _resolve, back)
            try:
                await back
            finally:
                timer.cancel()
        if r.owed:  # not all back in time: not waited for the next time
            r.owed.clear()
            r.quick = False

    @contextlib.contextmanager
    def flying(self, key: Hashable, callers: Iterable[Hashable] = ()) -> Iterator[None]:
        """A put of ``key`` for the puts of ``callers`` in flight for the block; its end wakes
        the put waiting to follow and owes its callers."""
        self._count[key] = self._count.get(key, 0) + 1
        began = time.monotonic()
        try:
            yield
        finally:
            left = self._count.pop(key) - 1
            if left:
                self._count[key] = left
            ended = self._ended.pop(key, None)
            if ended is not None and not ended.done():
                ended.set_result(None)
            if self._fraction > 0:
                self._owe(key, callers, time.monotonic() - began)

    def _owe(self, key: Hashable, callers: Iterable[Hashable], took: float) -> None:
        now = time.monotonic()
        r = self._rejoin.get(key)
        if r is None:
            r = self._rejoin[key] = Rejoin(flight=took)
        elif r.owed and now - r.ended > self._fraction * r.flight:  # not back in time
            r.owed.clear()
            r.quick = False
        r.owed.update(c for c in callers if c is not None)
        r.ended = now
        r.flight += SMOOTHING * (took - r.flight)
        if len(self._rejoin) > self._sweep_at:  # keys gone idle (a partition done with)
            idle = [
                k
                for k, e in self._rejoin.items()
                if k not in self._count and (not e.quick or now - e.ended > 10 * e.flight)
            ]
            for k in idle:
                del self._rejoin[k]
            self._sweep_at = max(SWEEP_AT, 2 * len(self._rejoin))


SWEEP_AT = 16
"""Keys remembered (:class:`Rejoin`) before those of idle keys are dropped."""
SMOOTHING = 0.25
"""The weight of a flight's time in its key's smoothed one."""


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
