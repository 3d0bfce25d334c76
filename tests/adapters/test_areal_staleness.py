"""``tqstream.adapters.areal.StalenessManager`` against AReaL's own ``StalenessManager``: the same
methods, the same capacity and ``RolloutStat`` counters on any event sequence, but one budget at
the controller — shared by every rank, kept across a trainer restart."""

from __future__ import annotations

import inspect
import itertools

import pytest

pytest.importorskip("areal")

from areal.api import RolloutStat
from areal.api.cli_args import InferenceEngineConfig
from areal.infra.staleness_manager import StalenessManager as AReaLStalenessManager
from areal.infra.workflow_executor import WorkflowExecutor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tqstream
from tqstream import AdmissionError, InvalidRequestError
from tqstream.adapters.areal import StalenessManager

_names = itertools.count()


class Engine:
    """The version provider AReaL passes: its inference engine's ``get_version``."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version


def test_is_areals_manager_with_the_same_methods() -> None:
    assert issubclass(StalenessManager, AReaLStalenessManager)
    for name, base in inspect.getmembers(AReaLStalenessManager, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(StalenessManager, name)
        assert _params(ours) == _params(base), name


def _params(fn: object) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults: what a caller relies on (annotations are strings in one)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_injectable_into_workflow_executor(client: tqstream.Client, partition: str) -> None:
    assert "staleness_manager" in inspect.signature(WorkflowExecutor.__init__).parameters
    engine = Engine()
    config = InferenceEngineConfig(
        consumer_batch_size=4, max_concurrent_rollouts=6, max_head_offpolicyness=1
    )
    manager = StalenessManager.from_config(client, config, engine, name=partition)
    executor = WorkflowExecutor(config, engine, staleness_manager=manager)  # type: ignore[arg-type]
    executor.initialize(train_data_parallel_size=2)  # AReaL would divide its own budget by 2
    try:
        assert executor.staleness_manager is manager
        # global limits, as configured: min(6 - 0, (1 + 0 + 1) * 4 - 0)
        assert executor.get_capacity() == 6
        state = client.stats().admissions[partition]
        assert (state["max_concurrent"], state["consumer_batch_size"]) == (6, 4)
    finally:
        executor.destroy()


# --- property: the capacity and counters are AReaL's on the same event sequence ---

_event = st.one_of(
    st.just(("enqueued",)),
    st.just(("submitted",)),
    st.just(("accepted",)),
    st.just(("rejected",)),
    st.tuples(st.just("version"), st.integers(1, 2)),
    st.tuples(st.just("recovered"), st.integers(0, 4)),
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    max_concurrent=st.integers(1, 8),
    batch_size=st.integers(1, 4),
    max_staleness=st.integers(0, 3),
    events=st.lists(_event, max_size=30),
)
def test_capacity_equals_areal_on_any_event_sequence(
    client: tqstream.Client,
    partition: str,
    max_concurrent: int,
    batch_size: int,
    max_staleness: int,
    events: list[tuple],
) -> None:
    engine = Engine()
    ref = AReaLStalenessManager(engine, max_concurrent, batch_size, max_staleness)
    ours = StalenessManager(
        client,
        engine,
        max_concurrent,
        batch_size,
        max_staleness,
        name=f"{partition}-{next(_names)}",
    )
    assert ours.get_capacity() == ref.get_capacity()
    for event in events:
        kind = event[0]
        if kind in ("accepted", "rejected") and ref.get_stats().running == 0:
            continue  # AReaL would count a rollout that never ran (running < 0); ours refuses
        if kind == "version":
            engine.set_version(engine.version + event[1])
        elif kind == "recovered":
            engine.set_version(event[1])
            for m in (ref, ours):
                m.on_version_recovered(event[1])
        else:
            for m in (ref, ours):
                getattr(m, f"on_rollout_{kind}")()
        assert ours.get_capacity() == ref.get_capacity(), event
        assert ours.get_stats() == ref.get_stats(), event


# --- global and durable ---


def test_budget_is_global_across_ranks(
    deployment: tuple[str, str], client: tqstream.Client, partition: str
) -> None:
    other = tqstream.connect(deployment[1])  # a second data-parallel rank
    try:
        engine = Engine()
        rank0 = StalenessManager(client, engine, 4, 2, 0, name=partition)
        rank1 = StalenessManager(other, engine, 4, 2, 0, name=partition)
        for _ in range(2):
            rank0.on_rollout_enqueued()
            rank0.on_rollout_submitted()
        # (0 + 0 + 1) * 2 - 2 running: rank 1 sees rank 0's rollouts
        assert rank1.get_capacity() == 0
        rank0.on_rollout_accepted()
        rank0.on_rollout_rejected()  # a rejected rollout gives its budget back
        assert rank1.get_capacity() == 1
        assert rank1.get_stats() == RolloutStat(accepted=1, enqueued=0, rejected=1, running=0)
        with pytest.raises(AdmissionError, match=r"already exists as capacity"):
            StalenessManager(other, engine, 8, 2, 0, name=partition)  # other limits, same name
    finally:
        other.close()


def test_survives_a_trainer_restart(
    deployment: tuple[str, str], client: tqstream.Client, partition: str
) -> None:
    engine = Engine()
    before = StalenessManager(client, engine, 8, 2, 1, name=partition)
    for _ in range(3):
        before.on_rollout_enqueued()
        before.on_rollout_submitted()
        before.on_rollout_accepted()
    restarted = tqstream.connect(deployment[1])  # the trainer process after a restart
    try:
        engine = Engine(version=5)
        after = StalenessManager(restarted, engine, 8, 2, 1, name=partition)
        assert after.get_stats().accepted == 3  # the controller kept the count
        after.on_version_recovered(5)
        ref = AReaLStalenessManager(engine, 8, 2, 1)
        ref.on_version_recovered(5)
        assert after.get_capacity() == ref.get_capacity() == 4  # not 5 batches too many
        assert after.get_stats().accepted == ref.get_stats().accepted == 10
    finally:
        restarted.close()


# --- bad input: typed errors, nothing created ---


def test_outcome_without_a_running_rollout(client: tqstream.Client, partition: str) -> None:
    manager = StalenessManager(client, Engine(), 4, 2, 1, name=partition)
    with pytest.raises(
        AdmissionError,
        match=r"on_rollout_accepted\(\) with no running rollout in this StalenessManager: call "
        r"on_rollout_submitted\(\) when a rollout starts, once per rollout",
    ):
        manager.on_rollout_accepted()
    with pytest.raises(AdmissionError, match=r"on_rollout_rejected\(\) with no running rollout"):
        manager.on_rollout_rejected()
    assert manager.get_stats() == RolloutStat()


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ((0, 2, 1), r"capacity admission needs max_concurrent >= 1 \(got 0\)"),
        ((4, 0, 1), r"capacity admission needs consumer_batch_size >= 1 \(got 0\)"),
        ((4, 2, -1), r"capacity admission needs max_staleness >= 0 \(got -1\)"),
    ],
)
def test_refused_limits(
    client: tqstream.Client, partition: str, limits: tuple[int, int, int], message: str
) -> None:
    with pytest.raises(AdmissionError, match=message):
        StalenessManager(client, Engine(), *limits, name=partition)
    assert partition not in client.stats().admissions


@pytest.mark.parametrize("version", [None, "1", -1])
def test_version_provider_must_give_a_version(
    client: tqstream.Client, partition: str, version: object
) -> None:
    engine = Engine()
    manager = StalenessManager(client, engine, 4, 2, 1, name=partition)
    engine.version = version  # type: ignore[assignment]
    with pytest.raises(
        InvalidRequestError,
        match=rf"version_provider.get_version\(\) returned {version!r}; the staleness bound needs "
        r"the current policy version \(an int >= 0\)",
    ):
        manager.get_capacity()
