"""``PPOTrainer``'s step in JAX: decoupled PPO with GRPO advantages on the flax Qwen2.

The same semantics as ``tqstream/reference/trainer.py`` (proximal logprobs recomputed or
log-linear, the behaviour cap, GRPO advantages per group, the entropy bonus only in groups whose
rewards differ, ``epochs`` AdamW steps per batch, optional global-norm clipping, ``version`` + 1
per step, the same statistics), on padded fixed-shape arrays:

- a batch is ``prompt_ids [B, P]`` and ``response_ids [B, R]`` (right-padded, with their lengths
  ``[B]``), the behaviour ``logprobs`` and per-token ``versions`` padded like the responses,
  ``rewards [B]``, ``group_ids [B]`` (each row's group numbered in the batch) and optionally
  ``fresh [B, R]`` (a token-measure read's ``fresh_mask``); the step joins each row's prompt and
  response into one right-padded sequence of ``P + R`` tokens inside the jit, so it compiles once
  per ``(B, P, R)`` — the iterator's buckets make that one shape for a run;
- the whole step (the proximal forward pass and the ``epochs`` optimizer steps, a ``lax.scan``)
  is one ``jax.jit`` call: one dispatch per batch, nothing read back but the statistics;
- the learning rate is a value of the optimizer state (``optax.inject_hyperparams``), so a
  schedule sets it per step without recompiling (:attr:`JaxPPOTrainer.lr`);
- a non-finite loss raises ``FloatingPointError`` after the step and leaves the weights and the
  optimizer state as they were before it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tqstream.reference.jax.loss import decoupled_ppo_loss, grpo_advantages, loglinear_proximal
from tqstream.reference.jax.model import Params, Qwen2, forward

__all__ = ["JaxPPOTrainer", "sequences"]


def sequences(
    prompts: jax.Array, prompt_lengths: jax.Array, responses: jax.Array,
    response_lengths: jax.Array, pad_id: int,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(ids [B, P + R], attention [B, P + R])``: each row's prompt then its response, padded on
    the right with ``pad_id`` (the layout of ``PPOTrainer.logprobs``'s batch)."""
    p, r = prompts.shape[1], responses.shape[1]
    t = jnp.arange(p + r)[None, :]
    plen, rlen = prompt_lengths[:, None], response_lengths[:, None]
    in_prompt = t < plen
    in_response = (t >= plen) & (t < plen + rlen)
    at = jnp.broadcast_to(jnp.clip(t, 0, p - 1), (prompts.shape[0], p + r))
    from_prompt = jnp.take_along_axis(prompts, at, 1)
    from_response = jnp.take_along_axis(responses, jnp.clip(t - plen, 0, r - 1), 1)
    ids = jnp.where(in_prompt, from_prompt, jnp.where(in_response, from_response, pad_id))
    return ids.astype(jnp.int32), in_prompt | in_response


class JaxPPOTrainer:
    """The JAX twin of ``PPOTrainer``: the same arguments (``model`` is a :class:`Qwen2`, e.g.
    ``nnx.merge`` of :func:`~tqstream.reference.jax.model.params_from_torch`'s params), and
    :attr:`params`, the weights as a pure dict, which every step replaces. The hyperparameters are
    compiled into the step when it first runs (build another trainer to change them), except the
    learning rate (:attr:`lr`)."""

    def __init__(
        self,
        model: Qwen2,
        *,
        pad_id: int,
        lr: float = 1e-3,
        temperature: float = 1.0,
        eps_clip: float = 0.2,
        behav_cap: float | None = 5.0,
        proximal: str = "recompute",
        version: int = 0,
        epochs: int = 1,
        entropy_coef: float = 0.0,
        max_grad_norm: float | None = None,
        weight_decay: float = 0.01,
    ) -> None:
        if proximal not in ("recompute", "loglinear"):
            raise ValueError(f"proximal must be 'recompute' or 'loglinear', got {proximal!r}")
        if epochs < 1:
            raise ValueError(f"epochs must be 1 or more, got {epochs}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        graphdef, state = nnx.split(model)
        self.graphdef = graphdef
        # committed to the device, as every step's outputs are: a jit's cache tells committed
        # arguments from uncommitted ones, and the second step would compile again
        self.device = jax.local_devices()[0]
        self.params: Params = jax.device_put(nnx.to_pure_dict(state), self.device)
        self.epochs, self.entropy_coef = epochs, entropy_coef
        self.max_grad_norm = max_grad_norm
        self.pad_id, self.temperature = pad_id, temperature
        self.eps_clip, self.behav_cap, self.proximal = eps_clip, behav_cap, proximal
        self.version = version
        # torch.optim.AdamW's defaults (optax's weight decay is 1e-4, torch's 1e-2)
        self._tx = optax.inject_hyperparams(optax.adamw)(
            learning_rate=lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay
        )
        self.opt_state: Any = jax.device_put(self._tx.init(self.params), self.device)
        self._step = jax.jit(self._ppo_step)
        self._supervised = jax.jit(self._supervised_step)
        self._logprobs = jax.jit(self._response_logprobs)

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.opt_state.hyperparams["learning_rate"])

    @lr.setter
    def lr(self, value: float) -> None:
        self.opt_state.hyperparams["learning_rate"] = jnp.asarray(value, jnp.float32)

    # --- pure functions (jitted in __init__) ---
    def _response_logprobs(
        self, params: Params, prompts: jax.Array, prompt_lengths: jax.Array,
        responses: jax.Array, response_lengths: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        """``(logp [B, R], entropy [B, R])`` of each response token at the rollout's temperature
        (garbage past a row's length: mask it)."""
        ids, attention = sequences(prompts, prompt_lengths, responses, response_lengths,
                                   self.pad_id)  # fmt: skip
        # the last position predicts nothing (it is at most a target): the model runs on the rest
        logits = forward(self.graphdef, params, ids[:, :-1], attention[:, :-1])
        # response token j is predicted by the logits at position prompt_length - 1 + j
        at = prompt_lengths[:, None] - 1 + jnp.arange(responses.shape[1])[None, :]
        at = jnp.clip(at, 0, logits.shape[1] - 1)
        logits = jnp.take_along_axis(logits, at[:, :, None], axis=1) / self.temperature
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, responses[:, :, None].astype(jnp.int32), -1)[..., 0]
        return chosen, -(jnp.exp(logp) * logp).sum(-1)

    def _update(self, params: Params, opt_state: Any, grads: Params) -> tuple[Any, Any, Any]:
        norm = optax.tree.norm(grads)
        if self.max_grad_norm is not None:  # torch's clip_grad_norm_: max_norm / (norm + 1e-6)
            scale = jnp.minimum(1.0, self.max_grad_norm / (norm + 1e-6))
            grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
        updates, opt_state = self._tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, norm

    def _ppo_step(
        self, params: Params, opt_state: Any, version: jax.Array, prompts: jax.Array,
        prompt_lengths: jax.Array, responses: jax.Array, response_lengths: jax.Array,
        behav: jax.Array, versions: jax.Array, rewards: jax.Array, group_ids: jax.Array,
        fresh: jax.Array,
    ) -> tuple[Params, Any, dict[str, jax.Array]]:  # fmt: skip
        args = (prompts, prompt_lengths, responses, response_lengths)
        mask = (jnp.arange(responses.shape[1])[None, :] < response_lengths[:, None]) & fresh
        behav = jnp.where(mask, behav.astype(jnp.float32), 0.0)
        token_versions = jnp.where(mask, versions, -1)
        prox = None
        if self.proximal == "recompute":
            prox, _ = self._response_logprobs(jax.lax.stop_gradient(params), *args)
        advantages, varied = grpo_advantages(rewards, group_ids)
        # the entropy bonus only where the reward still tells samples apart (see trainer.py)
        bonus = mask & varied[:, None]
        bonus_count = bonus.sum()

        def objective(p: Params) -> tuple[jax.Array, tuple[Any, ...]]:
            logp, entropy = self._response_logprobs(p, *args)
            proximal = (
                prox if prox is not None
                else loglinear_proximal(behav, logp, token_versions, version)
            )  # fmt: skip
            loss, stats = decoupled_ppo_loss(
                logp, proximal, behav, advantages, mask, eps_clip=self.eps_clip,
                behav_cap=self.behav_cap,
            )  # fmt: skip
            mean_entropy = jnp.where(mask, entropy, 0.0).sum() / jnp.maximum(mask.sum(), 1)
            if self.entropy_coef:
                bonus_mean = jnp.where(bonus, entropy, 0.0).sum() / jnp.maximum(bonus_count, 1)
                loss = loss - jnp.where(bonus_count > 0, self.entropy_coef * bonus_mean, 0.0)
            return loss, (stats, jax.lax.stop_gradient(mean_entropy))

        def epoch(carry: Any, _: Any) -> tuple[Any, Any]:
            p, state = carry
            (loss, (stats, entropy)), grads = jax.value_and_grad(objective, has_aux=True)(p)
            p, state, norm = self._update(p, state, grads)
            return (p, state), (loss, stats, entropy, norm)

        (params, opt_state), (losses, stats, entropy, norms) = jax.lax.scan(
            epoch, (params, opt_state), None, length=self.epochs
        )
        out = {k: v[-1] for k, v in stats.items()}  # as torch: the last epoch's
        out.update(losses=losses, entropy=entropy[-1], grad_norm=norms.max())
        return params, opt_state, out

    def _supervised_step(
        self, params: Params, opt_state: Any, prompts: jax.Array, prompt_lengths: jax.Array,
        responses: jax.Array, response_lengths: jax.Array,
    ) -> tuple[Params, Any, jax.Array]:  # fmt: skip
        mask = jnp.arange(responses.shape[1])[None, :] < response_lengths[:, None]

        def nll(p: Params) -> jax.Array:
            logp, _ = self._response_logprobs(p, prompts, prompt_lengths, responses,
                                              response_lengths)  # fmt: skip
            return -(jnp.where(mask, logp, 0.0).sum() / jnp.maximum(mask.sum(), 1))

        loss, grads = jax.value_and_grad(nll)(params)
        updates, opt_state = self._tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # --- the trainer's face ---
    def logprobs(
        self, prompts: Any, prompt_lengths: Any, responses: Any, response_lengths: Any
    ) -> tuple[jax.Array, jax.Array]:
        """``(logp [B, R], mask [B, R])`` of each response token under :attr:`params`."""
        logp, _ = self._logprobs(self.params, prompts, prompt_lengths, responses,
                                 response_lengths)  # fmt: skip
        mask = jnp.arange(np.shape(responses)[1])[None, :] < jnp.asarray(response_lengths)[:, None]
        return logp, mask

    def supervised_step(
        self, prompts: Any, prompt_lengths: Any, responses: Any, response_lengths: Any
    ) -> float:
        """One optimizer step on the responses' negative log-likelihood (the format warm
        start's); the version does not move. Returns the loss before the step."""
        self.params, self.opt_state, loss = self._supervised(
            self.params, self.opt_state, prompts, prompt_lengths, responses, response_lengths
        )
        return float(loss)

    def step(
        self,
        prompts: Any,
        prompt_lengths: Any,
        responses: Any,
        response_lengths: Any,
        behav_logprobs: Any,
        versions: Any,
        rewards: Any,
        group_ids: Any,
        fresh: Any = None,
    ) -> dict[str, Any]:
        """``epochs`` optimizer steps on the batch (arrays as the module docstring says); returns
        the statistics ``PPOTrainer.step`` returns (``lag_counts``: trajectories by the version
        lag of their oldest trained token)."""
        b, r = np.shape(responses)
        if np.shape(behav_logprobs) != (b, r) or np.shape(versions) != (b, r):
            raise ValueError(
                f"responses {(b, r)}, logprobs {np.shape(behav_logprobs)} and versions "
                f"{np.shape(versions)} must have one shape: one logprob and version per token"
            )
        for name, a in (("prompt_lengths", prompt_lengths), ("response_lengths", response_lengths),
                        ("rewards", rewards), ("group_ids", group_ids)):  # fmt: skip
            if np.shape(a) != (b,):
                raise ValueError(f"{name} has shape {np.shape(a)}; it needs one entry per row, {b}")
        if np.shape(prompts)[0] != b or (fresh is not None and np.shape(fresh) != (b, r)):
            raise ValueError("prompts (and fresh) need one row per response")
        fresh_mask = jnp.ones((b, r), bool) if fresh is None else jnp.asarray(fresh, bool)
        params, opt_state, out = self._step(
            self.params, self.opt_state, jnp.int32(self.version), prompts, prompt_lengths,
            responses, response_lengths, behav_logprobs, versions, rewards, group_ids, fresh_mask,
        )  # fmt: skip
        losses = np.asarray(out.pop("losses"))
        if not np.isfinite(losses).all():
            bad = losses[~np.isfinite(losses)][0]
            raise FloatingPointError(f"the loss is {bad} at version {self.version}")
        self.params, self.opt_state = params, opt_state
        self.version += 1
        stats = {k: float(v) for k, v in jax.device_get(out).items()}
        lags = _lags(self.version, np.asarray(versions), np.asarray(response_lengths),
                     np.asarray(fresh_mask))  # fmt: skip
        return {
            "loss": float(losses[-1]),
            "reward_mean": float(np.asarray(rewards, np.float32).mean()),
            "version": float(self.version),
            **lags,
            **stats,
        }


def _lags(version: int, versions: np.ndarray, lengths: np.ndarray, fresh: np.ndarray
          ) -> dict[str, Any]:  # fmt: skip
    """``max_lag`` over the trained tokens and ``lag_counts`` by each trajectory's oldest one,
    against the version the step trained at (``version - 1``)."""
    mask = (np.arange(versions.shape[1])[None, :] < lengths[:, None]) & fresh
    lag = version - 1 - versions[mask]
    heads = np.where(mask, versions, version).min(axis=1)[mask.any(axis=1)]
    counts = Counter((version - 1 - heads).tolist())
    return {"max_lag": float(lag.max()) if lag.size else 0.0,
            "lag_counts": dict(sorted(counts.items()))}  # fmt: skip
