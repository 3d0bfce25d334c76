"""Every example runs as a user would run it: a fresh process, the embedded default, on CPU."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "needs", "expect"),
    [
        ("stream.py", None, "rows"),
        ("torch_dataloader.py", None, "trained 128 of 128 rows"),
        ("jax_trainer.py", "jax", "trained 128 of 128 rows in 8 steps, 1 compilations"),
        ("areal_rollout.py", "areal", ""),
        ("verl_asyncrl.py", "verl", ""),
        ("verl_fully_async.py", "verl", ""),
    ],
)
def test_example_runs(script: str, needs: str | None, expect: str) -> None:
    if needs is not None:
        pytest.importorskip(needs)
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout
    assert "Traceback" not in out.stderr


def test_the_areal_example_finishes_every_time() -> None:
    """AReaL's dispatcher waits for capacity without a timeout; only a resume() (or a result, or
    new input) wakes it. The example publishes each version as AReaL's trainer does (pause, set
    the version, resume), so its last ``prepare_batch`` always gets the budget the new version
    opens: 20 runs in a row, each watched (publishing without resume() hung about one run in
    five, with tqstream's manager; with AReaL's own, whenever the step paused before publishing)."""
    pytest.importorskip("areal")
    spec = importlib.util.spec_from_file_location("areal_rollout", EXAMPLES / "areal_rollout.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for i in range(20):
        random.seed(i)
        out: list[str] = []
        run = threading.Thread(target=lambda out=out: out.append(example.run()), daemon=True)
        run.start()
        run.join(60)
        assert not run.is_alive(), f"run {i} of the example hung"
        assert out and "running=0" in out[0], out
