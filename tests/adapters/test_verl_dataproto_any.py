"""Any verl ``DataProto`` (not only rollouts) through tqstream and back, exactly: arbitrary batches,
no batch, no rows, several batch dims, jagged tensors, every kind of ``non_tensor_batch`` array,
verl's own agent-loop output; and the object codec against bytes it did not write."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("verl")

import msgpack
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensordict import TensorDict
from test_verl_dataproto import VALUES, assert_dataproto_equal, make_dataproto, objects, uids
from verl.protocol import DataProto

import tqstream
from tqstream.adapters.verl import (
    LAYOUT_FIELD,
    VerlExperience,
    dataproto_to_rows,
    rows_to_dataproto,
)
from tqstream.adapters.verl.layout import Layout
from tqstream.adapters.verl.objects import decode_rows, encode_rows, pack, unpack

_names = itertools.count()


def round_trip(client: tqstream.Client, dp: DataProto, **read: Any) -> DataProto:
    """One put of ``dp``'s rows, a get of them by key, converted back."""
    partition = f"any-{next(_names)}"
    rows = dataproto_to_rows(dp)
    meta = client.put(rows.data, partition, groups=rows.groups, versions_field=None)
    batch = client.get_by_keys(partition, meta.keys, rows.fields, **read)
    client.clear_partition(partition)
    return rows_to_dataproto(batch)


# --- any DataProto, as a property ----------------------------------------------------------------
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8,
           torch.bool, torch.complex64]  # fmt: skip
_NUMPY = st.sampled_from(["int32", "float64", "bool", ">i4", "uint16", "complex128", "float16"])


@st.composite
def any_dataprotos(draw: st.DrawFn) -> DataProto:
    n = draw(st.integers(0, 4))
    batch = None
    if draw(st.integers(0, 3)):
        tensors = {}
        for k in range(draw(st.integers(0, 3))):
            shape = (n, *draw(st.lists(st.integers(0, 3), max_size=2)))
            dtype = draw(st.sampled_from(_DTYPES))
            tensors[f"t{k}"] = (torch.randn(shape) * 100).to(dtype)
        batch = TensorDict(tensors, batch_size=[n])
    non_tensor: dict[str, np.ndarray] | None = None if not draw(st.integers(0, 5)) else {}
    if non_tensor is not None and (batch is not None or n):
        for k in range(draw(st.integers(0 if batch is not None else 1, 4))):
            kind = draw(st.sampled_from(["objects", "objects-2d", "str", "numeric", "datetime"]))
            if kind == "objects":
                arr = objects([draw(VALUES) for _ in range(n)])
            elif kind == "objects-2d":
                arr = np.empty((n, 2), dtype=object)
                for i, j in itertools.product(range(n), range(2)):
                    arr[i, j] = draw(VALUES)
            elif kind == "str":
                arr = np.array(draw(st.lists(st.text(max_size=4), min_size=n, max_size=n)), "<U4")
            elif kind == "datetime":
                arr = np.arange(n).astype("datetime64[s]")
            else:
                arr = draw(
                    hnp.arrays(np.dtype(draw(_NUMPY)), (n, *draw(st.sampled_from([(), (2,)]))))
                )
            non_tensor[f"n{k}"] = arr
    meta = draw(st.none() | st.dictionaries(st.text(max_size=4), VALUES, max_size=3))
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(dp=any_dataprotos())
def test_any_dataproto_comes_back_equal(client: tqstream.Client, dp: DataProto) -> None:
    assert_dataproto_equal(dp, round_trip(client, dp))
    if len(dp):  # padded reads (ragged fields padded + <field>_lengths) give the same
        assert_dataproto_equal(dp, round_trip(client, dp, padded=True))


# --- what verl makes -----------------------------------------------------------------------------
def agent_loop_output(n: int = 4) -> DataProto:
    """What verl 0.9.1's own ``AgentLoopWorker._postprocess`` makes of ``n`` padded agent-loop
    outputs with a GSM8K batch's non-tensor fields (NaN inside ``reward_extra_info`` dicts, a
    tuple inside ``extras``)."""
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopMetrics,
        AgentLoopWorker,
        _InternalAgentLoopOutput,
    )
    from verl.utils.model import compute_position_id_with_mask

    outputs = []
    for i in range(n):
        one = make_dataproto([[5 + i] * (i + 1)], [[7] * (2 * i + 1)], prompt_length=4,
                             response_length=8)  # fmt: skip
        b = one.batch
        outputs.append(
            _InternalAgentLoopOutput(
                prompt_ids=b["prompts"], response_ids=b["responses"], input_ids=b["input_ids"],
                position_ids=compute_position_id_with_mask(b["attention_mask"]),
                response_mask=b["response_mask"], attention_mask=b["attention_mask"],
                response_logprobs=b["rollout_log_probs"], reward_score=float(i % 2), num_turns=2,
                metrics=AgentLoopMetrics(generate_sequences=0.5),
                extra_fields={
                    "reward_extra_info": {"acc": math.nan if i == 3 else float(i % 2)},
                    "raw_prompt": [{"role": "user", "content": f"q{i}"}],
                    "turn_scores": [], "tool_rewards": [],
                    "extras": {"tool_calls": ("calculator", i)} if i % 2 else None,
                },
            )
        )  # fmt: skip
    non_tensor = {
        "data_source": objects(["openai/gsm8k"] * n),
        "reward_model": objects([{"ground_truth": str(i), "style": "rule"} for i in range(n)]),
        "index": objects(list(range(n))),
        "uid": uids(2, n - 2),
    }
    postprocess: Any = AgentLoopWorker._postprocess
    worker = SimpleNamespace(reward_loop_worker_handles=None)
    return postprocess(worker, outputs, input_non_tensor_batch=non_tensor)


def test_verls_agent_loop_output_comes_back_equal(client: tqstream.Client, partition: str) -> None:
    dp = agent_loop_output()
    assert isinstance(dp.non_tensor_batch["extras"][1]["tool_calls"], tuple)
    assert math.isnan(dp.non_tensor_batch["reward_extra_info"][3]["acc"])
    assert_dataproto_equal(dp, round_trip(client, dp))
    exp = VerlExperience(client, partition=partition, tasks=["actor"])
    exp.put_experience(dp, 0)
    batch = exp.get_experience(len(dp), 0, timeout=10)
    assert_dataproto_equal(dp, batch.data)
    batch.ack()
    assert client.stats(partition).partitions[partition].rows == 0


def test_multimodal_position_ids_and_other_input_ids_are_stored(
    client: tqstream.Client, partition: str
) -> None:
    """A rollout's position ids that are not the mask's cumsum (M-RoPE ``[B, 3, L]``) and input
    ids that are not prompts ⧺ responses are stored as they are, the rest still rebuilt."""
    dp = make_dataproto([[5, 6], [7]], [[8], [9, 10]], non_tensor={"uid": uids(2)})
    mrope = torch.arange(2 * 3 * 5).reshape(2, 3, 5)
    ids = dp.batch["input_ids"].clone()
    ids[0, 0] = 99
    dp = DataProto(
        batch=TensorDict({**dp.batch.to_dict(), "position_ids": mrope, "input_ids": ids}, [2]),
        non_tensor_batch=dp.non_tensor_batch,
    )
    rows = dataproto_to_rows(dp)
    assert {"position_ids", "input_ids"} <= set(rows.data) and "attention_mask" not in rows.data
    assert_dataproto_equal(dp, round_trip(client, dp))


def test_a_dataproto_without_rows_is_one_row_of_layout(client: tqstream.Client) -> None:
    for dp in (
        DataProto(meta_info={"info": "test_info"}),
        DataProto(batch=None, non_tensor_batch=None, meta_info={"step": (1, 2)}),
        DataProto(
            batch=TensorDict({"obs": torch.empty(0, 3, dtype=torch.float16)}, batch_size=[0]),
            non_tensor_batch={"labels": np.empty(0, object), "s": np.empty((0, 2), "<U3")},
        ),
    ):
        rows = dataproto_to_rows(dp)
        assert rows.fields == [LAYOUT_FIELD] and len(rows) == 1
        assert_dataproto_equal(dp, round_trip(client, dp))


def test_several_batch_dims_and_jagged_tensors(client: tqstream.Client) -> None:
    """What ``unfold_batch_dim`` leaves in a DataProto ([n, 2] batch), and jagged nested tensors
    (kept jagged, also when read padded)."""
    folded = DataProto(non_tensor_batch={"labels": np.array([["a", "b"], ["c", "d"]], object)})
    folded.batch = TensorDict({"obs": torch.arange(8).reshape(2, 2, 2)}, batch_size=[2, 2])
    assert_dataproto_equal(folded, round_trip(client, folded))
    rows = [torch.arange(k, dtype=torch.float32) for k in (1, 3, 0)]
    ragged = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    dp = DataProto(batch=TensorDict({"ragged": ragged, "x": torch.ones(3)}, batch_size=[3]))
    for read in ({}, {"padded": True}):
        back = round_trip(client, dp, **read)
        assert back.batch["ragged"].is_nested
        assert [t.tolist() for t in back.batch["ragged"].unbind()] == [r.tolist() for r in rows]


def test_rows_of_several_puts_widen_strings_as_concat(
    client: tqstream.Client, partition: str
) -> None:
    a = DataProto.from_dict({"obs": torch.ones(2)}, {"labels": np.array(["a", "b"])}, {"k": 1})
    b = DataProto.from_dict({"obs": torch.zeros(1)}, {"labels": np.array(["ccc"])}, {"k": 1})
    fields = []
    for dp in (a, b):
        rows = dataproto_to_rows(dp)
        client.put(rows.data, partition)
        fields = rows.fields
    batch = client.get(partition, fields, 3, "t", timeout=10)
    assert_dataproto_equal(DataProto.concat([a, b]), rows_to_dataproto(batch))


# --- the codec against bytes it did not write ----------------------------------------------------
def test_codec_round_trips_exact_values() -> None:
    values = [(1, (2,)), {1: "a", (2, 3): [None]}, math.nan, -0.0, 2**80, np.float32(0.5),
              np.str_(""), np.arange(3).astype(">i2"), objects([[1], {"a": 1}]),
              torch.tensor([1.5], dtype=torch.bfloat16), {1, "a"}, frozenset({2}), 1 + 2j,
              bytearray(b"\xc4x"), b"\xc5", np.datetime64("2024-01-01"), np.str_("a\x00"),
              np.bytes_(b"\x00"), np.str_("\ud800")]  # fmt: skip
    nt = encode_rows("v", values)
    back = decode_rows("v", nt.values(), nt.offsets())
    from verl_dataproto_recorder import same

    for want, got in zip(values, back, strict=True):
        assert same(want, got), (want, got)
    assert same(unpack(pack({"m": (1, math.inf)}, "meta_info"), "meta_info"), {"m": (1, math.inf)})


def test_bytearrays_inside_object_arrays_stay_bytearrays() -> None:
    # a row of a 2-D object array is itself an object array: msgpack would pack its bytearrays as
    # bytes without asking, so they are looked for there too
    grid = np.empty((2, 2), dtype=object)
    grid[:] = None
    grid[0, 0], grid[1, 1] = (1, bytearray(b"x")), bytearray(b"")
    nt = encode_rows("v", [*grid, objects([{"k": bytearray(b"\xc4")}])])
    back = decode_rows("v", nt.values(), nt.offsets())
    from verl_dataproto_recorder import same

    for want, got in zip([*grid, objects([{"k": bytearray(b"\xc4")}])], back, strict=True):
        assert same(want, got), (want, got)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (msgpack.packb(msgpack.ExtType(3, msgpack.packb(["|O", [1], b"\x00" * 8]))),
         "the numpy dtype '|O', which raw bytes cannot rebuild"),
        (msgpack.packb(msgpack.ExtType(3, msgpack.packb(["<i4", [3], b"\x00"]))),
         r"1 bytes for a int32 array of shape \[3\]"),
        (msgpack.packb(msgpack.ExtType(5, msgpack.packb(["nope", [1], b"\x00"]))),
         "unknown dtype name 'nope'"),
        (msgpack.packb(msgpack.ExtType(99, b"")), "the unknown extension type 99"),
        (b"\xc1", "cannot be decoded"),
        (msgpack.packb(1) + msgpack.packb(2), "cannot be decoded"),
    ],
    ids=["object-dtype", "short-array", "tensor-dtype", "unknown-ext", "reserved-byte", "extra"],
)  # fmt: skip
def test_bytes_from_a_peer_are_checked(data: bytes, match: str) -> None:
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with pytest.raises(tqstream.MalformedMessageError, match=match):
        decode_rows("f", values, torch.tensor([0, len(data)]))


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ([{"batch": "x"}], "field 'dataproto' does not hold verl row layouts"),  # one value
        ([msgpack.packb(b"\x01"), None], "field 'dataproto' is not a verl row layout"),
        ([1, None], "field 'dataproto' does not start with a verl row layout"),
        (
            [Layout([], [], {}).encode({}, first=True, folded={"labels": [6]}), None],
            r"field 'dataproto' is not a verl row layout \(ValueError\(\"folded\['labels'\] is not",
        ),
    ],
    ids=["one-value", "not-a-layout", "no-head", "bad-fold"],
)
def test_a_row_that_is_not_a_layout_is_refused(
    client: tqstream.Client, partition: str, row: list[Any], match: str
) -> None:
    data = b"".join(msgpack.packb(v, use_bin_type=True) for v in row)
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    client.put({LAYOUT_FIELD: [values]}, partition)
    batch = client.get(partition, [LAYOUT_FIELD], 1, "t", timeout=10)
    with pytest.raises(tqstream.SchemaError, match=match):
        rows_to_dataproto(batch)
