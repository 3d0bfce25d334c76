"""The JAX trainer in the reference loop: the flax model, its format warm start and greedy
evaluation (jitted), and its reads through the JAX adapter.

:class:`JaxLearner` is the loop's ``Learner`` (``pipeline.py``) for ``trainer="jax"``:

- it starts from the torch ``tiny_model``'s weights (converted), so both trainers begin at the same
  policy, and :meth:`JaxLearner.weights` gives ``torch_state_dict(params)`` for the same weight
  hub and the same torch rollout workers;
- it reads with ``ExperienceIterator`` (whole groups, the staleness window), every ragged field
  padded to one bucket (the prompts to the task's prompt length, the responses to
  ``max_new_tokens``), so the step compiles once. The seed's consumer thread: as soon as a step has
  moved the version, a reader thread starts the next read, which goes on while the loop pushes
  the weights (and evaluates), so the rollouts' first rows under the new weights are leased as they
  come. Not the iterator's ``prefetch``: its thread leases the next batch as soon as the loop takes
  one, under the window of the version before the step that will train on it, so a batch could
  hold tokens one version beyond ``max_staleness`` when trained;
- :func:`warm_start` and :func:`evaluate` have the semantics of ``pipeline.warm_start`` and
  ``pipeline.evaluate``: the same examples from the same ``rng``, the same AdamW state carried into
  the RL steps, greedy decoding scored by ``task.score``.
"""

from __future__ import annotations

import functools
import math
import random
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tqstream.reference.config import FIELDS, POLL, PipelineConfig
from tqstream.reference.jax.model import ModelConfig, Params, Qwen2, forward, params_from_torch
from tqstream.reference.jax.trainer import JaxPPOTrainer
from tqstream.reference.task import HeldOut, Problem, format_examples, held_out, score

__all__ = ["JaxLearner", "evaluate", "greedy", "warm_start"]


def _buckets(first: int, largest: int) -> tuple[int, ...]:
    """``first``, then the powers of two above it up to ``largest``."""
    return (first, *(2**k for k in range(3, largest.bit_length()) if first < 2**k <= largest))


def _padded(rows: list[list[int]], pad: int) -> tuple[jax.Array, jax.Array]:
    """``(ids [n, longest], lengths [n])``: rows right-padded (the format examples have one
    length: the warm start compiles once)."""
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), pad, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return jnp.asarray(out), jnp.asarray([len(r) for r in rows], jnp.int32)


def warm_start(
    trainer: JaxPPOTrainer, tok: Any, steps: int, rng: random.Random, batch: int = 128
) -> None:
    """``pipeline.warm_start`` for the JAX trainer: supervised steps on the answer's format."""
    for _ in range(steps):
        prompts, answers = format_examples(
            batch, rng, lambda text: tok.encode(text, add_special_tokens=False), tok.eos_token_id
        )
        trainer.supervised_step(*_padded(prompts, tok.pad_token_id),
                                *_padded(answers, tok.pad_token_id))  # fmt: skip


def greedy(
    graphdef: nnx.GraphDef[Qwen2], params: Params, prompts: jax.Array, max_new_tokens: int
) -> jax.Array:
    """Greedy completions ``[n, max_new_tokens]`` of prompts ``[n, P]`` of one length: every step
    runs the model over a fixed buffer of ``P + max_new_tokens`` tokens and takes the argmax at the
    last filled position (the causal mask keeps the unfilled ones out), so the loop is one shape
    and one compiled program; generation goes on past an end of sequence, as the torch version's,
    and the scoring cuts there."""
    return _greedy(graphdef, params, prompts, max_new_tokens)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _greedy(
    graphdef: nnx.GraphDef[Qwen2], params: Params, prompts: jax.Array, max_new_tokens: int
) -> jax.Array:
    n, p = prompts.shape
    buf = jnp.concatenate([prompts.astype(jnp.int32),
                           jnp.zeros((n, max_new_tokens), jnp.int32)], axis=1)  # fmt: skip
    attention = jnp.ones((n, p + max_new_tokens - 1), bool)

    def one(k: jax.Array, buf: jax.Array) -> jax.Array:
        logits = forward(graphdef, params, buf[:, :-1], attention)  # the last one predicts nothing
        last = jax.lax.dynamic_index_in_dim(logits, p - 1 + k, axis=1, keepdims=False)
        token = jnp.argmax(last, axis=-1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice_in_dim(buf, token[:, None], p + k, axis=1)

    return jax.lax.fori_loop(0, max_new_tokens, one, buf)[:, p:]


def evaluate(
    graphdef: nnx.GraphDef[Qwen2], params: Params, tok: Any, problems: list[Problem],
    max_new_tokens: int,
) -> HeldOut:  # fmt: skip
    """``pipeline.evaluate`` for the JAX model: greedy answers to ``problems``, scored."""
    prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in problems]
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("evaluate needs prompts of one length (the demo's task has them)")
    out = np.asarray(greedy(graphdef, params, jnp.asarray(prompts, jnp.int32), max_new_tokens))
    return score(problems, out.tolist(), tok.eos_token_id, tok.decode)


class JaxLearner:
    """``JaxPPOTrainer`` on the flax twin of the torch ``model``, reading through the JAX adapter
    (see the module docstring)."""

    def __init__(self, config: PipelineConfig, model: Any, tok: Any) -> None:
        self.config, self.tok = config, tok
        graphdef = nnx.split(Qwen2(ModelConfig.of(model.config), nnx.Rngs(config.seed)))[0]
        jax_model = nnx.merge(graphdef, params_from_torch(model.state_dict()))
        self.trainer = JaxPPOTrainer(
            jax_model, pad_id=tok.pad_token_id, lr=config.lr, temperature=config.temperature,
            proximal=config.proximal, epochs=config.epochs, entropy_coef=config.entropy_coef,
            max_grad_norm=config.max_grad_norm,
        )  # fmt: skip
        self.positions = model.config.max_position_embeddings
        self._steps = 0
        self._it: Any = None
        self._reader: ThreadPoolExecutor | None = None
        self._ahead: Future[Any] | None = None

    @property
    def version(self) -> int:
        return self.trainer.version

    def evaluate(self, problems: list[Problem]) -> HeldOut:
        return evaluate(self.trainer.graphdef, self.trainer.params, self.tok, problems,
                        self.config.max_new_tokens)  # fmt: skip

    def warm_start(self, rng: random.Random) -> None:
        warm_start(self.trainer, self.tok, self.config.warmup_steps, rng)

    def weights(self) -> dict[str, Any]:
        from tqstream.reference.jax.model import torch_state_dict

        return torch_state_dict(self.trainer.params)

    def _lr(self, step: int) -> float:
        """``CosineAnnealingLR(T_max=steps)`` (or a constant) at ``step``, as the torch loop's."""
        c = self.config
        if c.lr_schedule == "constant":
            return c.lr
        return c.lr * (1.0 + math.cos(math.pi * step / c.steps)) / 2.0

    def start(self, client: Any) -> None:
        from tqstream import StalenessPolicy
        from tqstream.adapters.jax import ExperienceIterator

        c = self.config
        # the task's prompts have one length and the responses at most max_new_tokens: padded to
        # exactly those, every batch has one shape (the step compiles once) and no token of
        # padding beyond what the rows need
        prompt = len(self.tok.encode(held_out(1)[0].prompt, add_special_tokens=False))
        response = (c.max_new_tokens,)
        self._it = ExperienceIterator(
            client, FIELDS, c.batch_groups * c.group_size, partition=c.partition, task="actor",
            whole_groups=True, ack="manual",
            staleness=StalenessPolicy(max_staleness=c.max_staleness, measure=c.measure,
                                      on_stale="drop"),
            version_fn=lambda: self.trainer.version, timeout=POLL,
            buckets={"prompt_ids": _buckets(prompt, self.positions), "response_ids": response,
                     "logprobs": response, "versions": response},
            pad_values={"prompt_ids": self.tok.pad_token_id,
                        "response_ids": self.tok.pad_token_id, "versions": -1},
        )  # fmt: skip
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tqstream-jax-read")

    def next_batch(self) -> Any:
        """The batch read ahead (or a read started now); its ``RequestTimeoutError`` is raised
        here, and the next call reads again."""
        ahead, self._ahead = self._ahead, None
        return (self._read() if ahead is None else ahead).result()

    def _read(self) -> Future[Any]:
        if self._reader is None or self._it is None:
            raise RuntimeError("JaxLearner.start(client) opens the reads; call it first")
        return self._reader.submit(next, self._it)

    def train(self, batch: Any) -> tuple[dict[str, Any], Any]:
        """The step, then the read of the next batch in the reader thread, which goes on while
        the loop pushes the weights and evaluates. It starts after the version moved, so its
        staleness window is the one of the version that will train on it (a read started
        earlier, during the step, would apply the window one version early)."""
        self.trainer.lr = self._lr(self._steps)
        fresh = batch["fresh_mask"] if self.config.measure == "token" else None
        stats = self.trainer.step(
            batch["prompt_ids"], batch["prompt_ids_lengths"], batch["response_ids"],
            batch["response_ids_lengths"], batch["logprobs"], batch["versions"], batch["rewards"],
            batch["group_ids"], fresh=fresh,
        )  # fmt: skip
        self._steps += 1
        self._it.ack(batch)
        if self._steps < self.config.steps:
            self._ahead = self._read()
        return stats, batch.meta

    def close(self) -> None:
        """Stop reading; a batch read ahead and not trained on goes back to the partition (it
        counts as left). Idempotent."""
        reader, self._reader = self._reader, None
        ahead, self._ahead = self._ahead, None
        if reader is not None:
            reader.shutdown(wait=True)  # a read in flight ends within its timeout
        if ahead is not None and ahead.exception() is None and self._it is not None:
            self._it.release(ahead.result())
        it, self._it = self._it, None
        if it is not None:
            it.close()
