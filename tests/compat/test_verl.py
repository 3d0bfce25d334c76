"""verl 0.9.1's TransferQueue path (its v1 trainer's calls) on tqstream through the switch.

The job (``verl_tq_job.py``) runs in a process of its own with ``TQSTREAM_TRANSFER_QUEUE=1``, as a
user would run verl: verl's modules ``import transfer_queue`` and get tqstream's layer, in the
driver and in the Ray actors (an agent-loop worker that attaches with a bare ``tq.init()`` and a
worker whose method verl's ``tqbridge`` wraps).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("verl_tq_job.py")
CHECKS = [
    "transfer_queue is tqstream's layer",
    "prompt tags merged: is_prompt kept through status updates",
    "one trajectory row per session, with verl's tags",
    "ReplayBuffer samples every finished group",
    "the sampled prompts are cleared",
    "data back by key, in key order",
    "responses are jagged nested tensors",
    "tqbridge returns the keys it wrote",
    "the worker ran in another process",
    "columns a worker added are visible to the driver",
    "a column written again is replaced",
    "a new cluster starts empty",
    "checkpoint -> close -> init -> load restores keys and tags",
    "... and the data",
    "total_storage_size caps the rows",
    "clear frees room for new keys",
]


@pytest.mark.timeout(600)
def test_verl_trainer_call_sequence_runs_on_tqstream() -> None:
    env = {**os.environ, "TQSTREAM_TRANSFER_QUEUE": "1", "RAY_DEDUP_LOGS": "0"}
    run = subprocess.run(
        [sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=540,
        check=False,
    )  # fmt: skip
    done = [
        line.removeprefix("ok: ") for line in run.stdout.splitlines() if line.startswith("ok: ")
    ]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-6000:]
    assert done == CHECKS
