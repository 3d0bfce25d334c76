"""The flax twin of the tiny Qwen2: the same logits as Hugging Face's from the same weights, an
exact round trip of the weights in the names and layouts the weight hub sends, the same greedy
evaluation, and JAX kept out of everything but ``tqstream.reference.jax``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")
pytest.importorskip("jax", reason="the JAX trainer needs the jax extra")

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import tqstream
from tqstream.reference.jax.learner import evaluate as jax_evaluate
from tqstream.reference.jax.model import (
    ModelConfig,
    Qwen2,
    forward,
    init_params,
    params_from_torch,
    torch_state_dict,
)
from tqstream.reference.pipeline import evaluate as torch_evaluate
from tqstream.reference.task import held_out
from tqstream.reference.tiny import tiny_config, tiny_model, tiny_tokenizer
from tqstream.reference.weightsync import WeightMeta


def _scrambled(vocab: int, seed: int, **overrides: object) -> torch.nn.Module:
    """A tiny model whose weights are far from their initialisation (HF's init makes the logits
    nearly flat, which would hide a wrong layout): every weight moved by noise of std 0.3."""
    model = tiny_model(vocab, seed=seed, **overrides)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@pytest.mark.parametrize("overrides", [{}, {"num_attention_heads": 4, "num_key_value_heads": 2}])
def test_the_logits_are_hugging_faces_on_padded_random_batches(overrides: dict) -> None:
    vocab = 17
    model = _scrambled(vocab, seed=1, **overrides)
    graphdef, _ = init_params(ModelConfig.of(tiny_config(vocab, **overrides)))
    params = params_from_torch(model.state_dict())
    g = torch.Generator().manual_seed(0)
    for width in (7, 12):
        ids = torch.randint(0, vocab, (6, width), generator=g)
        lengths = torch.tensor([width, 1, 3, width - 1, 5, 2])
        mask = (torch.arange(width)[None] < lengths[:, None]).long()  # right padding
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).logits.numpy()
        got = np.asarray(forward(graphdef, params, jnp.asarray(ids.numpy(), jnp.int32),
                                 jnp.asarray(mask.numpy())))  # fmt: skip
        real = mask.numpy().astype(bool)
        assert np.abs(want).max() > 1.0  # the weights are not near zero: the check means something
        np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)


def test_the_weights_round_trip_exactly_in_the_hubs_names_and_layouts() -> None:
    model = _scrambled(17, seed=2)
    sent = model.state_dict()
    back = torch_state_dict(params_from_torch(sent))
    # what a rollout worker compares the sync against: names in order, dtypes, shapes
    assert WeightMeta.of(back) == WeightMeta.of(sent)
    assert list(back) == list(sent)
    for name, t in sent.items():
        assert torch.equal(back[name], t), name
        assert back[name].is_contiguous() and back[name].numpy().flags.writeable
    # the module built from the params has exactly the tree init_params builds
    graphdef, fresh = init_params(ModelConfig.of(tiny_config(17)))
    merged = nnx.to_pure_dict(nnx.split(nnx.merge(graphdef, params_from_torch(sent)))[1])
    assert isinstance(nnx.merge(graphdef, fresh), Qwen2)
    assert {k for k in merged} == {k for k in fresh}


def test_a_state_dict_of_another_model_is_refused_naming_the_weights() -> None:
    sent = dict(tiny_model(17).state_dict())
    del sent["lm_head.weight"]
    sent["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(tqstream.WeightMismatchError) as err:
        params_from_torch(sent)
    assert str(err.value) == (
        "the state dict is not a Qwen2ForCausalLM's with untied embeddings: missing "
        "['lm_head.weight'], not expected ['model.extra.weight']"
    )
    with pytest.raises(ValueError, match="tied embeddings are not implemented"):
        ModelConfig.of(tiny_config(17, tie_word_embeddings=True))


def test_greedy_evaluation_scores_as_the_torch_one() -> None:
    tok = tiny_tokenizer()
    model = _scrambled(len(tok), seed=3)
    graphdef, _ = init_params(ModelConfig.of(model.config))
    problems = held_out(64)
    want = torch_evaluate(model, tok, problems, 6)
    got = jax_evaluate(graphdef, params_from_torch(model.state_dict()), tok, problems, 6)
    assert got == want


def test_jax_is_loaded_by_the_jax_trainer_only() -> None:
    code = (
        "import sys, tqstream, tqstream.reference.pipeline, tqstream.reference.demo; "
        "print(sorted({'jax', 'flax', 'optax'} & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_only_the_jax_packages_import_jax_flax_or_optax() -> None:
    root = Path(tqstream.__file__).parent
    allowed = (root / "reference" / "jax", root / "adapters" / "jax")
    for path in root.rglob("*.py"):
        if path.parent in allowed:
            continue
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m.split(".")[0] for m in names} & {"jax", "flax", "optax"}, path
