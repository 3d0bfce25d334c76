"""``VerlExperience`` (DataProto in and out) and the AsyncRL recipe's calls, on real servers."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("verl")

import asyncio

import numpy as np
import torch
from test_verl_dataproto import assert_dataproto_equal, make_dataproto, uids

import tqstream
from tqstream import StalenessPolicy
from tqstream.adapters.verl import AsyncRLExperience, VerlExperience


def group(uid: str, n: int = 2, first: int = 5) -> Any:
    """One prompt's ``n`` samples (a GRPO group), padded as verl's agent loop pads them."""
    return make_dataproto(
        [[first, first + 1]] * n,
        [[first + 2 + i] * (i + 1) for i in range(n)],
        prompt_length=4,
        response_length=n + 1,
        non_tensor={
            "uid": np.array([uid] * n, dtype=object),
            "__num_turns__": np.arange(n, dtype=np.int32),
        },
        meta_info={"metrics": [{"generate_sequences": 0.1}] * n},
    )


def test_put_and_get_a_dataproto(client: tqstream.Client, partition: str) -> None:
    exp = VerlExperience(client, partition=partition)
    dp = group("u0")
    meta = exp.put_experience(dp, current_version=4)
    assert meta.groups == ["u0", "u0"] and meta.version_start == [4, 4]
    batch = exp.get_experience(2, current_version=4, timeout=10)  # fields: the partition's
    assert_dataproto_equal(dp, batch.data)
    assert batch.versions == [4, 4]
    assert batch.ack() == 2


def test_the_window_measures_from_the_dispatch_version(
    client: tqstream.Client, partition: str
) -> None:
    """verl counts staleness from when generation was requested: a rollout dispatched at 1 and
    finished at 3 is 2 versions old at 3, and falls out of a 1-version window."""
    exp = VerlExperience(
        client, partition=partition, fields=["responses", "uid"],
        staleness=StalenessPolicy(max_staleness=1, measure="dispatch", on_stale="drop"),
    )  # fmt: skip
    exp.put_experience(group("late"), current_version=3, dispatch_version=1)
    exp.put_experience(group("fresh", first=9), current_version=3, dispatch_version=2)
    batch = exp.get_experience(2, current_version=3, timeout=10)
    assert batch.data.non_tensor_batch["uid"].tolist() == ["fresh", "fresh"]
    assert batch.stale_dropped == 2
    assert client.stats(partition).partitions[partition].stale_dropped == 2


def test_one_trajectory_per_put_makes_whole_groups(client: tqstream.Client, partition: str) -> None:
    exp = VerlExperience(client, partition=partition, fields=["responses", "rollout_log_probs"])
    dp = group("g", n=3)
    for i in range(3):
        exp.put_experience(dp[i : i + 1], current_version=0, group_size=3)
        if i < 2:
            with pytest.raises(tqstream.RequestTimeoutError):
                exp.get_experience(3, current_version=0, timeout=0)
    batch = exp.get_experience(3, current_version=0, timeout=10)
    assert batch.data.batch["responses"].tolist() == dp.batch["responses"].tolist()


def test_async_calls(client: tqstream.Client, partition: str) -> None:
    async def main() -> None:
        exp = VerlExperience(client, partition=partition, fields=["responses", "uid"])
        await exp.async_put_experience(group("a"), current_version=1)
        batch = await exp.async_get_experience(2, current_version=1, timeout=10)
        assert batch.data.non_tensor_batch["uid"].tolist() == ["a", "a"]
        assert await batch.async_ack() == 2

    asyncio.run(main())


def test_a_batch_that_cannot_be_converted_goes_back(
    client: tqstream.Client, partition: str
) -> None:
    exp = VerlExperience(client, partition=partition, fields=["responses"], prompt_length=1)
    exp.put_experience(group("a"), current_version=0)
    with pytest.raises(tqstream.InvalidRequestError, match=r"prompt_length=1 is shorter"):
        exp.get_experience(2, current_version=0, timeout=10)
    task = client.stats(partition).partitions[partition].tasks["actor"]
    assert (task.available, task.leased) == (2, 0)


@pytest.mark.parametrize("version", [None, "3", 1.5, True])
def test_a_put_without_an_int_version_stores_nothing(
    client: tqstream.Client, partition: str, version: Any
) -> None:
    exp = VerlExperience(client, partition=partition, fields=["responses"])
    with pytest.raises(
        tqstream.InvalidRequestError,
        match=rf"current_version must be a policy version: an int in 0..2147483647 \(.*\); got "
        rf"{re.escape(repr(version))}",
    ):
        exp.put_experience(group("a"), current_version=version)
    assert client.list_keys(partition) == []
    rl = AsyncRLExperience(client, ["input_ids"], partition=partition + "-rl")
    with pytest.raises(tqstream.InvalidRequestError, match=r"current_version must be"):
        rl.put_experience({"input_ids": torch.ones(2, 3)}, current_version=version)
    assert client.list_keys(partition + "-rl") == []
    with pytest.raises(tqstream.InvalidRequestError, match=r"must be a policy version"):
        exp.get_experience(1, current_version=version, timeout=0)


def test_group_members_that_disagree_on_fields_are_refused(
    client: tqstream.Client, partition: str
) -> None:
    exp = VerlExperience(client, partition=partition, fields=["responses"])
    dp = group("g", n=2)
    exp.put_experience(dp[0:1], current_version=0, group_size=2)
    second = dp[1:2]
    second.batch.pop("rollout_log_probs")
    with pytest.raises(
        tqstream.GroupError,
        match=r"group 'g': this put's members disagree on fields with the group's earlier members "
        r"\(missing \['rollout_log_probs'\]\)",
    ):
        exp.put_experience(second, current_version=0, group_size=2)
    assert len(client.list_keys(partition)) == 1  # the first member only
    exp.put_experience(dp[1:2], current_version=0, group_size=2)  # the right member completes it
    assert len(exp.get_experience(2, current_version=0, timeout=10)) == 2


def test_group_size_needs_uids(client: tqstream.Client, partition: str) -> None:
    exp = VerlExperience(client, partition=partition, fields=["responses"])
    dp = make_dataproto([[5]], [[6]])
    with pytest.raises(tqstream.InvalidRequestError, match=r"group_size= needs the rows' groups"):
        exp.put_experience(dp, current_version=0, group_size=2)
    assert client.list_keys(partition) == []


def test_reading_before_any_field_exists_says_what_to_pass(
    client: tqstream.Client, partition: str
) -> None:
    exp = VerlExperience(client, partition=partition)
    with pytest.raises(tqstream.InvalidRequestError, match=r"has no fields yet to read"):
        exp.get_experience(1, current_version=0, timeout=0)


# --- the AsyncRL recipe's adapter surface --------------------------------------------------------
COLUMNS = ["input_ids", "attention_mask", "old_logprobs", "token_policy_versions", "rewards"]


def step(version: int, n: int = 2) -> dict[str, torch.Tensor]:
    """A batch as the recipe's rollout manager puts it: padded [n, 6] per-token tensors."""
    return {
        "input_ids": torch.arange(n * 6).reshape(n, 6) + 100 * version,
        "attention_mask": torch.ones(n, 6, dtype=torch.int64),
        "old_logprobs": -torch.rand(n, 6),
        "token_policy_versions": torch.full((n, 6), version),
        "rewards": torch.full((n,), float(version)),
    }


def test_asyncrl_window_is_one_request(client: tqstream.Client, partition: str) -> None:
    """The recipe asked TransferQueue for global_step v, v-1, ... v-k in turn; here one get
    returns the oldest rows inside the window and evicts (and counts) the stale ones."""
    rl = AsyncRLExperience(client, COLUMNS, max_staleness=1, partition=partition)
    sent = {v: step(v) for v in range(3)}
    for v, data in sent.items():
        rl.put_experience(data, current_version=v)
    got = rl.get_experience(4, current_version=2, timeout=10)
    assert sorted(got) == sorted(COLUMNS)
    assert got["rewards"].tolist() == [1.0, 1.0, 2.0, 2.0]
    for key in COLUMNS:
        assert torch.equal(got[key], torch.cat([sent[1][key], sent[2][key]])), key
    part = client.stats(partition).partitions[partition]
    assert part.stale_dropped == 2 and part.freed == 4 and part.rows == 0  # consumed rows freed
    with pytest.raises(tqstream.RequestTimeoutError):  # consumed on delivery
        rl.get_experience(1, current_version=2, timeout=0)


def test_asyncrl_async_calls_and_mixed_versions(client: tqstream.Client, partition: str) -> None:
    async def main() -> None:
        rl = AsyncRLExperience(client, COLUMNS, partition=partition, reject_mixed_versions=True)
        data = step(5)
        data["token_policy_versions"][1, 3:] = 6  # weights changed mid-generation
        meta = await rl.async_put_experience(data, current_version=6)
        assert len(meta) == 1 and meta.rejected == 1
        got = await rl.async_get_experience(1, current_version=6, timeout=10)
        assert got["input_ids"].tolist() == data["input_ids"][:1].tolist()

    asyncio.run(main())


def test_asyncrl_group_members_must_agree(client: tqstream.Client, partition: str) -> None:
    rl = AsyncRLExperience(client, ["input_ids"], partition=partition)
    rl.put_experience({"input_ids": torch.ones(1, 3), "rewards": torch.ones(1)},
                      current_version=0, group="p0", group_size=2)  # fmt: skip
    with pytest.raises(tqstream.GroupError, match=r"group 'p0'.*\(missing \['rewards'\]\)"):
        rl.put_experience({"input_ids": torch.ones(1, 3)}, current_version=0, group="p0")
    assert len(client.list_keys(partition)) == 1


def test_dense_and_object_fields_come_back_as_verl_keeps_them(
    client: tqstream.Client, partition: str
) -> None:
    """``non_tensor_batch`` arrays keep their numpy dtypes (int32, <U, object with lists)."""
    turns = np.empty(2, dtype=object)
    turns[0], turns[1] = [0.5, 1.0], []
    dp = make_dataproto(
        [[5], [6, 7]],
        [[8, 9], [10]],
        non_tensor={
            "uid": uids(2),
            "data_source": np.array(["gsm8k", "math"]),
            "turn_scores": turns,
            "index": np.array([3, 4], dtype=np.int64),
        },
    )
    exp = VerlExperience(client, partition=partition)
    exp.put_experience(dp, current_version=0)
    got = exp.get_experience(2, current_version=0, timeout=10).data
    assert_dataproto_equal(dp, got)
    assert got.non_tensor_batch["data_source"].dtype == np.dtype("<U5")
    assert got.non_tensor_batch["turn_scores"][0] == [0.5, 1.0]
