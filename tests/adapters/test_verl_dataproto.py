"""verl ``DataProto`` ⇄ tqstream rows against the real ``DataProto`` and real servers.

``make_dataproto`` builds batches the way verl's agent loop pads them (``_agent_loop_postprocess``:
left-padded prompts, right-padded responses / response_mask / rollout_log_probs, input_ids their
concatenation, position_ids from ``verl.utils.model.compute_position_id_with_mask``); the other
verl test files import it from here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("verl")

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl_dataproto_recorder import difference

import tqstream
from tqstream.adapters.verl import (
    LAYOUT_FIELD,
    VerlExperience,
    dataproto_to_rows,
    rows_to_dataproto,
    stored_fields,
)

_names = itertools.count()


def make_dataproto(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad: int = 0,
    response_masks: Sequence[Sequence[int]] | None = None,
    logprob_dtype: torch.dtype | None = torch.float32,
    mask_dtype: torch.dtype = torch.int64,
    input_ids: bool = True,
    position_ids: bool = True,
    non_tensor: dict[str, np.ndarray] | None = None,
    meta_info: dict[str, Any] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> DataProto:
    """A rollout ``DataProto`` padded as verl's agent loop pads it (widths: the longest row unless
    given); ``rollout_log_probs`` is -0.5 - 0.01 * position on real tokens, 0 on padding."""
    n = len(prompts)
    p_width = prompt_length if prompt_length is not None else max(map(len, prompts), default=0)
    r_width = response_length if response_length is not None else max(map(len, responses))
    p = torch.full((n, p_width), pad, dtype=torch.int64)
    r = torch.full((n, r_width), pad, dtype=torch.int64)
    mask = torch.zeros(n, p_width + r_width, dtype=torch.int64)
    rmask = torch.zeros(n, r_width, dtype=torch.int64)
    logp = torch.zeros(n, r_width, dtype=torch.float64)
    for i, (pi, ri) in enumerate(zip(prompts, responses, strict=True)):
        p[i, p_width - len(pi) :] = torch.tensor(pi, dtype=torch.int64)
        r[i, : len(ri)] = torch.tensor(ri, dtype=torch.int64)
        mask[i, p_width - len(pi) : p_width + len(ri)] = 1
        rm = response_masks[i] if response_masks is not None else [1] * len(ri)
        rmask[i, : len(ri)] = torch.tensor(rm, dtype=torch.int64)
        logp[i, : len(ri)] = -0.5 - 0.01 * torch.arange(len(ri), dtype=torch.float64)
    batch: dict[str, torch.Tensor] = {
        "prompts": p,
        "responses": r,
        "response_mask": rmask,
        "attention_mask": mask.to(mask_dtype),
    }
    if input_ids:
        batch["input_ids"] = torch.cat([p, r], dim=1)
    if position_ids:
        batch["position_ids"] = compute_position_id_with_mask(mask)
    if logprob_dtype is not None:
        batch["rollout_log_probs"] = logp.to(logprob_dtype)
    batch.update(extra or {})
    return DataProto(
        batch=TensorDict(batch, batch_size=[n]),
        non_tensor_batch=dict(non_tensor or {}),
        meta_info=dict(meta_info or {}),
    )


def uids(*groups: int) -> np.ndarray:
    """``uid`` for contiguous groups of these sizes, as verl's ``repeat(interleave=True)``."""
    out = [f"uid-{g}" for g, size in enumerate(groups) for _ in range(size)]
    return np.array(out, dtype=object)


def assert_dataproto_equal(a: DataProto, b: DataProto) -> None:
    """Equal batches, non_tensor_batch and meta_info: keys, dtypes, shapes, bits and Python types
    at every level (``verl_dataproto_recorder.difference``, stricter than ``_deep_equal``)."""
    problem = difference(a, b)
    assert problem is None, problem


def put_and_read(client: tqstream.Client, dp: DataProto, partition: str, **read: Any) -> DataProto:
    """One put of ``dp``'s rows (uid groups), one whole-groups get of them all (``len(rows)``: a
    ``DataProto`` without rows is one row), converted back."""
    rows = dataproto_to_rows(dp)
    client.put(rows.data, partition, groups=rows.groups, version=0)
    batch = client.get(partition, rows.fields, len(rows), "actor", whole_groups=True, timeout=10)
    batch.ack()
    return rows_to_dataproto(batch, **read)


# --- the round trip, as a property -----------------------------------------------------------
_HASHABLE = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=4)
_LEAVES = (
    _HASHABLE
    | st.floats(width=64)  # NaN and infinities too
    | st.binary(max_size=4)
    | st.binary(max_size=4).map(bytearray)
    | st.complex_numbers(max_magnitude=1e6)
    | st.sampled_from([np.float64, np.float32, np.int32, np.int64, np.uint8]).flatmap(
        lambda kind: st.integers(0, 100).map(kind)
    )
    | st.text(max_size=3).map(np.str_)
    | st.booleans().map(np.bool_)
    | st.lists(st.floats(width=32), max_size=4).map(lambda v: np.array(v, dtype=np.float32))
    | st.lists(st.integers(-9, 9), max_size=4).map(lambda v: torch.tensor(v, dtype=torch.int64))
    | st.frozensets(st.integers(-9, 9) | st.text(max_size=2), max_size=3)
)
VALUES = st.recursive(
    _LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(_HASHABLE | st.tuples(st.integers(0, 3)), inner, max_size=3)
    ),
    max_leaves=6,
)
"""Python values of object arrays and ``meta_info`` that come back exactly (types included)."""


def objects(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array of these values (element by element: lists stay elements)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


@st.composite
def dataprotos(draw: st.DrawFn) -> tuple[DataProto, int | None]:
    """Random shapes, paddings, dtypes, non-tensor fields and uid groups; ``(dp, pad_token_id
    to pass or None to infer)``."""
    group_sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    n = sum(group_sizes)
    pad = draw(st.sampled_from([0, 1, 151643]))
    token = st.integers(2, 50_000)
    p_lens = draw(st.lists(st.integers(1, 7), min_size=n, max_size=n))
    r_lens = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n))
    prompts = [draw(st.lists(token, min_size=k, max_size=k)) for k in p_lens]
    responses = [draw(st.lists(token, min_size=k, max_size=k)) for k in r_lens]
    masks = [draw(st.lists(st.integers(0, 1), min_size=k, max_size=k)) for k in r_lens]
    extra_p, extra_r = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    p_width, r_width = max(p_lens) + extra_p, max(max(r_lens), 1) + extra_r
    non_tensor: dict[str, np.ndarray] = {}
    if draw(st.booleans()):
        non_tensor["uid"] = uids(*group_sizes)
    if draw(st.booleans()):
        non_tensor["extras"] = objects([draw(VALUES) for _ in range(n)])
    if draw(st.booleans()):
        non_tensor["__num_turns__"] = np.array(
            draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), dtype=np.int32
        )
    if draw(st.booleans()):
        non_tensor["data_source"] = np.array(
            draw(st.lists(st.text("abc", max_size=5), min_size=n, max_size=n))
        )
    extra = {}
    if draw(st.booleans()):  # a dense per-token field kept padded (e.g. verl's rm_scores)
        extra["rm_scores"] = torch.tensor(
            draw(st.lists(st.floats(-5, 5, width=32), min_size=n * r_width, max_size=n * r_width)),
            dtype=torch.float32,
        ).reshape(n, r_width)
    dp = make_dataproto(
        prompts,
        responses,
        prompt_length=p_width,
        response_length=r_width,
        pad=pad,
        response_masks=masks,
        logprob_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64, None])),
        mask_dtype=draw(st.sampled_from([torch.int64, torch.int32, torch.bool])),
        input_ids=draw(st.booleans()),
        position_ids=draw(st.booleans()),
        non_tensor=non_tensor,
        meta_info=draw(st.dictionaries(st.text(max_size=5), VALUES, max_size=3)),
        extra=extra,
    )
    return dp, pad if draw(st.booleans()) else None


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=dataprotos())
def test_round_trip_through_tqstream_gives_an_equal_dataproto(
    client: tqstream.Client, case: tuple[DataProto, int | None]
) -> None:
    dp, pad = case
    partition = f"verl-prop-{next(_names)}"
    rows = dataproto_to_rows(dp, pad_token_id=pad)
    assert LAYOUT_FIELD in rows.data and "attention_mask" not in rows.data
    meta = client.put(rows.data, partition, groups=rows.groups, version=3)
    batch = client.get(partition, rows.fields, len(dp), "actor", whole_groups=True, timeout=10)
    assert batch.meta.keys == meta.keys  # one put, contiguous groups: put order
    back = rows_to_dataproto(batch, pad_token_id=pad)
    assert_dataproto_equal(dp, back)
    # padded reads (padded tensors + <field>_lengths) give the same DataProto
    again = client.get_by_keys(partition, meta.keys, rows.fields, padded=True)
    assert_dataproto_equal(dp, rows_to_dataproto(again.data, pad_token_id=pad))
    client.clear_partition(partition)


# --- what is stored ------------------------------------------------------------------------------
def row_lists(col: tqstream.Column) -> list[list[Any]]:
    """Each row of a ragged column as a list."""
    assert col.offsets is not None
    bounds = col.offsets.tolist()
    return [col.values[a:b].tolist() for a, b in itertools.pairwise(bounds)]


def test_rows_are_unpadded_and_uid_is_the_group(client: tqstream.Client, partition: str) -> None:
    dp = make_dataproto(
        [[5, 6], [7, 8, 9]],
        [[10], [11, 12, 13]],
        prompt_length=6,
        response_length=5,
        response_masks=[[1], [1, 0, 1]],
        non_tensor={"uid": uids(2)},
    )
    rows = dataproto_to_rows(dp)
    assert rows.groups == ["uid-0", "uid-0"]
    assert row_lists(rows.data["prompts"]) == [[5, 6], [7, 8, 9]]
    assert row_lists(rows.data["responses"]) == [[10], [11, 12, 13]]
    assert row_lists(rows.data["response_mask"]) == [[1], [1, 0, 1]]
    meta = client.put(rows.data, partition, groups=rows.groups, version=0)
    assert meta.groups == ["uid-0", "uid-0"]
    schemas = client.stats(partition).partitions[partition].schemas
    assert schemas["prompts"].kind == "ragged" and schemas["rollout_log_probs"].kind == "ragged"
    # object values ride in the layout field: no field of their own
    assert "uid" not in schemas
    assert (schemas[LAYOUT_FIELD].kind, schemas[LAYOUT_FIELD].dtype) == ("ragged", "uint8")
    assert not {"input_ids", "attention_mask", "position_ids"} & set(schemas)


def test_a_read_naming_some_object_keys_gets_those(client: tqstream.Client, partition: str) -> None:
    """Object values travel together in the layout field, but the DataProto read back holds the
    keys named, and a read naming a key the rows do not have waits for it as a field."""
    extra = {"uid": uids(2), "prompt": objects(["a", {"b": (1,)}]), "n": np.arange(2)}
    dp = make_dataproto([[5, 6], [7]], [[10], [11, 12]], non_tensor=extra)
    exp = VerlExperience(client, partition=partition, fields=["responses", "prompt", "n"])
    exp.put_experience(dp, current_version=0)
    batch = exp.get_experience(2, current_version=0, timeout=10)
    assert list(batch.data.non_tensor_batch) == ["prompt", "n"]
    assert batch.data.non_tensor_batch["prompt"][1] == {"b": (1,)}
    batch.ack()
    waiting = VerlExperience(client, partition=partition, fields=["responses", "absent"])
    started = time.monotonic()
    with pytest.raises(tqstream.RequestTimeoutError):
        waiting.get_experience(2, current_version=0, task="other", timeout=0.5)
    assert time.monotonic() - started < 3  # one timeout for the whole get, not one per read
    # the rows were released in between: another task reads them
    assert len(exp.get_experience(2, current_version=0, task="third", timeout=10)) == 2


def test_stored_fields_names_the_written_fields_and_the_layout() -> None:
    written = ["prompts", "responses", "rm_scores", LAYOUT_FIELD]
    keys = ["responses", "uid", "rm_scores", "input_ids"]
    assert stored_fields(keys, written) == ["prompts", "responses", "rm_scores", LAYOUT_FIELD]
    assert stored_fields(["uid"], []) == [LAYOUT_FIELD]  # object values ride in the layout
    assert stored_fields(["attention_mask"], []) == ["prompts", "responses", LAYOUT_FIELD]
    # a tensor verl computes that was stored as it is (e.g. M-RoPE position ids) is a field
    assert stored_fields(["position_ids"], ["position_ids"]) == ["position_ids", LAYOUT_FIELD]


def test_rows_to_dataproto_keeps_the_object_keys_asked_for(
    client: tqstream.Client, partition: str
) -> None:
    extra = {"uid": uids(2), "prompt": objects(["a", {"b": (1,)}]), "n": np.arange(2)}
    dp = make_dataproto([[5, 6], [7]], [[10], [11, 12]], non_tensor=extra)
    rows = dataproto_to_rows(dp)
    client.put(rows.data, partition)
    batch = client.get(partition, rows.fields, 2, "actor", timeout=10)
    assert list(rows_to_dataproto(batch).non_tensor_batch) == ["uid", "prompt", "n"]
    back = rows_to_dataproto(batch, keys=["responses", "prompt", "input_ids"])
    assert list(back.non_tensor_batch) == ["prompt", "n"]  # n: a field read
    with pytest.raises(tqstream.SchemaError, match="'nope'") as err:
        rows_to_dataproto(batch, keys=["responses", "nope"])
    assert err.value.details["keys"] == ["nope"]


def test_a_key_written_after_the_put_is_waited_for(client: tqstream.Client, partition: str) -> None:
    """A key the rows do not have yet is taken for an object value, found missing, and read
    again as a field: the get returns once a later write adds it to the rows."""
    dp = make_dataproto([[5, 6], [7]], [[10], [11, 12]], non_tensor={"uid": uids(2)})
    exp = VerlExperience(client, partition=partition, fields=["responses", "uid", "ref"])
    meta = exp.put_experience(dp, current_version=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(exp.get_experience, 2, 0, timeout=30)
        time.sleep(0.3)
        assert not reading.done()
        client.put_fields(meta, {"ref": torch.tensor([[1.0, 2.0], [3.0, 4.0]])})
        batch = reading.result(timeout=30)
    assert batch.data.batch["ref"].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert list(batch.data.non_tensor_batch) == ["uid"]
    batch.ack()


def test_re_pads_to_the_requested_widths(client: tqstream.Client, partition: str) -> None:
    """Rows put at one width read back as verl pads them at another (e.g. a trainer's
    rollout.prompt_length), mask and positions rebuilt."""
    prompts, responses = [[5, 6], [7, 8, 9]], [[10], [11, 12, 13]]
    narrow = make_dataproto(prompts, responses, pad=3, non_tensor={"uid": uids(2)})
    wide = make_dataproto(
        prompts, responses, prompt_length=8, response_length=6, pad=3, non_tensor={"uid": uids(2)}
    )
    got = put_and_read(client, narrow, partition, prompt_length=8, response_length=6)
    assert_dataproto_equal(wide, got)
    assert got.batch["attention_mask"][0].tolist() == [0] * 6 + [1] * 3 + [0] * 5


def test_rows_of_several_puts_merge_as_dataproto_concat(
    client: tqstream.Client, partition: str
) -> None:
    """One read of two puts' rows is verl's own DataProto.concat of the two (meta_info's
    per-worker metrics gathered)."""
    a = make_dataproto(
        [[5, 6]], [[10, 11]], prompt_length=3, response_length=4,
        non_tensor={"uid": uids(1)}, meta_info={"metrics": [{"t": 1.0}], "global_steps": 2},
    )  # fmt: skip
    b = make_dataproto(
        [[7]], [[12]], prompt_length=3, response_length=4,
        non_tensor={"uid": np.array(["uid-9"], dtype=object)},
        meta_info={"metrics": [{"t": 2.0}], "global_steps": 2},
    )  # fmt: skip
    fields = None
    for dp in (a, b):
        rows = dataproto_to_rows(dp)
        client.put(rows.data, partition, groups=rows.groups, version=0)
        fields = rows.fields
    assert fields is not None
    batch = client.get(partition, fields, 2, "actor", whole_groups=True, timeout=10)
    assert_dataproto_equal(DataProto.concat([a, b]), rows_to_dataproto(batch))


def _verl_without_rows() -> list[DataProto]:
    """The ``DataProto``s without rows verl's own tests build (``test_len``,
    ``test_dataproto_no_batch``), built the same way."""
    labels = ["a", "b", "c"]
    popped = DataProto.from_dict(non_tensors={"labels": labels}, meta_info={"info": "test_info"})
    popped.pop(non_tensor_batch_keys=["labels"])
    return [
        DataProto(batch=None, non_tensor_batch={}, meta_info={"info": "test_info"}),
        DataProto(batch=None, non_tensor_batch=None, meta_info={"info": "test_info"}),
        popped,
    ]


def test_a_dataproto_without_rows_reads_back_from_its_one_row(
    client: tqstream.Client, partition: str
) -> None:
    """verl's empty ``DataProto``s (len 0) are one row of layout: a read asks for ``len(rows)``
    rows (a read of ``len(dp)``, 0, is refused by the data plane) and gets an equal one."""
    for i, dp in enumerate(_verl_without_rows()):
        assert len(dp) == 0 and len(dataproto_to_rows(dp)) == 1
        back = put_and_read(client, dp, f"{partition}-{i}")
        assert len(back) == 0
        assert_dataproto_equal(dp, back)


def test_the_rows_fold_batch_dim_leaves_behind_round_trip(
    client: tqstream.Client, partition: str
) -> None:
    """verl's ``fold_batch_dim`` reshapes the ``non_tensor_batch`` of the ``DataProto`` it is
    given in place: ``[6]`` rows with ``[3, 2]`` labels (verl's own check refuses that state). Its
    rows hold each array row by row; a read of the put's rows folds them again, a read of some
    of them keeps them row by row."""
    from verl.protocol import fold_batch_dim

    data = DataProto.from_dict(
        tensors={"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])},
        non_tensors={"labels": ["a", "b", "c"], "score": np.arange(3.0)},
        meta_info={"info": "test_info"},
    ).repeat(repeat_times=2, interleave=True)
    folded = fold_batch_dim(data, new_batch_size=3)
    assert len(data) == 6 and data.non_tensor_batch["labels"].shape == (3, 2)
    assert folded.batch.batch_size == (3,) and folded.non_tensor_batch["score"].shape == (3, 2)
    for i, dp in enumerate((data, folded)):
        assert_dataproto_equal(dp, put_and_read(client, dp, f"{partition}-{i}"))
    rows = dataproto_to_rows(data)
    assert len(rows) == 6
    meta = client.put(rows.data, f"{partition}-some", versions_field=None)
    back = rows_to_dataproto(client.get_by_keys(f"{partition}-some", meta.keys[1:5], rows.fields))
    assert back.non_tensor_batch["labels"].tolist() == ["a", "b", "b", "c"]
    assert back.non_tensor_batch["score"].tolist() == [0.0, 1.0, 1.0, 2.0]
    back.check_consistency()


def test_rows_of_other_producers_convert_too(client: tqstream.Client, partition: str) -> None:
    """Rows without the layout field (not put from a DataProto) still become a DataProto."""
    client.put(
        {
            "prompts": [torch.tensor([5, 6]), torch.tensor([7])],
            "responses": [torch.tensor([8]), torch.tensor([9, 10])],
            "rollout_log_probs": [torch.tensor([-0.5]), torch.tensor([-0.25, -0.75])],
            "reward": torch.tensor([1.0, 0.0]),
            "uid": ["a", "b"],
        },
        partition,
    )
    batch = client.get(
        partition, ["prompts", "responses", "rollout_log_probs", "reward", "uid"], 2, "t"
    )
    dp = rows_to_dataproto(batch)
    assert dp.batch["prompts"].tolist() == [[5, 6], [0, 7]]
    assert dp.batch["responses"].tolist() == [[8, 0], [9, 10]]
    assert dp.batch["attention_mask"].tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert dp.batch["position_ids"].tolist() == [[0, 1, 2, 2], [0, 0, 1, 2]]
    assert dp.batch["rollout_log_probs"].tolist() == [[-0.5, 0.0], [-0.25, -0.75]]
    assert dp.non_tensor_batch["uid"].tolist() == ["a", "b"]


def test_too_narrow_widths_are_refused(client: tqstream.Client, partition: str) -> None:
    dp = make_dataproto([[5, 6, 7]], [[8, 9]])
    rows = dataproto_to_rows(dp)
    client.put(rows.data, partition, version=0)
    batch = client.get(partition, rows.fields, 1, "actor", timeout=10)
    with pytest.raises(
        tqstream.InvalidRequestError,
        match=r"prompt_length=2 is shorter than the longest row \(3 tokens\)",
    ):
        rows_to_dataproto(batch, prompt_length=2)
    with pytest.raises(tqstream.InvalidRequestError, match=r"response_length=1 is shorter"):
        rows_to_dataproto(batch, response_length=1)


def test_response_wide_tensors_are_stored_without_zero_padding(
    client: tqstream.Client, partition: str
) -> None:
    """Any other ``[B, R]`` tensor of a rollout (``rm_scores``, ``values``, ...) is ragged: its
    rows without their padding when that is 0, whole otherwise; either comes back exact, alone
    and read together (a field's kind is fixed by its first put)."""
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    zero = make_dataproto([[5], [6, 7]], [[8, 9], [10]], response_length=4,
                          extra={"rm_scores": scores, "values": torch.zeros(2, 4)})  # fmt: skip
    rows = dataproto_to_rows(zero)
    for key in ("rm_scores", "values"):
        assert rows.data[key].offsets.tolist() == [0, 2, 3], key  # the responses' rows
    assert row_lists(rows.data["rm_scores"]) == [[0.0, 1.0], [0.5]]
    three = torch.full((2, 4), 3.0)
    whole = make_dataproto([[5], [6, 7]], [[8, 9], [10]], response_length=4,
                           extra={"rm_scores": scores, "values": three})  # fmt: skip
    rows = dataproto_to_rows(whole)
    assert rows.data["values"].offsets.tolist() == [0, 4, 8]
    assert row_lists(rows.data["values"]) == [[3.0] * 4, [3.0] * 4]
    assert_dataproto_equal(put_and_read(client, zero, partition), zero)
    assert_dataproto_equal(put_and_read(client, whole, partition), whole)
    for dp in (zero, whole):
        rows = dataproto_to_rows(dp)
        client.put(rows.data, partition, version=0)
    both = client.get(partition, rows.fields, 4, "actor", timeout=10)
    assert_dataproto_equal(rows_to_dataproto(both), DataProto.concat([zero, whole]))
    with pytest.raises(
        tqstream.InvalidRequestError,
        match=r"values has rows of 4 positions \(stored whole: its padding was not 0\) but the "
        r"read re-pads to response_length=2; pass at least 4",
    ):
        rows_to_dataproto(both, response_length=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_response_fields_of_any_dtype_round_trip(
    client: tqstream.Client, partition: str, dtype: torch.dtype
) -> None:
    """bfloat16 has no numpy type: stripping, re-padding and the padding check go by its bits."""
    dp = make_dataproto([[5, 6], [7]], [[8], [9, 10, 11]], logprob_dtype=dtype,
                        extra={"rm_scores": torch.zeros(2, 3, dtype=dtype)})  # fmt: skip
    assert_dataproto_equal(put_and_read(client, dp, partition), dp)
    logp = dp.batch["rollout_log_probs"].clone()
    logp[0, 2] = -2.0
    with pytest.raises(
        tqstream.InvalidRequestError,
        match=r"rollout_log_probs row 0 holds -2.0 at position 2, beyond the response",
    ):
        dataproto_to_rows(_with(dp, rollout_log_probs=logp))


# --- bad input: a typed error, and nothing stored ------------------------------------------------
def _good() -> DataProto:
    return make_dataproto(
        [[5, 6], [7, 8, 9]], [[10], [11, 12]], prompt_length=4, response_length=3,
        non_tensor={"uid": uids(2)},
    )  # fmt: skip


def _with(dp: DataProto, **tensors: torch.Tensor) -> DataProto:
    batch = {k: dp.batch.get(k) for k in dp.batch.keys()}  # noqa: SIM118
    batch.update(tensors)
    return DataProto(
        batch=TensorDict(batch, batch_size=[len(dp)]),
        non_tensor_batch=dict(dp.non_tensor_batch),
        meta_info=dict(dp.meta_info),
    )


def _mask_hole() -> DataProto:
    dp = _good()
    mask = dp.batch["attention_mask"].clone()
    mask[1, 2] = 0  # row 1's prompt [7, 8, 9] has a hole
    return _with(dp, attention_mask=mask, position_ids=compute_position_id_with_mask(mask))


def _mask_over_left_padding() -> DataProto:
    dp = _good()
    mask = dp.batch["attention_mask"].clone()
    mask[0, 1] = 1  # row 0's prompt is [0, 0, 5, 6]: the mask now covers the pad at 1
    return _with(dp, attention_mask=mask, position_ids=compute_position_id_with_mask(mask))


def _response_mask_beyond_response() -> DataProto:
    dp = _good()
    rmask = dp.batch["response_mask"].clone()
    rmask[0, 2] = 1  # row 0's response is 1 token long
    return _with(dp, response_mask=rmask)


def _response_mask_too_long() -> DataProto:
    dp = _good()
    return _with(dp, response_mask=torch.ones(2, 4, dtype=torch.int64))


def _response_hole() -> DataProto:
    dp = _good()
    mask = dp.batch["attention_mask"].clone()
    mask[1, 4], mask[1, 6] = 0, 1
    return _with(dp, attention_mask=mask, position_ids=compute_position_id_with_mask(mask))


def _logprobs_in_padding() -> DataProto:
    dp = _good()
    logp = dp.batch["rollout_log_probs"].clone()
    logp[0, 2] = -1.0
    return _with(dp, rollout_log_probs=logp)


def _two_pad_ids() -> DataProto:
    dp = _good()
    prompts = dp.batch["prompts"].clone()
    prompts[0, 0] = 17  # a padding position (mask 0) holding another id
    return _with(dp, prompts=prompts, input_ids=torch.cat([prompts, dp.batch["responses"]], 1))


@dataclasses.dataclass
class Point:
    x: int
    y: int


def _self_reference() -> DataProto:
    loop: list[Any] = []
    loop.append(loop)
    return _non_tensor(loop)


def _non_tensor(value: Any) -> DataProto:
    dp = _good()
    arr = np.empty(2, dtype=object)
    arr[0], arr[1] = value, None
    return DataProto(batch=dp.batch, non_tensor_batch={**dp.non_tensor_batch, "extras": arr})


IE, SE = tqstream.InvalidRequestError, tqstream.SchemaError
BAD = {
    "mask-hole": (
        _mask_hole, IE,
        r"attention_mask row 1 is not left-padded over the prompt \(\[0, 1, 0, 1\]\)",
    ),
    "mask-over-left-padding": (
        _mask_over_left_padding, IE,
        r"attention_mask row 0 is 1 over the prompt's left padding \(its first attended token "
        r"is the pad id 0\)",
    ),
    "response-mask-beyond-response": (
        _response_mask_beyond_response, IE,
        r"response_mask row 0 holds 1 at position 2, beyond the response \(attention_mask is 0 "
        r"there\)",
    ),
    "response-mask-too-long": (
        _response_mask_too_long, IE,
        r"response_mask has shape \[2, 4\] but responses is 3 tokens wide",
    ),
    "response-hole": (
        _response_hole, IE,
        r"attention_mask row 1 is not right-padded over the response \(\[0, 1, 1\]\)",
    ),
    "logprobs-in-padding": (
        _logprobs_in_padding, IE,
        r"rollout_log_probs row 0 holds -1.0 at position 2, beyond the response",
    ),
    "two-pad-ids": (_two_pad_ids, IE, r"hold several token ids \[0, 17\]"),
    "object": (
        lambda: _non_tensor(Point(1, 2)), SE,
        r"non_tensor_batch\['extras'\] row 0 holds a test_verl_dataproto.Point value "
        r"Point\(x=1, y=2\), which tqstream cannot store exactly; convert it to None, bool",
    ),
    "object-nested": (
        lambda: _non_tensor({"a": [1, Point(1, 2)]}), SE,
        r"non_tensor_batch\['extras'\] row 0 holds a test_verl_dataproto.Point value",
    ),
    "dict-subclass": (
        lambda: _non_tensor(collections.OrderedDict(a=1)), SE,
        r"row 0 holds a collections.OrderedDict value",
    ),
    "memoryview": (
        lambda: _non_tensor([memoryview(b"ab")]), SE,
        r"row 0 holds a memoryview \(convert it with bytes\(view\)\)",
    ),
    "structured": (
        lambda: _non_tensor(np.zeros(2, dtype=[("a", "i4")])), SE,
        r"row 0 holds a structured numpy array \(named fields\)",
    ),
    "sparse-tensor": (
        lambda: _non_tensor(torch.eye(2).to_sparse()), SE,
        r"row 0 holds a torch.sparse_coo tensor \(convert it with .to_dense\(\)\)",
    ),
    "self-reference": (
        _self_reference, SE, r"row 0 holds a value nested too deep, or that contains itself",
    ),
    "meta-info": (
        lambda: DataProto(batch=_good().batch, meta_info={"t": Point(0, 0)}), SE,
        r"meta_info holds a test_verl_dataproto.Point value",
    ),
    "nested-tensordict": (
        lambda: _with(_good(), extra=TensorDict({"a": torch.ones(2)}, batch_size=[2])), SE,
        r"batch\['extra'\] is a nested TensorDict; .* flatten it first",
    ),
    "strided-nested": (
        lambda: _with(_good(), ragged=torch.nested.nested_tensor([torch.ones(1), torch.ones(2)])),
        SE, r"batch\['ragged'\] is a nested tensor of layout torch.strided",
    ),
    "name-clash": (
        lambda: DataProto(batch=_good().batch, non_tensor_batch={"responses": objects([1, 2])}),
        SE, r"non_tensor_batch and batch both have \['responses'\]",
    ),
    "layout-name": (
        lambda: DataProto(batch=_good().batch, non_tensor_batch={LAYOUT_FIELD: objects([1, 2])}),
        SE, r"has a field named 'dataproto', the name of the row layout field",
    ),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize(("build", "error", "match"), list(BAD.values()), ids=list(BAD))
def test_bad_dataproto_is_refused_and_nothing_is_stored(
    client: tqstream.Client, partition: str, build: Any, error: type[Exception], match: str
) -> None:
    exp = VerlExperience(client, partition=partition, fields=["responses"])
    with pytest.raises(error, match=match):
        exp.put_experience(build(), current_version=0)
    assert client.list_keys(partition) == []
    assert client.stats(partition).partitions[partition].rows == 0


def test_a_given_pad_id_finds_the_position_that_disagrees() -> None:
    with pytest.raises(
        tqstream.InvalidRequestError,
        match=r"prompts row 0 holds 17 at position 0, left of the prompt \(attention_mask is 0 "
        r"there\), where verl pads with 0",
    ):
        dataproto_to_rows(_two_pad_ids(), pad_token_id=0)


def test_a_verl_read_builds_no_tensordict_of_the_rows(
    client: tqstream.Client, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rows_to_dataproto takes the rows from the read's columns: the TensorDict of nested
    tensors that Batch.data would build is never made."""
    import tqstream.client.batch

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Batch.data was built")

    dp = make_dataproto([[5, 6], [7]], [[10], [11, 12]], non_tensor={"uid": uids(2)})
    exp = VerlExperience(client, partition=partition, fields=["responses", "uid"])
    exp.put_experience(dp, current_version=0)
    monkeypatch.setattr(tqstream.client.batch, "to_tensordict", refuse)
    batch = exp.get_experience(2, current_version=0, timeout=10)
    assert batch.data.batch["responses"].tolist() == [[10, 0], [11, 12]]
    batch.ack()
