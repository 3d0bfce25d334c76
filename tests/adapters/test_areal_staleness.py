"""``tqstream.adapters.areal.StalenessManager`` beyond AReaL's own cases (those are in
``test_areal_staleness_parity.py``): built by AReaL's ``WorkflowExecutor`` itself, a budget pooled
by ranks in other processes, a rank killed with rollouts running, a trainer restart, the counted
anomalies, and the typed errors."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("areal")

import areal.infra.staleness_manager as areal_staleness
import areal.infra.workflow_executor as areal_executor
from areal.api import RolloutStat
from areal.api.cli_args import InferenceEngineConfig
from areal.infra.staleness_manager import StalenessManager as AReaLStalenessManager
from areal.infra.workflow_executor import WorkflowExecutor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tqstream
from tqstream import AdmissionError, ClosedError, InvalidRequestError
from tqstream.adapters.areal import ArealExperience, StalenessManager, StalenessPolicy, install
from tqstream.launch.default import default_client

HERE = Path(__file__).parent


class Engine:
    """The version provider AReaL passes: its inference engine's ``get_version``."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version


def budget(client: tqstream.Client, name: str) -> dict[str, Any]:
    return dict(client.stats().admissions.get(name, {}))


def wait_for(check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# --- AReaL's signature and construction ---


def test_areals_signature_with_keyword_only_extras() -> None:
    assert issubclass(StalenessManager, AReaLStalenessManager)
    ours = list(inspect.signature(StalenessManager).parameters.values())
    theirs = list(inspect.signature(AReaLStalenessManager).parameters.values())
    assert [p.name for p in ours[:4]] == [p.name for p in theirs]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in ours[:4])
    assert [(p.name, p.kind, p.default) for p in ours[4:]] == [
        ("client", inspect.Parameter.KEYWORD_ONLY, None),
        ("name", inspect.Parameter.KEYWORD_ONLY, None),
    ]
    for name, base in inspect.getmembers(AReaLStalenessManager, inspect.isfunction):
        if not name.startswith("_"):
            assert _params(getattr(StalenessManager, name)) == _params(base), name


def _params(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.fixture
def installed() -> Iterator[None]:
    """``install()``, undone afterwards so other tests see AReaL's own class."""
    before = {m: m.StalenessManager for m in (areal_staleness, areal_executor)}
    install()
    yield
    for module, cls in before.items():
        module.StalenessManager = cls


def test_workflow_executor_builds_it_after_install(installed: None) -> None:
    install()  # idempotent
    assert areal_executor.StalenessManager is StalenessManager
    engine = Engine()
    train = InferenceEngineConfig(
        consumer_batch_size=8, max_concurrent_rollouts=6, max_head_offpolicyness=1
    )
    evaluate = InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=0)
    executors = [WorkflowExecutor(c, engine) for c in (train, evaluate)]  # type: ignore[arg-type]
    for executor in executors:
        executor.initialize(train_data_parallel_size=2)  # AReaL divides the limits by 2
    try:
        managers = [e.staleness_manager for e in executors]
        assert all(type(m) is StalenessManager for m in managers)
        assert managers[0].name != managers[1].name  # two budgets of their own, one cluster
        assert managers[0].client is managers[1].client is default_client()
        # each behaves like the manager AReaL would have built: min(6 // 2, 2 * (8 // 2))
        assert [e.get_capacity() for e in executors] == [3, 1]
        stats = default_client().stats().admissions
        assert stats[managers[0].name]["max_concurrent"] == 3
        assert stats[managers[1].name]["consumer_batch_size"] == 1
    finally:
        for executor in executors:
            executor.destroy()
            executor.staleness_manager.close()


# --- rollout_stat is current ---


def test_rollout_stat_reads_the_current_counts() -> None:
    manager = StalenessManager(Engine(), 4, 2, 1)
    try:
        manager.on_rollout_enqueued()
        manager.on_rollout_submitted()
        assert manager.rollout_stat == RolloutStat(running=1)
        manager.on_rollout_accepted()
        assert manager.rollout_stat.accepted == 1 and manager.rollout_stat.running == 0
    finally:
        manager.close()


# --- property: the same numbers as AReaL's on any event sequence, misuse included ---

_event = st.one_of(
    st.sampled_from([("enqueued",), ("submitted",), ("accepted",), ("rejected",)]),
    st.tuples(st.just("version"), st.integers(1, 2)),
    st.tuples(st.just("recovered"), st.integers(0, 4)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_concurrent=st.integers(0, 8),
    batch_size=st.integers(0, 4),
    max_staleness=st.integers(0, 3),
    events=st.lists(_event, max_size=30),
)
def test_same_numbers_as_areal_on_any_event_sequence(
    max_concurrent: int, batch_size: int, max_staleness: int, events: list[tuple]
) -> None:
    engine = Engine()
    ref = AReaLStalenessManager(engine, max_concurrent, batch_size, max_staleness)
    ours = StalenessManager(engine, max_concurrent, batch_size, max_staleness)
    try:
        for event in events:
            if event[0] == "version":
                engine.set_version(engine.version + event[1])
            elif event[0] == "recovered":
                engine.set_version(event[1])
                for m in (ref, ours):
                    m.on_version_recovered(event[1])
            else:
                for m in (ref, ours):
                    getattr(m, f"on_rollout_{event[0]}")()
            assert ours.get_capacity() == ref.get_capacity(), event
            assert ours.get_stats() == ref.get_stats(), event
    finally:
        ours.close()


# --- anomalies: done as AReaL does, and counted ---


def test_clamped_limits_and_unmatched_callbacks_are_counted() -> None:
    manager = StalenessManager(Engine(), 0, 0, 0)
    try:
        manager.on_rollout_accepted()  # no running rollout
        manager.on_rollout_submitted()  # no enqueued input
        manager.on_rollout_rejected()  # running is 0 again
        assert manager.get_stats() == RolloutStat(accepted=1, enqueued=-1, rejected=1, running=-1)
        state = budget(manager.client, manager.name)
        assert (state["clamped"], state["unmatched"]) == (2, 3)
        assert (state["max_concurrent"], state["consumer_batch_size"]) == (1, 1)
    finally:
        manager.close()


# --- a budget shared by ranks ---


def _rank(address: str, shared: str, dp: int = 2, version: int = 0) -> subprocess.Popen[str]:
    env = dict(os.environ, TQSTREAM_ADDRESS=address, TQSTREAM_AREAL_BUDGET=shared)
    return subprocess.Popen(
        [sys.executable, str(HERE / "areal_rank_worker.py"), str(dp), str(version)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _ask(rank: subprocess.Popen[str], command: str) -> Any:
    assert rank.stdin is not None and rank.stdout is not None
    rank.stdin.write(command + "\n")
    rank.stdin.flush()
    return json.loads(rank.stdout.readline())


def test_ranks_share_one_budget_and_a_killed_rank_gives_its_rollouts_back(
    client: tqstream.Client, partition: str
) -> None:
    ranks = [_rank(client.address, partition) for _ in range(2)]
    try:
        names = [json.loads(r.stdout.readline()) for r in ranks]  # type: ignore[union-attr]
        assert names == [{"train": partition, "eval": f"{partition}.1"}] * 2
        train = budget(client, partition)
        # AReaL's shares (8 // 2 each) add up to the job's limits
        assert (train["members"], train["max_concurrent"], train["consumer_batch_size"]) == (
            2,
            8,
            8,
        )
        assert budget(client, f"{partition}.1")["max_concurrent"] == 4
        assert _ask(ranks[0], "submit 6") == 6
        # rank 1 sees rank 0's rollouts: min(8 - 6, (1 + 0 + 1) * 8 - 6)
        assert _ask(ranks[1], "capacity") == 2
        assert _ask(ranks[0], "accept 2") == 4
        assert _ask(ranks[1], "stats") == vars(RolloutStat(accepted=2, running=4))
        ranks[0].send_signal(signal.SIGKILL)  # with 4 rollouts running
        ranks[0].wait(10)
        wait_for(lambda: budget(client, partition)["members"] == 1)
        train = budget(client, partition)
        assert (train["running"], train["returned"], train["left"]) == (0, 4, 1)
        # what is left is rank 1's own manager, as AReaL would have built it: min(4, 2 * 4)
        assert _ask(ranks[1], "capacity") == 4
    finally:
        for rank in ranks:
            rank.stdin.close()  # type: ignore[union-attr]  # the worker exits at end of input
            rank.wait(30)
    wait_for(lambda: partition not in client.stats().admissions)  # the last member ended it


def test_members_pool_limits_and_counts(
    deployment: tuple[str, str], client: tqstream.Client, partition: str
) -> None:
    other = tqstream.connect(deployment[1])
    try:
        engine = Engine()
        rank0 = StalenessManager(engine, 4, 2, 0, client=client, name=partition)
        rank1 = StalenessManager(engine, 4, 2, 0, client=other, name=partition)
        ref = AReaLStalenessManager(engine, 8, 4, 0)  # one manager with the summed limits
        for m in (rank0, ref):
            m.on_rollout_enqueued()
            m.on_rollout_submitted()
        # another member sees rank 0's callbacks once its counts have reached the controller
        # (reported in the background; a question of rank 0's own sends them along at once)
        rank0.get_stats()
        assert rank1.get_capacity() == ref.get_capacity() == 3
        for m in (rank0, ref):
            m.on_rollout_accepted()
        rank0.get_stats()
        assert rank1.get_stats() == ref.get_stats() == RolloutStat(accepted=1)
        rank1.close()  # its share stops counting: rank 0 alone, as AReaL's manager alone
        rank1.close()
        assert rank0.get_capacity() == AReaLStalenessManager(engine, 4, 2, 0).get_capacity() - 1
        with pytest.raises(ClosedError, match=r"StalenessManager .* is closed; build a new one"):
            rank1.get_capacity()
    finally:
        other.close()


def test_a_restarted_trainer_recovers_its_share(
    deployment: tuple[str, str], client: tqstream.Client, partition: str
) -> None:
    engine = Engine(version=5)
    survivor = StalenessManager(engine, 8, 2, 1, client=client, name=partition)
    crashed = tqstream.connect(deployment[1])
    before = StalenessManager(engine, 8, 2, 1, client=crashed, name=partition)
    for _ in range(3):
        before.on_rollout_enqueued()
        before.on_rollout_submitted()
    crashed.close()  # the trainer process dies with 3 rollouts running
    wait_for(lambda: budget(client, partition)["members"] == 1)
    restarted = tqstream.connect(deployment[1])
    try:
        after = StalenessManager(engine, 8, 2, 1, client=restarted, name=partition)
        after.on_version_recovered(5)
        survivor.on_version_recovered(5)
        ref = AReaLStalenessManager(engine, 16, 4, 1)  # the summed limits, recovered
        ref.on_version_recovered(5)
        assert after.get_capacity() == ref.get_capacity() == 8  # not 5 batches too many
        assert after.get_stats() == ref.get_stats()
    finally:
        restarted.close()
        survivor.close()


def test_a_budget_name_cannot_be_an_admission(client: tqstream.Client, partition: str) -> None:
    client.admission("capacity", name=partition, max_concurrent=4, max_staleness=1,
                     consumer_batch_size=2)  # fmt: skip
    with pytest.raises(AdmissionError, match=rf"{partition!r} is a capacity admission, not a "):
        StalenessManager(Engine(), 4, 2, 1, client=client, name=partition)
    manager = StalenessManager(Engine(), 4, 2, 1, client=client, name=f"{partition}-b")
    with pytest.raises(AdmissionError, match=r"is a StalenessManager budget; give the admission"):
        client.admission("capacity", name=manager.name, max_concurrent=4, max_staleness=1,
                         consumer_batch_size=2)  # fmt: skip
    manager.close()


# --- bad input: typed errors, nothing joined ---


def test_members_must_agree_on_max_staleness(client: tqstream.Client, partition: str) -> None:
    first = StalenessManager(Engine(), 4, 2, 1, client=client, name=partition)
    with pytest.raises(
        AdmissionError,
        match=rf"budget {partition!r} has max_staleness=1; a manager with max_staleness=2 "
        r"cannot share it",
    ):
        StalenessManager(Engine(), 4, 2, 2, client=client, name=partition)
    assert budget(client, partition)["members"] == 1
    first.close()


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ((4, 2, -1), r"budget '.*': max_staleness must be >= 0 \(got -1\)"),
        ((4.0, 2, 1), r"needs an int max_concurrent_rollouts \(got 4.0 of type float\)"),
        ((4, True, 1), r"needs an int consumer_batch_size \(got True of type bool\)"),
        ((4, 2, "1"), r"needs an int max_staleness \(got '1' of type str\)"),
    ],
)
def test_refused_limits(client: tqstream.Client, limits: tuple, message: str) -> None:
    before = set(client.stats().admissions)
    with pytest.raises(AdmissionError, match=message):
        StalenessManager(Engine(), *limits, client=client)
    assert set(client.stats().admissions) == before


@pytest.mark.parametrize("version", [None, "1", -1, 1.5])
def test_version_provider_must_give_a_version(version: object) -> None:
    engine = Engine()
    manager = StalenessManager(engine, 4, 2, 1)
    engine.version = version  # type: ignore[assignment]
    try:
        with pytest.raises(
            InvalidRequestError,
            match=rf"version_provider.get_version\(\) returned {version!r}; the staleness bound "
            r"needs the current policy version \(an int >= 0\)",
        ):
            manager.get_capacity()
        with pytest.raises(InvalidRequestError, match=r"on_version_recovered needs the recovered"):
            manager.on_version_recovered(version)  # type: ignore[arg-type]
        assert manager.get_stats() == RolloutStat()
    finally:
        manager.close()


def test_an_unreachable_cluster_in_the_environment() -> None:
    code = (
        "from tqstream.adapters.areal import StalenessManager\n"
        "class E:\n    def get_version(self): return 0\n"
        "try:\n    StalenessManager(E(), 4, 2, 1)\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = dict(os.environ, TQSTREAM_ADDRESS="tcp://127.0.0.1:9", TQSTREAM_CONNECT_TIMEOUT="1")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.startswith("ConnectError no tqstream server answered at tcp://127.0.0.1:9")


def test_stale_drops_give_the_budget_back(client: tqstream.Client, partition: str) -> None:
    engine = Engine()
    manager = StalenessManager(engine, 8, 2, 0, client=client, name=partition)
    exp = ArealExperience(
        client, partition=partition, staleness=StalenessPolicy(max_staleness=0), admission=manager
    )
    for v in (0, 0, 1):
        manager.on_rollout_enqueued()
        manager.on_rollout_submitted()
        exp.put_experience([_sample(v)], v)
        manager.on_rollout_accepted()
    engine.set_version(1)
    assert manager.get_capacity() == 1  # min(8, (0 + 1 + 1) * 2 - 3)
    batch = exp.get_experience(1, current_version=1, timeout=10)
    assert batch.stale_dropped == 2
    # the two stale samples no longer count: AReaL's bound sees 1 accepted
    assert manager.get_capacity() == 3 and budget(client, partition)["dropped"] == 2
    manager.close()


def _sample(version: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([[1, 2, 3]], dtype=torch.int32),
        "loss_mask": torch.tensor([[0, 1, 1]], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0, -0.5, -0.5]]),
        "versions": torch.tensor([[-1, version, version]], dtype=torch.int32),
        "attention_mask": torch.ones(1, 3, dtype=torch.bool),
        "rewards": torch.tensor([1.0]),
    }
