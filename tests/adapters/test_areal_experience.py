"""The AReaL adapter's put and read against AReaL's real ``concat_padded_tensors``, on the embedded
and the multi-process deployment: trajectories go in as AReaL's workflows return them and come
back as ``prepare_batch`` returns them; bad input is refused with a typed error, storing nothing."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("areal")

import torch
from areal.utils.data import concat_padded_tensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tqstream
from tqstream import GroupError, InvalidRequestError, SchemaError
from tqstream.adapters.areal import ArealExperience, StalenessPolicy

_ids = itertools.count()


def sample(
    prompt: int, gen: int, version: int, reward: float, dtype: torch.dtype = torch.int32
) -> dict[str, torch.Tensor]:
    """One trajectory the way AReaL's RLVRWorkflow builds it: [1, L], versions -1 on the prompt."""
    length = prompt + gen
    return {
        "input_ids": (torch.arange(length, dtype=dtype) + 7 * gen)[None],
        "loss_mask": torch.tensor([0] * prompt + [1] * gen, dtype=dtype)[None],
        "logprobs": torch.tensor([0.0] * prompt + [-0.25 * (i + 1) for i in range(gen)])[None],
        "versions": torch.tensor([-1] * prompt + [version] * gen, dtype=dtype)[None],
        "attention_mask": torch.ones(1, length, dtype=torch.bool),
        "rewards": torch.tensor([reward]),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), (key, got[key], value)


def nothing_stored(client: tqstream.Client, partition: str) -> None:
    assert client.list_keys(partition) == []
    assert client.stats(partition).partitions[partition].produced == 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_read_equals_concat_padded_tensors(
    client: tqstream.Client, partition: str, dtype: torch.dtype
) -> None:
    exp = ArealExperience(client, partition=partition)
    g1 = [sample(2, 3, 0, 1.0, dtype), sample(2, 5, 0, 0.0, dtype)]
    g2 = [sample(3, 1, 1, 1.0, dtype), sample(3, 2, 1, 0.0, dtype), sample(1, 1, 1, 0.0, dtype)]
    put1 = exp.put_experience(concat_padded_tensors(g1), 0)  # a padded [n, L] group
    put2 = exp.put_experience(g2, 1)  # the same, as a list of the group's samples
    assert len(put1) == 2 and len(put2) == 3
    assert put1.version_start == [0, 0] and put2.version_start == [1, 1, 1]
    assert len(set(put1.groups)) == 1 and len(set(put2.groups)) == 1  # one generated id each

    batch = exp.get_experience(5, current_version=1, timeout=10)
    assert len(batch) == 2 and batch.versions == [0, 0, 1, 1, 1]
    assert_same(batch[0], concat_padded_tensors(g1))
    assert_same(batch[1], concat_padded_tensors(g2))
    # the trainer's usual next step gives AReaL's batch of the same trajectories
    assert_same(concat_padded_tensors(list(batch)), concat_padded_tensors(g1 + g2))
    assert batch.ack() == 5
    assert client.stats(partition).partitions[partition].freed == 5  # "actor" was the only task


def test_single_trajectory_and_named_group(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition)
    one = sample(4, 2, 3, 0.5)
    meta = exp.put_experience(one, 3, group="prompt-17")
    assert meta.groups == ["prompt-17"] and meta.version_start == [3]
    batch = exp.get_experience(1, 3, timeout=10)
    assert_same(batch[0], one)
    with pytest.raises(GroupError):  # a group id names one group for the partition's lifetime
        exp.put_experience(one, 3, group="prompt-17")


def test_groups_are_whole_and_contiguous(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition)
    groups = [
        [sample(2, 1 + i + j, 0, float(j)) for j in range(n)] for i, n in enumerate((2, 1, 2))
    ]
    for g in groups:
        exp.put_experience(g, 0)
    batch = exp.get_experience(3, 0, timeout=10)  # 2 + 1 rows: the two oldest groups
    assert [len(t["input_ids"]) for t in batch] == [2, 1]
    assert_same(batch[1], concat_padded_tensors(groups[1]))
    rest = exp.get_experience(2, 0, timeout=10)
    assert_same(rest[0], concat_padded_tensors(groups[2]))


def test_head_window_drops_stale_groups(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition, staleness=StalenessPolicy(max_staleness=1))
    old = [sample(2, 2, 0, 1.0), sample(2, 3, 0, 0.0)]
    # head measure: a sample is as old as its first generated token (resumed under version 2)
    mixed = sample(2, 2, 2, 1.0)
    mixed["versions"] = torch.tensor([[-1, -1, 0, 2]], dtype=torch.int32)
    fresh = [sample(1, 2, 2, 1.0), sample(1, 4, 2, 0.0)]
    for g, v in ((old, 0), ([mixed], 2), (fresh, 2)):
        exp.put_experience(g, v)
    batch = exp.get_experience(2, current_version=2, timeout=10)
    assert batch.versions == [2, 2] and batch.stale_dropped == 3
    assert_same(batch[0], concat_padded_tensors(fresh))
    assert client.stats(partition).partitions[partition].stale_dropped == 3


def test_from_config_reads_max_head_offpolicyness(client: tqstream.Client, partition: str) -> None:
    from areal.api.cli_args import InferenceEngineConfig

    config = InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=3)
    exp = ArealExperience.from_config(client, config, partition=partition)
    assert exp.experience.staleness == StalenessPolicy(3, measure="head", on_stale="drop")


def test_put_fields_per_row(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition, tasks=["actor", "ref"])
    g1, g2 = [sample(2, 3, 0, 1.0), sample(2, 1, 0, 0.0)], [sample(3, 4, 0, 1.0)]
    exp.put_experience(g1, 0)
    exp.put_experience(g2, 0)
    batch = exp.get_experience(3, 0, task="ref", timeout=10)
    whole = concat_padded_tensors(list(batch))  # [3, 7]: what AReaL's compute_logp sees
    ref_logp = torch.where(whole["attention_mask"], whole["logprobs"] - 1.0, 0.0)
    # AReaL 1.0.4's trainer: compute_logp(rollout_batch) gives one [n, W_group] tensor per group
    prox_logp = [torch.where(t["attention_mask"], t["logprobs"] * 2, 0.0) for t in batch]
    scores = [t["rewards"] * 10 for t in batch]  # per sample, one tensor per group
    batch.put_fields({"ref_logp": ref_logp, "prox_logp": prox_logp, "scores": scores})
    with pytest.raises(tqstream.FieldExistsError):  # stored columns are never overwritten
        batch.put_fields({"scores": torch.zeros(3)})
    batch.ack()

    fields = [*exp.fields, "ref_logp", "prox_logp", "scores"]
    later = exp.get_experience(3, 0, task="actor", fields=fields, timeout=10)
    for got, want in zip(later, (g1, g2), strict=True):
        expected = concat_padded_tensors(want)
        mask = expected["attention_mask"]
        assert torch.equal(got["ref_logp"], torch.where(mask, expected["logprobs"] - 1.0, 0.0))
        assert torch.equal(got["prox_logp"], torch.where(mask, expected["logprobs"] * 2, 0.0))
        assert torch.equal(got["scores"], expected["rewards"] * 10)


def test_put_fields_bad_shape(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition)
    exp.put_experience([sample(2, 3, 0, 1.0), sample(2, 1, 0, 0.0)], 0)
    batch = exp.get_experience(2, 0, timeout=10)
    with pytest.raises(
        SchemaError,
        match=r"'ref_logp' is \[2, 3\]; for this batch of 2 rows a column is \[2, 5, \.\.\.\] "
        r"\(per token, padded like concat_padded_tensors\) or \[2\] \(per sample\)",
    ):
        batch.put_fields({"ref_logp": torch.zeros(2, 3)})
    with pytest.raises(SchemaError, match=r"list of 2 tensors but the batch has 1 groups"):
        batch.put_fields({"ref_logp": [torch.zeros(2, 5), torch.zeros(1, 5)]})
    assert client.stats(partition).partitions[partition].fields.get("ref_logp", 0) == 0


# --- bad input: a typed error with the message, and nothing stored ---


def test_trajectory_without_input_ids(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition)
    traj = sample(2, 2, 0, 1.0)
    del traj["input_ids"]
    with pytest.raises(
        SchemaError,
        match=r"an AReaL trajectory needs \['input_ids', 'attention_mask'\] as \[n, L\] tensors; "
        r"it lacks \['input_ids'\]",
    ):
        exp.put_experience(traj, 0)
    nothing_stored(client, partition)


def test_trajectory_without_attention_mask(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition)
    traj = sample(2, 2, 0, 1.0)
    del traj["attention_mask"]
    with pytest.raises(SchemaError, match=r"it lacks \['attention_mask'\]"):
        exp.put_experience(traj, 0)
    nothing_stored(client, partition)


@pytest.mark.parametrize("version", [None, "3", 1.5, True])
def test_current_version_must_be_an_int(
    client: tqstream.Client, partition: str, version: Any
) -> None:
    exp = ArealExperience(client, partition=partition)
    with pytest.raises(
        InvalidRequestError,
        match=rf"current_version must be a policy version: an int in 0..2147483647 \(.*\); got "
        rf"{re.escape(repr(version))}",
    ):
        exp.put_experience(sample(2, 2, 0, 1.0), version)
    nothing_stored(client, partition)


def test_group_members_disagree_on_fields(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition)
    a, b = sample(2, 2, 0, 1.0), sample(2, 3, 0, 0.0)
    del b["logprobs"]
    with pytest.raises(
        GroupError,
        match=r"group member 1 has fields \['attention_mask', 'input_ids', 'loss_mask', "
        r"'rewards', 'versions'\] but member 0 has \['attention_mask', 'input_ids', "
        r"'logprobs', 'loss_mask', 'rewards', 'versions'\]",
    ):
        exp.put_experience([a, b], 0)
    c = sample(2, 3, 0, 0.0, dtype=torch.int64)
    with pytest.raises(
        GroupError,
        match=r"group members disagree on field 'input_ids': member 0 has int32 \[\] per token, "
        r"member 1 has int64 \[\] per token",
    ):
        exp.put_experience([a, c], 0)
    nothing_stored(client, partition)


def test_malformed_trajectories(client: tqstream.Client, partition: str) -> None:
    exp = ArealExperience(client, partition=partition)
    left = sample(2, 2, 0, 1.0)
    left["attention_mask"] = torch.tensor([[False, True, True, True]])
    with pytest.raises(SchemaError, match=r"attention_mask row 0 is not right-padded"):
        exp.put_experience(left, 0)
    flat = sample(2, 2, 0, 1.0)
    flat["input_ids"] = flat["input_ids"][0]
    with pytest.raises(SchemaError, match=r"'input_ids' must be an \[n, L\] tensor .* got a 1-d"):
        exp.put_experience(flat, 0)
    odd = sample(2, 2, 0, 1.0)
    odd["rewards"] = torch.zeros(3)
    with pytest.raises(SchemaError, match=r"field 'rewards' has shape \[3\]; with input_ids of"):
        exp.put_experience(odd, 0)
    text = sample(2, 2, 0, 1.0)
    text["logprobs"] = [0.0, 0.0, -1.0, -1.0]
    with pytest.raises(SchemaError, match=r"field 'logprobs' is a list: .* tensor fields only"):
        exp.put_experience(text, 0)
    extra = sample(2, 2, 0, 1.0)
    extra["advantages"] = torch.zeros(1, 4)
    with pytest.raises(SchemaError, match=r"has \['advantages'\] that fields= does not name"):
        exp.put_experience(extra, 0)
    with pytest.raises(SchemaError, match=r"a non-empty list of them"):
        exp.put_experience([], 0)
    nothing_stored(client, partition)


def test_missing_areal_names_the_install_command() -> None:
    code = (
        "import sys; sys.modules['areal'] = None\n"
        "try:\n    import tqstream.adapters.areal\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "this tqstream adapter needs AReaL" in out.stdout
    assert "install it with: pip install areal==1.0.4" in out.stdout


def test_fields_must_name_input_ids(client: tqstream.Client, partition: str) -> None:
    with pytest.raises(InvalidRequestError, match=r"needs 'input_ids' among fields="):
        ArealExperience(client, partition=partition, fields=["logprobs"])


# --- property: any group read back is concat_padded_tensors of its trajectories ---

_group = st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=4
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    groups=st.lists(_group, min_size=1, max_size=4),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    padded=st.booleans(),
)
def test_round_trip_property(
    client: tqstream.Client,
    partition: str,
    groups: list[list[tuple[int, int, int]]],
    dtype: torch.dtype,
    padded: bool,
) -> None:
    part = f"{partition}-{next(_ids)}"
    exp = ArealExperience(client, partition=part)
    want = []
    for g in groups:
        members = [sample(p, n, v, float(p - n), dtype) for p, n, v in g]
        exp.put_experience(concat_padded_tensors(members) if padded else members, 3)
        want.append(concat_padded_tensors(members))
    batch = exp.get_experience(sum(map(len, groups)), 3, timeout=10)
    assert len(batch) == len(want)
    for got, expected in zip(batch, want, strict=True):
        assert_same(got, expected)
    batch.ack()
    client.clear_partition(part)
