"""The JAX trainer against the torch one: the loss, the advantages and the log-linear proximal
logprobs on random inputs, a whole ``step`` (statistics and updated weights) on one batch from one
set of weights, and the format warm start."""

from __future__ import annotations

import copy
import random

import pytest

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")
pytest.importorskip("jax", reason="the JAX trainer needs the jax extra")

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from tqstream.reference import loss as torch_loss
from tqstream.reference.jax import loss as jax_loss
from tqstream.reference.jax.learner import warm_start as jax_warm_start
from tqstream.reference.jax.model import ModelConfig, init_params, params_from_torch
from tqstream.reference.jax.trainer import JaxPPOTrainer, sequences
from tqstream.reference.pipeline import warm_start as torch_warm_start
from tqstream.reference.tiny import tiny_model, tiny_tokenizer
from tqstream.reference.trainer import PPOTrainer


def _close(got: object, want: torch.Tensor, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_advantages_equal_torch_on_random_rewards(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 24
    groups = rng.integers(0, 7, n)  # uneven groups, some of one sample
    rewards = rng.random(n).astype(np.float32)
    rewards[groups == 3] = 0.6  # one group with equal rewards: advantage exactly 0
    want = torch_loss.grpo_advantages(torch.tensor(rewards), groups.tolist())
    # the iterator numbers groups in the batch from 0
    ids = {g: i for i, g in enumerate(dict.fromkeys(groups.tolist()))}
    got, varied = jax_loss.grpo_advantages(
        jnp.asarray(rewards), jnp.asarray([ids[g] for g in groups.tolist()], jnp.int32)
    )
    _close(got, want, atol=1e-4)
    assert np.all(np.asarray(got)[groups == 3] == 0.0)
    counts = np.bincount(groups, minlength=7)
    assert np.asarray(varied).tolist() == [bool(counts[g] > 1 and g != 3) for g in groups]


@pytest.mark.parametrize("behav_cap", [5.0, None])
def test_the_decoupled_loss_and_its_statistics_equal_torch(behav_cap: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    shape = (16, 8)
    logp = -torch.rand(shape, generator=g) * 3
    prox = logp + torch.randn(shape, generator=g) * 0.3
    behav = prox + torch.randn(shape, generator=g) * 1.0  # some weights above the cap
    mask = torch.rand(shape, generator=g) > 0.3
    for advantages in (torch.randn(16, generator=g), torch.randn(shape, generator=g)):
        want, want_stats = torch_loss.decoupled_ppo_loss(
            logp, prox, behav, advantages, mask, behav_cap=behav_cap
        )
        got, got_stats = jax_loss.decoupled_ppo_loss(
            *(jnp.asarray(t.numpy()) for t in (logp, prox, behav, advantages, mask)),
            behav_cap=behav_cap,
        )
        _close(got, want)
        assert got_stats.keys() == want_stats.keys()
        for key, value in want_stats.items():
            assert float(got_stats[key]) == pytest.approx(value, abs=1e-5), key


def test_the_loglinear_proximal_equals_torch() -> None:
    g = torch.Generator().manual_seed(1)
    behav = -torch.rand(8, 6, generator=g) * 3
    logp = -torch.rand(8, 6, generator=g) * 3
    versions = torch.randint(-1, 7, (8, 6), generator=g)  # -1: prompt tokens
    for current in (0, 3, 7):
        want = torch_loss.loglinear_proximal(behav, logp, versions, current)
        got = jax_loss.loglinear_proximal(
            jnp.asarray(behav.numpy()), jnp.asarray(logp.numpy()),
            jnp.asarray(versions.numpy(), jnp.int32), current,
        )  # fmt: skip
        _close(got, want)


def _batch(vocab: int, b: int = 16, p: int = 6, r: int = 8) -> dict[str, list[torch.Tensor]]:
    rng = np.random.default_rng(0)
    plen, rlen = rng.integers(3, p + 1, b), rng.integers(1, r - 1, b)
    return {
        "prompts": [torch.tensor(rng.integers(3, vocab, n)) for n in plen],
        "responses": [torch.tensor(rng.integers(1, vocab, n)) for n in rlen],
        "behav": [torch.tensor(rng.normal(-2.5, 0.5, n), dtype=torch.float32) for n in rlen],
        "versions": [torch.tensor(rng.integers(3, 6, n), dtype=torch.int32) for n in rlen],
        "fresh": [torch.tensor(rng.random(n) > 0.2) for n in rlen],
    }


def _padded(rows: list[torch.Tensor], width: int, pad: float, dtype: object) -> jnp.ndarray:
    out = np.full((len(rows), width), pad, dtype)  # type: ignore[call-overload]
    for i, row in enumerate(rows):
        out[i, : len(row)] = row.numpy()
    return jnp.asarray(out)


def _jax_trainer(model: torch.nn.Module, **kwargs: object) -> JaxPPOTrainer:
    graphdef, _ = init_params(ModelConfig.of(model.config))
    return JaxPPOTrainer(nnx.merge(graphdef, params_from_torch(model.state_dict())), **kwargs)


def test_sequences_join_each_prompt_and_response_right_padded() -> None:
    ids, attention = sequences(
        jnp.asarray([[5, 6, 7], [8, 0, 0]]), jnp.asarray([3, 1]),
        jnp.asarray([[1, 2, 0], [3, 4, 9]]), jnp.asarray([2, 3]), pad_id=0,
    )  # fmt: skip
    assert np.asarray(ids).tolist() == [[5, 6, 7, 1, 2, 0], [8, 3, 4, 9, 0, 0]]
    assert np.asarray(attention).tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize(
    ("proximal", "fresh", "max_grad_norm"),
    [("recompute", False, None), ("recompute", True, 0.5), ("loglinear", True, None)],
)
def test_a_step_equals_the_torch_trainers(
    proximal: str, fresh: bool, max_grad_norm: float | None
) -> None:
    vocab, b, p, r = 17, 16, 6, 8
    model = tiny_model(vocab, seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from the initialisation: gradients of a real size
        for t in model.parameters():
            t.add_(torch.randn(t.shape, generator=g) * 0.1)
    kwargs = dict(pad_id=0, lr=1e-3, epochs=3, entropy_coef=0.01, proximal=proximal,
                  max_grad_norm=max_grad_norm, version=6)  # fmt: skip
    jax_trainer = _jax_trainer(copy.deepcopy(model), **kwargs)
    torch_trainer = PPOTrainer(model, **kwargs)  # type: ignore[arg-type]
    data = _batch(vocab, b, p, r)
    rewards = torch.tensor(np.random.default_rng(1).integers(0, 6, b) / 5, dtype=torch.float32)
    rewards[:4] = 0.6  # a group all of one reward: no advantage, no entropy bonus
    groups = [i // 4 for i in range(b)]
    for _ in range(2):  # the second step starts from the first's weights and Adam state
        want = torch_trainer.step(
            data["prompts"], data["responses"], data["behav"], data["versions"], rewards, groups,
            fresh=data["fresh"] if fresh else None,
        )  # fmt: skip
        got = jax_trainer.step(
            _padded(data["prompts"], p, 0, np.int32),
            jnp.asarray([len(x) for x in data["prompts"]], jnp.int32),
            _padded(data["responses"], r, 0, np.int32),
            jnp.asarray([len(x) for x in data["responses"]], jnp.int32),
            _padded(data["behav"], r, 0.0, np.float32),
            _padded(data["versions"], r, -1, np.int32),
            jnp.asarray(rewards.numpy()), jnp.asarray(groups, jnp.int32),
            fresh=_padded(data["fresh"], r, False, bool) if fresh else None,
        )  # fmt: skip
        assert got.keys() == want.keys()
        assert got["lag_counts"] == want["lag_counts"] and got["version"] == want["version"]
        for key in want.keys() - {"lag_counts"}:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    weights = torch_state_dict_of(jax_trainer)
    for name, t in model.state_dict().items():
        np.testing.assert_allclose(weights[name].numpy(), t.numpy(), atol=1e-4, err_msg=name)


def torch_state_dict_of(trainer: JaxPPOTrainer) -> dict[str, torch.Tensor]:
    from tqstream.reference.jax.model import torch_state_dict

    return torch_state_dict(trainer.params)


def test_a_non_finite_loss_raises_and_leaves_the_weights_as_they_were() -> None:
    trainer = _jax_trainer(tiny_model(17), pad_id=0)
    before = torch_state_dict_of(trainer)
    ones = jnp.ones((2, 4), jnp.int32)
    with pytest.raises(FloatingPointError, match=r"the loss is nan at version 0"):
        trainer.step(ones, jnp.asarray([4, 4]), ones, jnp.asarray([4, 4]),
                     jnp.full((2, 4), -1.0), jnp.zeros((2, 4), jnp.int32),
                     jnp.asarray([0.0, jnp.nan]), jnp.asarray([0, 0]))  # fmt: skip
    assert trainer.version == 0
    after = torch_state_dict_of(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_format_warm_start_moves_the_weights_as_torchs() -> None:
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=0)
    jax_trainer = _jax_trainer(copy.deepcopy(model), pad_id=tok.pad_token_id, lr=3e-4)
    torch_trainer = PPOTrainer(model, pad_id=tok.pad_token_id, lr=3e-4)
    torch_warm_start(torch_trainer, tok, 3, random.Random(0), batch=32)
    jax_warm_start(jax_trainer, tok, 3, random.Random(0), batch=32)
    weights = torch_state_dict_of(jax_trainer)
    moved = 0.0
    for name, t in model.state_dict().items():
        np.testing.assert_allclose(weights[name].numpy(), t.numpy(), atol=2e-5, err_msg=name)
        moved = max(moved, float((t - tiny_model(len(tok), seed=0).state_dict()[name]).abs().max()))
    assert moved > 5e-4  # three Adam steps of 3e-4 moved them: the comparison means something
