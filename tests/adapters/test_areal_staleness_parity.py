"""Every case of AReaL 1.0.4's ``tests/test_staleness_manager.py`` (and the two recovery cases of
the ``on_version_recovered`` the 1.0.4 wheel ships), run against AReaL's ``StalenessManager`` and
tqstream's side by side: the same scenarios, the same expected numbers.

tqstream's managers are built exactly as AReaL's are (no client, no name): each finds the
process's default cluster and keeps a budget of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("areal")

from areal.infra.staleness_manager import StalenessManager as AReaLStalenessManager

from tqstream.adapters.areal import StalenessManager

Make = Callable[..., Any]


class Version:
    """A version provider: what AReaL's engines are to the manager."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version


@pytest.fixture(params=["areal", "tqstream"])
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """Builds a manager of the class under test with AReaL's keyword arguments."""
    cls = AReaLStalenessManager if request.param == "areal" else StalenessManager
    built: list[Any] = []

    def build(version: Version | None = None, **limits: int) -> Any:
        manager = cls(version_provider=version or Version(), **limits)
        built.append(manager)
        return manager

    yield build
    for manager in built:
        if isinstance(manager, StalenessManager):
            manager.close()


def run(manager: Any, n: int, *outcomes: str) -> None:
    """``n`` rollouts enqueued then submitted; then each named outcome once per rollout."""
    for _ in range(n):
        manager.on_rollout_enqueued()
        manager.on_rollout_submitted()
    for outcome in outcomes:
        getattr(manager, f"on_rollout_{outcome}")()


def counts(manager: Any) -> tuple[int, int, int, int]:
    s = manager.get_stats()
    return s.enqueued, s.running, s.accepted, s.rejected


# --- basics ---


def test_limits_are_kept_and_counts_start_at_zero(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    assert (m.max_concurrent_rollouts, m.consumer_batch_size, m.max_staleness) == (10, 4, 2)
    assert counts(m) == (0, 0, 0, 0)


def test_fresh_manager_is_bound_by_concurrency(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    assert m.get_capacity() == 10  # min(10, 3 * 4)


def test_fresh_manager_with_a_wide_staleness_window(make: Make) -> None:
    m = make(max_concurrent_rollouts=100, consumer_batch_size=32, max_staleness=10)
    assert m.get_capacity() == 100  # min(100, 11 * 32)


# --- the capacity formula ---


def test_running_rollouts_use_concurrency(make: Make) -> None:
    m = make(max_concurrent_rollouts=5, consumer_batch_size=2, max_staleness=10)
    run(m, 3)
    assert m.get_capacity() == 2


def test_staleness_bounds_a_fresh_manager(make: Make) -> None:
    m = make(max_concurrent_rollouts=100, consumer_batch_size=4, max_staleness=2)
    assert m.get_capacity() == 12  # (2 + 0 + 1) * 4


def test_the_bound_grows_with_the_version(make: Make) -> None:
    version = Version()
    m = make(version, max_concurrent_rollouts=1000, consumer_batch_size=4, max_staleness=2)
    at_0 = m.get_capacity()
    version.set_version(5)
    at_5 = m.get_capacity()
    assert (at_0, at_5) == (12, 32)


def test_running_rollouts_count_against_both_limits(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    run(m, 3)
    assert m.get_capacity() == 7  # min(10 - 3, 12 - 3)


def test_accepted_rollouts_count_against_the_bound(make: Make) -> None:
    m = make(max_concurrent_rollouts=20, consumer_batch_size=4, max_staleness=2)
    for _ in range(5):
        run(m, 1, "accepted")
    assert m.get_capacity() == 7  # min(20, 12 - 5)


def test_capacity_reaches_zero_at_the_concurrency_limit(make: Make) -> None:
    m = make(max_concurrent_rollouts=5, consumer_batch_size=2, max_staleness=5)
    run(m, 5)
    assert m.get_capacity() == 0  # min(5 - 5, 12 - 5)


def test_capacity_goes_negative_beyond_the_limits(make: Make) -> None:
    m = make(max_concurrent_rollouts=3, consumer_batch_size=2, max_staleness=1)
    run(m, 10)
    assert m.get_capacity() < 0


def test_zero_limits_are_clamped_to_one(make: Make) -> None:
    m = make(max_concurrent_rollouts=0, consumer_batch_size=0, max_staleness=0)
    assert m.get_capacity() == 1  # min(max(1, 0), (0 + 0 + 1) * max(1, 0))


# --- one rollout's lifecycle ---


def test_submission_moves_enqueued_to_running(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    run(m, 1)
    assert counts(m) == (0, 1, 0, 0)


def test_acceptance_ends_a_running_rollout(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    run(m, 1, "accepted")
    assert counts(m) == (0, 0, 1, 0)


def test_rejection_ends_a_running_rollout(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    run(m, 1, "rejected")
    assert counts(m) == (0, 0, 0, 1)


def test_several_rollouts_with_both_outcomes(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    run(m, 5, *["accepted"] * 3, *["rejected"] * 2)
    assert counts(m) == (0, 0, 3, 2)


def test_an_outcome_without_a_submission_drives_running_below_zero(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    m.on_rollout_accepted()  # a misuse that must not crash
    assert counts(m) == (0, -1, 1, 0)


# --- threads ---


def _threads(target: Callable[[], None], n: int) -> None:
    threads = [threading.Thread(target=target) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_submissions_from_many_threads(make: Make) -> None:
    m = make(max_concurrent_rollouts=1000, consumer_batch_size=32, max_staleness=10)
    _threads(lambda: run(m, 100), 10)
    assert counts(m) == (0, 1000, 0, 0)


def test_submissions_and_outcomes_racing(make: Make) -> None:
    m = make(max_concurrent_rollouts=1000, consumer_batch_size=32, max_staleness=10)
    with ThreadPoolExecutor(max_workers=3) as pool:
        jobs = [
            pool.submit(run, m, 100),
            pool.submit(run, m, 0, *["accepted"] * 50),
            pool.submit(run, m, 0, *["rejected"] * 50),
        ]
        for job in jobs:
            job.result()
    assert counts(m) == (0, 0, 50, 50)


def test_capacity_asked_from_many_threads(make: Make) -> None:
    m = make(max_concurrent_rollouts=100, consumer_batch_size=32, max_staleness=10)
    seen: list[int] = []
    _threads(lambda: seen.extend(m.get_capacity() for _ in range(100)), 5)
    assert len(seen) == 500 and set(seen) == {100}


def test_stats_read_from_many_threads(make: Make) -> None:
    m = make(max_concurrent_rollouts=100, consumer_batch_size=32, max_staleness=10)
    run(m, 10)
    seen: list[tuple[int, int, int, int]] = []
    _threads(lambda: seen.extend(counts(m) for _ in range(100)), 5)
    assert len(seen) == 500 and all(min(c[:3]) >= 0 for c in seen)


# --- edge cases ---


def test_on_policy_window(make: Make) -> None:
    version = Version()
    m = make(version, max_concurrent_rollouts=100, consumer_batch_size=8, max_staleness=0)
    assert m.get_capacity() == 8
    version.set_version(5)
    assert m.get_capacity() == 48  # (0 + 5 + 1) * 8


def test_a_huge_version_leaves_concurrency_as_the_bound(make: Make) -> None:
    version = Version()
    m = make(version, max_concurrent_rollouts=10000, consumer_batch_size=64, max_staleness=10)
    version.set_version(1_000_000)
    assert m.get_capacity() == 10000


def test_batches_of_one(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=1, max_staleness=2)
    assert m.get_capacity() == 3


def test_rejections_give_all_the_capacity_back(make: Make) -> None:
    m = make(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=2)
    for _ in range(10):
        run(m, 1, "rejected")
    assert counts(m) == (0, 0, 0, 10)
    assert m.get_capacity() == 10


def test_some_accepted_some_rejected(make: Make) -> None:
    m = make(max_concurrent_rollouts=20, consumer_batch_size=8, max_staleness=3)
    run(m, 20, *["accepted"] * 15, *["rejected"] * 5)
    assert counts(m) == (0, 0, 15, 5)
    assert m.get_capacity() == 17  # min(20, 4 * 8 - 15)


# --- as in training ---


def test_a_training_step_moves_the_bound(make: Make) -> None:
    version = Version()
    m = make(version, max_concurrent_rollouts=32, consumer_batch_size=16, max_staleness=2)
    run(m, 16, *["accepted"] * 14, *["rejected"] * 2)
    version.set_version(1)
    assert m.get_capacity() == 32  # min(32, 4 * 16 - 14)
    run(m, 16)
    assert counts(m) == (0, 16, 14, 2)


def test_a_burst_beyond_the_limits_drains(make: Make) -> None:
    m = make(max_concurrent_rollouts=50, consumer_batch_size=32, max_staleness=5)
    run(m, 100)
    assert counts(m)[:2] == (0, 100)
    assert m.get_capacity() < 0
    run(m, 0, *["accepted"] * 80, *["rejected"] * 20)
    assert m.get_capacity() > 0


def test_a_slow_trainer_exhausts_the_window(make: Make) -> None:
    m = make(max_concurrent_rollouts=100, consumer_batch_size=8, max_staleness=3)
    for _ in range(30):
        run(m, 1, "accepted")
    assert m.get_capacity() == 2  # 4 * 8 - 30


@pytest.mark.parametrize(
    ("max_concurrent", "batch_size", "max_staleness"),
    [(10, 4, 2), (100, 32, 5), (1, 1, 0), (1000, 128, 10), (50, 16, 3)],
)
def test_settings_are_kept_and_capacity_is_an_int(
    make: Make, max_concurrent: int, batch_size: int, max_staleness: int
) -> None:
    m = make(
        max_concurrent_rollouts=max_concurrent,
        consumer_batch_size=batch_size,
        max_staleness=max_staleness,
    )
    assert (m.max_concurrent_rollouts, m.consumer_batch_size, m.max_staleness) == (
        max_concurrent,
        batch_size,
        max_staleness,
    )
    assert type(m.get_capacity()) is int


@pytest.mark.parametrize("version", [0, 1, 10, 100, 1000])
def test_capacity_at_a_version(make: Make, version: int) -> None:
    m = make(Version(version), max_concurrent_rollouts=1000, consumer_batch_size=32,
             max_staleness=5)  # fmt: skip
    assert m.get_capacity() == min(1000, (5 + version + 1) * 32)


# --- on_version_recovered (in the 1.0.4 wheel) ---


@pytest.mark.parametrize("recovered", [0, 5, 10, 50])
def test_recovery_does_not_inflate_the_bound(make: Make, recovered: int) -> None:
    version = Version()
    m = make(version, max_concurrent_rollouts=1000, consumer_batch_size=16, max_staleness=2)
    version.set_version(recovered)
    m.on_version_recovered(recovered)
    assert m.get_capacity() == 3 * 16


@pytest.mark.parametrize("running", [1, 5, 16])
def test_recovery_with_rollouts_running(make: Make, running: int) -> None:
    version = Version()
    m = make(version, max_concurrent_rollouts=1000, consumer_batch_size=16, max_staleness=2)
    run(m, running)
    version.set_version(10)
    m.on_version_recovered(10)
    assert m.get_capacity() == 3 * 16 - running
