"""``ExperienceWorkflow`` around a real ``RolloutWorkflow`` subclass (the user's code, written
here), run under asyncio on its own and under AReaL's real ``WorkflowExecutor``: accepted episodes
are stored, everything else is rejected with its staleness budget given back and nothing stored."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("areal")

import torch
from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import ModelResponse
from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai.types import InteractionWithTokenLogpReward
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils.data import concat_padded_tensors

import tqstream
from tqstream import InvalidRequestError, SchemaError
from tqstream.adapters.areal import (
    ArealExperience,
    ExperienceWorkflow,
    StalenessManager,
)


class Engine:
    """What AReaL hands to ``arun_episode``; the wrapper needs only its policy version."""

    def __init__(self, version: Any = 0) -> None:
        self.version = version

    def get_version(self) -> Any:
        return self.version


class CountingWorkflow(RolloutWorkflow):
    """A deterministic GRPO-style episode: ``n`` samples continuing the prompt by counting,
    rewarded when they stop at ``data["answer"]``; padded into one ``[n, L]`` group as AReaL's
    ``GroupedRolloutWorkflow`` does."""

    def __init__(self, n: int = 2, dtype: torch.dtype = torch.int32) -> None:
        self.n, self.dtype = n, dtype

    def sample(self, data: dict[str, Any], i: int, version: int) -> dict[str, torch.Tensor]:
        prompt = data["prompt"]
        gen = list(range(prompt[-1] + 1, prompt[-1] + 2 + i))
        seq, p = prompt + gen, len(prompt)
        return {
            "input_ids": torch.tensor([seq], dtype=self.dtype),
            "loss_mask": torch.tensor([[0] * p + [1] * len(gen)], dtype=self.dtype),
            "logprobs": torch.tensor([[0.0] * p + [-0.5] * len(gen)]),
            "versions": torch.tensor([[-1] * p + [version] * len(gen)], dtype=self.dtype),
            "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
            "rewards": torch.tensor([float(gen[-1] == data["answer"])]),
        }

    def samples(self, data: dict[str, Any], version: int) -> list[dict[str, torch.Tensor]]:
        return [self.sample(data, i, version) for i in range(self.n)]

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        await asyncio.sleep(0.01)  # generation
        if data.get("fail"):
            raise RuntimeError("reward service unreachable")
        if data.get("skip"):
            return None
        if data.get("unmasked"):
            return {"input_ids": torch.tensor([data["prompt"]])}
        return concat_padded_tensors(self.samples(data, engine.get_version()))


def item(k: int, **flags: bool) -> dict[str, Any]:
    return {"prompt": [k, k + 1], "answer": k + 3, **flags}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


async def run_standalone(
    manager: StalenessManager, wrapped: ExperienceWorkflow, engine: Engine, inputs: list[dict]
) -> list[Any]:
    """A producer loop without WorkflowExecutor: it checks capacity and submits, as AReaL's
    executor would; the wrapper reports each outcome."""
    tasks = []
    for data in inputs:
        manager.on_rollout_enqueued()
        assert await manager.async_get_capacity() > 0
        manager.on_rollout_submitted()
        tasks.append(asyncio.create_task(wrapped.arun_episode(engine, data)))
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_standalone_under_asyncio(
    client: tqstream.Client, partition: str, dtype: torch.dtype
) -> None:
    engine = Engine(version=2)
    manager = StalenessManager(engine, 8, 4, 1, client=client, name=partition)
    exp = ArealExperience(client, partition=partition)
    workflow = CountingWorkflow(n=2, dtype=dtype)
    wrapped = ExperienceWorkflow(workflow, exp, staleness_manager=manager)
    inputs = [item(0), item(10, skip=True), item(20), item(30, fail=True), item(40)]
    results = asyncio.run(run_standalone(manager, wrapped, engine, inputs))

    assert results[1] is None
    assert isinstance(results[3], RuntimeError)
    assert (wrapped.stored, wrapped.rejected, wrapped.failed) == (3, 1, 1)
    # None and the exception were rejected: their budget is back
    assert manager.get_stats().__dict__ == dict(accepted=3, enqueued=0, rejected=2, running=0)
    assert manager.get_capacity() == min(8 - 0, (1 + 2 + 1) * 4 - 3)

    batch = exp.get_experience(6, current_version=2, timeout=10)
    assert batch.versions == [2] * 6
    expected = {d["prompt"][0]: concat_padded_tensors(workflow.samples(d, 2)) for d in inputs[::2]}
    for result in results[::2]:  # the wrapper returns what the workflow returned
        assert_same(result, expected[int(result["input_ids"][0, 0])])
    assert len(batch) == 3  # episodes finish concurrently: groups in completion order
    for got in batch:
        assert_same(got, expected[int(got["input_ids"][0, 0])])


def test_rejected_episodes_store_nothing(client: tqstream.Client, partition: str) -> None:
    engine = Engine()
    manager = StalenessManager(engine, 4, 4, 0, client=client, name=partition)
    exp = ArealExperience(client, partition=partition)
    wrapped = ExperienceWorkflow(
        CountingWorkflow(), exp, staleness_manager=manager,
        should_accept_fn=lambda traj: bool(traj["rewards"].any()),
    )  # fmt: skip
    capacity = manager.get_capacity()
    results = asyncio.run(
        run_standalone(
            manager,
            wrapped,
            engine,
            [item(0, skip=True), item(1, fail=True), {**item(2), "answer": -1}],
        )
    )
    assert results[0] is None and results[2] is None  # the filter refused the third
    assert isinstance(results[1], RuntimeError)
    assert manager.get_capacity() == capacity
    assert manager.get_stats().__dict__ == dict(accepted=0, enqueued=0, rejected=3, running=0)
    assert client.list_keys(partition) == []


def test_bad_trajectory_is_rejected(client: tqstream.Client, partition: str) -> None:
    engine = Engine()
    manager = StalenessManager(engine, 4, 2, 0, client=client, name=partition)
    wrapped = ExperienceWorkflow(
        CountingWorkflow(), ArealExperience(client, partition=partition), staleness_manager=manager
    )
    (error,) = asyncio.run(run_standalone(manager, wrapped, engine, [item(0, unmasked=True)]))
    assert isinstance(error, SchemaError)
    assert "it lacks ['attention_mask']" in str(error)
    assert manager.get_stats().__dict__ == dict(accepted=0, enqueued=0, rejected=1, running=0)
    assert client.list_keys(partition) == []


@pytest.mark.parametrize("version", [None, "2", -1])
def test_engine_without_a_version(client: tqstream.Client, partition: str, version: Any) -> None:
    engine = Engine(version=0)
    manager = StalenessManager(engine, 4, 2, 0, client=client, name=partition)
    wrapped = ExperienceWorkflow(
        CountingWorkflow(), ArealExperience(client, partition=partition), staleness_manager=manager
    )
    manager.on_rollout_enqueued()
    manager.on_rollout_submitted()
    engine.version = version  # the engine lost its version before the episode ran
    with pytest.raises(
        InvalidRequestError,
        match=rf"the inference engine passed to arun_episode gave policy version {version!r}; "
        r"the wrapper stores each trajectory under engine.get_version\(\) \(an int >= 0\)",
    ):
        asyncio.run(wrapped.arun_episode(engine, item(0)))
    assert manager.get_stats().__dict__ == dict(accepted=0, enqueued=0, rejected=1, running=0)
    assert client.list_keys(partition) == []


def test_wraps_only_rollout_workflows(client: tqstream.Client, partition: str) -> None:
    with pytest.raises(InvalidRequestError, match=r"wraps an AReaL RolloutWorkflow instance"):
        ExperienceWorkflow(CountingWorkflow, ArealExperience(client, partition=partition))  # type: ignore[arg-type]


# --- under AReaL's own executor ---


def _executor(
    client: tqstream.Client, partition: str, engine: Engine
) -> tuple[WorkflowExecutor, StalenessManager]:
    config = InferenceEngineConfig(
        consumer_batch_size=4, max_concurrent_rollouts=4, max_head_offpolicyness=1
    )
    manager = StalenessManager(engine, 4, 4, 1, client=client, name=partition)
    executor = WorkflowExecutor(config, engine, staleness_manager=manager)  # type: ignore[arg-type]
    executor.initialize(train_data_parallel_size=1)
    return executor, manager


def test_under_workflow_executor(client: tqstream.Client, partition: str) -> None:
    engine = Engine(version=1)
    exp = ArealExperience(client, partition=partition)
    workflow = CountingWorkflow(n=3)
    wrapped = ExperienceWorkflow(workflow, exp)  # the executor reports outcomes
    inputs = [item(0), item(10), item(20, skip=True), item(30), item(40, fail=True), item(50)]
    executor, manager = _executor(client, partition, engine)
    try:
        for data in inputs:
            executor.submit(data, wrapped)
        results = executor.wait(len(inputs), timeout=60)
    finally:
        executor.destroy()
    accepted = [r for r in results if r is not None]
    assert len(accepted) == 4  # the None and the exception were rejected by the executor
    assert manager.get_stats().__dict__ == dict(accepted=4, enqueued=0, rejected=2, running=0)
    assert manager.get_capacity() == min(4 - 0, (1 + 1 + 1) * 4 - 4)

    batch = exp.get_experience(12, current_version=1, timeout=10)
    expected = {
        int(d["prompt"][0]): concat_padded_tensors(workflow.samples(d, 1))
        for d in inputs
        if not d.get("skip") and not d.get("fail")
    }
    assert len(batch) == 4
    for got in batch:
        assert_same(got, expected[int(got["input_ids"][0, 0])])


def test_manager_given_twice_is_refused(client: tqstream.Client, partition: str) -> None:
    engine = Engine()
    exp = ArealExperience(client, partition=partition)
    executor, manager = _executor(client, partition, engine)
    wrapped = ExperienceWorkflow(CountingWorkflow(), exp, staleness_manager=manager)
    try:
        executor.submit(item(0), wrapped)
        (result,) = executor.wait(1, timeout=60)
    finally:
        executor.destroy()
    assert result is None  # the executor caught the InvalidRequestError: rejected, counted once
    assert manager.get_stats().__dict__ == dict(accepted=0, enqueued=0, rejected=1, running=0)
    assert client.list_keys(partition) == []


class AgentWorkflow(RolloutWorkflow):
    """An OpenAI-style workflow: returns its completions as AReaL interaction objects."""

    def __init__(self, with_tokens: bool = True) -> None:
        self.with_tokens = with_tokens

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for i in range(2):
            response = ModelResponse(
                input_tokens=data["prompt"],
                output_tokens=list(range(50, 52 + i)),
                output_logprobs=[-0.1] * (2 + i),
                output_versions=[engine.get_version()] * (2 + i),
            )
            out[f"completion-{i}"] = InteractionWithTokenLogpReward(
                model_response=response if self.with_tokens else None, reward=float(i)
            )
        return out


def test_interactions_are_stored_as_tensors(client: tqstream.Client, partition: str) -> None:
    engine = Engine(version=4)
    exp = ArealExperience(client, partition=partition)
    result = asyncio.run(ExperienceWorkflow(AgentWorkflow(), exp).arun_episode(engine, item(0)))
    interactions = asyncio.run(AgentWorkflow().arun_episode(engine, item(0)))
    want = concat_padded_tensors([v.to_tensor_dict() for v in interactions.values()])
    assert_same(result, want)  # what AReaL's executor would have built from them
    batch = exp.get_experience(2, current_version=4, timeout=10)
    assert batch.versions == [4, 4]
    assert_same(batch[0], want)

    with pytest.raises(SchemaError, match=r"interactions without token data"):
        asyncio.run(ExperienceWorkflow(AgentWorkflow(False), exp).arun_episode(engine, item(1)))
    assert len(client.list_keys(partition)) == 2
