"""The reference trainer's step: a rewarded completion becomes likelier, an unrewarded one less
likely; both proximal modes; bad input refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")

from tqstream.reference.engine import TorchEngine
from tqstream.reference.tiny import tiny_model
from tqstream.reference.trainer import PPOTrainer

VOCAB = 64


@pytest.mark.parametrize("proximal", ["recompute", "loglinear"])
def test_steps_move_probability_towards_the_rewarded_completion(proximal: str) -> None:
    model = tiny_model(VOCAB, seed=1)
    engine = TorchEngine(model, eos_id=-1, pad_id=0, seed=0)
    prompt = [5, 6, 7]
    outs = engine.generate([prompt] * 4, max_new_tokens=5)
    prompts = [torch.tensor(prompt)] * 4
    responses = [torch.tensor(o.tokens) for o in outs]
    behav = [torch.tensor(o.logprobs) for o in outs]
    versions = [torch.tensor(o.versions) for o in outs]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    trainer = PPOTrainer(model, pad_id=0, lr=3e-3, proximal=proximal)

    def totals() -> torch.Tensor:
        with torch.no_grad():
            logp, mask = trainer.logprobs(prompts, responses)
        return torch.where(mask, logp, 0.0).sum(-1)

    before = totals()
    for _ in range(4):
        stats = trainer.step(prompts, responses, behav, versions, rewards, ["g"] * 4)
        assert torch.isfinite(torch.tensor(stats["loss"]))
    after = totals()
    assert after[0] > before[0] and (after[1:] < before[1:]).all()
    assert trainer.version == 4 and stats["max_lag"] == 3  # sampled at 0, trained at 3


def test_mismatched_inputs_are_refused() -> None:
    trainer = PPOTrainer(tiny_model(VOCAB, seed=1), pad_id=0)
    one = [torch.tensor([1, 2])]
    with pytest.raises(ValueError, match="one entry per trajectory"):
        trainer.step(one, one, one, one, torch.tensor([1.0, 0.0]), ["g"])
    with pytest.raises(ValueError, match="a response of 2 tokens came with 1 logprobs"):
        trainer.step(one, one, [torch.tensor([0.0])], one, torch.tensor([1.0]), ["g"])
    with pytest.raises(ValueError, match="proximal must be 'recompute' or 'loglinear'"):
        PPOTrainer(tiny_model(VOCAB, seed=1), pad_id=0, proximal="exact")
    with pytest.raises(ValueError, match="max_grad_norm must be positive or None, got 0"):
        PPOTrainer(tiny_model(VOCAB, seed=1), pad_id=0, max_grad_norm=0)


@pytest.mark.parametrize("max_grad_norm", [1e-3, None])
def test_gradients_above_max_grad_norm_are_scaled_down_to_it(max_grad_norm: float | None) -> None:
    model = tiny_model(VOCAB, seed=1)
    outs = TorchEngine(model, eos_id=-1, pad_id=0, seed=0).generate([[5, 6, 7]] * 4, 5)
    trainer = PPOTrainer(model, pad_id=0, max_grad_norm=max_grad_norm)
    stats = trainer.step(
        [torch.tensor([5, 6, 7])] * 4, [torch.tensor(o.tokens) for o in outs],
        [torch.tensor(o.logprobs) for o in outs], [torch.tensor(o.versions) for o in outs],
        torch.tensor([1.0, 0.0, 0.0, 0.0]), ["g"] * 4,
    )  # fmt: skip
    # the norm reported is the one the loss gave; the step applied the clipped gradient
    applied = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert stats["grad_norm"] > 1e-2
    if max_grad_norm is None:
        assert float(applied.norm()) == pytest.approx(stats["grad_norm"], rel=1e-5)
    else:
        assert float(applied.norm()) == pytest.approx(max_grad_norm, rel=1e-3)


def test_a_loss_that_is_not_finite_stops_the_step() -> None:
    trainer = PPOTrainer(tiny_model(VOCAB, seed=1), pad_id=0)
    one = [torch.tensor([1, 2])]
    with pytest.raises(FloatingPointError, match="the loss is nan at version 0"):
        trainer.step(one, one, [torch.tensor([-1.0, -1.0])], [torch.tensor([0, 0])],
                     torch.tensor([float("nan")]), ["g"])  # fmt: skip
    assert trainer.version == 0


def test_tokens_outside_the_fresh_mask_stay_out_of_the_update() -> None:
    engine = TorchEngine(tiny_model(VOCAB, seed=1), eos_id=-1, pad_id=0, seed=0)
    prompt = [5, 6, 7]
    outs = engine.generate([prompt] * 4, max_new_tokens=5)
    prompts = [torch.tensor(prompt)] * 4
    responses = [torch.tensor(o.tokens) for o in outs]
    behav = [torch.tensor(o.logprobs) for o in outs]
    # a partial rollout: the first two tokens of every trajectory under version 0, the rest under 2
    versions = [torch.tensor([0, 0, 2, 2, 2]) for _ in outs]
    fresh = [torch.tensor([False, False, True, True, True]) for _ in outs]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])

    def trained(behav: list[torch.Tensor], fresh: list[torch.Tensor] | None) -> list[torch.Tensor]:
        trainer = PPOTrainer(tiny_model(VOCAB, seed=1), pad_id=0, lr=3e-3, epochs=2)
        trainer.version = 3
        stats = trainer.step(prompts, responses, behav, versions, rewards, ["g"] * 4, fresh=fresh)
        # by the oldest token it learns from: sampled at 0 (or at 2 once masked), trained at 3
        assert stats["lag_counts"] == ({1: 4} if fresh is not None and not fresh[0][0] else {3: 4})
        return [p.detach().clone() for p in trainer.model.parameters()]

    masked = trained(behav, fresh)
    # what the masked tokens' behaviour logprobs say cannot matter: they are not in the loss
    garbage = [torch.cat([torch.full((2,), -30.0), b[2:]]) for b in behav]
    assert all(torch.equal(a, b) for a, b in zip(masked, trained(garbage, fresh), strict=True))
    # without the mask they do
    unmasked = trained(behav, None)
    assert any(not torch.equal(a, b) for a, b in zip(masked, unmasked, strict=True))
    everything = [torch.ones(5, dtype=torch.bool) for _ in outs]
    assert all(torch.equal(a, b) for a, b in zip(unmasked, trained(behav, everything), strict=True))
