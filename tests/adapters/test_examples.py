"""Every example runs as a user would run it: a fresh process, the embedded default, on CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "needs", "expect"),
    [
        ("stream.py", None, "rows"),
        ("torch_dataloader.py", None, "trained 128 of 128 rows"),
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
