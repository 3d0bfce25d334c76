"""The tiny Qwen2 of ``tiny.py`` in flax.nnx, and its weights to and from Hugging Face's.

The architecture is Hugging Face's ``Qwen2ForCausalLM`` without a KV cache: token embeddings,
decoder layers of (RMSNorm, grouped-query self-attention with q/k/v biases and rotary position
embeddings, residual; RMSNorm, SiLU-gated MLP, residual), a final RMSNorm and an untied
``lm_head``. Positions are ``0..T-1`` whatever the padding (as HF's when no ``position_ids`` are
given): a batch is right-padded, so a row's real tokens have the positions they would have alone,
and its padding is masked out of every key.

The weights cross between the frameworks as a *pure dict* (``nnx.to_pure_dict`` of the module's
state: nested dicts of ``jax.Array``, layer indices as int keys), which jit, grad and optax take as
a pytree and :func:`forward` merges back into the module:

- :func:`params_from_torch`: a ``Qwen2ForCausalLM.state_dict()`` (HF names, torch layouts) as
  those params (a ``Linear``'s ``[out, in]`` weight becomes an ``[in, out]`` kernel);
- :func:`torch_state_dict`: the params as the state dict the torch model and the weight hub
  expect: HF's names in HF's order (``WeightMeta.of`` compares the order), the same dtypes and
  shapes, contiguous CPU tensors that own their memory (copies: the hub may send them while the
  trainer's next step replaces the arrays).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tqstream.errors import WeightMismatchError

__all__ = [
    "ModelConfig", "Qwen2", "forward", "hf_names", "init_params", "params_from_torch",
    "torch_state_dict",
]  # fmt: skip

Params = dict[str, Any]
"""The model's weights as a pure dict (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The fields of a ``Qwen2Config`` the model is built from."""

    vocab_size: int
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def of(cls, hf: Any) -> ModelConfig:
        """From a Hugging Face ``Qwen2Config`` (``tiny_config(...)``): refuses what this model does
        not implement rather than computing something else."""
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not implemented; only 'default'")
        if getattr(hf, "use_sliding_window", False):
            raise ValueError(
                "sliding-window attention is not implemented; use_sliding_window=False"
            )
        if getattr(hf, "tie_word_embeddings", False):
            raise ValueError("tied embeddings are not implemented; tie_word_embeddings=False")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.hidden_act!r} is not implemented; only 'silu'")
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return cls(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            rope_theta=float(theta), rms_norm_eps=float(hf.rms_norm_eps),
        )  # fmt: skip


class RMSNorm(nnx.Module):
    """HF's ``Qwen2RMSNorm``: ``weight * x / sqrt(mean(x²) + eps)``, in float32."""

    def __init__(self, size: int, eps: float) -> None:
        self.weight = nnx.Param(jnp.ones((size,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return self.weight[...] * (x * jax.lax.rsqrt(variance + self.eps))


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotary(length: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of positions ``0..length-1``, ``[length, head_dim]`` (HF's layout: the
    frequencies twice over, for ``rotate_half``)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class Attention(nnx.Module):
    """Grouped-query self-attention: ``num_heads`` query heads share ``num_kv_heads`` key/value
    heads, in groups of ``num_heads // num_kv_heads``."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs) -> None:
        if c.num_heads % c.num_kv_heads:
            raise ValueError(
                f"num_heads={c.num_heads} is not a multiple of num_kv_heads={c.num_kv_heads}"
            )
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        h, d = c.hidden_size, c.head_dim
        self.q_proj = nnx.Linear(h, c.num_heads * d, use_bias=True, rngs=rngs)
        self.k_proj = nnx.Linear(h, c.num_kv_heads * d, use_bias=True, rngs=rngs)
        self.v_proj = nnx.Linear(h, c.num_kv_heads * d, use_bias=True, rngs=rngs)
        self.o_proj = nnx.Linear(c.num_heads * d, h, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        kv, group, d = self.kv_heads, self.heads // self.kv_heads, self.head_dim
        q = self.q_proj(x).reshape(b, t, kv, group, d)
        k = self.k_proj(x).reshape(b, t, kv, d)
        v = self.v_proj(x).reshape(b, t, kv, d)
        q = q * cos[:, None, None, :] + _rotate_half(q) * sin[:, None, None, :]
        k = k * cos[:, None, :] + _rotate_half(k) * sin[:, None, :]
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) * (d**-0.5)
        # a large negative, not -inf: a row with every key masked stays finite (it is padding)
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(b, t, self.heads * d)
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, c: ModelConfig, rngs: nnx.Rngs) -> None:
        h, i = c.hidden_size, c.intermediate_size
        self.gate_proj = nnx.Linear(h, i, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(h, i, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(i, h, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, rngs: nnx.Rngs) -> None:
        self.self_attn = Attention(c, rngs)
        self.mlp = MLP(c, rngs)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2(nnx.Module):
    """``Qwen2ForCausalLM`` (see the module docstring); call it with token ids ``[B, T]`` and an
    attention mask ``[B, T]`` (1 on real tokens) for float32 logits ``[B, T, vocab]``."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False,
                                  rngs=rngs)  # fmt: skip

    def __call__(self, ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        t = ids.shape[1]
        keys = jnp.ones(ids.shape, bool) if attention_mask is None else attention_mask.astype(bool)
        mask = jnp.tril(jnp.ones((t, t), bool))[None] & keys[:, None, :]  # [B, query, key]
        cos, sin = rotary(t, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def init_params(config: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef[Qwen2], Params]:
    """A freshly initialised model, split into its graph (static: what :func:`forward` merges the
    params into) and its params."""
    graphdef, state = nnx.split(Qwen2(config, nnx.Rngs(seed)))
    return graphdef, nnx.to_pure_dict(state)


def forward(
    graphdef: nnx.GraphDef[Qwen2], params: Params, ids: jax.Array, attention_mask: jax.Array
) -> jax.Array:
    """The logits of ``params`` (pure: for ``jax.jit`` and ``jax.grad``)."""
    return nnx.merge(graphdef, params)(ids, attention_mask)


# --- Hugging Face names ---------------------------------------------------------------------

_LAYER = (
    ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), True),
    ("self_attn.q_proj.bias", ("self_attn", "q_proj", "bias"), False),
    ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), True),
    ("self_attn.k_proj.bias", ("self_attn", "k_proj", "bias"), False),
    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), True),
    ("self_attn.v_proj.bias", ("self_attn", "v_proj", "bias"), False),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), True),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), True),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), True),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), True),
    ("input_layernorm.weight", ("input_layernorm", "weight"), False),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), False),
)


def hf_names(num_layers: int) -> list[tuple[str, tuple[Any, ...], bool]]:
    """``(HF name, path in the params, transposed)`` for every weight, in the order of
    ``Qwen2ForCausalLM.state_dict()``."""
    out: list[tuple[str, tuple[Any, ...], bool]] = [
        ("model.embed_tokens.weight", ("embed_tokens", "embedding"), False)
    ]
    for i in range(num_layers):
        out += [(f"model.layers.{i}.{name}", ("layers", i, *path), t) for name, path, t in _LAYER]
    out += [("model.norm.weight", ("norm", "weight"), False),
            ("lm_head.weight", ("lm_head", "kernel"), True)]  # fmt: skip
    return out


def _num_layers(names: Mapping[str, Any] | Params, hf: bool) -> int:
    if hf:
        found = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    else:
        found = set(names.get("layers", {}))
    return max(found) + 1 if found else 0


def params_from_torch(state_dict: Mapping[str, Any]) -> Params:
    """The params of a ``Qwen2ForCausalLM.state_dict()`` (float32 arrays; see the module
    docstring). Refuses a state dict with other names than this model's, naming them."""
    names = hf_names(_num_layers(state_dict, hf=True))
    expected = {n for n, _, _ in names}
    missing, extra = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or extra:
        raise WeightMismatchError(
            f"the state dict is not a Qwen2ForCausalLM's with untied embeddings: missing "
            f"{missing[:4]}{'...' if len(missing) > 4 else ''}, not expected "
            f"{extra[:4]}{'...' if len(extra) > 4 else ''}"
        )
    params: Params = {}
    for name, path, transposed in names:
        value = state_dict[name].detach().cpu().numpy()
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(value.T if transposed else value)
    return params


def torch_state_dict(params: Params) -> dict[str, Any]:
    """The params as the torch model's state dict (see the module docstring)."""
    import torch

    out: dict[str, Any] = {}
    host = jax.device_get(params)  # one transfer for all of them
    for name, path, transposed in hf_names(_num_layers(params, hf=False)):
        value = host
        for key in path:
            value = value[key]
        array = np.asarray(value)
        out[name] = torch.from_numpy(np.array(array.T if transposed else array, order="C"))
    return out
