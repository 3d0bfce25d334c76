"""The reference trainer's objective against brute force and against AReaL's own loss function
(``ppo_actor_loss_fn`` with token-level rejection). AReaL's log-linear approximation lives in a
module that imports its experiment trackers, so it is checked against its formula, token by
token."""

from __future__ import annotations

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.reference.loss import decoupled_ppo_loss, grpo_advantages, loglinear_proximal


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5)), min_size=1, max_size=20))
def test_grpo_advantages_match_brute_force(samples: list[tuple[int, float]]) -> None:
    groups = [g for g, _ in samples]
    rewards = torch.tensor([r for _, r in samples], dtype=torch.float64)
    got = grpo_advantages(rewards, groups)
    for i, (g, r) in enumerate(samples):
        mine = [x for h, x in samples if h == g]
        mean = sum(mine) / len(mine)
        std = statistics.pstdev(mine)
        assert got[i].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-4, abs=1e-3)


def test_grpo_advantages_refuse_mismatched_groups() -> None:
    with pytest.raises(ValueError, match=r"one group per sample; got \(3,\) rewards and 2 groups"):
        grpo_advantages(torch.zeros(3), ["a", "b"])


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 9
    behav = -torch.rand(b, t, generator=g) * 3
    return {
        "logp": behav + torch.randn(b, t, generator=g) * 0.3,
        "prox": behav + torch.randn(b, t, generator=g) * 0.8,
        "behav": behav,
        "adv": torch.randn(b, t, generator=g),
        "mask": torch.rand(b, t, generator=g) > 0.2,
        "versions": torch.randint(-1, 5, (b, t), generator=g),
    }


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 10_000), cap=st.sampled_from([1.5, 3.0, 10.0]))
def test_decoupled_loss_equals_areals(seed: int, cap: float) -> None:
    pytest.importorskip("areal", reason="AReaL: pip install --no-deps areal==1.0.4")
    from areal.api.cli_args import RejectionSamplingConfig
    from areal.utils.functional.functional import ppo_actor_loss_fn

    x = _batch(seed)
    logp = x["logp"].clone().requires_grad_(True)
    ours, stats = decoupled_ppo_loss(logp, x["prox"], x["behav"], x["adv"], x["mask"],
                                     eps_clip=0.2, behav_cap=cap)  # fmt: skip
    logp2 = x["logp"].clone().requires_grad_(True)
    rs = RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=cap)
    theirs, _ = ppo_actor_loss_fn(logp2, x["prox"], x["behav"], x["adv"], eps_clip=0.2,
                                  loss_mask=x["mask"], rejection_sampling=rs)  # fmt: skip
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    ours.backward()
    theirs.backward()
    assert torch.allclose(logp.grad, logp2.grad, atol=1e-6)
    assert 0 <= stats["behav_dropped_fraction"] <= 1 and 0 <= stats["clip_fraction"] <= 1


@given(seed=st.integers(0, 10_000), version=st.integers(0, 6))
def test_loglinear_proximal_follows_areals_formula(seed: int, version: int) -> None:
    x = _batch(seed)
    ours = loglinear_proximal(x["behav"], x["logp"], x["versions"], version)
    for b in range(ours.shape[0]):
        for t in range(ours.shape[1]):
            v = int(x["versions"][b, t])
            alpha = 0.0
            if v >= 0 and version - v > 0:
                alpha = min(max((version - 1 - v) / (version - v), 0.0), 1.0)
            behav, cur = float(x["behav"][b, t]), float(x["logp"][b, t])
            assert float(ours[b, t]) == pytest.approx(behav + alpha * (cur - behav), abs=1e-5)
