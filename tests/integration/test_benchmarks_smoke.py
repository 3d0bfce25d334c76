"""The benchmark suite (benchmarks/) runs end to end at its smallest sizes: one round of every
scenario against every system whose packages are installed (the others skip inside the run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_suite_runs() -> None:
    cmd = [
        sys.executable, "-m", "pytest", "benchmarks", "--bench-quick", "--benchmark-disable",
        "-q", "-p", "no:cacheprovider",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    )


def test_interleaved_comparison_runs() -> None:
    cmd = [
        sys.executable, "-m", "benchmarks.interleave", "--quick", "--rounds", "4", "--block", "2",
        "--warmup", "1", "--systems", "tqstream-procs-tcp,zmq-pattern,zmq-tcp",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["tqstream-procs-tcp", "zmq-pattern", "zmq-tcp"]
    assert rows[-1][-1] == "1.00"  # the reference


@pytest.mark.parametrize("systems", ["tqstream-procs-tcp,nosuch", "zmq-tcp"])
def test_interleave_refuses_unknown_or_single_systems(systems: str) -> None:
    cmd = [sys.executable, "-m", "benchmarks.interleave", "--systems", systems]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "--systems: name two or more of" in proc.stderr
    if "nosuch" in systems:
        assert "unknown: ['nosuch']" in proc.stderr
