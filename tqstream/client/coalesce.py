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
and a lone put never waits.

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
from collections.abc import Hashable, Iterator, Sequence
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


class Flights:
    """The puts of each merge key in flight, and the one put of a key that waits for one of them
    to end. Used from one event loop."""

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}
        self._ended: dict[Hashable, asyncio.Future[None]] = {}

    async def below(self, key: Hashable, limit: int) -> None:
        """Return once fewer than ``limit`` puts of ``key`` are in flight."""
        while self._count.get(key, 0) >= limit:
            ended = self._ended.get(key)
            if ended is None or ended.done():  # done: cancelled with a waiter that was
                ended = self._ended[key] = asyncio.get_running_loop().create_future()
            await ended

    @contextlib.contextmanager
    def flying(self, key: Hashable) -> Iterator[None]:
        """A put of ``key`` in flight for the block; its end wakes the put waiting to follow."""
        self._count[key] = self._count.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._count.pop(key) - 1
            if left:
                self._count[key] = left
            ended = self._ended.pop(key, None)
            if ended is not None and not ended.done():
                ended.set_result(None)
