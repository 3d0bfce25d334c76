"""The gets parked until rows come, by partition, handle and peer. Its owner is
:class:`~tqstream.controller.gets.Gets`, which alone parks and unparks them."""

from __future__ import annotations

import dataclasses
from typing import Any

from tqstream.controller.peers import peer_of
from tqstream.protocol.messages import GetMeta


@dataclasses.dataclass(eq=False)
class Parked:
    handle: Any
    req: GetMeta
    mask: int
    dropped: int = 0  # rows evicted as stale by its tries so far (reported when served)


class ParkedGets:
    """The gets waiting for rows, by partition, in arrival order. A get is parked once and leaves
    once: served, failed, timed out, cancelled, or with its partition or its peer. Indexed by
    handle and by peer too: a cancel or a peer's departure costs what it takes out, not what is
    parked (thousands of clients may each have a get parked)."""

    def __init__(self) -> None:
        self._by_partition: dict[str, dict[Any, Parked]] = {}
        self._by_handle: dict[Any, Parked] = {}
        self._by_peer: dict[Any, set[Any]] = {}  # peer -> the handles of its parked gets

    def __len__(self) -> int:
        return len(self._by_handle)

    def park(self, parked: Parked) -> None:
        if parked.handle in self._by_handle:
            raise ValueError("a request handle parks one get at a time")
        self._by_partition.setdefault(parked.req.partition, {})[parked.handle] = parked
        self._by_handle[parked.handle] = parked
        peer = peer_of(parked.handle)
        if peer is not None:
            self._by_peer.setdefault(peer, set()).add(parked.handle)

    def of(self, partition: str) -> list[Parked]:
        """The gets parked on ``partition``, in arrival order (a copy)."""
        return list(self._by_partition.get(partition, {}).values())

    def count(self, partition: str) -> int:
        return len(self._by_partition.get(partition, {}))

    def holds(self, parked: Parked) -> bool:
        return self._by_handle.get(parked.handle) is parked

    def unpark(self, parked: Parked) -> bool:
        """Take ``parked`` out; False when it had left already."""
        if not self.holds(parked):
            return False
        self._forget(parked)
        return True

    def drop_partition(self, partition: str) -> list[Parked]:
        """Take out and return every get parked on ``partition``."""
        out = list(self._by_partition.get(partition, {}).values())
        for parked in out:
            self._forget(parked)
        return out

    def cancel(self, handle: Any) -> None:
        """The requester went away: forget its parked get."""
        parked = self._by_handle.get(handle)
        if parked is not None:
            self._forget(parked)

    def drop_peer(self, peer: Any) -> None:
        """Forget every get parked by ``peer``'s connections."""
        for handle in list(self._by_peer.get(peer, ())):
            self._forget(self._by_handle[handle])

    def _forget(self, parked: Parked) -> None:
        del self._by_handle[parked.handle]
        waiting = self._by_partition[parked.req.partition]
        del waiting[parked.handle]
        if not waiting:
            del self._by_partition[parked.req.partition]
        peer = peer_of(parked.handle)
        if peer is not None:
            handles = self._by_peer[peer]
            handles.discard(parked.handle)
            if not handles:
                del self._by_peer[peer]
