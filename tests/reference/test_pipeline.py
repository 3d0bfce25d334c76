"""The reference loop end to end for a few steps: rollout worker processes, tqstream, the trainer
and the weight sync; versions advance, the lag stays within the window, every trajectory is
accounted for."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")

from tqstream.reference.pipeline import PipelineConfig, StepStats, run


@pytest.mark.parametrize("update_mode", ["keep", "abort"])
def test_a_few_steps_end_to_end(update_mode: str) -> None:
    seen: list[StepStats] = []
    config = PipelineConfig(steps=4, workers=2, batch_groups=2, group_size=4, max_staleness=1,
                            update_mode=update_mode, timeout=90.0)  # fmt: skip
    summary = run(config, on_step=seen.append)
    assert [s.version for s in seen] == [1, 2, 3, 4] and summary.history == seen
    assert all(math.isfinite(s.loss) for s in seen)
    assert summary.max_lag <= config.max_staleness
    assert summary.trained == 4 * 2 * 4
    assert summary.left >= 0
    assert summary.produced == summary.trained + summary.dropped + summary.left


def test_a_run_needs_workers_and_steps() -> None:
    with pytest.raises(ValueError, match="a run needs at least one worker and one step"):
        run(PipelineConfig(workers=0))
