"""tqstream.compat.transfer_queue: what tqstream adds to TransferQueue's API and what it refuses.

TransferQueue's own tests (test_transferqueue_suite.py) check the API's behaviour; these check
the errors, the leases, the configuration and the deployments, on the embedded deployment unless
a test says otherwise (its cluster runs in this process; child processes attach to it).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tqstream
import tqstream.compat.transfer_queue as tq
from tqstream.compat.transfer_queue import config as tq_config
from tqstream.compat.transfer_queue.errors import ForeignMetadataError, NotInitializedError

EMBEDDED = {"tqstream": {"deployment": "embedded"}}


@pytest.fixture
def session() -> Iterator[Any]:
    tq.init(EMBEDDED)
    yield tq.get_client()
    tq.close()


def rows(n: int, start: int = 0) -> TensorDict:
    return TensorDict(
        {
            "input_ids": torch.arange(start, start + 3 * n).reshape(n, 3),
            "reward": torch.arange(n, dtype=torch.float32),
            "text": NonTensorStack(*[f"t{start + i}" for i in range(n)]),
        },
        batch_size=[n],
    )


def test_init_returns_the_merged_config_and_attaching_returns_the_argument() -> None:
    conf = tq.init({**EMBEDDED, "backend": {"SimpleStorage": {"num_data_storage_units": 3}}})
    try:
        assert conf.backend.SimpleStorage.num_data_storage_units == 3
        assert conf.controller.polling_mode is False
        assert len(tq.get_client().client.stats().units) == 3
        assert tq.init({"ignored": True}) == {"ignored": True}  # already attached
    finally:
        tq.close()


def test_calls_before_init_say_so() -> None:
    with pytest.raises(NotInitializedError, match=r"call transfer_queue\.init"):
        tq.kv_list()
    with pytest.raises(RuntimeError, match="not initialized"):
        tq.save_checkpoint("/tmp/nowhere")


def test_missing_keys_and_partitions_are_value_errors(session: Any) -> None:
    tq.kv_batch_put(keys=["a"], partition_id="p", fields=rows(1))
    for keys, partition in ((["a", "b"], "p"), (["a"], "no-such-partition")):
        with pytest.raises(ValueError, match="not found") as info:
            tq.kv_batch_get(keys=keys, partition_id=partition)
        assert isinstance(info.value, tqstream.UnknownKeyError | tqstream.TQStreamError)
    tq.kv_batch_put(keys=["c"], partition_id="p", tags=[{"only": "tags"}])
    with pytest.raises(ValueError, match="not written for 1 of the requested rows"):
        tq.kv_batch_get(keys=["a", "c"], partition_id="p", select_fields=["input_ids"])
    with pytest.raises(ValueError, match=r"select_fields.*not found"):
        tq.kv_batch_get_by_meta(tq.kv_batch_put(keys=["a"], partition_id="p", tags=[{}]), "nope")
    assert tq.kv_list("no-such-partition") == {}
    tq.kv_clear(keys=["nope"], partition_id="no-such-partition")  # harmless


def test_bad_tags_and_shapes_are_refused_and_nothing_is_stored(session: Any) -> None:
    tq.kv_batch_put(keys=["a"], partition_id="p", fields=rows(1), tags=[{"n": 1}])
    before = tq.kv_list()
    with pytest.raises(ValueError, match="tag 'nested' of row 0 is a dict"):
        tq.kv_batch_put(keys=["b"], partition_id="p", fields=rows(1), tags=[{"nested": {"x": 1}}])
    with pytest.raises(ValueError, match="is a Tensor"):
        tq.kv_put(key="a", partition_id="p", tag={"t": torch.ones(2)})
    with pytest.raises(ValueError, match="`keys` has 2 entries but `fields` has batch_size 1"):
        tq.kv_batch_put(keys=["b", "c"], partition_id="p", fields=rows(1))
    with pytest.raises(ValueError, match="`keys` has 1 entries but `tags` has 2"):
        tq.kv_batch_put(keys=["b"], partition_id="p", tags=[{}, {}])
    with pytest.raises(ValueError, match="needs fields or tags"):
        tq.kv_batch_put(keys=["b"], partition_id="p")
    with pytest.raises(tqstream.SchemaError, match="stored as ragged int64"):
        floats = TensorDict({"input_ids": torch.ones(1, 3)}, batch_size=[1])
        tq.kv_batch_put(keys=["b"], partition_id="p", fields=floats)
    assert tq.kv_list() == before


def _schema(client: Any, partition: str, n: int) -> dict[str, Any]:
    meta = client.get_meta(["x"], n, partition, mode="force_fetch")
    return meta.field_schema["x"]


def test_is_nested_follows_the_shapes_put_as_transferqueue_reports_it(
    session: Any, tmp_path: Any
) -> None:
    """A regular field turns nested when rows of another shape arrive, and back when a clear
    leaves rows of one shape; a nested put is nested even of one shape; a checkpoint keeps it."""
    session.put(TensorDict({"x": torch.ones(2, 4)}, batch_size=[2]), partition_id="p")
    first = _schema(session, "p", 2)
    assert first["is_nested"] is False and first["shape"] == torch.Size([4])
    assert "per_sample_shapes" not in first
    slots = session.get_meta(["x"], 2, "p", mode="insert", task_name="alloc")
    session.put(TensorDict({"x": torch.ones(2, 6)}, batch_size=[2]), metadata=slots)
    mixed = _schema(session, "p", 4)
    assert mixed["is_nested"] is True and mixed["shape"] is None
    assert mixed["per_sample_shapes"] == [(4,), (4,), (6,), (6,)]
    ragged = torch.nested.nested_tensor([torch.ones(3), torch.ones(5)], layout=torch.jagged)
    tq.kv_batch_put(keys=["k0", "k1"], partition_id="q", fields=TensorDict({"x": ragged}, [2]))
    assert session.kv_retrieve_meta(["k0", "k1"], "q").field_schema["x"]["per_sample_shapes"] == [
        (3,), (5,)]  # fmt: skip
    uniform = torch.nested.nested_tensor([torch.ones(2), torch.ones(2)], layout=torch.jagged)
    session.put(TensorDict({"x": uniform}, batch_size=[2]), partition_id="r")
    assert _schema(session, "r", 2)["is_nested"] is True
    tq.save_checkpoint(tmp_path / "ckpt")
    everything = session.get_meta(["x"], 4, "p", mode="force_fetch")
    session.clear_samples(everything.select_samples([2, 3]))  # the rows of shape (6,)
    regular = _schema(session, "p", 2)
    assert regular["is_nested"] is False and regular["shape"] == torch.Size([4])
    for partition in ("p", "q", "r"):
        session.clear_partition(partition)
    tq.load_checkpoint(tmp_path / "ckpt")
    assert _schema(session, "p", 4)["per_sample_shapes"] == [(4,), (4,), (6,), (6,)]
    assert _schema(session, "r", 2)["is_nested"] is True


def test_a_shape_record_that_does_not_fit_the_put_is_refused(session: Any) -> None:
    client = session.client
    data = {"x": [torch.ones(2), torch.ones(3)]}
    for shapes, match in (
        ({"y": tqstream.RowShapes(False, (2,))}, "does not write"),
        ({"x": tqstream.RowShapes(True, None, [(2,)])}, "list 1 rows, the put has 2"),
        ({"x": tqstream.RowShapes(False)}, "give no shape"),
    ):
        with pytest.raises(tqstream.InvalidRequestError, match=match):
            client.put(data, "p", shapes=shapes)
    assert "p" not in client.stats().partitions


def test_metadata_of_another_cluster_is_refused(session: Any) -> None:
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=rows(2))
    meta = session.kv_retrieve_meta(["a", "b"], "p")
    tq.close()
    tq.init(EMBEDDED)  # another cluster: its row ids could name other rows
    client = tq.get_client()
    client.put(rows(2, start=10), partition_id="p")
    before = tq.kv_list()
    with pytest.raises(ForeignMetadataError, match="issued by another tqstream cluster"):
        client.put(rows(2), metadata=meta)
    with pytest.raises(ForeignMetadataError):
        client.get_data(meta)
    with pytest.raises(ForeignMetadataError):
        client.clear_samples(meta)
    assert tq.kv_list() == before
    # metadata a user builds names rows by global index: resolved at the controller
    own = tq.BatchMeta(global_indexes=[0, 1], partition_ids=["p", "p"],
                       field_schema={"input_ids": {}})  # fmt: skip
    assert client.get_data(own)["input_ids"].unbind()[1].tolist() == [13, 14, 15]


def test_fetch_polling_insert_and_status(session: Any) -> None:
    with pytest.raises(TimeoutError):
        session.get_meta(["input_ids"], 2, "p", mode="fetch", task_name="t")
    meta = session.get_meta(["input_ids", "reward"], 2, "p", mode="insert")
    assert meta.size == 2 and not meta.is_ready and meta.field_names == ["input_ids", "reward"]
    assert not session.check_production_status(["input_ids"], "p")
    session.put(rows(2).select("input_ids"), metadata=meta)
    assert session.check_production_status(["input_ids"], "p")
    assert not session.check_production_status(["input_ids", "reward"], "p")
    session.put(rows(2).select("reward"), metadata=meta)
    fetched = session.get_meta(["input_ids", "reward"], 2, "p", task_name="t")
    assert fetched.size == 2 and session.check_consumption_status("t", "p")
    data = session.get_data(fetched)
    assert data["reward"].tolist() == [0.0, 1.0]
    assert [r.tolist() for r in data["input_ids"].unbind()] == [[0, 1, 2], [3, 4, 5]]
    polling = tq.TransferQueueClient(session.client, polling_mode=True)
    try:
        assert polling.get_meta(["input_ids"], 1, "p", task_name="t").size == 0
        assert polling.get_meta(["input_ids"], 1, "no-partition", task_name="t").size == 0
    finally:
        polling.close()
    assert session.reset_consumption("p", "t") and not session.check_consumption_status("t", "p")
    assert session.get_partition_list() == ["p"]


def test_a_consumer_that_dies_before_reading_gives_its_rows_back(session: Any) -> None:
    """TransferQueue marks rows consumed when their metadata is fetched: a consumer that dies
    then loses them. Here they are leased to it, and come back when its process is gone."""
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=rows(2))
    code = (
        "import sys, time, tqstream.compat.transfer_queue as tq\n"
        "tq.init()\n"  # attaches through the address this process inherited
        "m = tq.get_client().get_meta(['input_ids'], 2, 'p', task_name='t')\n"
        "print(m.size, flush=True)\n"
        "time.sleep(300)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "2"
        assert session.check_consumption_status("t", "p")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        deadline = time.monotonic() + 10
        while session.check_consumption_status("t", "p") and time.monotonic() < deadline:
            time.sleep(0.05)
        again = session.get_meta(["input_ids"], 2, "p", task_name="t")
        assert sorted(session.kv_retrieve_keys(again.global_indexes, "p")) == ["a", "b"]
        session.get_data(again)  # read: acked for good
        assert session.check_consumption_status("t", "p")
    finally:
        child.kill()


def test_config_keys(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"unknown tqstream setting\(s\) \['nope'\]"):
        tq.init({"tqstream": {"nope": 1}})
    with pytest.raises(ValueError, match="other samplers are not supported"):
        tq.init({"controller": {"sampler": "GRPOGroupNSampler"}})
    # the module's own logger, not logging.getLogger(): importing AReaL (its adapter's tests run
    # earlier in the suite) swaps logging's root and manager, so a name lookup now finds another
    log = tq_config._log
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="tqstream.compat"):
            tq.init({**EMBEDDED, "backend": {"storage_backend": "MooncakeStore"},
                     "metrics": {"enabled": True}})  # fmt: skip
    finally:
        log.removeHandler(caplog.handler)
    try:
        assert "backend 'MooncakeStore' is not used" in caplog.text
        endpoint = tq.get_metrics_endpoint()
        assert endpoint is not None and endpoint.startswith("127.0.0.1:")
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as page:
            assert b"tqstream_" in page.read()
    finally:
        tq.close()
    assert tq.init(EMBEDDED) is not None and tq.get_metrics_endpoint() is None
    tq.close()


def test_data_parser_runs_before_the_put(session: Any) -> None:
    def parse(batch: dict[str, Any]) -> None:
        batch["text"][:] = [t.upper() for t in batch["text"]]

    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=rows(2), data_parser=parse)
    assert tq.kv_batch_get(keys=["b"], partition_id="p")["text"] == ["T1"]


def test_a_child_process_attaches_with_a_bare_init(session: Any) -> None:
    tq.kv_put(key="a", partition_id="p", fields={"x": torch.tensor([1, 2])}, tag={"s": "x"})
    code = (
        "import torch, tqstream.compat.transfer_queue as tq\n"
        "tq.init()\n"
        "print(tq.kv_batch_get(keys='a', partition_id='p')['x'].unbind()[0].tolist())\n"
        "tq.kv_put(key='a', partition_id='p', tag={'t': 'y'})\n"
        "tq.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[1, 2]"
    assert tq.kv_list("p") == {"p": {"a": {"s": "x", "t": "y"}}}  # the child's close kept it


def test_staleness_windows_and_admission_through_extra_keywords(session: Any) -> None:
    tq.kv_batch_put(keys=["old"], partition_id="p", fields=rows(1), version=1)
    tq.kv_batch_put(keys=["new"], partition_id="p", fields=rows(1, start=5), version=3)
    session.put(rows(1, start=9), partition_id="p", version=4)
    meta = session.get_meta(["input_ids"], 2, "p", task_name="t", current_version=4,
                            max_staleness=1, on_stale="drop")  # fmt: skip
    served = session.kv_retrieve_keys(meta.global_indexes, "p")
    assert "new" in served and "old" not in served
    assert "old" not in tq.kv_list("p")["p"]  # out of the window: evicted, and counted
    assert session.client.stats("p").partitions["p"].stale_dropped == 1
    gate = session.admission("capacity", max_concurrent=2, max_staleness=0, consumer_batch_size=1)
    assert len(gate.try_acquire(3, version=0)) == 1  # AReaL's bound, kept at the controller


def test_fetched_metadata_pickles_small_and_is_read_and_acked_in_another_process(
    session: Any, tmp_path: Any
) -> None:
    """verl hands BatchMeta to workers through Ray (pickled): it carries where each row is and
    the lease, never data; the worker that reads the data acks the lease."""
    tq.kv_batch_put(keys=[f"k{i}" for i in range(64)], partition_id="p",
                    fields=TensorDict({"x": torch.zeros(64, 4096)}, batch_size=[64]))  # fmt: skip
    meta = session.get_meta(["x"], 64, "p", task_name="t")
    blob = pickle.dumps(meta)
    assert len(blob) < 16_000  # 1 MiB of data, metadata only
    path = tmp_path / "meta.pkl"
    path.write_bytes(blob)
    code = (
        "import pickle, sys, tqstream.compat.transfer_queue as tq\n"
        "tq.init()\n"
        f"meta = pickle.loads(open({str(path)!r}, 'rb').read())\n"
        "print(tuple(tq.get_client().get_data(meta)['x'].values().shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "(262144,)"
    task = session.client.stats("p").partitions["p"].tasks["t"]
    assert (task.acked, task.leased) == (64, 0)  # the reader acked the lease it got with the meta


BESIDE_TRANSFERQUEUE = """
import logging, torch, ray, transfer_queue as real
import tqstream.compat.transfer_queue as tq
from tqstream.compat.transfer_queue.errors import ForeignControllerError
# TransferQueue's storage units take a CPU each
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
         logging_level=logging.ERROR)
real.init({"controller": {"polling_mode": True}})
try:
    tq.init({})
except ForeignControllerError as exc:
    print("refused:", exc)
tq.init({"tqstream": {"deployment": "embedded"}})
tq.kv_put(key="a", partition_id="p", fields={"x": torch.tensor([1, 2])})
real.kv_put(key="a", partition_id="p", fields={"x": torch.tensor([3, 4])})
print("tqstream:", tq.kv_batch_get(keys="a", partition_id="p")["x"].unbind()[0].tolist())
print("transfer_queue:", real.kv_batch_get(keys="a", partition_id="p")["x"].unbind()[0].tolist())
tq.close()
real.close()
ray.shutdown()
"""


@pytest.mark.timeout(300)
def test_beside_transferqueue_in_one_ray_job_the_name_clash_is_named_and_embedded_works() -> None:
    """TransferQueue's own controller holds the actor name the layer's processes look up: a bare
    or Ray init says so (it would attach to nothing), an embedded one runs beside it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQSTREAM_TRANSFER_QUEUE")}
    out = subprocess.run([sys.executable, "-c", BESIDE_TRANSFERQUEUE], capture_output=True,
                         text=True, timeout=280, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: Ray namespace 'transfer_queue' already holds an actor")
    assert "deployment': 'embedded'" in lines[0]
    assert lines[1:] == ["tqstream: [1, 2]", "transfer_queue: [3, 4]"]
