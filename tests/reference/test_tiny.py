"""The reference pipeline's tiny model and tokenizer, made without downloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")

from transformers import AutoTokenizer

from tqstream.reference.tiny import ALPHABET, EOS, PAD, tiny_model, tiny_tokenizer


def test_tokenizer_round_trips_task_text_and_loads_with_autotokenizer(tmp_path: Path) -> None:
    tiny_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("31415=68584", "3+4=7", "99 - 9 = 90"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert len(ids) == len(text)  # one token per character: each digit its own token
    assert tok.pad_token == PAD and tok.eos_token == EOS and tok.pad_token_id != tok.eos_token_id
    assert len(tok) == len(ALPHABET) + 3  # the alphabet, pad, eos and unk
    assert tok.decode(tok.encode("a1", add_special_tokens=False)) == "<|unk|>1"


def test_model_is_untied_seeded_and_runs() -> None:
    tok = tiny_tokenizer()
    a, b = tiny_model(len(tok), seed=3), tiny_model(len(tok), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                  strict=True))  # fmt: skip
    assert a.lm_head.weight.data_ptr() != a.model.embed_tokens.weight.data_ptr()
    assert a.config.head_dim >= 32 and not a.config.tie_word_embeddings
    ids = torch.tensor([tok.encode("31415=", add_special_tokens=False)])
    with torch.no_grad():
        logits = a(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    c = tiny_model(len(tok), seed=4)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
