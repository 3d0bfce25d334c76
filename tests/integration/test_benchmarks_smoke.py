"""The benchmark suite (benchmarks/) runs end to end at its smallest sizes: one round of every
scenario against every system whose packages are installed (the others skip inside the run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(480)
def test_benchmark_suite_runs_and_reports() -> None:
    """Every scenario against every installed system, once at its smallest, through the report;
    the producers scenario (2 producers, 16 puts each, 32 in the agent-loop pair) has one table
    per variant (one trajectory, a group, 32 trajectories in flight, the same paced, an agent loop
    building each when it ends and its prebuilt twin put back to back) with rows/s, put p50 / p99
    and tqstream's rows/s over each system's."""
    cmd = [sys.executable, "-m", "benchmarks.report", "--bench-quick"]
    # verl-kv starts Ray and two systems' Ray actors: most of its ~50 s
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    titles = [i for i, line in enumerate(lines) if line.startswith("producers — ")]
    assert sorted(lines[i].split(", L ")[0] for i in titles) == [
        "producers — 2 producers x 1 group of 8 per put",
        "producers — 2 producers x 1 trajectory per put",
        "producers — 2 producers x 1 trajectory per put, 32 puts in flight each",
        "producers — 2 producers x 1 trajectory per put, 32 puts in flight each",
        "producers — 2 producers x 1 trajectory per put, 32 rollouts each ending after 0-2 ms, "
        "built then",
        "producers — 2 producers x 1 trajectory per put, 32 rollouts each, offered 4,000 rows/s",
    ]
    # the raw-pyzmq floor in every variant (the in-flight ones coalesced)
    others = ["zmq-tcp"] + [p for p in ("transferqueue", "ray-actor-queue") if _installed(p)]
    for i in titles:
        head = lines[i + 1].split()
        assert head[:5] == ["system", "rows/s", "MB/s", "put", "p50"], lines[i + 1]
        modes = [h for h in head if h.endswith("/x")]  # a ratio column per tqstream mode
        assert "tqstream-embedded/x" in modes, lines[i + 1]
        rows = {}
        for line in lines[i + 2 :]:
            if not line.strip() or line.startswith(("producers", "ratio")):
                break
            rows[line.split()[0]] = line.split()
        assert set(others) <= set(rows), (others, list(rows))
        for name, r in rows.items():
            ratios = r[-len(modes) :]
            assert float(r[1].replace(",", "")) > 0 and all(float(x) > 0 for x in ratios), r
            if name == "tqstream-embedded":  # over itself
                assert ratios[modes.index("tqstream-embedded/x")] == "1", r


def _installed(system: str) -> bool:
    needs = {"transferqueue": ("ray", "transfer_queue"), "ray-actor-queue": ("ray",)}
    return all(importlib.util.find_spec(p) for p in needs[system])


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
