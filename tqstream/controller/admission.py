"""Producer admission: how many samples the producers may start generating now. Pure state.

Producers ask before generating so that samples stay fresh (bounded staleness) and memory stays
bounded. The object lives at the controller and is global: every limit is a global number (all
producers, all data-parallel ranks together) and is applied once, never scaled by a DP size
(AReaL #1396). ``try_acquire`` never blocks; a caller that got fewer slots than it asked for waits,
and the service retries parked callers after every event that may free capacity (``release``,
``on_version``, ``on_version_recovered``, ``reset_staleness``).

Slot ids are issued here and a slot counts only while its id is live, so no slot can be counted
twice (verl #7938): a second release of an id is a no-op, and releasing an id never issued raises.
A full admission refuses, it never evicts: a queue that drops its oldest sample to make room
(verl's ``drop_oldest``) evicts the sample itself and releases its slot as ``dropped``, counted
apart. A ``rejected`` or ``dropped`` release gives its slot's staleness budget back in every style:
the sample never reaches the trainer, so counting it would let rejections starve the trainer and
deadlock a configuration that the constructor accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from tqstream.errors import AdmissionError
from tqstream.staleness import MAX_VERSION, capacity_bound, is_version
from tqstream.types import AdmissionStyle, check_outcome, check_style


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


class PerVersionAdmission(_Slots):
    """JAX-vLLM offloading: at most ``max_per_version`` prompts start under each policy version.

    Only the newest version has a budget: a producer on older weights gets nothing (its samples
    would be stale), and a producer on a newer version than the controller has heard of opens it
    (it can only hold weights the trainer published; the notice may simply arrive later).
    """

    style = "per_version"

    def __init__(self, max_per_version: int, update_interval: int) -> None:
        super().__init__()
        _check_ints("per_version", max_per_version=max_per_version)
        _check_ints("per_version", update_interval=update_interval)
        if update_interval < 1:
            raise AdmissionError(
                f"per_version admission needs update_interval >= 1 (got {update_interval}); set it "
                f"to the number of prompts the trainer consumes per weight update"
            )
        if max_per_version < 1:
            raise AdmissionError(
                f"per_version admission needs max_per_version >= 1 (got {max_per_version}): no "
                f"prompt could start under any version; set it >= update_interval "
                f"({update_interval})"
            )
        if max_per_version < update_interval:
            raise AdmissionError(
                f"per_version admission would deadlock: max_per_version={max_per_version} < "
                f"update_interval={update_interval}: producers stop after {max_per_version} "
                f"prompts under a version while the trainer publishes the next version only after "
                f"{update_interval} prompts, so both wait forever; set max_per_version >= "
                f"{update_interval} (JAX-vLLM's rule MAX_STALENESS >= UPDATE_INTERVAL)"
            )
        self.max_per_version = max_per_version
        self.update_interval = update_interval
        self.admitted = 0  # under self.version, net of rejected refunds

    def try_acquire(self, n: int, version: int) -> list[int]:
        """Up to ``n`` slots within what remains of ``version``'s budget (a partial grant is
        normal: the rest waits for the next version, like vLLM's partial batch)."""
        n = self._check_n(n)
        v = _version(version)
        self.on_version(v)
        if v < self.version:
            return []
        k = min(n, self.max_per_version - self.admitted)
        self.admitted += k
        return self._issue(k, v)

    def _refund(self, tag: int) -> None:
        if tag == self.version:
            self.admitted -= 1

    def on_version(self, version: int) -> None:
        """Open the budget of a newer version; a repeated or late notice is a no-op."""
        v = _version(version)
        if v > self.version:
            self.version = v
            self.admitted = 0

    def on_version_recovered(self, version: int) -> None:
        """A restart at ``version``: its budget is fresh, slots issued before are void."""
        self.version = _version(version)
        self.admitted = 0
        self._void()

    def state(self) -> dict[str, int | float | str]:
        return {
            **self._common(),
            "admitted": self.admitted,
            "remaining": self.max_per_version - self.admitted,
            "max_per_version": self.max_per_version,
            "update_interval": self.update_interval,
        }


_STYLES: dict[AdmissionStyle, tuple[Callable[..., Admission], tuple[str, ...], tuple[str, ...]]] = {
    "capacity": (
        CapacityAdmission,
        ("max_concurrent", "max_staleness", "consumer_batch_size"),
        (),
    ),
    "per_version": (PerVersionAdmission, ("max_per_version", "update_interval"), ()),
    "slots": (SlotAdmission, ("max_pending_slots", "max_version_slots"), ("consumer_batch_size",)),
}


def make_admission(style: str, **config: int | None) -> Admission:
    """Build an admission of ``style`` from its config keys; refuses unknown or missing keys."""
    cls, required, optional = _STYLES[check_style(style)]
    valid_keys = ", ".join(sorted(required + optional))
    unknown = sorted(set(config) - set(required) - set(optional))
    missing = [k for k in required if k not in config]
    if unknown or missing:
        parts = [f"unknown config key(s) {unknown}"] if unknown else []
        parts += [f"missing config key(s) {missing}"] if missing else []
        raise AdmissionError(
            f"admission style {style!r}: {'; '.join(parts)}; valid keys: {valid_keys}",
            style=style,
        )
    return cls(**config)
