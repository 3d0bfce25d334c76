"""``tqstream demo`` as a user runs it: the console command, its summary and its plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")


def test_demo_command_writes_its_summary_and_plot(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tqstream.cli", "demo", "--steps", "6", "--quiet",
           "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "6 steps in" in out.stdout and "wrote" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("steps", "reward_first", "reward_last", "max_lag", "produced", "trained",
                "dropped", "left"):  # fmt: skip
        assert key in summary
    assert summary["steps"] == 6 and len(summary["history"]) == 6
    assert summary["produced"] == summary["trained"] + summary["dropped"] + summary["left"]
    assert summary["max_lag"] <= summary["config"]["max_staleness"]
    assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_command_is_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "tqstream.cli", "train"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "invalid choice: 'train'" in out.stderr
