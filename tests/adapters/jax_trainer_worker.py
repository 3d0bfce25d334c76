"""One run of a JAX training job that checkpoints its ExperienceIterator after every step.

Each step's rows are recorded (fsync'd) when trained, then the checkpoint (the iterator's state
and the rows trained so far) is replaced atomically. A run started with a checkpoint resumes
from it. ``STALL_AT`` > 0: that step hangs after training, before its checkpoint, until the
process is killed. ``NAMING``: "state_dict" or "grain" (``get_state`` / ``set_state``).

    jax_trainer_worker.py ADDRESS PARTITION CHECKPOINT RECORD END RUN NAMING STALL_AT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tqstream.adapters.jax import ExperienceIterator


def durable(path: Path, text: str, mode: str) -> None:
    with path.open(mode) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    address, partition, checkpoint, record, end, run, naming, stall_at = sys.argv[1:9]
    ckpt, grain = Path(checkpoint), naming == "grain"
    it = ExperienceIterator(
        address, ["x"], 3, partition=partition, finite=True, lease_timeout=2.0, timeout=60
    )
    trained: list[str] = []
    if ckpt.exists():
        saved = json.loads(ckpt.read_text())
        (it.set_state if grain else it.load_state_dict)(saved["iterator"])
        trained = saved["trained"]
    step_fn = jax.jit(lambda x: jnp.sum(x * 2))
    for step, batch in enumerate(it, start=1):
        assert batch.meta is not None
        loss = float(step_fn(batch["x"]))  # the "training step"
        assert loss == 2 * float(np.asarray(batch["x"]).sum())
        keys = list(batch.meta.keys)
        durable(Path(record), json.dumps({"run": int(run), "step": step, "keys": keys}) + "\n", "a")
        trained += keys
        print(f"trained {step}", flush=True)
        if step == int(stall_at):
            time.sleep(120)  # a long step: the job is killed here
        state: dict[str, Any] = it.get_state() if grain else it.state_dict()
        tmp = ckpt.with_suffix(".tmp")
        durable(tmp, json.dumps({"iterator": state, "trained": trained}), "w")
        os.replace(tmp, ckpt)
    durable(Path(end), json.dumps({"trained": trained}), "w")
    print("done", flush=True)


if __name__ == "__main__":
    main()
