"""The reference trainer's step: decoupled PPO with GRPO advantages on a Hugging Face causal LM.

One call is one optimizer step on a batch of trajectories (prompt tokens, response tokens, their
behaviour logprobs and per-token versions from the rollout engine, a reward, a group):

1. proximal logprobs: recomputed by a forward pass with the weights the step starts from (the
   standard decoupled PPO), or AReaL's log-linear approximation from the per-token versions
   (``proximal="loglinear"``: no extra forward pass);
2. current logprobs with gradients, at the rollout's ``temperature`` so that they are comparable
   with the behaviour logprobs;
3. GRPO advantages per group, the decoupled loss (``loss.py``) minus ``entropy_coef`` times the
   mean entropy of the generated tokens' distributions (in groups whose rewards differ: a solved
   group has nothing left to explore for, and the bonus alone would undo it), and ``epochs``
   optimizer steps over the batch (PPO's passes: the clip keeps later passes near the proximal
   policy), each with its gradient's global norm clipped to ``max_grad_norm`` if given;
   ``version`` goes up by one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from tqstream.reference.loss import decoupled_ppo_loss, grpo_advantages, loglinear_proximal

__all__ = ["PPOTrainer"]


class PPOTrainer:
    def __init__(
        self,
        model: Any,
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
    ) -> None:
        if proximal not in ("recompute", "loglinear"):
            raise ValueError(f"proximal must be 'recompute' or 'loglinear', got {proximal!r}")
        if epochs < 1:
            raise ValueError(f"epochs must be 1 or more, got {epochs}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        self.model = model
        self.epochs, self.entropy_coef = epochs, entropy_coef
        self.max_grad_norm = max_grad_norm
        self.pad_id, self.temperature = pad_id, temperature
        self.eps_clip, self.behav_cap, self.proximal = eps_clip, behav_cap, proximal
        self.version = version
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def logprobs(
        self,
        prompts: Sequence[torch.Tensor],
        responses: Sequence[torch.Tensor],
        *,
        entropy: bool = False,
    ) -> Any:
        """``(logp [B, T], mask [B, T])``: each response token's logprob under the current weights,
        at response positions of a right-padded batch (grad enabled if the caller's is); with
        ``entropy``, also each position's entropy ``[B, T]``."""
        seqs = [torch.cat([p.long(), r.long()]) for p, r in zip(prompts, responses, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
        for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
            ids[i, : len(s)] = s
            attention[i, : len(s)] = 1
            mask[i, len(p) - 1 : len(s) - 1] = True  # logits at t predict token t + 1
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp = torch.log_softmax(logits / self.temperature, dim=-1)
        chosen = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        if entropy:
            return chosen, mask, -(logp.exp() * logp).sum(-1)
        return chosen, mask

    @staticmethod
    def _place(values: Sequence[torch.Tensor], mask: torch.Tensor, fill: float) -> torch.Tensor:
        out = torch.full(mask.shape, fill, dtype=torch.float32)
        out[mask] = torch.cat([v.float().reshape(-1) for v in values])
        return out

    def step(
        self,
        prompts: Sequence[torch.Tensor],
        responses: Sequence[torch.Tensor],
        behav_logprobs: Sequence[torch.Tensor],
        versions: Sequence[torch.Tensor],
        rewards: torch.Tensor,
        groups: Sequence[Hashable],
        fresh: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """``epochs`` optimizer steps on the batch; returns their statistics (loss, reward,
        clipping, ... and ``lag_counts``: trajectories by version lag of their oldest token).

        ``fresh``: per trajectory, which generated tokens to learn from (a token-measure read's
        ``fresh_mask``): the others stay out of the loss, as tokens of a stale trajectory would
        with the whole trajectory."""
        if not (len(prompts) == len(responses) == len(behav_logprobs) == len(versions)
                == len(rewards) == len(groups)):  # fmt: skip
            raise ValueError("every argument needs one entry per trajectory")
        for r, b, v in zip(responses, behav_logprobs, versions, strict=True):
            if not (len(r) == len(b) == len(v)):
                raise ValueError(
                    f"a response of {len(r)} tokens came with {len(b)} logprobs and {len(v)} "
                    "versions; the rollout engine gives one of each per generated token"
                )
        self.model.train()
        if self.proximal == "recompute":
            with torch.no_grad():
                prox, _ = self.logprobs(prompts, responses)
        advantages = grpo_advantages(rewards, groups)
        # the entropy bonus only where the reward still tells samples apart: on a group that all
        # got the same reward the surrogate is 0, and the bonus alone (at Adam's step size,
        # whatever its scale) would drive a solved policy back to random answers
        varied = {g for g, a in zip(groups, advantages.tolist(), strict=True) if a != 0.0}
        live = torch.tensor([g in varied for g in groups], dtype=torch.bool)[:, None]
        norms: list[float] = []
        for _ in range(self.epochs):
            logp, mask, entropy = self.logprobs(prompts, responses, entropy=True)
            behav = self._place(behav_logprobs, mask, 0.0)
            token_versions = self._place(versions, mask, -1.0).long()
            if fresh is not None:
                mask = mask & self._place(fresh, mask, 0.0).bool()
            if self.proximal == "loglinear":
                prox = loglinear_proximal(behav, logp, token_versions, self.version)
            loss, stats = decoupled_ppo_loss(
                logp, prox, behav, advantages, mask, eps_clip=self.eps_clip,
                behav_cap=self.behav_cap,
            )  # fmt: skip
            mean_entropy = torch.where(mask, entropy, 0.0).sum() / max(int(mask.sum()), 1)
            bonus = mask & live
            if self.entropy_coef and bool(bonus.any()):
                loss = loss - self.entropy_coef * (
                    torch.where(bonus, entropy, 0.0).sum() / int(bonus.sum())
                )
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the loss is {loss.item()} at version {self.version}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(),
                float("inf") if self.max_grad_norm is None else self.max_grad_norm,
            )
            norms.append(float(norm))
            self.optimizer.step()
        self.model.eval()
        self.version += 1
        lag = self.version - 1 - token_versions[mask]
        # each trajectory's lag by its oldest generated token (the head measure)
        heads = torch.where(mask, token_versions, self.version).min(dim=1).values
        row_lags = Counter((self.version - 1 - heads[mask.any(dim=1)]).tolist())
        return {
            "loss": loss.item(),
            "reward_mean": float(rewards.float().mean()),
            "version": float(self.version),
            "max_lag": float(lag.max()) if lag.numel() else 0.0,
            "entropy": float(mean_entropy.detach()),
            "lag_counts": dict(sorted(row_lags.items())),
            "grad_norm": max(norms),
            **stats,
        }
