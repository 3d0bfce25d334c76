"""``tqstream demo`` as a user runs it: the console command, its summary, its plot, its errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")

DEMO = [sys.executable, "-m", "tqstream.cli", "demo"]


def _demo(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([*DEMO, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)  # fmt: skip


def test_demo_command_writes_its_summary_and_plot(tmp_path: Path) -> None:
    out = _demo("--steps", "6", "--out", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    # the workers and their threads end quietly (no C++ terminate, no thread's traceback)
    for noise in ("terminate called", "Traceback", "Exception in thread"):
        assert noise not in out.stderr, out.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("steps", "reward_first", "reward_last", "max_lag", "produced", "trained",
                "dropped", "left", "eval_untrained", "eval_first", "eval_last",
                "seconds_to_eval_0.8", "warm_start_seconds", "eval_digits_first",
                "eval_digits_last"):  # fmt: skip
        assert key in summary
    assert summary["steps"] == 6 and len(summary["history"]) == 6
    assert summary["produced"] == summary["trained"] + summary["dropped"] + summary["left"]
    assert summary["max_lag"] <= summary["config"]["max_staleness"]
    # the format warm start alone leaves the task unlearned: what is learned comes from RL
    assert summary["eval_untrained"] <= 0.1 and summary["eval_first"] <= 0.3
    assert summary["history"][-1]["eval"] == summary["eval_last"]
    assert summary["history"][-1]["eval_digits"] == summary["eval_digits_last"]
    assert summary["eval_digits_first"] <= 0.3  # ~0.1: digits right by chance
    assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # without a terminal (a log file, CI): progress lines instead of the live view, the last
    # step's among them, then the summary
    lines = out.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("6 steps in"))
    progress = [line for line in lines[:at] if line.startswith("step ")]
    assert progress and progress[-1].startswith("step 6/6  version 6  reward "), lines[:at]
    assert "held-out" in progress[-1] and "rows/s" in progress[-1]
    assert not any("─" in line for line in lines[:at])  # no frame of a live view
    assert "held-out exact-match" in lines[at] and lines[-1].startswith("wrote ")


def test_compare_runs_the_baseline_and_plots_both(tmp_path: Path) -> None:
    out = _demo("--compare", "--steps", "3", "--quiet", "--out", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["max_staleness"] == 2
    baseline = summary["compare"]["baseline"]
    assert baseline["config"]["max_staleness"] == 0 and baseline["max_lag"] == 0
    assert "speedup_to_eval_0.8" in summary["compare"]
    starts = [line.split(":")[0] for line in out.stdout.splitlines() if " steps in " in line]
    assert starts == ["synchronous", "asynchronous"]
    assert "time to held-out exact-match 0.8, synchronous / asynchronous:" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "argument --workers: must be 1 or more, got 0"),
        (["--steps", "-1"], "argument --steps: must be 1 or more, got -1"),
        (["--steps", "many"], "argument --steps: 'many' is not a whole number"),
        (["--lr", "0"], "argument --lr: must be positive, got 0.0"),
        (["--max-grad-norm", "-1"], "argument --max-grad-norm: must be positive, got -1.0"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    out = _demo(*args, cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("usage: tqstream demo") and message in out.stderr


def test_help_is_plain_text_and_every_option_is_described(tmp_path: Path) -> None:
    out = _demo("--help", cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and "``" not in out.stdout
    entries = re.split(r"\n  (?=-)", out.stdout.split("options:", 1)[1])
    described = {e.split()[0].rstrip(","): len(e.split()) for e in entries if e.strip()}
    assert {"--steps", "--workers", "--seed", "--compare", "--out", "--quiet"} <= set(described)
    for option, words in described.items():
        assert words > 3 or option in ("-h", "--quiet"), option  # each says what it does
    top = subprocess.run([sys.executable, "-m", "tqstream.cli", "--help"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert "tqstream-launch" in top.stdout


def test_without_the_reference_extra_it_names_the_install_command(tmp_path: Path) -> None:
    # a directory that shadows transformers with nothing importable: the extra "is missing"
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'matplotlib'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([*DEMO, "--steps", "1"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        "tqstream demo: needs transformers, matplotlib (the reference extra): "
        "pip install 'tqstream[reference]'"
    )


def test_the_jax_trainer_runs_the_synchronous_baseline(tmp_path: Path) -> None:
    pytest.importorskip("jax", reason="--trainer jax needs the jax extra")
    out = _demo("--trainer", "jax", "--max-staleness", "0", "--steps", "6", "--quiet", "--out",
                str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    for noise in ("terminate called", "Traceback", "Exception in thread"):
        assert noise not in out.stderr, out.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["trainer"] == "jax" and summary["config"]["max_staleness"] == 0
    assert summary["steps"] == 6 and len(summary["history"]) == 6
    # the per_version admission lets each version's batch be generated under its weights: with
    # no staleness allowed nothing is dropped, and the trainer never waits for a batch in vain
    assert summary["max_lag"] == 0 and summary["dropped"] == 0
    assert summary["produced"] == summary["trained"] + summary["dropped"] + summary["left"]
    assert summary["eval_untrained"] <= 0.1 and summary["eval_first"] <= 0.3
    assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stdout.splitlines()[-1].startswith("wrote ")


def test_without_the_jax_extra_the_jax_trainer_names_the_install_command(tmp_path: Path) -> None:
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'flax', 'optax'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([*DEMO, "--trainer", "jax", "--steps", "1"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        "tqstream demo --trainer jax: needs jax, flax, optax (the jax extra): "
        'pip install "tqstream[jax]"'
    )


def test_unknown_command_is_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "tqstream.cli", "train"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "invalid choice: 'train'" in out.stderr
