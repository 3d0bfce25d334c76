"""AReaL's capacity admission (its StalenessManager)."""

from __future__ import annotations

from tqstream.controller.admission.base import _check_ints, _Slots, _version
from tqstream.errors import AdmissionError
from tqstream.staleness import capacity_bound


class CapacityAdmission(_Slots):
    """AReaL's StalenessManager: a concurrency limit and a staleness bound on cumulative samples.

    ``capacity(v) = min(max_concurrent - running, (max_staleness + v + 1) * consumer_batch_size
    - (accepted + running))``: by version ``v`` the trainer has consumed ``v`` batches, so at most
    ``max_staleness + 1`` batches beyond them may exist or be in flight, and none of them can be
    older than ``max_staleness`` versions when the trainer reaches it.
    """

    style = "capacity"

    def __init__(self, max_concurrent: int, max_staleness: int, consumer_batch_size: int) -> None:
        super().__init__()
        _check_ints(
            "capacity",
            max_concurrent=max_concurrent,
            max_staleness=max_staleness,
            consumer_batch_size=consumer_batch_size,
        )
        if max_concurrent < 1:
            raise AdmissionError(
                f"capacity admission needs max_concurrent >= 1 (got {max_concurrent}): no rollout "
                f"could ever run, so the trainer would wait forever; set it to the number of "
                f"rollouts all producers together may run at once"
            )
        if consumer_batch_size < 1:
            raise AdmissionError(
                f"capacity admission needs consumer_batch_size >= 1 (got {consumer_batch_size}): "
                f"the staleness bound (max_staleness + version + 1) * consumer_batch_size would "
                f"admit nothing; set it to the trainer's global batch size in samples (all "
                f"data-parallel ranks together, not per rank)"
            )
        if max_staleness < 0:
            raise AdmissionError(
                f"capacity admission needs max_staleness >= 0 (got {max_staleness}): at version 0 "
                f"the bound (max_staleness + 1) * consumer_batch_size would admit nothing, so the "
                f"trainer would never publish version 1; set 0 for on-policy samples or the number "
                f"of versions a sample may lag behind the trainer"
            )
        self.max_concurrent = max_concurrent
        self.max_staleness = max_staleness
        self.consumer_batch_size = consumer_batch_size
        self.enqueued = 0

    def get_capacity(self, version: int) -> int:
        """AReaL's get_capacity; may be negative after ``on_rollout_submitted`` over capacity."""
        v = _version(version)
        concurrency = self.max_concurrent - self.running
        bound = capacity_bound(self.max_staleness, v, self.consumer_batch_size)
        return min(concurrency, bound - (self.accepted + self.running))

    def try_acquire(self, n: int, version: int) -> list[int]:
        """Up to ``n`` slots, as many as ``capacity(version)`` allows. ``version`` is used as given
        (AReaL's ``current_version``); a producer on older weights gets a smaller capacity."""
        n = self._check_n(n)
        return self._issue(min(n, max(0, self.get_capacity(version))), 0)

    def on_version(self, version: int) -> None:
        """Only recorded (for ``state``): the bound moves with the version passed to acquire."""
        self.version = max(self.version, _version(version))

    def on_version_recovered(self, version: int) -> None:
        """A restart from the checkpoint at ``version``: the trainer has consumed ``version``
        batches, so ``accepted`` must say so, or capacity would be inflated by ``version``
        batches (AReaL #1345/#1388). Slots issued before are void."""
        self.version = _version(version)
        self.accepted = self.version * self.consumer_batch_size
        self._void()

    def on_dropped(self, n: int) -> None:
        """``n`` accepted samples were evicted as stale before any trainer consumed them: they
        no longer count against the staleness budget, or the trainer, short of ``n`` samples,
        would wait for producers that the formula keeps blocked (a deadlock once more than
        ``max_staleness * consumer_batch_size`` were dropped)."""
        dropped = min(n, self.accepted)
        self.accepted -= dropped
        self.dropped += dropped

    # --- AReaL's names, same semantics ---
    def on_rollout_enqueued(self) -> None:
        self.enqueued += 1

    def on_rollout_submitted(self) -> int:
        """One slot regardless of capacity, as AReaL's executor does after checking it."""
        return self._issue(1, 0)[0]

    def on_rollout_accepted(self, slot_id: int) -> None:
        self.release([slot_id], "accepted")

    def on_rollout_rejected(self, slot_id: int) -> None:
        self.release([slot_id], "rejected")

    def state(self) -> dict[str, int | float | str]:
        return {
            **self._common(),
            "enqueued": self.enqueued,
            "capacity": self.get_capacity(self.version),
            "max_concurrent": self.max_concurrent,
            "max_staleness": self.max_staleness,
            "consumer_batch_size": self.consumer_batch_size,
        }
