"""NeMo-RL's data-plane contract on tqstream, against the embedded and the multi-process
deployment: the interface's round trips, its TransferQueue client's call sequence (register ->
put -> claim -> get_data -> consumption -> clear), claims that survive a killed consumer, typed
errors for bad input, the staleness samplers' admit / select / evict, the factory, and the
adapter's behaviour where ``nemo_rl`` is importable (a stand-in package in a child process)."""

from __future__ import annotations

import asyncio
import json
import pickle
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import tqstream
from tqstream import Client, StalenessPolicy
from tqstream.adapters.nemo_rl import (
    HOLD_TASK,
    ConfigError,
    FieldTypeError,
    KVBatchMeta,
    NemoRLExperience,
    NotProducedError,
    ReadyFirstSampler,
    TQStreamDataPlaneClient,
    TQStreamDataPlaneConfig,
    UnknownTaskError,
    WindowedSampler,
    build_data_plane_client,
    create_sampler,
)

WORKER = Path(__file__).with_name("nemo_rl_worker.py")


@pytest.fixture
def dp(client: Client) -> Iterator[TQStreamDataPlaneClient]:
    with TQStreamDataPlaneClient(client=client) as d:
        yield d


def td(**fields: Any) -> TensorDict:
    n = len(next(iter(fields.values())))
    return TensorDict(fields, batch_size=[n])


def jagged(*rows: list[int]) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)


def put_group(dp: TQStreamDataPlaneClient, part: str, uid: str, version: int, g: int = 2) -> None:
    """One rollout group as NeMo-RL's replay buffer commits it: keys ``{uid}_g{i}``, jagged
    tokens, the start weight as a tag."""
    rows = [[version] * (i + 2) for i in range(g)]
    fields = td(input_ids=jagged(*rows), input_lengths=torch.tensor([len(r) for r in rows]))
    dp.put_samples(
        [f"{uid}_g{i}" for i in range(g)], part, fields, [{"weight_version": version}] * g
    )


# --- the interface's round trips ---
def test_register_put_get_clear(dp: TQStreamDataPlaneClient, partition: str) -> None:
    dp.register_partition(partition, ["x"], num_samples=4, consumer_tasks=["read"])
    keys = ["a", "b", "c", "d"]
    receipt = dp.put_samples(sample_ids=keys, partition_id=partition, fields=td(x=torch.arange(4)))
    assert isinstance(receipt, KVBatchMeta)
    assert (receipt.sample_ids, receipt.fields, receipt.task_name) == (keys, ["x"], None)
    out = dp.get_samples(sample_ids=["d", "a", "d"], partition_id=partition, select_fields=["x"])
    assert out.batch_size == torch.Size([3]) and out["x"].tolist() == [3, 0, 3]
    assert dp.list_sample_ids(partition) == keys
    dp.clear_samples(sample_ids=None, partition_id=partition)
    assert dp.list_sample_ids(partition) == []
    with pytest.raises(KeyError, match=f"partition '{partition}' does not exist"):
        dp.get_samples(sample_ids=keys, partition_id=partition, select_fields=["x"])
    dp.register_partition(partition, ["x"], num_samples=4, consumer_tasks=["read"])  # again


def test_transfer_queue_call_sequence(dp: TQStreamDataPlaneClient, partition: str) -> None:
    """register -> put -> claim -> get_data -> check_consumption_status -> clear(None)."""
    dp.register_partition(partition, ["x", "y"], 4, ["train"])
    dp.put_samples(["a", "b", "c", "d"], partition, td(x=torch.arange(4)))
    assert not dp.check_consumption_status(partition, ["train"])
    dp.put_samples(["a", "b", "c", "d"], partition, td(y=torch.arange(4) * 10))  # delta write
    meta = dp.claim_meta(partition, "train", ["x", "y"], 4, timeout_s=30)
    assert isinstance(meta, KVBatchMeta) and meta.size == 4 and meta.task_name == "train"
    data = dp.get_data(meta)  # fields: the claim's required fields
    for key, x, y in zip(meta.sample_ids, data["x"].tolist(), data["y"].tolist(), strict=True):
        assert (x, y) == ("abcd".index(key), 10 * "abcd".index(key))
    assert dp.check_consumption_status(partition, ["train"])
    assert dp.get_samples(["b"], partition, ["y"])["y"].tolist() == [10]  # still readable
    again = dp.claim_meta(partition, "train", ["x"], 1, blocking=False)
    assert (again.size, again.fields, again.task_name) == (0, ["x"], "train")
    dp.clear_samples(None, partition)
    with pytest.raises(KeyError):
        dp.get_data(meta)


def test_claims_are_all_or_nothing(dp: TQStreamDataPlaneClient, partition: str) -> None:
    dp.register_partition(partition, ["x"], 4, ["train"])
    dp.put_samples(["a", "b", "c"], partition, td(x=torch.arange(3)))
    assert dp.claim_meta(partition, "train", ["x"], 4, blocking=False).size == 0
    with pytest.raises(TimeoutError, match=r"batch_size=4\) timed out after 0.2s"):
        dp.claim_meta(partition, "train", ["x"], 4, timeout_s=0.2)
    task = dp.client.stats(partition).partitions[partition].tasks["train"]
    assert (task.leased, task.acked) == (0, 0)  # nothing was half claimed
    dp.put_samples(["d"], partition, td(x=torch.tensor([3])))
    assert sorted(dp.claim_meta(partition, "train", ["x"], 4).sample_ids) == list("abcd")


def test_claims_are_exclusive_per_task(dp: TQStreamDataPlaneClient, partition: str) -> None:
    dp.register_partition(partition, ["x"], 4, ["actor", "ref"])
    dp.put_samples(list("abcd"), partition, td(x=torch.arange(4)))
    first = dp.claim_meta(partition, "actor", ["x"], 2)
    second = dp.claim_meta(partition, "actor", ["x"], 2)
    assert sorted(first.sample_ids + second.sample_ids) == list("abcd")
    assert first.sample_ids == ["a", "b"]  # oldest first
    assert not dp.check_consumption_status(partition, ["actor", "ref"])
    assert dp.claim_meta(partition, "ref", ["x"], 4).size == 4  # tasks are independent
    assert dp.check_consumption_status(partition, ["actor", "ref"])
    assert not dp.check_consumption_status(partition, ["critic"])  # not registered


def test_a_claim_waits_at_the_controller_for_the_producer(
    dp: TQStreamDataPlaneClient, partition: str
) -> None:
    dp.register_partition(partition, ["x"], 2, ["train"])  # declared: claims wait for it

    async def claim_then_put() -> KVBatchMeta:
        waiting = asyncio.create_task(
            asyncio.to_thread(dp.claim_meta, partition, "train", ["x"], 2, timeout_s=20)
        )
        await asyncio.sleep(0.3)
        assert not waiting.done()
        dp.put_samples(["a", "b"], partition, td(x=torch.arange(2)))
        return await waiting

    t0 = time.monotonic()
    assert asyncio.run(claim_then_put()).sample_ids == ["a", "b"]
    assert time.monotonic() - t0 < 5


def test_tags_merge_key_by_key(dp: TQStreamDataPlaneClient, partition: str) -> None:
    """A delta write without tags keeps the stamped weight_version (NeMo-RL's advantage
    write-back relies on it); a tags-only write adds keys; claims carry the merged tags."""
    dp.register_partition(partition, ["input_ids", "advantages"], 2, ["train"])
    dp.put_samples(
        ["u_g0", "u_g1"], partition, td(input_ids=jagged([1, 2, 3], [4, 5])),
        [{"weight_version": 3, "input_lengths": 3}, {"weight_version": 3, "input_lengths": 2}],
    )  # fmt: skip
    dp.put_samples(["u_g0", "u_g1"], partition, td(advantages=torch.tensor([0.5, -0.5])))
    receipt = dp.put_samples(["u_g1"], partition, tags=[{"std": torch.tensor(0.25)}])
    assert receipt.fields is None and receipt.tags == [{"std": 0.25}]
    meta = dp.claim_meta(partition, "train", ["input_ids", "advantages"], 2)
    assert meta.tags == [
        {"weight_version": 3, "input_lengths": 3},
        {"weight_version": 3, "input_lengths": 2, "std": 0.25},
    ]
    assert meta.sequence_lengths == [3, 2]
    looked = dp.client.lookup(partition, ["u_g0"])
    assert (looked.version_start, looked.groups) == ([3], ["u"])  # NeMo-RL's conventions
    dp.put_samples(["u_g2"], partition, td(input_ids=jagged([6])), [{"weight_version": 4}])
    late = dp.client.lookup(partition, ["u_g2"])  # the group was complete: a row of its own
    assert (late.version_start, late.groups, late.tags) == ([4], [None], [{"weight_version": 4}])


def test_fields_keep_their_shapes_and_dtypes(dp: TQStreamDataPlaneClient, partition: str) -> None:
    ids = torch.arange(12).reshape(4, 3)
    lp = torch.randn(4, 5, dtype=torch.bfloat16)
    fields = td(
        input_ids=ids, logprobs=lp, reward=torch.tensor([1.0, 0.0, 0.5, 1.0]),
        tokens=jagged([1], [2, 3], [4, 5, 6], [7]), uniform=jagged([1, 2], [3, 4], [5, 6], [7, 8]),
        prompt=NonTensorStack("1+1", "2+2", "3+3", "4+4"),
    )  # fmt: skip
    dp.put_samples(list("abcd"), partition, fields)
    out = dp.get_samples(list("abcd"), partition, list(fields.keys()))
    assert torch.equal(out["input_ids"], ids) and not out["input_ids"].is_nested
    assert out["logprobs"].dtype == torch.bfloat16 and torch.equal(out["logprobs"], lp)
    assert out["reward"].shape == (4,)
    assert out["tokens"].is_nested and [t.tolist() for t in out["tokens"].unbind()][2] == [4, 5, 6]
    assert not out["uniform"].is_nested and out["uniform"].tolist()[3] == [7, 8]  # as NeMo-RL
    assert out.get("prompt").tolist() == ["1+1", "2+2", "3+3", "4+4"]
    assert dp.get_samples([], partition, ["x"]).batch_size == torch.Size([0])


def test_register_starts_an_empty_partition_afresh(
    dp: TQStreamDataPlaneClient, partition: str
) -> None:
    dp.register_partition(partition, ["a"], 2, ["t"])
    dp.put_samples(["k"], partition, td(a=torch.tensor([[1, 2]])))
    dp.clear_samples(["k"], partition)
    dp.register_partition(partition, ["b"], 4, ["t"])  # the next step: new schemas allowed
    held = dp.client.stats(partition).partitions[partition]
    assert list(held.fields) == ["b"] and held.tasks_registered == ["t", HOLD_TASK]
    dp.put_samples(["k"], partition, td(a=torch.tensor([[0.5, 1.5, 2.5]])))  # was int64[2]
    dp.register_partition(partition, ["c"], 4, ["u"])  # rows held: kept, fields added
    assert dp.list_sample_ids(partition) == ["k"]
    assert set(dp.client.stats(partition).partitions[partition].fields) == {"a", "b", "c"}


def test_clear_ids_ignores_missing_and_stops_counting(
    dp: TQStreamDataPlaneClient, partition: str
) -> None:
    dp.register_partition(partition, ["x"], 4, ["train"])
    dp.put_samples(list("abcd"), partition, td(x=torch.arange(4)))
    claimed = dp.claim_meta(partition, "train", ["x"], 2)
    dp.clear_samples(["c", "d", "zz", "d"], partition)
    assert dp.list_sample_ids(partition) == ["a", "b"]
    assert dp.check_consumption_status(partition, ["train"])  # cleared rows do not count
    dp.clear_samples(claimed.sample_ids, partition)
    dp.clear_samples(["a"], "no-such-partition")  # nothing to do
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dp.clear_samples(None, partition)
    assert [str(w.message) for w in seen] == [
        f"clear_samples(None, {partition!r}) found nothing to clear: the partition holds no rows"
    ]


def test_close_consumes_the_claims(client: Client, partition: str) -> None:
    """A claimer that closes cleanly consumed its claims for good (TransferQueue's semantics);
    one that dies gives them back (the next test)."""
    with TQStreamDataPlaneClient(client=client) as other:
        other.register_partition(partition, ["x"], 4, ["train"])
        other.put_samples(list("abcd"), partition, td(x=torch.arange(4)))
        assert other.claim_meta(partition, "train", ["x"], 2).sample_ids == ["a", "b"]
    other.close()  # idempotent
    with TQStreamDataPlaneClient({"enabled": True, "controller_address": client.address}) as dp:
        assert dp.claim_meta(partition, "train", ["x"], 2).sample_ids == ["c", "d"]
        assert dp.get_samples(["a"], partition, ["x"])["x"].tolist() == [0]  # not freed


def test_a_killed_consumers_claims_come_back(dp: TQStreamDataPlaneClient, partition: str) -> None:
    dp.register_partition(partition, ["x"], 4, ["train"])
    dp.put_samples(list("abcd"), partition, td(x=torch.arange(4)))
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "claim", dp.client.address, partition, "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == ["a", "b", "c"]  # claimed, then SIGKILLed
    assert dp.claim_meta(partition, "train", ["x"], 3, blocking=False).size == 0
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    meta = dp.claim_meta(partition, "train", ["x"], 4, timeout_s=20)
    assert sorted(meta.sample_ids) == list("abcd")  # the dead claim's rows, and the fourth


def test_replay_buffer_call_sequence(dp: TQStreamDataPlaneClient, partition: str) -> None:
    """What NeMo-RL's replay buffer asks of the data plane: one put per committed group, a
    rollback clear after a failed put, one clear for evicted groups, and a checkpoint that reads
    each group back and re-puts it with its tags after a restart."""
    metas = {}
    for uid, version in (("g1", 0), ("g2", 1)):
        put_group(dp, partition, uid, version)
        metas[uid] = dp.put_samples([f"{uid}_g0", f"{uid}_g1"], partition, tags=[{}, {}])
    bad = {"input_ids": jagged([1]), "input_lengths": torch.tensor([1, 2])}  # a plain dict
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        dp.put_samples(["g3_g0", "g3_g1"], partition, bad, [{"weight_version": 1}] * 2)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.clear_samples(["g3_g0", "g3_g1"], partition)  # the rollback: nothing there, quietly
    fields = ["input_ids", "input_lengths"]
    saved = {uid: dp.get_samples(m.sample_ids, partition, fields) for uid, m in metas.items()}
    tags = {uid: dp.client.lookup(partition, m.sample_ids).tags for uid, m in metas.items()}
    dp.clear_samples([k for m in metas.values() for k in m.sample_ids], partition)
    assert dp.list_sample_ids(partition) == []
    for uid, m in metas.items():  # restored after a restart
        dp.put_samples(m.sample_ids, partition, saved[uid], tags[uid])
    back = dp.client.lookup(partition, ["g1_g1", "g2_g0"])
    assert back.version_start == [0, 1] and back.groups == ["g1", "g2"]
    assert back.tags == [{"weight_version": 0}, {"weight_version": 1}]
    again = dp.get_samples(["g1_g1"], partition, ["input_ids"])["input_ids"]
    assert again.tolist() == [[0, 0, 0]]  # one row: dense, as the rows have one length


# --- bad input: a typed error naming the problem, nothing stored ---
def test_bad_input_raises_typed_errors(dp: TQStreamDataPlaneClient, partition: str) -> None:
    dp.register_partition(partition, ["x", "adv"], 2, ["train"])
    dp.put_samples(["a", "b"], partition, td(x=torch.arange(2)))
    with pytest.raises(KeyError, match=r"1 of 2 keys are not in partition .*'zz'"):
        dp.get_samples(["a", "zz"], partition, ["x"])  # TransferQueue returned 1 row here
    with pytest.raises(NotProducedError, match="field 'adv' is not written for 2 of the"):
        dp.get_samples(["a", "b"], partition, ["adv"])
    with pytest.raises(KeyError, match="field 'nope' is not in partition"):
        dp.get_samples(["a"], partition, ["nope"])
    with pytest.raises(ValueError, match=r"select_fields=\[\.\.\.\] or in meta.fields"):
        dp.get_data(KVBatchMeta(partition, None, ["a"]))
    with pytest.raises(ValueError, match="select_fields is empty"):
        dp.get_samples(["a"], partition, [])
    with pytest.raises(TypeError, match="sample_ids must be a list of str, got str"):
        dp.put_samples("a", partition, td(x=torch.arange(1)))  # type: ignore[arg-type]
    with pytest.raises(FieldTypeError, match=r"fields must be a TensorDict .* got list"):
        dp.put_samples(["c"], partition, [torch.arange(1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="field 'o' is a non-tensor leaf tqstream cannot store"):
        dp.put_samples(["c"], partition, td(o=NonTensorStack({"t": torch.ones(1)})))
    with pytest.raises(ValueError, match="tags has 1 entries for 2 sample_ids"):
        dp.put_samples(["c", "d"], partition, td(x=torch.arange(2)), [{}])
    with pytest.raises(ValueError, match="got 3 rows of data for 2 keys"):
        dp.put_samples(["c", "d"], partition, td(x=torch.arange(3)))
    with pytest.raises(ValueError, match="is stored as dense int64"):
        dp.put_samples(["c"], partition, td(x=torch.ones(1, 2)))
    with pytest.raises(ValueError, match="got neither fields nor tags"):
        dp.put_samples(["c"], partition)
    with pytest.raises(ValueError, match="tag 't' of row 0 is a list"):
        dp.put_samples(["c"], partition, tags=[{"t": [[1]]}])
    assert dp.list_sample_ids(partition) == ["a", "b"]  # none of them stored anything
    with pytest.raises(UnknownTaskError, match="task 'trian' is not registered for partition"):
        dp.claim_meta(partition, "trian", ["x"], 2)
    with pytest.raises(KeyError, match="register_partition it"):
        dp.claim_meta("no-such-partition", "train", ["x"], 2)
    with pytest.raises(KeyError, match="field 'y' is not in partition"):
        dp.claim_meta(partition, "train", ["y"], 2)
    with pytest.raises(ValueError, match="required_fields is empty"):
        dp.claim_meta(partition, "train", [], 2)
    with pytest.raises(ValueError, match="batch_size must be a positive number of rows"):
        dp.claim_meta(partition, "train", ["x"], 0)
    with pytest.raises(KeyError, match="partition 'no-such-partition' does not exist"):
        dp.check_consumption_status("no-such-partition", ["train"])
    assert "train" not in dp.client.stats(partition).partitions[partition].tasks  # no claim


def test_argument_errors_name_the_argument(dp: TQStreamDataPlaneClient, partition: str) -> None:
    cases: list[tuple[type[Exception], str, Any]] = [
        (TypeError, "sample_ids must hold non-empty str, got int 1", lambda: dp.put_samples(
            ["a", 1], partition, tags=[{}, {}])),
        (TypeError, "tags must be a list with one dict per row, got dict", lambda: dp.put_samples(
            ["a"], partition, tags={"a": 1})),
        (TypeError, r"tags\[0\] must be a dict, got str", lambda: dp.put_samples(
            ["a"], partition, tags=["x"])),
        (ValueError, "num_samples must be an int >= 0, got -1", lambda: dp.register_partition(
            partition, ["x"], -1, ["t"])),
        (ValueError, "task_name must be a non-empty str, got ''", lambda: dp.claim_meta(
            partition, "", ["x"], 1)),
        (ValueError, "task_names is empty", lambda: dp.check_consumption_status(partition, [])),
        (ValueError, "fields is empty", lambda: NemoRLExperience(dp, fields=[])),
        (ValueError, "max_staleness_versions must be an int >= 0, got 1.5", lambda: (
            ReadyFirstSampler(dp, max_staleness_versions=1.5, group_size=1))),
    ]  # fmt: skip
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    assert dp.list_sample_ids(partition) == []


def test_non_tensor_leaves_stored_or_rejected(client: Client, partition: str) -> None:
    with TQStreamDataPlaneClient(client=client) as dp:
        dp.put_samples(["a"], partition, td(msg=NonTensorData("hello", batch_size=[1])))
        assert dp.get_samples(["a"], partition, ["msg"]).get("msg").tolist() == ["hello"]
    strict = TQStreamDataPlaneConfig(non_tensor_fields="reject")
    with TQStreamDataPlaneClient(client=client, config=strict) as dp:
        bad = td(x=torch.zeros(2, 4), meta=NonTensorData(["a", "b"], batch_size=[2]))
        with pytest.raises(TypeError, match="field 'meta' is a non-tensor leaf"):
            dp.put_samples(["x_g0", "y_g0"], partition, bad)
        assert dp.list_sample_ids(partition) == ["a"]


# --- staleness samplers ---
def test_windowed_select_and_evict(dp: TQStreamDataPlaneClient, partition: str) -> None:
    for uid, version in (("u0", 0), ("u1", 1), ("u2", 2), ("u3", 2)):
        put_group(dp, partition, uid, version)
    sampler = WindowedSampler(dp, max_staleness_versions=1, group_size=2, partition_id=partition)
    assert not sampler.is_on_policy and sampler.required_buffer_capacity(4) is None
    assert asyncio.run(sampler.admit(trainer_version_fn=lambda: 0)) is None  # never gated
    assert asyncio.run(sampler.evict(current_train_weight=2)) == 0
    meta, k = asyncio.run(
        sampler.select(current_train_weight=2, min_prompt_groups=1, max_prompt_groups=2)
    )
    assert k == 2 and meta is not None and meta.sample_ids == ["u1_g0", "u1_g1", "u2_g0", "u2_g1"]
    assert [t["weight_version"] for t in meta.tags] == [1, 1, 2, 2]
    assert meta.sequence_lengths == [2, 3, 2, 3] and meta.task_name == "train"
    assert meta.fields == ["input_ids", "input_lengths"]
    assert asyncio.run(sampler.evict(current_train_weight=2)) == 1  # u0, dropped by the window
    assert dp.client.stats(partition).partitions[partition].stale_dropped == 2
    assert dp.get_data(meta)["input_ids"].is_nested  # selected rows stay readable
    dp.clear_samples(meta.sample_ids, partition)  # the train pump clears what it trained on
    nothing = asyncio.run(
        sampler.select(current_train_weight=4, min_prompt_groups=1, max_prompt_groups=3)
    )
    assert nothing == (None, 0) and asyncio.run(sampler.evict(current_train_weight=4)) == 1
    assert sampler.should_abort_inflight(start_weight_version=2, current_train_weight=4)
    assert not sampler.should_abort_inflight(start_weight_version=3, current_train_weight=4)


def test_select_takes_what_is_ready_between_min_and_max(
    dp: TQStreamDataPlaneClient, partition: str
) -> None:
    for i in range(5):
        put_group(dp, partition, f"u{i}", 0)
    sampler = create_sampler(
        dp, {"name": "windowed", "max_staleness_versions": 0}, group_size=2, partition_id=partition
    )
    meta, k = asyncio.run(
        sampler.select(current_train_weight=0, min_prompt_groups=4, max_prompt_groups=4)
    )
    assert k == 4 and meta is not None
    assert asyncio.run(
        sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=8)
    ) == (None, 0)
    put_group(dp, partition, "u5", 0)
    put_group(dp, partition, "u6", 0)
    meta, k = asyncio.run(
        sampler.select(current_train_weight=0, min_prompt_groups=1, max_prompt_groups=8)
    )
    assert k == 3 and meta is not None and len(meta.sample_ids) == 6  # greedy, not just min
    with pytest.raises(ValueError, match="min_prompt_groups <= max_prompt_groups"):
        asyncio.run(
            sampler.select(current_train_weight=0, min_prompt_groups=3, max_prompt_groups=2)
        )


def test_ready_first_gates_dispatch_globally(client: Client, partition: str) -> None:
    dp = TQStreamDataPlaneClient(client=client)
    peer = TQStreamDataPlaneClient({"enabled": True, "controller_address": client.address})
    version = {"now": 0}
    try:
        sampler = ReadyFirstSampler(
            dp, max_staleness_versions=1, group_size=2, partition_id=partition
        )
        other = ReadyFirstSampler(
            peer, max_staleness_versions=1, group_size=2, partition_id=partition
        )
        assert sampler.required_buffer_capacity(8) == 16 and not sampler.is_on_policy

        async def scenario() -> None:
            admit = sampler.admit(trainer_version_fn=lambda: version["now"])
            assert await admit is None and await other.admit(trainer_version_fn=lambda: 0) is None
            blocked = asyncio.create_task(other.admit(trainer_version_fn=lambda: version["now"]))
            await asyncio.sleep(0.4)
            assert not blocked.done()  # batches 0 and 1 are out: W + 1 = 1
            version["now"] = 1
            assert await sampler.evict(current_train_weight=1) == 0  # publishes version 1
            await asyncio.wait_for(blocked, 5)

        asyncio.run(scenario())
        assert (sampler.dispatch_index, other.dispatch_index) == (0, 1)
        put_group(dp, partition, "old", 0)
        put_group(dp, partition, "new", 5)
        meta, k = asyncio.run(
            sampler.select(current_train_weight=1, min_prompt_groups=2, max_prompt_groups=2)
        )
        assert (
            k == 2
            and meta is not None
            and [t["weight_version"] for t in meta.tags] == [0] * 2 + [5] * 2
        )
        sampler.set_dispatch_index(7)  # resume: batches 7 and 8 may go at version 7
        assert sampler.dispatch_index == 6 and sampler.gate is not None
        assert len(sampler.gate.try_acquire(3, version=7)) == 2
        with pytest.raises(ValueError, match="resume_from_trainer_version must be >= 0"):
            sampler.set_dispatch_index(-1)
        with pytest.raises(tqstream.AdmissionError, match="cannot be re-created as capacity"):
            ReadyFirstSampler(dp, max_staleness_versions=3, group_size=2, partition_id=partition)
    finally:
        dp.close()
        peer.close()


def test_sampler_construction_errors(dp: TQStreamDataPlaneClient, partition: str) -> None:
    class ReplayBuffer:  # NeMo-RL's create_sampler passes its buffer first
        def __init__(self, dp_client: Any, partition_id: str) -> None:
            self._dp_client, self._partition_id = dp_client, partition_id

    sampler = WindowedSampler(ReplayBuffer(dp, partition), max_staleness_versions=0, group_size=1)
    assert sampler.partition_id == partition and sampler.is_on_policy
    protocol = ["admit", "select", "evict", "should_abort_inflight", "is_on_policy",
                "required_buffer_capacity", "set_dispatch_index", "dispatch_index",
                "supports_buffer_checkpoint"]  # fmt: skip
    assert all(hasattr(sampler, name) for name in protocol)  # NeMo-RL's sampler protocol
    assert sampler.required_buffer_capacity(4) is None
    with pytest.raises(ConfigError, match="needs a TQStreamDataPlaneClient"):
        WindowedSampler(ReplayBuffer(object(), partition), max_staleness_versions=0, group_size=1)
    with pytest.raises(ConfigError, match="sample_freshest_first=True is not available"):
        WindowedSampler(dp, max_staleness_versions=1, sample_freshest_first=True, group_size=2)
    with pytest.raises(ValueError, match="max_staleness_versions must be an int >= 0, got -1"):
        WindowedSampler(dp, max_staleness_versions=-1, group_size=2)
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        WindowedSampler(dp, max_staleness_versions=1, group_size=0)
    with pytest.raises(ConfigError, match="sampler 'in_order' has no tqstream mapping"):
        create_sampler(dp, {"name": "in_order", "max_lookahead_versions": 1}, group_size=2)
    with pytest.raises(ConfigError, match="sampler 'custom' has no tqstream mapping;"):
        create_sampler(dp, {"name": "custom"}, group_size=2)


def test_put_and_get_experience_through_the_window(
    dp: TQStreamDataPlaneClient, partition: str
) -> None:
    window = StalenessPolicy(max_staleness=1, measure="head", on_stale="drop")
    exp = NemoRLExperience(
        dp, fields=["input_ids", "input_lengths"], partition_id=partition, staleness=window
    )

    async def produce() -> list[KVBatchMeta]:
        return [
            await exp.async_put_experience(
                td(input_ids=jagged([v, v], [v]), input_lengths=torch.tensor([2, 1])),
                v,
                group=f"q{v}",
            )
            for v in (0, 1, 2)
        ]

    receipts = asyncio.run(produce())
    assert (
        receipts[1].sample_ids == ["q1_g0", "q1_g1"]
        and receipts[1].tags == [{"weight_version": 1}] * 2
    )
    meta, data = exp.get_experience(4, current_version=2, timeout=5)
    assert meta.sample_ids == ["q1_g0", "q1_g1", "q2_g0", "q2_g1"] and meta.task_name == "train"
    assert [t.tolist() for t in data["input_ids"].unbind()] == [[1, 1], [1], [2, 2], [2]]
    assert meta.sequence_lengths == [2, 1, 2, 1] and meta.fields == ["input_ids", "input_lengths"]
    assert dp.client.stats(partition).partitions[partition].stale_dropped == 2  # q0
    with pytest.raises(TimeoutError, match=r"timed out after 0\.2s"):
        asyncio.run(exp.async_get_experience(2, current_version=2, timeout=0.2))
    dp.clear_samples(meta.sample_ids, partition)
    assert dp.list_sample_ids(partition) == []


# --- configuration and factory ---
def test_factory_rules_and_config_errors() -> None:
    on = {"enabled": True, "impl": "tqstream"}
    for cfg, message in [
        (None, "the data plane is disabled"),
        ({**on, "enabled": False}, "the data plane is disabled"),
        ({**on, "impl": "noop"}, "unknown data_plane impl for tqstream's factory: 'noop'"),
        ({**on, "tqstream": {"lanch": "ray"}}, r"data_plane.tqstream settings \['lanch'\]"),
        ({**on, "tqstream": {"launch": "k8s"}}, "tqstream.launch must be"),
        ({**on, "controller_address": "10.0.0.1:5"}, "must look like tcp://"),
        ({**on, "tqstream": {"group_key_pattern": "(.+)_g"}}, "needs a named group"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_data_plane_client(cfg)  # type: ignore[arg-type]
    for block, message in [
        ({"storage_units": 0}, "storage_units must be an int >= 1, got 0"),
        ({"claim_lease_timeout_s": 0}, "claim_lease_timeout_s must be > 0 seconds, got 0"),
        ({"non_tensor_fields": "pickle"}, "non_tensor_fields must be 'store' or 'reject'"),
        ({"group_key_pattern": "(?P<group>"}, "group_key_pattern is not a regular expression"),
    ]:
        with pytest.raises(ConfigError, match=message):
            TQStreamDataPlaneConfig.from_dataplane_config({"tqstream": block})
    with pytest.raises(ConfigError, match=r"data_plane\.tqstream must be a mapping"):
        TQStreamDataPlaneConfig.from_dataplane_config({"tqstream": "ray"})
    worker = {"enabled": True, "impl": "tqstream", "tqstream": {"launch": "embedded"}}
    with pytest.raises(ConfigError, match="a worker \\(bootstrap=False\\) cannot find the cluster"):
        build_data_plane_client(worker, bootstrap=False)
    observed = {**worker, "observability": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"observability\.enabled needs NeMo-RL.s metrics client"):
        build_data_plane_client(observed)  # NeMo-RL is not importable here
    ray_worker = {"enabled": True, "impl": "tqstream", "tqstream": {"ray_name": "no-such"}}
    with pytest.raises(tqstream.ConnectError, match=r"ray\.init|no tqstream cluster named"):
        build_data_plane_client(ray_worker, bootstrap=False)
    parsed = TQStreamDataPlaneConfig.from_dataplane_config(
        {"controller_address": "tcp://h:1", "simple": {"num_storage_units": 3}}
    )
    assert (parsed.address, parsed.storage_units) == ("tcp://h:1", 3)


def test_driver_starts_and_workers_attach() -> None:
    cfg: dict[str, Any] = {
        "enabled": True, "impl": "tqstream", "claim_meta_poll_interval_s": 0.5,
        "backend": "simple", "tqstream": {"launch": "embedded", "storage_units": 2},
    }  # fmt: skip
    driver = build_data_plane_client(cfg, bootstrap=True)
    address = cfg["controller_address"]  # written for the workers' copy of the configuration
    assert address.startswith("tcp://") and len(driver.client.stats().units) == 2
    worker = build_data_plane_client(cfg, bootstrap=False)
    driver.put_samples(["a"], "p", td(x=torch.arange(1)))
    assert worker.get_samples(["a"], "p", ["x"])["x"].tolist() == [0]
    worker.close()
    driver.close()
    with pytest.raises(tqstream.ConnectError):
        tqstream.connect(address, tqstream.ClientConfig(connect_timeout=0.5))


def test_with_nemo_rl_importable(tmp_path: Path) -> None:
    with tqstream.init() as owner:
        out = subprocess.run(
            [sys.executable, str(WORKER), "standin", str(tmp_path), owner.address, "p"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["flag"] is True and got["classes"] == [True, True, True]
    assert got["routed_before"] == "the stand-in factory builds transfer_queue only, not 'tqstream'"
    assert got["install"] == [True, True]
    assert got["built"] == ["TQStreamDataPlaneClient"] * 3
    assert got["other_impl"] == "the stand-in transfer_queue client"
    assert got["metas"] == [True, True] and got["claimed"] == ["a", "b"]
    assert got["wrapped"] == "MetricsDataPlaneClient" and got["events"] == [{"op": "close"}]


# --- KVBatchMeta (this module's, when nemo_rl is not importable) ---
def test_kvbatchmeta_transforms() -> None:
    meta = KVBatchMeta("p", "t", ["a", "b", "c"], fields=["x"], sequence_lengths=[3, 1, 2])
    assert meta.size == 3 and meta.extra_info == {} and meta.tags is None
    assert KVBatchMeta("p", None, []).extra_info is not KVBatchMeta("p", None, []).extra_info
    with pytest.raises(ValueError, match="2 tags for 3 sample_ids"):
        KVBatchMeta("p", "t", ["a", "b", "c"], tags=[{}, {}])
    with pytest.raises(ValueError, match="'w' has 2 values for 3 rows"):
        meta.stamp_tags({"w": [1, 2]})
    assert meta.tags is None  # a refused stamp changes nothing
    meta.stamp_tags({"w": torch.tensor([7, 8, 9]).tolist()})
    sub = meta.subset([2, 0])
    assert (sub.sample_ids, sub.sequence_lengths, sub.tags) == (
        ["c", "a"],
        [2, 3],
        [{"w": 9}, {"w": 7}],
    )
    assert sub.tags is not None and meta.tags is not None and sub.tags[1] is meta.tags[0]
    assert meta.slice(1, 3).sample_ids == ["b", "c"] and meta.drop([0, 1, 2]) is None
    both = meta.concat(KVBatchMeta("p", "t", ["d"], sequence_lengths=[5]))
    assert both.sample_ids == ["a", "b", "c", "d"] and both.sequence_lengths == [3, 1, 2, 5]
    assert both.tags is None and both.fields is meta.fields
    with pytest.raises(ValueError, match="every part must be of partition 'p'"):
        meta.concat(KVBatchMeta("q", "t", []))
    wider = meta.with_fields(["y", "x"])
    assert wider.fields == ["x", "y"] and meta.fields == ["x"]
    assert wider.tags is not None and wider.tags[0] is not meta.tags[0]
    assert pickle.loads(pickle.dumps(meta)) == meta
