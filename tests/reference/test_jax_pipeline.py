"""The reference loop with the JAX trainer: torch rollout workers held by a per-version admission,
batches read through the JAX adapter, weights pushed as torch state dicts; it learns the task."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")
pytest.importorskip("jax", reason="the JAX trainer needs the jax extra")

import tqstream
from tqstream.reference.pipeline import (
    PipelineConfig,
    StepStats,
    _take_slots,
    admission_settings,
    run,
)


def test_the_jax_trainer_holds_rollouts_by_a_per_version_admission_in_rows() -> None:
    config = PipelineConfig(trainer="jax", batch_groups=4, group_size=8, sync_interval=2)
    assert admission_settings(config) == (
        "per_version", {"max_per_version": 64, "update_interval": 64}
    )  # fmt: skip
    slack = PipelineConfig(trainer="jax", batch_groups=4, group_size=8, admission_slack=1)
    assert admission_settings(slack)[1] == {"max_per_version": 64, "update_interval": 32}
    assert admission_settings(PipelineConfig())[0] == "capacity"


class _Engine:
    """What ``_take_slots`` reads of a rollout engine: the version of its weights."""

    version = 0


def test_a_worker_takes_whole_groups_until_the_versions_budget_is_spent() -> None:
    # the worker loop as it runs, on a per_version admission: 2 groups of 4 rows per version
    client = tqstream.init()
    try:
        admission = client.admission("per_version", name="r", max_per_version=8,
                                     update_interval=8)  # fmt: skip
        engine, stop, slots, row = _Engine(), threading.Event(), [-1] * 8, slice(0, 8)
        first = _take_slots(admission, engine, 4, 8, stop, slots, row)
        assert len(first) == 8 and slots == first  # both groups at once, recorded as held
        got: list[list[int]] = []
        waiting = threading.Thread(
            target=lambda: got.append(_take_slots(admission, engine, 4, 8, stop, slots, row))
        )
        waiting.start()
        time.sleep(1.2)  # more than two of its 0.5 s acquires: it waits for the next version
        assert not got and admission.state()["remaining"] == 0
        engine.version = 1  # the weights of version 1 arrived; the trainer then publishes it
        admission.on_version(1)
        waiting.join(5)
        assert len(got) == 1 and len(got[0]) == 8 and not set(got[0]) & set(first)
        assert admission.state()["version"] == 1 and admission.state()["remaining"] == 0
    finally:
        client.close()


def test_a_few_steps_with_token_staleness_and_rollouts_running_ahead() -> None:
    # each version admits two updates' worth of rows (admission_slack=1), and aborted
    # generations resume under new weights: trajectories span versions, the window masks
    config = PipelineConfig(steps=6, workers=2, batch_groups=2, group_size=4, max_staleness=1,
                            admission_slack=1, update_mode="abort", measure="token",
                            timeout=90.0, warmup_steps=5, trainer="jax")  # fmt: skip
    summary = run(config)
    assert [s.version for s in summary.history] == list(range(1, 7))
    assert summary.max_lag <= config.max_staleness  # of the tokens trained on
    assert summary.trained == 6 * 2 * 4 and summary.left >= 0
    assert summary.produced == summary.trained + summary.dropped + summary.left
    assert summary.restarts == 0 and all(s.workers == 2 for s in summary.history)


def test_a_seeded_jax_run_learns_the_task_through_tqstream() -> None:
    # the demo's settings with a constant learning rate, 120 steps (see test_pipeline.py's torch
    # twin): after the format warm start the held-out exact-match is ~0; what the policy learns
    # beyond, it learns from the reward, read through the JAX adapter
    config = PipelineConfig(steps=120, seed=0, timeout=90.0, eval_every=40,
                            lr_schedule="constant", trainer="jax")  # fmt: skip
    summary = run(config)
    assert summary.eval_untrained <= 0.1 and summary.eval_first <= 0.3, summary
    assert summary.reward_last > summary.reward_first + 0.3, summary
    assert summary.eval_digits_first <= 0.2 and summary.eval_digits_last >= 0.5, summary
    assert summary.eval_last > summary.eval_first, summary
    assert [h.step for h in summary.history if h.eval is not None] == [39, 79, 119]
    assert summary.produced == summary.trained + summary.dropped + summary.left
    # a version's budget is one batch, generated under that version's weights: nothing is stale
    assert summary.max_lag == 0 and summary.dropped == 0, summary


def test_a_rollout_worker_killed_is_replaced_and_its_slots_come_back_to_the_version() -> None:
    killed: list[int] = []

    def on_step(s: StepStats) -> None:
        if s.step == 1:  # workers generate all the time: this lands mid-generation
            victim = next(p for p in multiprocessing.active_children()
                          if p.name.startswith("tqstream-rollout-"))  # fmt: skip
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(victim.pid)
        elif s.step > 1 and s.workers < 2:
            time.sleep(2.0)  # the replacement starts (torch, the model) and joins the hub

    config = PipelineConfig(steps=16, workers=2, batch_groups=2, group_size=4, max_staleness=1,
                            max_restarts=1, timeout=45.0, warmup_steps=5,
                            trainer="jax")  # fmt: skip
    summary = run(config, on_step=on_step)
    assert len(killed) == 1 and summary.restarts == 1
    assert [s.version for s in summary.history] == list(range(1, 17))
    assert summary.history[-1].workers == 2  # the replacement joined the weight hub
    # the dead worker's slots were released as rejected: the version's budget got them back and
    # the other worker made the batch (a budget short of them would have stalled the trainer)
    assert summary.produced == summary.trained + summary.dropped + summary.left
