"""AReaL's staleness budget, pooled over the managers that share it. Pure state.

AReaL gives each data-parallel rank a ``StalenessManager`` with a share of the job's limits
(``max_concurrent_rollouts // dp``, ``consumer_batch_size // dp``). A budget here is what those
managers become when they share: its limits are the sum of its members' shares, its counts the sum
of their counts, and its capacity AReaL's formula over the sums,

    min(Σ max_concurrent - running, (max_staleness + v + 1) * Σ consumer_batch_size
        - (accepted + running))

so the members together behave like one AReaL manager with the summed limits, and a budget of one
member like that member's own. Each member counts its own rollouts (the client knows the order of
its callbacks, the controller does not) and reports its counts whole, numbered: a report that
arrives after a newer one changes nothing, and a report from a member the budget no longer knows
joins it again, so a lost report is repaired by the next one.

A member that leaves (closed, or its client's connection dropped) takes its share and its counts
with it: the others go on as if it had never joined, and its running rollouts stop counting
(``returned``). The last member to leave ends the budget.

Where AReaL clamps or tolerates, so does a budget, and counts it: ``clamped`` limits below 1
(AReaL uses ``max(1, ...)``), ``unmatched`` callbacks (an outcome with no running rollout, a
submission with no enqueued input: AReaL lets its counters go below 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tqstream.errors import AdmissionError
from tqstream.staleness import capacity_bound

COUNTS = ("enqueued", "running", "accepted", "rejected")
"""AReaL's ``RolloutStat`` counters, as members report them."""


@dataclasses.dataclass
class Member:
    peer: Any
    max_concurrent: int  # the share as given; the formula uses max(1, ...)
    consumer_batch_size: int
    seq: int = -1
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)
    unmatched: int = 0


class Budget:
    """One pooled budget: its members and the sums the formula reads, kept in step with them."""

    style = "budget"

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.members: dict[int, Member] = {}
        self.max_concurrent = 0  # Σ max(1, share)
        self.consumer_batch_size = 0
        self.sums = [0, 0, 0, 0]  # COUNTS over the members
        self.version = 0  # the newest version a capacity was asked at
        self.dropped = 0  # accepted samples evicted as stale before any trainer read them
        self.unmatched = 0
        self.clamped = 0
        self.left = 0
        self.returned = 0

    @property
    def accepted(self) -> int:
        return max(0, self.sums[2] - self.dropped)

    def capacity(self, version: int) -> int:
        """AReaL's ``get_capacity`` at ``version`` over the sums; negative when over the limits."""
        self.version = max(self.version, version)
        running = self.sums[1]
        concurrency = self.max_concurrent - running
        bound = capacity_bound(self.max_staleness, version, self.consumer_batch_size)
        return min(concurrency, bound - (self.accepted + running))

    def join(self, key: int, peer: Any, max_concurrent: int, consumer_batch_size: int) -> Member:
        member = Member(peer, max_concurrent, consumer_batch_size)
        self.members[key] = member
        self.max_concurrent += max(1, max_concurrent)
        self.consumer_batch_size += max(1, consumer_batch_size)
        self.clamped += (max_concurrent < 1) + (consumer_batch_size < 1)
        return member

    def report(
        self, member: Member, seq: int, counts: tuple[int, int, int, int], unmatched: int
    ) -> None:
        if seq <= member.seq:
            return  # overtaken by a newer report
        member.seq = seq
        self._move(member.counts, counts)
        member.counts = counts
        self.unmatched += max(0, unmatched - member.unmatched)
        member.unmatched = max(member.unmatched, unmatched)

    def leave(self, key: int) -> None:
        member = self.members.pop(key)
        self.max_concurrent -= max(1, member.max_concurrent)
        self.consumer_batch_size -= max(1, member.consumer_batch_size)
        self.returned += max(0, member.counts[1])
        self.left += 1
        self._move(member.counts, (0, 0, 0, 0))
        self.dropped = min(self.dropped, self.sums[2])

    def _move(self, old: tuple[int, ...], new: tuple[int, ...]) -> None:
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            self.sums[i] += b - a

    def on_dropped(self, n: int) -> None:
        """``n`` accepted samples were evicted as stale before any trainer read them: they no
        longer count against the bound, or a trainer short of them would wait on producers the
        formula keeps blocked."""
        self.dropped += min(n, self.accepted)

    def state(self) -> dict[str, int | float | str]:
        enqueued, running, _, rejected = self.sums
        return {
            "style": self.style,
            "members": len(self.members),
            "max_concurrent": self.max_concurrent,
            "consumer_batch_size": self.consumer_batch_size,
            "max_staleness": self.max_staleness,
            "version": self.version,
            "capacity": self.capacity(self.version),
            "enqueued": enqueued,
            "running": running,
            "accepted": self.accepted,
            "rejected": rejected,
            "dropped": self.dropped,
            "unmatched": self.unmatched,
            "clamped": self.clamped,
            "left": self.left,
            "returned": self.returned,
        }


class Budgets:
    """Every budget by name; a member is known by the key its client chose and owned by the peer
    (client session) that joined it."""

    def __init__(self) -> None:
        self.by_name: dict[str, Budget] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def report(
        self, name: str, key: int, peer: Any, limits: tuple[int, int, int], seq: int,
        counts: tuple[int, int, int, int], unmatched: int, leave: bool = False,
    ) -> Budget | None:  # fmt: skip
        """Apply one member's report (joining first if the budget does not know it); returns the
        budget, or None when the member left and the budget ended with it."""
        max_concurrent, consumer_batch_size, max_staleness = limits
        budget = self.by_name.get(name)
        member = None if budget is None else budget.members.get(key)
        if member is None:
            if leave:
                return budget
            budget = self._budget(name, max_staleness, budget)
            member = budget.join(key, peer, max_concurrent, consumer_batch_size)
        elif member.peer != peer:
            raise AdmissionError(
                f"member {key} of budget {name!r} belongs to another client; each "
                f"StalenessManager reports only its own counts",
                name=name,
            )
        assert budget is not None
        if not leave:
            budget.report(member, seq, counts, unmatched)
            return budget
        budget.leave(key)  # with the counts last reported: a leave may come from a finalizer
        if not budget.members:
            del self.by_name[name]
            return None
        return budget

    def _budget(self, name: str, max_staleness: int, budget: Budget | None) -> Budget:
        if max_staleness < 0:
            raise AdmissionError(
                f"budget {name!r}: max_staleness must be >= 0 (got {max_staleness}): at version 0 "
                f"the bound (max_staleness + 1) * consumer_batch_size admits nothing, so the "
                f"trainer would never publish version 1; set 0 for on-policy samples or the "
                f"number of versions a sample may lag behind the trainer",
                name=name,
            )
        if budget is None:
            budget = self.by_name[name] = Budget(max_staleness)
        elif budget.max_staleness != max_staleness:
            raise AdmissionError(
                f"budget {name!r} has max_staleness={budget.max_staleness}; a manager with "
                f"max_staleness={max_staleness} cannot share it (members share one staleness "
                f"bound); give it the same max_head_offpolicyness or another name",
                name=name,
            )
        return budget

    def drop_peer(self, peer: Any) -> None:
        """The client ``peer`` is gone: its members leave (their running rollouts come back)."""
        for name, budget in list(self.by_name.items()):
            for key in [k for k, m in budget.members.items() if m.peer == peer]:
                budget.leave(key)
            if not budget.members:
                del self.by_name[name]

    def states(self) -> dict[str, dict[str, int | float | str]]:
        return {name: b.state() for name, b in self.by_name.items()}
