"""``loss.py``'s objective in jax.numpy, on fixed-shape arrays (for ``jax.jit``).

The same three functions with the same math (see ``tqstream/reference/loss.py``); what differs is
only what fixed shapes need:

- groups are int ids ``[B]`` in ``0..B-1`` (the iterator's ``group_ids``), summed over with
  ``segment_sum`` into ``B`` segments (static), not a list of hashables;
- a group whose rewards are all equal gets advantage exactly 0 by a test (``max == min``), where
  the torch version computes in float64 so that the rounding noise stays below ``eps``: JAX runs
  in 32 bits, where ``(r - mean) / (std + eps)`` of equal rewards is not always 0;
- the statistics are arrays (read them after the step), not Python floats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["decoupled_ppo_loss", "grpo_advantages", "loglinear_proximal"]


def grpo_advantages(
    rewards: jax.Array, group_ids: jax.Array, eps: float = 1e-6
) -> tuple[jax.Array, jax.Array]:
    """``((r - mean_group) / (std_group + eps), varied)`` per sample (population std);
    ``varied``: the sample's group has rewards that differ (the others' advantages are 0)."""
    n = rewards.shape[0]
    r = rewards.astype(jnp.float32)
    count = jax.ops.segment_sum(jnp.ones_like(r), group_ids, num_segments=n)
    mean = jax.ops.segment_sum(r, group_ids, num_segments=n) / jnp.maximum(count, 1.0)
    centred = r - mean[group_ids]
    var = jax.ops.segment_sum(centred**2, group_ids, num_segments=n) / jnp.maximum(count, 1.0)
    high = jax.ops.segment_max(r, group_ids, num_segments=n)
    low = jax.ops.segment_min(r, group_ids, num_segments=n)
    # a NaN reward must make NaN advantages (the step then raises), not look like a solved group
    varied = ~(high == low)[group_ids] | ~jnp.isfinite(centred)
    advantages = jnp.where(varied, centred / (jnp.sqrt(var[group_ids]) + eps), 0.0)
    return advantages, varied


def loglinear_proximal(
    behav_logp: jax.Array, logp: jax.Array, versions: jax.Array, current_version: jax.Array | int
) -> jax.Array:
    """AReaL's log-linear ``log π_prox``: ``behav + alpha * (current - behav)``, ``alpha =
    (v_current - 1 - v_behav) / (v_current - v_behav)`` clamped to [0, 1], 0 on version -1."""
    v_behav = versions.astype(jnp.float32)
    current = jnp.asarray(current_version, jnp.float32)
    span = current - v_behav
    gap = current - 1.0 - v_behav
    alpha = jnp.where((span > 0) & (versions >= 0), gap / jnp.maximum(span, 1e-9), 0.0)
    alpha = jnp.clip(alpha, 0.0, 1.0)
    return behav_logp + alpha * (jax.lax.stop_gradient(logp) - behav_logp)


def decoupled_ppo_loss(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_clip: float = 0.2,
    behav_cap: float | None = 5.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss (a scalar to minimise) and its statistics, as ``loss.decoupled_ppo_loss``:
    ``advantages`` per token or per sequence (``[B]``), ``mask`` the generated tokens."""
    mask = mask.astype(bool)
    if advantages.ndim == 1:
        advantages = jnp.broadcast_to(advantages[:, None], logp.shape)
    count = jnp.maximum(mask.sum(), 1).astype(jnp.float32)
    prox_logp = jax.lax.stop_gradient(prox_logp)
    behav_logp = jax.lax.stop_gradient(behav_logp)
    # the exponent is masked before exp: a padded position's difference may be anything, and
    # exp's gradient there would be inf * 0
    ratio = jnp.where(mask, jnp.exp(jnp.where(mask, logp - prox_logp, 0.0)), 0.0)
    clipped = jnp.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    surrogate = jnp.maximum(-advantages * ratio, -advantages * clipped)
    weight = jnp.where(mask, jnp.exp(jnp.where(mask, prox_logp - behav_logp, 0.0)), 0.0)
    keep = mask if behav_cap is None else mask & (weight <= behav_cap)
    loss = jnp.where(keep, surrogate * weight, 0.0).sum() / count
    ratio, weight = jax.lax.stop_gradient(ratio), jax.lax.stop_gradient(weight)
    kept = jnp.maximum(keep.sum(), 1).astype(jnp.float32)
    stats = {
        "clip_fraction": ((ratio != clipped) & mask).sum() / count,
        "behav_dropped_fraction": (mask & ~keep).sum() / count,
        "behav_weight_mean": jnp.where(keep, weight, 0.0).sum() / kept,
        "ratio_mean": ratio.sum() / count,
    }
    return loss, stats
