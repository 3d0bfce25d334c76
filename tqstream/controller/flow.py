"""Producer admission inside the controller state: slots, capacity and StalenessManager budgets.

An acquire that cannot be granted parks (an ``AdmissionTable`` waiting acquire) and is woken by the
events that free what it waits for — released slots, a new version, rows dropped as stale — which
signal its admission (``Effects.woken``); it fails at its deadline from the state's one heap.
Storage byte quotas, the other half of flow control, wait with the puts (:mod:`.puts`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from tqstream.controller.admission import (
    Admission,
    CapacityAdmission,
    SlotAdmission,
    make_admission,
)
from tqstream.controller.budget import Budgets
from tqstream.controller.deadlines import DeadlineHeap
from tqstream.controller.partition import Partition
from tqstream.controller.peers import peer_of
from tqstream.controller.records import Effects
from tqstream.errors import AdmissionError, InvalidRequestError, RequestTimeoutError
from tqstream.protocol.messages import Acquire, BudgetReport, Slots


class AdmissionRecord(NamedTuple):
    """A producer admission: its policy object and the settings it was created with (creating it
    again must give the same ones)."""

    admission: Admission
    style: str
    config: dict[str, int]


class WaitingAcquire(NamedTuple):
    req: Acquire
    since: float


class AdmissionTable(Mapping[str, AdmissionRecord]):
    """The producer admissions by name (a read-only mapping to :class:`AdmissionRecord`), the
    acquires waiting for a slot, and which peer holds each granted slot (its slots go back when it
    disconnects)."""

    def __init__(self) -> None:
        self._records: dict[str, AdmissionRecord] = {}
        self._waiting: dict[Any, WaitingAcquire] = {}  # by request handle, in arrival order
        self._owners: dict[str, dict[int, Any]] = {}  # admission -> slot id -> peer

    def __getitem__(self, name: str) -> AdmissionRecord:
        return self._records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def install(self, name: str, record: AdmissionRecord) -> None:
        """Add admission ``name`` (or replace it: a checkpoint's, loaded)."""
        self._records[name] = record

    def admission(self, name: str) -> Admission:
        """Admission ``name``'s policy; ``AdmissionError`` when there is none."""
        record = self._records.get(name)
        if record is None:
            raise AdmissionError(
                f"admission {name!r} does not exist; create it first with "
                f"client.admission(style, name={name!r}, ...)",
                name=name,
            )
        return record.admission

    def states(self) -> dict[str, dict[str, int | float | str]]:
        return {name: record.admission.state() for name, record in self._records.items()}

    # --- acquires waiting for a slot ---
    def park(self, handle: Any, waiting: WaitingAcquire) -> None:
        self._waiting[handle] = waiting

    def unpark(self, handle: Any) -> WaitingAcquire | None:
        """Stop the wait of ``handle``'s acquire: how it waited, None when it does not wait."""
        return self._waiting.pop(handle, None)

    def parked(self, handle: Any) -> WaitingAcquire | None:
        return self._waiting.get(handle)

    def waiting(self, name: str | None = None) -> list[tuple[Any, WaitingAcquire]]:
        """The waiting acquires (of admission ``name``) by handle, in arrival order (a copy)."""
        return [(h, w) for h, w in self._waiting.items() if name is None or w.req.name == name]

    # --- who holds the granted slots ---
    def own(self, name: str, slot_ids: Sequence[int], peer: Any) -> None:
        """``peer`` holds these slots of ``name`` (None: nobody to watch, e.g. in-process)."""
        if peer is not None and slot_ids:
            self._owners.setdefault(name, {}).update(dict.fromkeys(slot_ids, peer))

    def disown(self, name: str, slot_ids: Sequence[int]) -> None:
        """The slots were released."""
        owners = self._owners.get(name)
        if owners:
            for s in slot_ids:
                owners.pop(s, None)

    def void(self, name: str) -> None:
        """Every slot of ``name`` was voided (a version recovered): nobody holds any."""
        self._owners.pop(name, None)

    def take_peer(self, peer: Any) -> dict[str, list[int]]:
        """The slots ``peer`` held, by admission, which nobody holds any more."""
        out = {}
        for name, owners in self._owners.items():
            mine = [s for s, o in owners.items() if o == peer]
            for s in mine:
                del owners[s]
            if mine:
                out[name] = mine
        return out


class Flow:
    def __init__(self, deadlines: DeadlineHeap) -> None:
        self.admissions = AdmissionTable()  # owned here: changed by this class only
        self.budgets = Budgets()  # StalenessManagers' pooled budgets
        self.deadlines = deadlines

    def install(self, name: str, record: AdmissionRecord) -> None:
        """Add admission ``name`` as a checkpoint saved it (or replace it)."""
        self.admissions.install(name, record)

    def drop_peer(self, peer: Any, effects: Effects) -> None:
        """The producer ``peer`` went away: its waiting acquires are forgotten, its slots released
        as rejected (capacity comes back) and its StalenessManagers leave their budgets (their
        running rollouts come back)."""
        for handle, _ in self.admissions.waiting():
            if peer_of(handle) == peer:
                self.admissions.unpark(handle)
        for name, mine in self.admissions.take_peer(peer).items():
            if name in self.admissions:
                self.admissions[name].admission.release(mine, "rejected")
                effects.woken.add(name)
        self.budgets.drop_peer(peer)

    def create_admission(self, name: str, style: str, config: dict[str, int]) -> None:
        """Create admission ``name``; creating it again with the same settings is a no-op, so
        every producer and trainer process can call it at start-up."""
        if name in self.budgets:
            raise AdmissionError(
                f"{name!r} is a StalenessManager budget; give the admission another name",
                name=name,
            )
        existing = self.admissions.get(name)
        if existing is not None:
            if (existing.style, existing.config) != (style, config):
                raise AdmissionError(
                    f"admission {name!r} already exists as {existing.style} {existing.config}; it "
                    f"cannot be re-created as {style} {config} (use another name)",
                    name=name,
                )
            return
        record = AdmissionRecord(make_admission(style, **config), style, dict(config))
        self.admissions.install(name, record)

    def acquire(self, req: Acquire, now: float, handle: Any = None) -> list[int] | None:
        """Up to ``req.n`` slots; None when none can be granted yet and the caller waits."""
        adm = self.admissions.admission(req.name)
        if req.n < 1:
            raise InvalidRequestError(f"acquire needs n >= 1, got {req.n}")
        if req.force:
            if not isinstance(adm, CapacityAdmission):
                raise AdmissionError("force= (on_rollout_submitted) is for capacity admission")
            granted = [adm.on_rollout_submitted()]
            self.admissions.own(req.name, granted, peer_of(handle))
            return granted
        granted = adm.try_acquire(req.n, self._acquire_version(adm, req))
        self.admissions.own(req.name, granted, peer_of(handle))
        if granted or not req.wait or handle is None:
            return granted
        if req.timeout == 0:
            raise self.acquire_timeout(req, 0.0)
        self.admissions.park(handle, WaitingAcquire(req, now))
        if req.timeout is not None:
            self.deadlines.add(now + req.timeout, "acquire", handle)
        return None

    @staticmethod
    def _acquire_version(adm: Admission, req: Acquire) -> int:
        """The version an acquire is evaluated at: the producer's, or the newest one published
        (on_version comes after the weight sync, so every producer holds at least that one). A
        parked acquire is re-evaluated at it, so on_version can wake it."""
        return req.version if req.version < 0 else max(req.version, adm.version)

    def acquire_timeout(self, req: Acquire, waited: float) -> RequestTimeoutError:
        state = self.admissions.admission(req.name).state()
        return RequestTimeoutError(
            f"no admission slot of {req.name!r} ({state['style']}) was free within {waited:.1f}s "
            f"for version {req.version}: {state}; the trainer must consume and publish a new "
            f"version (on_version) or producers release slots",
            name=req.name,
        )

    def wake(self, name: str, effects: Effects) -> None:
        adm = self.admissions.admission(name)
        for handle, (req, _) in self.admissions.waiting(name):
            granted = adm.try_acquire(req.n, self._acquire_version(adm, req))
            if granted:
                self.admissions.unpark(handle)
                self.admissions.own(name, granted, peer_of(handle))
                effects.replies.append((handle, Slots(rid=0, slot_ids=granted)))

    def release_slots(self, name: str, slot_ids: list[int], outcome: str) -> Effects:
        self.admissions.admission(name).release(slot_ids, outcome)
        self.admissions.disown(name, slot_ids)
        return Effects(woken={name})

    def admission_version(
        self, name: str, version: int, recovered: bool, reset: bool = False
    ) -> Effects:
        adm = self.admissions.admission(name)
        if reset:
            if not isinstance(adm, SlotAdmission):
                raise AdmissionError(
                    f"reset_staleness is for slots admission; {name!r} is "
                    f"{self.admissions[name].style}: call on_version(v) after each weight sync",
                    name=name,
                )
            adm.reset_staleness()
        elif recovered:
            adm.on_version_recovered(version)  # voids every running slot
            self.admissions.void(name)
        else:
            adm.on_version(version)
        return Effects(woken={name})

    def admission_info(
        self, name: str, version: int | None, enqueued: int
    ) -> tuple[dict[str, int | float | str], int | None]:
        adm = self.admissions.admission(name)
        capacity = None
        if isinstance(adm, CapacityAdmission):
            for _ in range(enqueued):
                adm.on_rollout_enqueued()
            if version is not None:
                capacity = adm.get_capacity(version)
        return adm.state(), capacity

    def budget_report(self, req: BudgetReport, handle: Any = None) -> dict[str, int | float | str]:
        """One StalenessManager's report (``controller/budget.py``); the budget's state after it,
        with ``capacity`` at ``req.version`` when asked."""
        if req.name in self.admissions:
            raise AdmissionError(
                f"{req.name!r} is a {self.admissions[req.name].style} admission, not a "
                f"StalenessManager budget; give the manager another name",
                name=req.name,
            )
        counts = (req.enqueued, req.running, req.accepted, req.rejected)
        limits = (req.max_concurrent, req.consumer_batch_size, req.max_staleness)
        budget = self.budgets.report(
            req.name, req.member, peer_of(handle), limits, req.seq, counts, req.unmatched,
            req.leave,
        )  # fmt: skip
        if budget is None:
            return {"style": "budget", "members": 0}
        state = budget.state()
        if req.version is not None:
            state["capacity"] = budget.capacity(req.version)
        return state

    def budget_back(self, p: Partition, dropped: int, effects: Effects) -> None:
        """Stale evictions of a partition fed by a capacity admission or a StalenessManager
        budget return their budget."""
        name = p.admission
        if not dropped or not name:
            return
        entry = self.admissions.get(name)
        if entry is not None and isinstance(entry.admission, CapacityAdmission):
            entry.admission.on_dropped(dropped)
            effects.woken.add(name)
        elif name in self.budgets:
            self.budgets.by_name[name].on_dropped(dropped)

    def admission_stats(self) -> dict[str, dict[str, int | float | str]]:
        return dict(sorted({**self.admissions.states(), **self.budgets.states()}.items()))

    def expire_acquire(self, handle: Any, now: float, effects: Effects) -> None:
        """A parked acquire's timeout came: it fails."""
        waited = self.admissions.unpark(handle)
        if waited is not None:
            effects.failed.append((handle, self.acquire_timeout(waited.req, now - waited.since)))
