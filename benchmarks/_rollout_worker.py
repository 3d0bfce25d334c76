"""The rollout worker of the rollout benchmark, run as its own process:

    python -m benchmarks._rollout_worker ADDRESS GROUPS NEW_TOKENS

Makes the reference pipeline's tiny model and torch engine, then for every ``go`` line on stdin
generates GROUPS groups (8 samples of up to NEW_TOKENS tokens per prompt, the same seeded problems
and samples every time) and prints ``done TOKENS PUT_SECONDS``. ADDRESS ``-``: the engine alone;
else each group is also put into the tqstream cluster at ADDRESS (partition ``rollouts``), as the
pipeline's workers do, and PUT_SECONDS is the time spent in those puts.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import torch

GROUP = 8


def main() -> None:
    address, groups, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.disable_progress_bar()
    from tqstream.reference.engine import TorchEngine
    from tqstream.reference.pipeline import group_rows
    from tqstream.reference.task import problems
    from tqstream.reference.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=0, max_position_embeddings=512)
    writer: Any = None
    if address != "-":
        from tqstream.adapters.torch import ExperienceWriter

        writer = ExperienceWriter(address, partition="rollouts")
    for round_no, line in enumerate(sys.stdin):
        if line.strip() != "go":
            break
        engine = TorchEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=0)
        rng = random.Random(0)
        tokens, put_s = 0, 0.0
        for k in range(groups):
            problem = problems(1, rng)[0]
            prompt = tok.encode(problem.prompt, add_special_tokens=False)
            outs = engine.generate([prompt] * GROUP, new_tokens)
            tokens += sum(len(o.tokens) for o in outs)
            if writer is not None:
                rows = group_rows(prompt, outs, [0.0] * GROUP)
                t0 = time.perf_counter()
                writer.put_experience(rows, current_version=0, group=f"{round_no}-{k}")
                put_s += time.perf_counter() - t0
        print(f"done {tokens} {put_s}", flush=True)


if __name__ == "__main__":
    main()
