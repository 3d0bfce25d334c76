"""Producer admission: AReaL's formula, random interleavings against a model, refused configs.

The state machines drive each style with random acquires, releases (accepted, rejected, twice,
bogus ids), version notices and recoveries, and compare ``state()`` with a plain model after every
step, so every counter is checked all the time; the bounds each style promises are checked at the
moment of each grant. The liveness tests run the tightest accepted configurations with rejections
and show that the trainer keeps publishing versions (no deadlock).
"""

from __future__ import annotations

import random
from typing import Any, get_args

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tqstream.controller.admission import (
    Admission,
    CapacityAdmission,
    PerVersionAdmission,
    SlotAdmission,
    make_admission,
)
from tqstream.errors import AdmissionError, TQStreamError
from tqstream.types import AdmissionStyle


# --- AReaL's get_capacity, transcribed (areal/core/staleness_manager.py) ---
def areal_get_capacity(
    max_concurrent_rollouts: int,
    consumer_batch_size: int,
    max_staleness: int,
    running: int,
    accepted: int,
    current_version: int,
) -> int:
    max_concurrent_rollouts = max(1, max_concurrent_rollouts)
    concurrency_capacity = max_concurrent_rollouts - running
    ofp = max_staleness
    sample_cnt = accepted + running
    consumer_bs = max(1, consumer_batch_size)
    staleness_capacity = (ofp + current_version + 1) * consumer_bs - sample_cnt
    return min(concurrency_capacity, staleness_capacity)


def _capacity_with(
    max_staleness: int, running: int, accepted: int, max_concurrent: int = 4, cbs: int = 8
) -> CapacityAdmission:
    adm = CapacityAdmission(max_concurrent, max_staleness, cbs)
    done = [adm.on_rollout_submitted() for _ in range(accepted)]
    for slot in done:
        adm.on_rollout_accepted(slot)
    for _ in range(running):
        adm.on_rollout_submitted()
    assert (adm.running, adm.accepted) == (running, accepted)
    return adm


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("version", [0, 1, 2, 3])
@pytest.mark.parametrize(
    ("running", "accepted"), [(0, 0), (2, 0), (4, 0), (0, 8), (3, 5), (1, 16), (4, 20), (0, 40)]
)
def test_get_capacity_matches_areal(
    max_staleness: int, version: int, running: int, accepted: int
) -> None:
    adm = _capacity_with(max_staleness, running, accepted)
    want = areal_get_capacity(4, 8, max_staleness, running, accepted, version)
    assert adm.get_capacity(version) == want
    assert len(adm.try_acquire(10, version)) == max(0, want)


@pytest.mark.parametrize(
    ("max_staleness", "version", "running", "accepted", "capacity"),
    [
        (0, 0, 0, 0, 4),  # concurrency-bound
        (0, 0, 0, 8, 0),  # on-policy: version 0's batch is complete
        (0, 0, 2, 5, 1),  # 8 - 7 staleness room, 2 concurrency room
        (1, 0, 0, 8, 4),  # one version ahead: 16 - 8
        (1, 0, 0, 14, 2),
        (2, 1, 0, 40, -8),  # over the bound (e.g. forced submits): negative, grants nothing
        (0, 3, 4, 0, 0),  # concurrency full
    ],
)
def test_capacity_worked_examples(
    max_staleness: int, version: int, running: int, accepted: int, capacity: int
) -> None:
    adm = _capacity_with(max_staleness, running, accepted)
    assert adm.get_capacity(version) == capacity
    assert len(adm.try_acquire(3, version)) == min(3, max(0, capacity))


def test_recovery_does_not_inflate_capacity() -> None:
    adm = CapacityAdmission(max_concurrent=100, max_staleness=1, consumer_batch_size=8)
    old = adm.try_acquire(3, 0)
    adm.on_version_recovered(5)  # restart from the checkpoint of version 5
    assert adm.accepted == 40 and adm.running == 0
    assert (
        adm.get_capacity(5) == 16 == areal_get_capacity(100, 8, 1, 0, 0, 0)
    )  # as at a fresh start
    adm.release(old, "accepted")  # void: no effect
    assert adm.accepted == 40 and adm.get_capacity(5) == 16


def test_areal_names_and_enqueued() -> None:
    adm = CapacityAdmission(max_concurrent=1, max_staleness=0, consumer_batch_size=2)
    adm.on_rollout_enqueued()
    a = adm.on_rollout_submitted()
    b = adm.on_rollout_submitted()  # regardless of capacity, like AReaL
    assert adm.get_capacity(0) == -1
    adm.on_rollout_accepted(a)
    adm.on_rollout_rejected(b)
    adm.on_rollout_accepted(a)  # twice: no-op
    s = adm.state()
    assert (s["enqueued"], s["running"], s["accepted"], s["rejected"]) == (1, 0, 1, 1)


def test_slot_verl_names() -> None:
    adm = SlotAdmission(max_pending_slots=1, max_version_slots=2)
    a = adm.acquire_slot()
    assert a == 1 and adm.acquire_slot() is None  # layer 1 full
    adm.release_slot(a)
    b = adm.acquire_slot()
    assert b == 2
    adm.release_slot(b)
    assert adm.acquire_slot() is None  # layer 2 full until the trainer syncs
    adm.on_version(1)
    adm.on_version(1)  # repeated notice: no second window
    assert adm.resets == 1 and adm.acquire_slot() == 3


def test_per_version_partial_grants_and_stale_versions() -> None:
    adm = PerVersionAdmission(max_per_version=5, update_interval=3)
    assert len(adm.try_acquire(3, 0)) == 3
    assert len(adm.try_acquire(3, 0)) == 2  # partial: the rest waits for version 1
    assert adm.try_acquire(1, 0) == []
    adm.on_version(1)
    assert adm.try_acquire(1, 0) == []  # stale weights get nothing
    assert len(adm.try_acquire(9, 1)) == 5
    assert len(adm.try_acquire(2, 2)) == 2  # a newer version opens its budget


# --- refused configurations and misuse: exact messages ---
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "capacity",
        {"max_concurrent": 0, "max_staleness": 1, "consumer_batch_size": 8},
        "capacity admission needs max_concurrent >= 1 (got 0): no rollout could ever run, so the "
        "trainer would wait forever; set it to the number of rollouts all producers together may "
        "run at once",
    ),
    (
        "capacity",
        {"max_concurrent": 4, "max_staleness": 1, "consumer_batch_size": 0},
        "capacity admission needs consumer_batch_size >= 1 (got 0): the staleness bound "
        "(max_staleness + version + 1) * consumer_batch_size would admit nothing; set it to the "
        "trainer's global batch size in samples (all data-parallel ranks together, not per rank)",
    ),
    (
        "capacity",
        {"max_concurrent": 4, "max_staleness": -1, "consumer_batch_size": 8},
        "capacity admission needs max_staleness >= 0 (got -1): at version 0 the bound "
        "(max_staleness + 1) * consumer_batch_size would admit nothing, so the trainer would never "
        "publish version 1; set 0 for on-policy samples or the number of versions a sample may lag "
        "behind the trainer",
    ),
    (
        "capacity",
        {"max_concurrent": 4.0, "max_staleness": 1, "consumer_batch_size": 8},
        "capacity admission needs an int max_concurrent (got 4.0 of type float); pass a whole "
        "number of samples or versions",
    ),
    (
        "slots",
        {"max_pending_slots": 0, "max_version_slots": 8},
        "slots admission needs max_pending_slots >= 1 (got 0): no sample could ever be in flight, "
        "so the trainer would wait forever; set it to the number of samples all producers together "
        "may generate at once",
    ),
    (
        "slots",
        {"max_pending_slots": 4, "max_version_slots": 0},
        "slots admission needs max_version_slots >= 1 (got 0): no sample could start before the "
        "next weight sync, which needs samples; set it to the number of samples producers may "
        "start per weight version",
    ),
    (
        "slots",
        {"max_pending_slots": 4, "max_version_slots": 8, "consumer_batch_size": 0},
        "slots admission needs consumer_batch_size >= 1 or None (got 0); set it to the trainer's "
        "global batch size in samples",
    ),
    (
        "slots",
        {"max_pending_slots": 4, "max_version_slots": 6, "consumer_batch_size": 8},
        "slots admission would deadlock: max_version_slots=6 < consumer_batch_size=8: the trainer "
        "syncs weights (which resets the window) only after consuming 8 samples, but only 6 can "
        "start per window; set max_version_slots >= 8",
    ),
    (
        "per_version",
        {"max_per_version": 5, "update_interval": 0},
        "per_version admission needs update_interval >= 1 (got 0); set it to the number of prompts "
        "the trainer consumes per weight update",
    ),
    (
        "per_version",
        {"max_per_version": 0, "update_interval": 1},
        "per_version admission needs max_per_version >= 1 (got 0): no prompt could start under any "
        "version; set it >= update_interval (1)",
    ),
    (
        "per_version",
        {"max_per_version": 3, "update_interval": 5},
        "per_version admission would deadlock: max_per_version=3 < update_interval=5: producers "
        "stop after 3 prompts under a version while the trainer publishes the next version only "
        "after 5 prompts, so both wait forever; set max_per_version >= 5 (JAX-vLLM's rule "
        "MAX_STALENESS >= UPDATE_INTERVAL)",
    ),
    (
        "nope",
        {},
        "unknown admission style 'nope'; valid styles: 'capacity', 'per_version', 'slots'",
    ),
    (
        "capacity",
        {"max_concurrent": 4, "max_staleness": 1, "consumer_batch_size": 8, "dp_size": 2},
        "admission style 'capacity': unknown config key(s) ['dp_size']; valid keys: "
        "consumer_batch_size, max_concurrent, max_staleness",
    ),
    (
        "slots",
        {"max_pending_slots": 4},
        "admission style 'slots': missing config key(s) ['max_version_slots']; valid keys: "
        "consumer_batch_size, max_pending_slots, max_version_slots",
    ),
    (
        "per_version",
        {"max_per_version": 4, "interval": 2},
        "admission style 'per_version': unknown config key(s) ['interval']; missing config key(s) "
        "['update_interval']; valid keys: max_per_version, update_interval",
    ),
]


@pytest.mark.parametrize(("style", "config", "message"), REFUSED)
def test_refused_configuration(style: str, config: dict[str, Any], message: str) -> None:
    with pytest.raises(AdmissionError) as err:
        make_admission(style, **config)
    assert str(err.value) == message
    assert isinstance(err.value, ValueError) and isinstance(err.value, TQStreamError)
    assert err.value.code == "admission"


@pytest.mark.parametrize("style", get_args(AdmissionStyle))
def test_every_style_the_wire_carries_is_one_the_controller_builds(style: str) -> None:
    with pytest.raises(AdmissionError) as err:
        make_admission(style)  # known: only its config keys are missing
    assert str(err.value).startswith(f"admission style {style!r}: missing config key(s)")


def test_direct_constructors_refuse_too() -> None:
    with pytest.raises(AdmissionError, match="would deadlock"):
        SlotAdmission(max_pending_slots=4, max_version_slots=6, consumer_batch_size=8)
    with pytest.raises(AdmissionError, match="would deadlock"):
        PerVersionAdmission(max_per_version=3, update_interval=5)
    with pytest.raises(AdmissionError, match="max_staleness >= 0"):
        CapacityAdmission(max_concurrent=4, max_staleness=-1, consumer_batch_size=8)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda a: a.release([1, 7], "accepted"),
            "release of slot id(s) [7] that this capacity admission never issued (issued: 1..2); "
            "pass the ids returned by try_acquire",
        ),
        (
            lambda a: a.release([0], "rejected"),
            "release of slot id(s) [0] that this capacity admission never issued (issued: 1..2); "
            "pass the ids returned by try_acquire",
        ),
        (
            lambda a: a.release([1], "done"),
            "release outcome must be 'accepted', 'rejected' or 'dropped' (got 'done')",
        ),
        (
            lambda a: a.release(1, "accepted"),
            "release needs an iterable of slot ids (got 1)",
        ),
        (lambda a: a.try_acquire(-1, 0), "try_acquire needs a slot count n >= 0 (got -1)"),
        (
            lambda a: a.try_acquire(1, -2),
            "policy version must be an int in 0..2147483647 (got -2); pass the weight version the "
            "trainer published",
        ),
    ],
)
def test_misuse_is_refused_and_changes_nothing(call: Any, message: str) -> None:
    adm = CapacityAdmission(max_concurrent=4, max_staleness=0, consumer_batch_size=8)
    assert adm.try_acquire(2, 0) == [1, 2]
    before = adm.state()
    with pytest.raises(AdmissionError) as err:
        call(adm)
    assert str(err.value) == message
    assert adm.state() == before


def test_release_before_any_grant() -> None:
    adm = PerVersionAdmission(max_per_version=2, update_interval=1)
    with pytest.raises(AdmissionError, match=r"never issued \(issued: none yet\)"):
        adm.release([1], "accepted")


# --- liveness: the tightest accepted configurations keep the trainer going despite rejections ---
def _drive(adm: Admission, batch: int, steps: int, seed: int) -> int:
    """Producers take every slot they can and finish in random order, rejecting ~40%; the trainer
    publishes a version after every ``batch`` accepted samples. Returns the version reached."""
    rng = random.Random(seed)
    version, accepted, running = 0, 0, []
    for _ in range(steps):
        running += adm.try_acquire(rng.randint(1, 4), version)
        if not running:
            break  # nothing in flight and nothing granted: deadlock
        rng.shuffle(running)
        k = rng.randint(1, len(running))
        done, running = running[:k], running[k:]
        for slot in done:
            ok = rng.random() > 0.4
            adm.release([slot], "accepted" if ok else "rejected")
            accepted += ok
        if accepted >= batch:
            accepted -= batch
            version += 1
            adm.on_version(version)
    return version


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    "make",
    [
        lambda: (CapacityAdmission(max_concurrent=2, max_staleness=0, consumer_batch_size=3), 3),
        lambda: (SlotAdmission(max_pending_slots=2, max_version_slots=3, consumer_batch_size=3), 3),
        lambda: (PerVersionAdmission(max_per_version=3, update_interval=3), 3),
    ],
)
def test_tightest_configuration_never_deadlocks(make: Any, seed: int) -> None:
    adm, batch = make()
    assert _drive(adm, batch, steps=400, seed=seed) >= 20


# --- state machines ---
class _Machine(RuleBasedStateMachine):
    """The parts common to the styles: ids, releases and their model."""

    adm: Any

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # model: live id -> tag
        self.issued = 0
        self.released: list[int] = []
        self.n_released = 0
        self.n_voided = 0
        self.accepted = 0
        self.rejected = 0
        self.dropped = 0
        self.version = 0

    def _grant(self, ids: list[int], expected: int, tag: int) -> None:
        assert ids == list(range(self.issued + 1, self.issued + 1 + expected))
        self.issued += expected
        self.live.update(dict.fromkeys(ids, tag))

    def _refund(self, tag: int) -> None:
        pass

    def expected(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "running": len(self.live),
            "granted": self.issued,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "dropped": self.dropped,
        }

    @precondition(lambda self: self.issued > 0)
    @rule(data=st.data(), outcome=st.sampled_from(["accepted", "rejected", "dropped"]))
    def release(self, data: st.DataObject, outcome: str) -> None:
        ids = data.draw(st.lists(st.integers(1, self.issued), max_size=5))
        self.adm.release(ids, outcome)
        for i in ids:
            tag = self.live.pop(i, None)
            if tag is None:
                continue
            self.released.append(i)
            self.n_released += 1
            if outcome == "accepted":
                self.accepted += 1
                continue
            if outcome == "dropped":
                self.dropped += 1
            else:
                self.rejected += 1
            self._refund(tag)

    @precondition(lambda self: self.released)
    @rule(data=st.data(), outcome=st.sampled_from(["accepted", "rejected", "dropped"]))
    def double_release(self, data: st.DataObject, outcome: str) -> None:
        before = self.adm.state()
        self.adm.release([data.draw(st.sampled_from(self.released))], outcome)
        assert self.adm.state() == before

    @rule(data=st.data())
    def bogus_release(self, data: st.DataObject) -> None:
        bogus = data.draw(
            st.one_of(st.integers(-3, 0), st.integers(self.issued + 1, self.issued + 5))
        )
        ids = [*list(self.live)[:2], bogus]
        before = self.adm.state()
        with pytest.raises(AdmissionError, match="never issued"):
            self.adm.release(ids, "accepted")
        assert self.adm.state() == before  # all or nothing

    def _void(self, version: int) -> None:
        self.n_voided += len(self.live)
        self.released += list(self.live)  # releasing a voided id is a no-op, like a second release
        self.live.clear()
        self.version = version

    @invariant()
    def state_matches_model(self) -> None:
        state = self.adm.state()
        assert state == {**state, **self.expected()}
        assert self.adm.running == self.issued - self.n_released - self.n_voided >= 0
        assert all(isinstance(v, (int, float, str)) for v in state.values())


SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None)


class CapacityMachine(_Machine):
    @initialize(mc=st.integers(1, 6), ms=st.integers(0, 3), cbs=st.integers(1, 5))
    def init(self, mc: int, ms: int, cbs: int) -> None:
        self.adm = CapacityAdmission(mc, ms, cbs)
        self.mc, self.ms, self.cbs = mc, ms, cbs
        self.forced = 0  # live slots granted by on_rollout_submitted, which ignores capacity

    def capacity(self, v: int) -> int:
        running = len(self.live)
        return areal_get_capacity(self.mc, self.cbs, self.ms, running, self.accepted, v)

    @rule(n=st.integers(0, 8), v=st.integers(0, 6))
    def acquire(self, n: int, v: int) -> None:
        want = min(n, max(0, self.capacity(v)))
        ids = self.adm.try_acquire(n, v)
        self._grant(ids, want, 0)
        if ids:  # the bound held at the moment of the grant
            assert self.accepted + len(self.live) <= (self.ms + v + 1) * self.cbs
            assert len(self.live) <= self.mc

    @rule()
    def submit(self) -> None:
        self._grant([self.adm.on_rollout_submitted()], 1, 0)

    @rule(v=st.integers(0, 8))
    def on_version(self, v: int) -> None:
        self.adm.on_version(v)
        self.version = max(self.version, v)

    @rule(v=st.integers(0, 8))
    def recover(self, v: int) -> None:
        self.adm.on_version_recovered(v)
        self._void(v)
        self.accepted = v * self.cbs
        assert self.adm.get_capacity(v) == min(self.mc, (self.ms + 1) * self.cbs)

    def expected(self) -> dict[str, Any]:
        return {**super().expected(), "style": "capacity", "capacity": self.capacity(self.version)}


class SlotMachine(_Machine):
    @initialize(mp=st.integers(1, 5), mv=st.integers(1, 6), data=st.data())
    def init(self, mp: int, mv: int, data: st.DataObject) -> None:
        cbs = data.draw(st.none() | st.integers(1, mv))
        self.adm = SlotAdmission(mp, mv, cbs)
        self.mp, self.mv = mp, mv
        self.version_slots = 0
        self.window = 0
        self.resets = 0

    def _refund(self, tag: int) -> None:
        if tag == self.window:
            self.version_slots -= 1

    @rule(n=st.integers(0, 8), v=st.integers(0, 6))
    def acquire(self, n: int, v: int) -> None:
        want = max(0, min(n, self.mp - len(self.live), self.mv - self.version_slots))
        self._grant(self.adm.try_acquire(n, v), want, self.window)
        self.version_slots += want
        assert len(self.live) <= self.mp and 0 <= self.version_slots <= self.mv

    @rule()
    def acquire_slot(self) -> None:
        slot = self.adm.acquire_slot()
        want = int(len(self.live) < self.mp and self.version_slots < self.mv)
        self._grant([] if slot is None else [slot], want, self.window)
        self.version_slots += want

    def _reset(self) -> None:
        self.version_slots = 0
        self.window += 1
        self.resets += 1

    @rule()
    def reset_staleness(self) -> None:
        self.adm.reset_staleness()
        self._reset()

    @rule(v=st.integers(0, 8))
    def on_version(self, v: int) -> None:
        self.adm.on_version(v)
        if v > self.version:
            self.version = v
            self._reset()

    @rule(v=st.integers(0, 8))
    def recover(self, v: int) -> None:
        self.adm.on_version_recovered(v)
        self._void(v)
        self._reset()

    def expected(self) -> dict[str, Any]:
        return {
            **super().expected(),
            "style": "slots",
            "pending": len(self.live),
            "version_slots": self.version_slots,
            "resets": self.resets,
        }


class PerVersionMachine(_Machine):
    @initialize(ui=st.integers(1, 4), extra=st.integers(0, 4))
    def init(self, ui: int, extra: int) -> None:
        self.adm = PerVersionAdmission(ui + extra, ui)
        self.max = ui + extra
        self.epoch = 0
        self.net: dict[tuple[int, int], int] = {}  # (epoch, version) -> admitted net of refunds

    def _key(self) -> tuple[int, int]:
        return (self.epoch, self.version)

    def _refund(self, tag: int) -> None:
        if tag == self.version:
            self.net[self._key()] -= 1

    @rule(n=st.integers(0, 8), v=st.integers(0, 6))
    def acquire(self, n: int, v: int) -> None:
        self.version = max(self.version, v)
        admitted = self.net.setdefault(self._key(), 0)
        want = 0 if v < self.version else min(n, self.max - admitted)
        self._grant(self.adm.try_acquire(n, v), want, v)
        self.net[self._key()] += want
        assert all(0 <= k <= self.max for k in self.net.values())

    @rule(v=st.integers(0, 8))
    def on_version(self, v: int) -> None:
        self.adm.on_version(v)
        self.version = max(self.version, v)

    @rule(v=st.integers(0, 8))
    def recover(self, v: int) -> None:
        self.adm.on_version_recovered(v)
        self._void(v)
        self.epoch += 1

    def expected(self) -> dict[str, Any]:
        admitted = self.net.get(self._key(), 0)
        return {
            **super().expected(),
            "style": "per_version",
            "admitted": admitted,
            "remaining": self.max - admitted,
        }


TestCapacityMachine = SETTINGS(CapacityMachine).TestCase
TestSlotMachine = SETTINGS(SlotMachine).TestCase
TestPerVersionMachine = SETTINGS(PerVersionMachine).TestCase


def test_stale_drops_give_capacity_back() -> None:
    """Accepted samples evicted as stale no longer hold budget (else the trainer starves)."""
    adm = CapacityAdmission(max_concurrent=4, max_staleness=0, consumer_batch_size=2)
    ids = adm.try_acquire(2, 0)
    adm.release(ids, "accepted")
    assert adm.get_capacity(0) == 0
    adm.on_dropped(2)
    assert adm.get_capacity(0) == 2
    assert adm.state()["dropped"] == 2 and adm.state()["accepted"] == 0
    adm.on_dropped(5)  # never below zero accepted
    assert adm.state()["accepted"] == 0 and adm.state()["dropped"] == 2
