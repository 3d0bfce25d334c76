"""The reference loop's configuration: one frozen dataclass, checked before anything starts, and
the loop's error. Apart from ``pipeline.py`` so that the trainers' glue (the JAX one too) takes
the configuration without importing the loop that drives them."""

from __future__ import annotations

import dataclasses

from tqstream.errors import TQStreamError
from tqstream.reference.task import DIGITS

__all__ = ["FIELDS", "POLL", "PipelineConfig", "PipelineError"]

POLL = 1.0
"""Seconds the trainer waits for a batch before it looks at its workers again."""
FIELDS = ["prompt_ids", "response_ids", "logprobs", "versions", "rewards"]
"""A trajectory's fields as the rollout workers put them and the trainers read them."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    steps: int = 20
    """Optimizer steps (= weight versions published)."""
    workers: int = 2
    """Rollout worker processes."""
    batch_groups: int = 32
    """Groups (prompts) per training batch."""
    group_size: int = 8
    """Samples per prompt (the GRPO group)."""
    prompts_per_rollout: int = 8
    """Prompts a worker generates for in one batch and puts in one put (at most
    ``batch_groups``)."""
    max_staleness: int = 2
    """A trajectory whose oldest token is more versions behind than this is dropped, not trained on;
    0 is the synchronous baseline."""
    admission_slack: int = 0
    """Versions beyond ``max_staleness`` the admission lets rollouts run ahead: 0 keeps the heads
    of trajectories inside the window (little is ever stale); more overlaps generation and training
    further, and the window then drops (head) or masks (token) what comes out stale. With the jax
    trainer's per_version admission: each version admits ``1 + admission_slack`` weight updates'
    worth of rows (0: exactly what the trainer consumes before it pushes the next weights)."""
    sync_interval: int = 1
    """Steps between two weight syncs; needs ``max_staleness >= sync_interval - 1``."""
    engine: str = "torch"
    """The rollout engine: "torch" (``TorchEngine``) or "vllm" (``VLLMEngine``, needs vLLM)."""
    trainer: str = "torch"
    """The trainer: "torch" (``PPOTrainer``, reading through the torch adapter, the rollouts held
    by a capacity admission) or "jax" (``JaxPPOTrainer`` on the flax twin of the model, reading
    through the JAX adapter, the rollouts held by a per_version admission; needs the jax extra).
    Either pushes torch state dicts to the same rollout workers."""
    max_restarts: int = 3
    """Rollout workers that may die and be replaced before the run fails."""
    backend: str = "gloo"
    """The weight sync's transport: "gloo" (CPU) or "nccl" (GPUs; the trainer's weights go from
    ``cuda:0``, each worker receives on its current device)."""
    max_new_tokens: int = DIGITS + 1
    """Tokens a completion may have: the answer's digits and the end of sequence."""
    temperature: float = 1.0
    lr: float = 3e-4
    """The learning rate of the first step."""
    lr_schedule: str = "cosine"
    """"cosine": the learning rate decays to 0 over ``steps`` (a solved policy is not shaken
    apart late on); "constant": it stays ``lr`` (a short run learns more in its steps)."""
    epochs: int = 8
    """Optimizer steps per batch (PPO's passes over it)."""
    entropy_coef: float = 0.005
    """Weight of the generated tokens' mean entropy in the loss (keeps the policy exploring)."""
    max_grad_norm: float | None = None
    """Each optimizer step's gradients are scaled down to this global norm when above it (None:
    never; verl and AReaL clip to 1.0 by default)."""
    warmup_steps: int = 100
    """Supervised steps on the answer's format (random digits) before the first rollout."""
    eval_every: int = 10
    """Steps between two held-out evaluations (greedy exact-match); 0: only first and last."""
    eval_problems: int = 256
    """Held-out problems evaluated (never drawn for training)."""
    seed: int = 0
    update_mode: str = "keep"
    """What a weight update does to generations in flight: "keep" or "abort" (see engine.py)."""
    measure: str = "head"
    """How the staleness window measures a trajectory: "head" (its oldest token: the whole
    trajectory is dropped once that is too old) or "token" (read while any token is inside; the
    tokens outside stay out of the loss)."""
    proximal: str = "recompute"
    timeout: float = 120.0
    """Seconds a read, a weight sync or a worker's start may take before the run fails (a vLLM
    engine's start counts in)."""
    partition: str = "rollouts"

    def check(self) -> None:
        """Refuse what cannot run, or would deadlock, with what to change."""
        if self.workers < 1 or self.steps < 1 or self.batch_groups < 1 or self.group_size < 1:
            raise PipelineError("a run needs at least one worker, step, group and sample per group")
        if self.prompts_per_rollout < 1 or self.epochs < 1 or self.warmup_steps < 0:
            raise PipelineError(
                "prompts_per_rollout and epochs must be 1 or more, warmup_steps 0 or more"
            )
        if self.eval_every < 0 or self.eval_problems < 1:
            raise PipelineError("eval_every must be 0 or more, eval_problems 1 or more")
        if self.max_staleness < 0:
            raise PipelineError(f"max_staleness must be 0 or more, got {self.max_staleness}")
        if self.admission_slack < 0:
            raise PipelineError(f"admission_slack must be 0 or more, got {self.admission_slack}")
        if self.sync_interval < 1:
            raise PipelineError(f"sync_interval must be 1 or more, got {self.sync_interval}")
        if self.max_staleness < self.sync_interval - 1:
            raise PipelineError(
                f"max_staleness={self.max_staleness} with sync_interval={self.sync_interval} would "
                f"deadlock: the trainer goes {self.sync_interval - 1} versions past the weights "
                "the rollouts use before it pushes new ones, so every trajectory would be stale "
                f"and no batch would come; use max_staleness >= {self.sync_interval - 1} or a "
                "shorter sync_interval"
            )
        if self.engine not in ("torch", "vllm"):
            raise PipelineError(f"unknown engine {self.engine!r}; use 'torch' or 'vllm'")
        if self.trainer not in ("torch", "jax"):
            raise PipelineError(f"unknown trainer {self.trainer!r}; use 'torch' or 'jax'")
        if self.update_mode not in ("keep", "abort"):
            raise PipelineError(f"update_mode must be 'keep' or 'abort', got {self.update_mode!r}")
        if self.lr_schedule not in ("cosine", "constant"):
            raise PipelineError(
                f"lr_schedule must be 'cosine' or 'constant', got {self.lr_schedule!r}"
            )
        if self.measure not in ("head", "token"):
            raise PipelineError(f"measure must be 'head' or 'token', got {self.measure!r}")
        if self.backend not in ("gloo", "nccl"):
            raise PipelineError(f"unknown backend {self.backend!r}; use 'gloo' or 'nccl'")
        if self.max_restarts < 0:
            raise PipelineError(f"max_restarts must be 0 or more, got {self.max_restarts}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise PipelineError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")


class PipelineError(TQStreamError, RuntimeError):
    """The reference loop cannot run as configured, or lost more workers than it may replace."""

    code = "pipeline"
