"""The controller's Prometheus endpoint, scraped over HTTP and parsed with prometheus-client's own
parser: embedded and as ``tqstream-launch`` processes, through puts, gets, acks, a parked get and
acquire, request errors, a SIGKILLed storage unit; every metric documented in
docs/observability.md."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import tqstream
from tqstream.client.budget import BudgetMember
from tqstream.launch.processes import ProcessCluster

DOCS = Path(__file__).parents[2] / "docs" / "observability.md"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scrape:
    """One scrape: ``value(name, **labels)`` of a sample, ``types`` of every family."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain")
            self.text = reply.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.types = {name: f.type for name, f in self.families.items()}

    def value(self, name: str, **labels: str) -> float:
        found = [
            s.value
            for f in self.families.values()
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, f"{name} {labels}: {len(found)} samples in\n{self.text}"
        return float(found[0])


def _until(what: Callable[[], bool], limit: float = 15.0) -> None:
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < limit, "condition not met in time"
        time.sleep(0.05)


def test_embedded_metrics_follow_the_data() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    client = tqstream.init(storage_units=2, metrics_port=port)
    try:
        client.create_partition("train", tasks=["actor", "critic"])
        for v in range(4):
            client.put({"x": torch.randn(8, 4)}, partition="train", version=v)
        batch = client.get("train", ["x"], batch_size=8, task="actor", current_version=5)
        batch.ack()  # 8 rows acked at version 5, generated under version 0: lag 5
        leased = client.get("train", ["x"], batch_size=4, task="critic")
        with pytest.raises(tqstream.UnknownPartitionError):
            client.get("nope", ["x"], batch_size=1, task="actor", timeout=0)

        m = Scrape(url)
        st = client.stats()
        p = st.partitions["train"]
        assert m.value("tqstream_rows_produced_total", partition="train") == p.produced == 32
        assert m.value("tqstream_partition_rows", partition="train") == p.rows == 32
        assert m.value("tqstream_field_rows_written", partition="train", field="x") == 32
        assert m.value("tqstream_rows_consumed_total", partition="train", task="actor") == 8
        assert m.value("tqstream_task_rows_acked", partition="train", task="actor") == 8
        assert m.value("tqstream_task_rows_available", partition="train", task="actor") == 24
        assert m.value("tqstream_task_rows_leased", partition="train", task="critic") == 4
        # the lag histogram: 8 rows at lag 5, so the buckets up to 4 are empty, 6 and up hold 8
        lag = {"partition": "train", "task": "actor"}
        assert m.value("tqstream_consumed_version_lag_bucket", le="4.0", **lag) == 0
        assert m.value("tqstream_consumed_version_lag_bucket", le="6.0", **lag) == 8
        assert m.value("tqstream_consumed_version_lag_count", **lag) == 8
        assert m.value("tqstream_consumed_version_lag_sum", **lag) == 40
        for i, u in enumerate(st.units):
            labels = {"unit": str(i), "address": u.address}
            assert m.value("tqstream_unit_up", **labels) == 1
            assert m.value("tqstream_unit_bytes", **labels) == u.bytes > 0
            assert m.value("tqstream_unit_rows", **labels) == u.rows
        assert m.value("tqstream_request_duration_seconds_count", operation="get_meta") >= 2
        assert m.value("tqstream_request_duration_seconds_count", operation="ack") == 1
        assert 0 < m.value("tqstream_request_duration_seconds_sum", operation="ack") < 10
        err = {"operation": "get_meta", "error": "UnknownPartitionError"}
        assert m.value("tqstream_request_errors_total", **err) == 1
        assert m.types["tqstream_request_duration_seconds"] == "histogram"
        assert m.types["tqstream_rows_produced"] == "counter"
        assert m.types["tqstream_unit_bytes"] == "gauge"

        leased.ack()
        client.clear_partition("train")
        m = Scrape(url)
        assert all(m.value("tqstream_unit_bytes", unit=str(i)) == 0 for i in range(2))
    finally:
        client.close()
    with pytest.raises(urllib.error.URLError):  # closing the client frees the port
        urllib.request.urlopen(url, timeout=2)


def test_parked_requests_and_admission_state() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    client = tqstream.init(metrics_port=port)
    try:
        client.create_partition("train", fields=["x"], tasks=["actor"])
        adm = client.admission("capacity", name="rollout", max_concurrent=2, max_staleness=0,
                               consumer_batch_size=2)  # fmt: skip
        slots = adm.acquire(2, version=0)
        got: list[object] = []
        getter = threading.Thread(
            target=lambda: got.append(
                client.get("train", ["x"], batch_size=2, task="actor", timeout=30)
            )
        )
        waiter = threading.Thread(target=lambda: got.append(adm.acquire(1, timeout=30)))
        getter.start()
        waiter.start()

        def parked() -> bool:
            m = Scrape(url)
            return (
                m.value("tqstream_parked_gets", partition="train") == 1
                and m.value("tqstream_parked_acquires", admission="rollout") == 1
            )

        _until(parked)
        m = Scrape(url)
        labels = {"admission": "rollout", "style": "capacity"}
        assert m.value("tqstream_admission_running", **labels) == 2
        assert m.value("tqstream_admission_granted_total", **labels) == 2
        assert m.value("tqstream_admission_capacity", **labels) == 0
        assert m.value("tqstream_admission_max_concurrent", **labels) == 2

        time.sleep(0.3)
        client.put({"x": torch.ones(2)}, partition="train", version=0)
        adm.release(slots[:1], "rejected")  # a slot back: the parked acquire takes it
        getter.join(10)
        waiter.join(10)
        assert not getter.is_alive() and not waiter.is_alive() and len(got) == 2
        m = Scrape(url)
        assert m.value("tqstream_parked_gets", partition="train") == 0
        assert "tqstream_parked_acquires{" not in m.text  # none waits: no sample
        assert m.value("tqstream_admission_rejected_total", **labels) == 1
        assert m.value("tqstream_request_duration_seconds_count", operation="get_meta") == 1
        # the parked get's latency includes its wait
        assert m.value("tqstream_request_duration_seconds_sum", operation="get_meta") >= 0.3
    finally:
        client.close()


def test_processes_count_a_killed_unit() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with ProcessCluster(2, metrics_port=port) as cluster:
        assert cluster.metrics_address == url
        client = tqstream.connect(cluster.address)
        try:
            client.create_partition("train", tasks=["actor"])
            for _ in range(4):  # direct puts go to the units in turn: rows on both
                client.put({"x": torch.randn(4, 2)}, partition="train")
            m = Scrape(url)
            assert m.value("tqstream_connected_peers") == 3  # this client and the 2 units
            # the units register in the order they come up: find the index of the one killed
            address = cluster.unit_addresses[1]
            unit = m.families["tqstream_unit_up"]
            index = next(s.labels["unit"] for s in unit.samples if s.labels["address"] == address)
            assert m.value("tqstream_unit_up", unit=index) == 1
            held = m.value("tqstream_unit_rows", unit=index)
            assert held > 0

            cluster.procs[2].send_signal(signal.SIGKILL)  # storage unit process 1
            _until(lambda: Scrape(url).value("tqstream_unit_up", unit=index) == 0)
            # the unit's own connection to the controller is seen gone on its own
            _until(lambda: Scrape(url).value("tqstream_connected_peers") == 2)
            m = Scrape(url)
            assert m.value("tqstream_rows_lost_total", partition="train") == held
            assert m.value("tqstream_task_rows_lost_total", partition="train", task="actor") == held
            assert m.value("tqstream_unit_bytes", unit=index) == 0

            cluster.restart_unit(1)
            _until(lambda: Scrape(url).value("tqstream_unit_up", unit=index) == 1)
        finally:
            client.close()
        _until(lambda: Scrape(url).value("tqstream_connected_peers") == 2)  # the units


def test_metrics_port_in_use_fails_at_start_and_frees_the_rest() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        with pytest.raises(
            OSError, match=rf"cannot serve metrics at .*:{port}/metrics.*--metrics-port"
        ):
            tqstream.init(metrics_port=port)
        cmd = [sys.executable, "-m", "tqstream.launch.processes", "--metrics-port", str(port)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert "did not start" in out.stderr or "cannot serve metrics" in out.stderr


def test_launcher_prints_the_metrics_address() -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "tqstream.launch.processes", "--metrics-port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"metrics at http://127.0.0.1:{port}/metrics" in line, line
        assert (
            Scrape(f"http://127.0.0.1:{port}/metrics").value("tqstream_connected_peers") == 1
        )  # the unit
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_without_metrics_port_nothing_listens() -> None:
    code = (
        "import sys, tqstream\n"
        "c = tqstream.init()\n"
        "c.create_partition('p')\n"
        "assert 'prometheus_client' not in sys.modules, 'imported without metrics_port'\n"
        "c.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_metric_is_documented() -> None:
    """docs/observability.md names every family a scrape returns, and nothing else."""
    port = _free_port()
    client = tqstream.init(storage_units=2, metrics_port=port)
    try:
        client.create_partition("train", tasks=["actor"])
        client.put({"x": torch.randn(2, 2)}, partition="train", version=0)
        client.get("train", ["x"], batch_size=2, task="actor", current_version=0).ack()
        for style, config in (
            ("capacity", {"max_concurrent": 2, "max_staleness": 1, "consumer_batch_size": 2}),
            ("slots", {"max_pending_slots": 2, "max_version_slots": 2, "consumer_batch_size": 2}),
            ("per_version", {"max_per_version": 2, "update_interval": 1}),
        ):
            client.admission(style, name=style, **config)
        member = BudgetMember(client, "budget", 2, 2, 1)  # an AReaL StalenessManager's budget
        m = Scrape(f"http://127.0.0.1:{port}/metrics")
        assert member.state()["members"] == 1  # still a member when scraped
    finally:
        client.close()
    exported = set()
    for name, kind in m.types.items():
        exported.add(f"{name}_total" if kind == "counter" else name)
    documented = set(re.findall(r"^\| `(tqstream_[a-z_]+)`", DOCS.read_text(), re.M))
    assert exported - documented == set(), "exported but not in docs/observability.md"
    assert documented - exported == set(), "in docs/observability.md but not exported"
