"""What every admission style shares: the protocol, the checks of a config, and the live-slot
bookkeeping (``_Slots``) that makes a slot count once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from tqstream.errors import AdmissionError
from tqstream.staleness import MAX_VERSION, is_version
from tqstream.types import check_outcome


class Admission(Protocol):
    style: str
    version: int

    def try_acquire(self, n: int, version: int) -> list[int]: ...
    def release(self, slot_ids: Iterable[int], outcome: str) -> None: ...
    def on_version(self, version: int) -> None: ...
    def on_version_recovered(self, version: int) -> None: ...
    def state(self) -> dict[str, int | float | str]: ...
    def checkpoint(self) -> tuple[dict[str, int | None], dict[int, int]]: ...
    def restore(self, counters: dict[str, int | None], live: dict[int, int]) -> None: ...


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ints(style: str, **config: object) -> None:
    for name, value in config.items():
        if not _is_int(value):
            raise AdmissionError(
                f"{style} admission needs an int {name} (got {value!r} of type "
                f"{type(value).__name__}); pass a whole number of samples or versions",
                style=style,
                key=name,
            )


def _version(version: object) -> int:
    if not is_version(version):
        raise AdmissionError(
            f"policy version must be an int in 0..{MAX_VERSION} (got {version!r}); pass the weight "
            f"version the trainer published"
        )
    return int(version)


class _Slots:
    """Slot bookkeeping shared by the styles.

    ``_live`` maps every granted, unreleased id to a tag (the window or version it was counted
    in). Released ids are not remembered: an id below ``_next`` that is not live was released or
    voided by a recovery, so memory stays O(running). Ids start at 1 so that ``if slot_id:`` can
    never mistake a real id for ``None``. ``running`` is ``len(_live)``: it cannot drift.
    """

    style = ""

    def __init__(self) -> None:
        self._next = 1
        self._live: dict[int, int] = {}
        self.version = 0  # the newest version seen
        self.granted = 0
        self.accepted = 0
        self.rejected = 0
        self.dropped = 0

    @property
    def running(self) -> int:
        return len(self._live)

    def _check_n(self, n: object) -> int:
        if not _is_int(n) or n < 0:  # type: ignore[operator]
            raise AdmissionError(f"try_acquire needs a slot count n >= 0 (got {n!r})")
        return n  # type: ignore[return-value]

    def _issue(self, k: int, tag: int) -> list[int]:
        ids = list(range(self._next, self._next + k))
        self._next += k
        self.granted += k
        self._live.update(dict.fromkeys(ids, tag))
        return ids

    def release(self, slot_ids: Iterable[int], outcome: str) -> None:
        """End slots: ``accepted`` (the sample reached storage), ``rejected`` (discarded) or
        ``dropped`` (stored, then evicted before any trainer took it).

        All ids are checked before anything changes, so a refused call changes nothing.
        """
        check_outcome(outcome)
        if _is_int(slot_ids) or isinstance(slot_ids, (str, bytes)):
            raise AdmissionError(f"release needs an iterable of slot ids (got {slot_ids!r})")
        ids = list(slot_ids)
        bogus = [i for i in ids if not _is_int(i) or not 1 <= i < self._next]
        if bogus:
            issued = f"1..{self._next - 1}" if self._next > 1 else "none yet"
            raise AdmissionError(
                f"release of slot id(s) {bogus} that this {self.style} admission never issued "
                f"(issued: {issued}); pass the ids returned by try_acquire",
                slot_ids=bogus,
            )
        for i in ids:
            tag = self._live.pop(i, None)
            if tag is None:
                continue  # released before, or voided by a recovery
            if outcome == "accepted":
                self.accepted += 1
                continue
            if outcome == "dropped":
                self.dropped += 1
            else:
                self.rejected += 1
            self._refund(tag)

    def _refund(self, tag: int) -> None:
        """Give a rejected slot's staleness budget back (if it still counts against one)."""

    def _void(self) -> None:
        self._live.clear()  # their ids stay issued: releasing them later is a no-op

    def checkpoint(self) -> tuple[dict[str, int | None], dict[int, int]]:
        """Every counter and the live slots (id -> tag): what :meth:`restore` continues from. Slots
        granted and not released stay running in the restored admission; a producer restarted
        from the checkpoint calls ``on_version_recovered`` to void them, as after any restart."""
        counters = {k: v for k, v in vars(self).items() if k != "_live"}
        return counters, dict(self._live)

    def restore(self, counters: dict[str, int | None], live: dict[int, int]) -> None:
        """Continue from what :meth:`checkpoint` returned (for an admission of the same style
        and settings); refuses counters this style does not have, or slots it never issued. A
        counter the checkpoint lacks (saved before it was counted) starts at its initial value."""
        mine = {k for k in vars(self) if k != "_live"}
        unknown = sorted(set(counters) - mine)
        if unknown or not all(v is None or _is_int(v) for v in counters.values()):
            raise AdmissionError(
                f"{self.style} admission cannot restore counters {sorted(counters)} (expected "
                f"{sorted(mine)}, as whole numbers)",
                style=self.style,
            )
        next_id = counters.get("_next")
        if not isinstance(next_id, int) or any(not 1 <= i < next_id for i in live):
            raise AdmissionError(f"{self.style} admission: live slots beyond the ids it issued")
        vars(self).update(counters)
        self._live = dict(live)

    def _common(self) -> dict[str, int | float | str]:
        return {
            "style": self.style,
            "version": self.version,
            "running": self.running,
            "granted": self.granted,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "dropped": self.dropped,
        }
