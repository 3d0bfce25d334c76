"""The reference trainer's objective: GRPO group-normalised advantages and the decoupled PPO loss
(three policies: the behaviour policy that sampled the tokens, the proximal policy the clipping is
centred on, the current policy), as in AReaL. Pure tensor math on padded ``[B, T]`` batches.

- :func:`grpo_advantages`: each sample's reward minus its group's mean, over the group's standard
  deviation; a group of one (or of equal rewards) has advantage 0.
- :func:`loglinear_proximal`: AReaL's log-linear approximation of the proximal logprobs from the
  per-token versions, without a forward pass: ``behav + alpha * (current - behav)`` with
  ``alpha = (v_prox - v_behav) / (v_current - v_behav)`` clamped to [0, 1] and
  ``v_prox = v_current - 1``; prompt tokens (version -1) get alpha 0.
- :func:`decoupled_ppo_loss`: the clipped surrogate on ``current / proximal`` probabilities, each
  token weighted by the behaviour importance weight ``proximal / behaviour``; tokens whose weight
  exceeds ``behav_cap`` are dropped (AReaL's token-level rejection, "mask" mode). The mean is over
  the tokens of ``mask`` before dropping.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["decoupled_ppo_loss", "grpo_advantages", "loglinear_proximal"]


def grpo_advantages(
    rewards: torch.Tensor, groups: Sequence[Hashable], eps: float = 1e-6
) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)`` per sample (population std)."""
    if rewards.ndim != 1 or len(groups) != rewards.shape[0]:
        raise ValueError(
            f"rewards must be 1-D with one group per sample; got {tuple(rewards.shape)} rewards "
            f"and {len(groups)} groups"
        )
    index: dict[Hashable, int] = {}
    ids = torch.tensor([index.setdefault(g, len(index)) for g in groups], dtype=torch.long)
    r = rewards.double()  # equal rewards must give exactly 0, not rounding noise over eps
    k = len(index)
    count = torch.zeros(k, dtype=r.dtype).index_add_(0, ids, torch.ones_like(r))
    mean = torch.zeros(k, dtype=r.dtype).index_add_(0, ids, r) / count
    var = torch.zeros(k, dtype=r.dtype).index_add_(0, ids, (r - mean[ids]) ** 2) / count
    return ((r - mean[ids]) / (var[ids].sqrt() + eps)).float()


def loglinear_proximal(
    behav_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, current_version: int
) -> torch.Tensor:
    """AReaL's log-linear ``log π_prox`` (see the module docstring); ``versions`` per token."""
    v_behav = versions.float()
    span = float(current_version) - v_behav
    gap = float(current_version - 1) - v_behav
    alpha = torch.where((span > 0) & (versions >= 0), gap / span.clamp(min=1e-9), 0.0)
    alpha = alpha.clamp(0.0, 1.0)
    return behav_logp + alpha * (logp.detach() - behav_logp)


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    behav_cap: float | None = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss (a scalar to minimise) and its statistics; ``advantages`` per token or per
    sequence (``[B]``, broadcast over tokens); ``mask`` marks the generated tokens."""
    mask = mask.bool()
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(logp)
    count = int(mask.sum()) or 1
    prox_logp, behav_logp = prox_logp.detach(), behav_logp.detach()
    ratio = torch.where(mask, torch.exp(logp - prox_logp), 0.0)
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)
    surrogate = torch.maximum(-advantages * ratio, -advantages * clipped)
    weight = torch.where(mask, torch.exp(prox_logp - behav_logp), 0.0)
    keep = mask if behav_cap is None else mask & (weight <= behav_cap)
    loss = torch.where(keep, surrogate * weight, 0.0).sum() / count
    ratio, weight = ratio.detach(), weight.detach()
    stats = {
        "clip_fraction": float(((ratio != clipped.detach()) & mask).sum()) / count,
        "behav_dropped_fraction": float((mask & ~keep).sum()) / count,
        "behav_weight_mean": float(torch.where(keep, weight, 0.0).sum()) / max(int(keep.sum()), 1),
        "ratio_mean": float(ratio.sum()) / count,
    }
    return loss, stats
