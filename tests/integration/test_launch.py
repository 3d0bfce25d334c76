"""``tqstream-launch`` as a user runs it: address line, readiness, clean shutdown, no orphans."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import tqstream
from tqstream.config import cluster_settings


def _launch(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tqstream.launch.processes", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    m = re.search(r"tcp://[\d.]+:\d+", line)
    assert m, f"no address in {line!r}"
    return proc, m.group(0)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split()[2] != "Z"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_help_documents_every_flag() -> None:
    """A flag per cluster setting (generated from the configuration dataclasses, with their
    docstrings as help) and the launcher's own."""
    out = subprocess.run(
        [sys.executable, "-m", "tqstream.launch.processes", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for setting in cluster_settings().values():
        assert setting.flag in out and setting.env in out
    for flag in ("--storage-units", "--storage-max-bytes", "--storage-timeout", "--insecure"):
        assert flag in out
    assert "Seconds a leased batch stays leased" in " ".join(out.split())


def test_flags_reach_the_servers() -> None:
    """Flags (and a variable for a flag not given) set the cluster's settings in the children."""
    env = {**os.environ, "TQSTREAM_MAX_ROWS": "3"}
    flags = ["--storage-units", "2", "--storage-max-bytes", "123456", "--replicas", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tqstream.launch.processes", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "controller + 2 storage units" in line, line
        address = re.search(r"tcp://[\d.]+:\d+", line).group(0)  # type: ignore[union-attr]
        with tqstream.connect(address) as client:
            assert [u.max_bytes for u in client.stats().units] == [123456, 123456]
            client.put({"x": torch.ones(2)}, "p")
            assert client.stats().partitions["p"].replicas == 2
            with pytest.raises(tqstream.CapacityError, match="max_rows=3"):
                client.put({"x": torch.ones(2)}, "p")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_launch_serves_and_shuts_down_cleanly(sig: signal.Signals) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, address = _launch("--storage-units", "2", "--port", str(port))
    try:
        assert address == f"tcp://127.0.0.1:{port}"
        children = _children(proc.pid)
        assert len(children) == 3
        with tqstream.connect(address) as client:
            client.put({"x": torch.arange(4)}, "p")
            assert client.get("p", "x", 4, "t").data["x"].tolist() == [0, 1, 2, 3]
            assert len(client.stats().units) == 2
        proc.send_signal(sig)
        assert proc.wait(15) == 0
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(c) for c in children), "orphan processes"
        assert _port_free(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_planned_stop_is_logged_as_a_shutdown_not_a_loss() -> None:
    proc, address = _launch("--storage-units", "2")
    try:
        with tqstream.connect(address) as client:
            client.put({"x": torch.arange(64)}, "p")  # rows on both units
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert "is lost" not in err and "WARNING" not in err, err
        stopped = re.findall(r"storage unit (\d) at \S+ stopped \(it was shut down\)", err)
        assert sorted(stopped) == ["0", "1"], err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_connecting_to_a_storage_unit_names_the_controller() -> None:
    proc, address = _launch("--storage-units", "1")
    try:
        with tqstream.connect(address) as client:
            unit = client.stats().units[0].address
        with pytest.raises(tqstream.ConnectError) as info:
            tqstream.connect(unit)
        assert str(info.value).startswith(
            f"{unit} is a storage unit of the cluster at {address}, not a controller; connect to "
            f"the controller's address"
        )
    finally:
        proc.kill()
        proc.wait()


def test_children_exit_when_launcher_is_killed() -> None:
    proc, _ = _launch("--storage-units", "1")
    children = _children(proc.pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(c) for c in children)


def test_launcher_exits_when_the_controller_dies() -> None:
    proc, _ = _launch("--storage-units", "1")
    try:
        out = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "tqstream.launch.worker controller"],
            capture_output=True,
            text=True,
        )
        os.kill(int(out.stdout.split()[0]), signal.SIGKILL)
        assert proc.wait(15) == 1
        assert "exited" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_flag_value() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tqstream.launch.processes", "--storage-units", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert "storage_units must be at least 1, got 0 (tqstream-launch --storage-units" in out.stderr


def test_a_server_process_keeps_its_start_up_heap_out_of_full_collections() -> None:
    """What a unit's process holds once started (torch's objects, ~170k) is frozen: a full
    collection afterwards scans only what was made since, not the whole heap again."""
    code = (
        "import gc; from tqstream.storage.service import StorageService; "
        "from tqstream.launch.worker import settle_heap; "
        "before = len(gc.get_objects()); settle_heap(); "
        "print(before, len(gc.get_objects()), gc.get_freeze_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, frozen = map(int, out.stdout.split()[-3:])
    assert before > 50_000 and frozen > 50_000, out.stdout
    assert after < 1_000, out.stdout  # what a full collection still has to scan


@pytest.mark.parametrize("env", [None, "2"])
def test_a_storage_unit_uses_one_torch_thread_unless_told(env: str | None) -> None:
    """A unit's process runs torch with one intra-op thread (its copies serve many clients'
    requests; spinning OpenMP workers would take their cores) unless OMP_NUM_THREADS is set."""
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if env is not None:
        environ["OMP_NUM_THREADS"] = env
    code = (
        "import torch; from tqstream.launch.worker import unit_threads; "
        "before = torch.get_num_threads(); unit_threads(); print(before, torch.get_num_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    before, after = map(int, out.stdout.split()[-2:])
    assert after == (1 if env is None else before)
