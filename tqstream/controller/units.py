"""Storage-unit membership and liveness at the controller: addresses, bytes held, quotas, and
which units are alive; placement over the live ones. Pure: no sockets, no clock.

A unit is *lost* when the service sees its connection drop (the process died, or missed
heartbeats); the rows it held are then lost too, unless another unit holds their replica. A lost
unit *revives* under the same index when it comes back (the same process after a network outage,
or a restarted one at the same address): it starts empty, since the controller has given its rows
up. A unit at a new address takes a new index.

Lifecycle of an index: ``alive → lost → alive`` (revive), any number of times; never removed, so
the indices in ``BatchMeta.units`` stay meaningful.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqstream.controller.placement import place, place_on
from tqstream.errors import CapacityError, UnitLostError

__all__ = ["UnitTable"]


class UnitTable:
    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.bytes: list[int] = []
        self.quota: list[int] = []  # 0: unlimited
        self.alive: list[bool] = []
        self.lost_rows: list[int] = []  # rows given up when the unit was lost, over its lifetime
        self.losses: list[int] = []  # times the unit was lost
        self.turn = 0  # the unit equally loaded ones are taken from (placement round-robin)

    def __len__(self) -> int:
        return len(self.addresses)

    def add(self, address: str, max_bytes: int = 0) -> tuple[int, bool]:
        """Register ``address``: its index, and whether it is a lost unit's (to revive)."""
        if address in self.addresses:
            u = self.addresses.index(address)
            self.quota[u] = max_bytes
            return u, not self.alive[u]
        self.addresses.append(address)
        self.bytes.append(0)
        self.quota.append(max_bytes)
        self.alive.append(True)
        self.lost_rows.append(0)
        self.losses.append(0)
        return len(self.addresses) - 1, False

    def live(self) -> list[int]:
        return [u for u, ok in enumerate(self.alive) if ok]

    def lose(self, u: int) -> bool:
        """Mark unit ``u`` lost; False if it already was."""
        if not self.alive[u]:
            return False
        self.alive[u] = False
        self.losses[u] += 1
        self.bytes[u] = 0
        return True

    def revive(self, u: int) -> None:
        self.alive[u] = True
        self.bytes[u] = 0

    def charge(self, unit: int, replica: int, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer, negative) on ``unit`` and on ``replica`` (-1: none)."""
        self.bytes[unit] += nbytes
        if replica >= 0:
            self.bytes[replica] += nbytes

    def place(
        self, n_rows: int, nbytes: int, replicas: int = 1, near: Sequence[int] = ()
    ) -> list[tuple[int, int, int, int]] | None:
        """``(unit, replica, start, stop)`` runs over the live units (replica -1: none), or None
        while the put does not fit yet. The units of ``near`` (the writer's host) take the rows
        when they have room, else the least loaded of all. A second copy goes to another live
        unit when there is one; with a single live unit the rows are stored once (see
        ``docs/faults.md``)."""
        live = self.live()
        if not live:
            raise self._none_alive()
        sub_bytes = [self.bytes[u] for u in live]
        sub_quota = [self.quota[u] for u in live]
        runs = None
        mine = [i for i, u in enumerate(live) if u in near]
        if 0 < len(mine) < len(live):  # the writer's host first
            try:
                local = place([sub_bytes[i] for i in mine], n_rows, nbytes,
                              [sub_quota[i] for i in mine], self.turn)  # fmt: skip
            except CapacityError:  # can never fit on those alone
                local = None
            if local is not None:
                runs = [(mine[i], start, stop) for i, start, stop in local]
        if runs is None:
            runs = place(sub_bytes, n_rows, nbytes, sub_quota, self.turn)
        self.turn += 1
        if runs is None:
            return None
        out = []
        for i, start, stop in runs:
            replica = -1
            if replicas > 1 and len(live) > 1:
                need = nbytes * (stop - start) // n_rows
                j = self._replica_for(i, sub_bytes, sub_quota, need)
                if j is None:
                    return None  # no room for the second copy yet: wait like any put
                replica = live[j]
            out.append((live[i], replica, start, stop))
        return out

    def _replica_for(
        self, primary: int, sub_bytes: list[int], sub_quota: list[int], need: int
    ) -> int | None:
        n = len(sub_bytes)
        order = sorted(
            (j for j in range(n) if j != primary),
            key=lambda j: (sub_bytes[j], (j - primary - 1) % n),
        )
        for j in order:
            if not sub_quota[j] or sub_bytes[j] + need <= sub_quota[j]:
                return j
        return None

    def place_on(
        self, u: int, n_rows: int, nbytes: int, replica: int = -1
    ) -> list[tuple[int, int, int, int]] | None:
        """The rows on unit ``u`` (and their copy on ``replica``), or None while either has no
        room for them."""
        for v in (u, replica):
            if 0 <= v < len(self.alive) and not self.alive[v]:
                raise UnitLostError(
                    f"storage unit {v} at {self.addresses[v]} was declared lost by the "
                    f"controller, so it takes no rows; the put was not stored: retry it",
                    unit=v,
                    address=self.addresses[v],
                )
        runs = place_on(u, self.bytes, n_rows, nbytes, self.quota)
        if runs is None or (replica >= 0 and place_on(replica, self.bytes, n_rows, nbytes,
                                                      self.quota) is None):  # fmt: skip
            return None
        return [(unit, replica, a, b) for unit, a, b in runs]

    def room_elsewhere(self, u: int, nbytes: int) -> bool:
        """Whether a live unit other than ``u`` has room for ``nbytes`` now."""
        return any(
            v != u and (not self.quota[v] or self.bytes[v] + nbytes <= self.quota[v])
            for v in self.live()
        )

    def _none_alive(self) -> CapacityError:
        if not self.addresses:
            return CapacityError(
                "no storage unit is registered with the controller; start storage units "
                "(tqstream-launch --storage-units N) before putting data"
            )
        return CapacityError(
            f"all {len(self.addresses)} storage units are lost ({', '.join(self.addresses)}); "
            f"the put waits for none: restart them (tqstream-launch restarts them by default, "
            f"--on-unit-exit restart)",
            units=len(self.addresses),
        )
