"""Rollout producers -> a jitted JAX step, through tqstream's JAX adapter.

Two producer processes put one group of 4 samples per call as numpy and jax arrays (ragged token
ids, per-token versions with -1 on the prompt, a reward per sample); the trainer reads whole
groups, 16 rows a batch, padded to the smallest of three buckets that fits, through a staleness
window; a jitted step (GRPO advantages per group, a masked token mean) compiles once per bucket,
each batch is acked after its step, and the run stops once the producers closed the partition and
every row was trained. Embedded default, CPU, seconds: python examples/jax_trainer.py
"""

from __future__ import annotations

import multiprocessing as mp
import time

PRODUCERS, GROUPS, GROUP, BATCH = 2, 16, 4, 16
BUCKETS = (16, 32, 64)


def produce(address: str, rank: int) -> None:
    import jax.numpy as jnp
    import numpy as np

    from tqstream.adapters.jax import ExperienceWriter

    rng = np.random.default_rng(rank)
    with ExperienceWriter(address, partition="train") as writer:  # closes it for this producer
        for i in range(GROUPS):
            version = i // 8  # the policy version that generated this group
            prompt = 8
            lengths = rng.integers(4, 48, GROUP)
            writer.put_experience(
                {
                    "input_ids": [
                        rng.integers(0, 1000, prompt + n).astype(np.int32) for n in lengths
                    ],
                    "versions": [
                        np.concatenate([np.full(prompt, -1), np.full(n, version)]).astype(np.int32)
                        for n in lengths
                    ],
                    "rewards": jnp.asarray(rng.random(GROUP), dtype=jnp.float32),
                },
                current_version=version,
                group=f"p{rank}-{i}",
            )


def main() -> None:
    import jax
    import jax.numpy as jnp

    import tqstream
    from tqstream import StalenessPolicy
    from tqstream.adapters.jax import ExperienceIterator

    client = tqstream.init()
    client.create_partition("train", ["input_ids", "versions", "rewards"], producers=PRODUCERS)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=produce, args=(client.address, r)) for r in range(PRODUCERS)]
    for p in procs:
        p.start()
    it = ExperienceIterator(
        client.address, ["input_ids", "versions", "rewards"], BATCH, partition="train",
        staleness=StalenessPolicy(max_staleness=1), version_fn=lambda: 1, whole_groups=True,
        buckets=BUCKETS, pad_values={"versions": -1}, ack="manual", finite=True, prefetch=1,
    )  # fmt: skip
    traces = []

    @jax.jit
    def step(batch):  # type: ignore[no-untyped-def]
        traces.append(batch["input_ids"].shape)  # runs once per compilation
        groups = batch["group_ids"]
        count = jax.ops.segment_sum(jnp.ones_like(batch["rewards"]), groups, BATCH)
        mean = jax.ops.segment_sum(batch["rewards"], groups, BATCH) / jnp.maximum(count, 1)
        advantages = batch["rewards"] - mean[groups]
        generated = batch["versions"] >= 0  # prompt tokens and padding are -1
        tokens = batch["input_ids"].astype(jnp.float32) / 1000.0
        per_row = (tokens * generated).sum(1) / jnp.maximum(generated.sum(1), 1)
        return (advantages * per_row).mean()

    start, rows, steps = time.perf_counter(), 0, 0
    for batch in it:
        loss = float(step(batch))  # a "step"
        it.ack(batch)  # after the step: a crash before this line loses nothing
        rows, steps = rows + batch.rows, steps + 1
        print(f"step {steps:2d}: {batch.rows:2d} rows, padded to "
              f"{batch['input_ids'].shape[1]:2d} tokens, loss {loss:+.4f}")  # fmt: skip
    it.close()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - start
    shapes = sorted(set(traces))
    print(f"trained {rows} of {PRODUCERS * GROUPS * GROUP} rows in {steps} steps, "
          f"{len(traces)} compilations for shapes {shapes}, {elapsed:.2f} s")  # fmt: skip
    client.close()


if __name__ == "__main__":
    main()
