"""The pure-torch rollout engine: behaviour logprobs equal a plain forward pass, per-token versions
across a weight update in keep and abort mode, pause and resume."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the reference pipeline needs transformers")

from tqstream.reference.engine import TorchEngine
from tqstream.reference.tiny import tiny_model

VOCAB = 64


def update_after(engine: TorchEngine, forwards: int, weights: Any, version: int) -> Any:
    """A forward hook that hands the engine new weights during its ``forwards``-th step."""
    calls = [0]

    def hook(module: Any, args: Any, output: Any) -> None:
        calls[0] += 1
        if calls[0] == forwards:
            engine.load_weights(weights, version)

    return engine.model.register_forward_hook(hook)


def test_logprobs_are_those_of_a_plain_forward_pass() -> None:
    model = tiny_model(VOCAB, seed=1)
    engine = TorchEngine(model, eos_id=-1, pad_id=0, temperature=0.7, seed=0)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]  # different lengths: left padding must not matter
    outs = engine.generate(prompts, max_new_tokens=6)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length" and len(out.tokens) == 6 and out.versions == [0] * 6
        seq = torch.tensor([prompt + out.tokens])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.tokens)[:, None])
        assert torch.allclose(torch.tensor(out.logprobs), expected.squeeze(-1), atol=1e-4)


def test_keep_mode_continues_under_the_new_weights() -> None:
    engine = TorchEngine(tiny_model(VOCAB, seed=1), eos_id=-1, pad_id=0, seed=0)
    new = tiny_model(VOCAB, seed=2).state_dict()
    handle = update_after(engine, 3, new, version=1)
    outs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=7)
    handle.remove()
    assert [o.versions for o in outs] == [[0, 0, 0, 1, 1, 1, 1]] * 2
    assert engine.version == 1
    assert torch.equal(engine.model.lm_head.weight, new["lm_head.weight"])


def test_abort_mode_resubmits_with_the_partial_output() -> None:
    engine = TorchEngine(tiny_model(VOCAB, seed=1), eos_id=-1, pad_id=0, seed=0,
                         update_mode="abort")  # fmt: skip
    handle = update_after(engine, 3, tiny_model(VOCAB, seed=2).state_dict(), version=1)
    partial = engine.generate([[1, 2, 3]], max_new_tokens=7)
    assert partial[0].finish_reason == "abort" and partial[0].versions == [0, 0, 0]
    handle.remove()
    engine = TorchEngine(tiny_model(VOCAB, seed=1), eos_id=-1, pad_id=0, seed=0,
                         update_mode="abort")  # fmt: skip
    handle = update_after(engine, 3, tiny_model(VOCAB, seed=2).state_dict(), version=1)
    outs = engine.generate_resumed([[1, 2, 3], [4, 5]], max_new_tokens=7)
    handle.remove()
    assert [o.versions for o in outs] == [[0, 0, 0, 1, 1, 1, 1]] * 2
    assert all(o.finish_reason == "length" and len(o.logprobs) == 7 for o in outs)


def test_pause_holds_generation_until_resume() -> None:
    engine = TorchEngine(tiny_model(VOCAB, seed=1), eos_id=-1, pad_id=0, seed=0)
    engine.pause()
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.extend(engine.generate([[1, 2]], 4)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not result
    engine.load_weights(tiny_model(VOCAB, seed=3).state_dict(), version=5)  # while paused
    engine.resume()
    t.join(30)
    assert result[0].versions == [5, 5, 5, 5]


def test_bad_arguments() -> None:
    model = tiny_model(VOCAB, seed=1)
    with pytest.raises(ValueError, match="update_mode must be 'keep' or 'abort'"):
        TorchEngine(model, eos_id=1, pad_id=0, update_mode="wait")
    with pytest.raises(ValueError, match="temperature must be positive, got 0"):
        TorchEngine(model, eos_id=1, pad_id=0, temperature=0)
    engine = TorchEngine(model, eos_id=1, pad_id=0)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        engine.generate([[1], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        engine.generate([[1]], 0)


def test_weights_through_the_hub_and_the_errors_of_a_sync_out_of_step() -> None:
    from tqstream.errors import WeightSyncError
    from tqstream.reference.weightsync import WeightHub, WeightSubscription

    model = tiny_model(VOCAB, seed=1)
    engine = TorchEngine(model, eos_id=-1, pad_id=0, seed=0)
    with pytest.raises(WeightSyncError) as err:
        engine.sync_weights(1)
    assert str(err.value) == "sync_weights before connect_weights: connect to the hub first"
    hub = WeightHub(timeout=20.0)
    sub = WeightSubscription("127.0.0.1", hub.port, timeout=20.0)
    engine.connect_weights("127.0.0.1", hub.port, sub.member, timeout=20.0)
    new = {k: v + 1 for k, v in tiny_model(VOCAB, seed=2).state_dict().items()}
    errors: list[BaseException] = []

    def take(shift: int) -> None:
        try:
            announced = sub.next()
            assert announced is not None
            engine.sync_weights(announced + shift)
        except WeightSyncError as exc:
            errors.append(exc)

    for version, shift in ((3, 0), (4, 1)):
        t = threading.Thread(target=take, args=(shift,))
        t.start()
        assert hub.send(new, version).receivers == 1
        t.join(30)
    assert engine.version == 3  # the first sync was taken, the second refused
    assert all(torch.equal(p, new[k]) for k, p in engine.model.state_dict().items())
    [error] = errors
    assert str(error) == (
        "rank 1: the trainer sent version 4 where 5 was announced; the rollout side and the "
        "trainer are out of step"
    )
    hub.close()
    engine.close()
