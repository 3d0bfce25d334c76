"""verl's dual-layer slot admission."""

from __future__ import annotations

from tqstream.controller.admission.base import _check_ints, _Slots, _version
from tqstream.errors import AdmissionError


class SlotAdmission(_Slots):
    """verl's dual-layer slots: ``pending`` bounds samples in flight (memory), ``version_slots``
    bounds samples started since the trainer's last weight sync (staleness).

    ``version_slots`` counts per window; a window ends at ``reset_staleness``. A rejected slot gives
    its window slot back only if it was counted in the current window, so the counter can neither
    go negative nor be freed twice.
    """

    style = "slots"

    def __init__(
        self, max_pending_slots: int, max_version_slots: int, consumer_batch_size: int | None = None
    ) -> None:
        super().__init__()
        _check_ints("slots", max_pending_slots=max_pending_slots)
        _check_ints("slots", max_version_slots=max_version_slots)
        if consumer_batch_size is not None:
            _check_ints("slots", consumer_batch_size=consumer_batch_size)
        if max_pending_slots < 1:
            raise AdmissionError(
                f"slots admission needs max_pending_slots >= 1 (got {max_pending_slots}): no "
                f"sample could ever be in flight, so the trainer would wait forever; set it to the "
                f"number of samples all producers together may generate at once"
            )
        if max_version_slots < 1:
            raise AdmissionError(
                f"slots admission needs max_version_slots >= 1 (got {max_version_slots}): no "
                f"sample could start before the next weight sync, which needs samples; set it to "
                f"the number of samples producers may start per weight version"
            )
        if consumer_batch_size is not None and consumer_batch_size < 1:
            raise AdmissionError(
                f"slots admission needs consumer_batch_size >= 1 or None (got "
                f"{consumer_batch_size}); set it to the trainer's global batch size in samples"
            )
        if consumer_batch_size is not None and max_version_slots < consumer_batch_size:
            raise AdmissionError(
                f"slots admission would deadlock: max_version_slots={max_version_slots} < "
                f"consumer_batch_size={consumer_batch_size}: the trainer syncs weights (which "
                f"resets the window) only after consuming {consumer_batch_size} samples, but only "
                f"{max_version_slots} can start per window; set max_version_slots >= "
                f"{consumer_batch_size}"
            )
        self.max_pending_slots = max_pending_slots
        self.max_version_slots = max_version_slots
        self.consumer_batch_size = consumer_batch_size
        self.version_slots = 0
        self.window = 0
        self.resets = 0

    @property
    def pending(self) -> int:
        return self.running

    def try_acquire(self, n: int, version: int) -> list[int]:
        """Up to ``n`` slots while both layers have room. ``version`` is only checked: the window
        moves with ``on_version``/``reset_staleness`` alone, as in verl."""
        n = self._check_n(n)
        _version(version)
        k = min(
            n, self.max_pending_slots - self.pending, self.max_version_slots - self.version_slots
        )
        k = max(0, k)
        self.version_slots += k
        return self._issue(k, self.window)

    def _refund(self, tag: int) -> None:
        if tag == self.window:
            self.version_slots -= 1

    def reset_staleness(self) -> None:
        """The trainer synced weights: a new window. Unconditional (verl's name and semantics)."""
        self.version_slots = 0
        self.window += 1
        self.resets += 1

    def on_version(self, version: int) -> None:
        """``reset_staleness`` for a version newer than any seen; a repeated or late notice is a
        no-op, so one weight sync can never open two windows."""
        v = _version(version)
        if v > self.version:
            self.version = v
            self.reset_staleness()

    def on_version_recovered(self, version: int) -> None:
        """A restart at ``version``: a fresh window, slots issued before are void."""
        self.version = _version(version)
        self._void()
        self.reset_staleness()

    # --- verl's names ---
    def acquire_slot(self) -> int | None:
        """The non-blocking form of verl's acquire_slot: an id, or None (wait and retry)."""
        ids = self.try_acquire(1, self.version)
        return ids[0] if ids else None

    def release_slot(self, slot_id: int, outcome: str = "accepted") -> None:
        self.release([slot_id], outcome)

    def state(self) -> dict[str, int | float | str]:
        out = {
            **self._common(),
            "pending": self.pending,
            "version_slots": self.version_slots,
            "resets": self.resets,
            "max_pending_slots": self.max_pending_slots,
            "max_version_slots": self.max_version_slots,
        }
        if self.consumer_batch_size is not None:
            out["consumer_batch_size"] = self.consumer_batch_size
        return out
