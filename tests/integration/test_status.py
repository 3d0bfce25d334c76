"""``tqstream status`` against a real multi-process cluster: its JSON equals ``client.stats()``,
JSON Lines follow a producer, the live view draws and refreshes in a real terminal (tmux), and a
controller that cannot be reached or dies ends it with exit status 1 and one line, no traceback."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

import tqstream
from tqstream.cli import main
from tqstream.launch.processes import ProcessCluster
from tqstream.types import Stats

PART = "status-train"
STATUS = [sys.executable, "-m", "tqstream.cli", "status"]


def _put(client: tqstream.Client, partition: str, n: int, version: int = 0) -> None:
    data = {"input_ids": [torch.arange(i % 5 + 1) for i in range(n)], "rewards": torch.ones(n)}
    client.put(data, partition, version=version)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[ProcessCluster, tqstream.Client]]:
    """Two storage units; 24 rows of which "actor" acked 8 and leases 4, "critic" acked 4."""
    with ProcessCluster(storage_units=2) as pc, tqstream.connect(pc.address) as client:
        client.create_partition(PART, ["input_ids", "rewards"], tasks=["actor", "critic"])
        client.admission("capacity", name="rollout", max_concurrent=4, max_staleness=1,
                         consumer_batch_size=4)  # fmt: skip
        for v in range(3):
            _put(client, PART, 8, version=v)
        client.get(PART, ["input_ids"], 8, "actor", timeout=10, current_version=2).ack()
        client.get(PART, ["input_ids"], 4, "actor", timeout=10)  # leased, not acked
        client.get(PART, ["rewards"], 4, "critic", timeout=10, current_version=2).ack()
        yield pc, client


def _status(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The command with its output to pipes (no terminal, and no COLUMNS: its default width)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([*STATUS, address, *args], capture_output=True, text=True, timeout=60,
                          env=env)  # fmt: skip


def test_json_once_is_the_stats_with_rates(cluster: tuple[ProcessCluster, tqstream.Client]) -> None:
    pc, client = cluster
    before = time.time()
    out = _status(pc.address, "--json", "--once", "--interval", "0.3")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["address"] == pc.address and before < snap["time"] <= time.time()
    # the Stats fields sit at the top level: the object decodes as the Stats it was made from
    decoded, now = msgspec.json.decode(out.stdout, type=Stats), client.stats()
    assert 0 < decoded.uptime <= now.uptime  # the cluster's, not the command's
    assert msgspec.structs.replace(decoded, uptime=now.uptime) == now
    part = snap["partitions"][PART]
    actor = part["tasks"]["actor"]  # the 4 rows both tasks acked are freed and leave "acked"
    assert (actor["available"], actor["leased"], actor["acked"], part["freed"]) == (12, 4, 4, 4)
    assert sorted(u["address"] for u in snap["units"]) == sorted(pc.unit_addresses)
    assert snap["admissions"]["rollout"]["style"] == "capacity"
    rates = snap["rates"]
    assert 0.25 < rates["seconds"] < 5
    assert rates["partitions"][PART]["put_rows_per_s"] == 0.0  # nothing put in between
    assert rates["partitions"][PART]["tasks"]["critic"]["consume_rows_per_s"] == 0.0


def test_status_does_not_load_torch(cluster: tuple[ProcessCluster, tqstream.Client]) -> None:
    """A status command talks to the controller only: the data client (torch, tensordict) stays
    unloaded, so it answers in a fraction of a second instead of several."""
    pc, _ = cluster
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *STATUS[1:], pc.address, "--once", "--interval", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert not {"torch", "tensordict", "numpy"} & loaded
    assert "cluster up 0:0" in out.stdout


def test_a_storage_unit_address_is_refused(
    cluster: tuple[ProcessCluster, tqstream.Client],
) -> None:
    pc, _ = cluster
    out = _status(pc.unit_addresses[0], "--once", "--interval", "0")
    assert out.returncode == 1
    assert f"is a storage unit of the cluster at {pc.address}, not a controller" in out.stderr


def test_json_lines_follow_a_producer(cluster: tuple[ProcessCluster, tqstream.Client]) -> None:
    pc, client = cluster
    stop = threading.Event()

    def produce() -> None:  # 4 rows every 0.1 s: about 40 rows/s
        while not stop.is_set():
            _put(client, "status-stream", 4)
            time.sleep(0.1)

    producer = threading.Thread(target=produce, name="status-test-producer")
    proc = subprocess.Popen([*STATUS, pc.address, "--json", "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline()]  # the first sample, once the command is up
        producer.start()
        # six samples (3 s), or more time on a loaded machine, where a sample can come late
        deadline = time.monotonic() + 20.0
        while len(lines) < 6 and time.monotonic() < deadline and (line := proc.stdout.readline()):
            lines.append(line)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
    finally:
        stop.set()
        if producer.is_alive():
            producer.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and err == "", err
    snaps = [json.loads(line) for line in [*lines, *rest.splitlines()] if line.strip()]
    assert len(snaps) >= 5
    assert snaps[0]["rates"]["seconds"] is None  # a rate needs two samples
    produced = [s["partitions"].get("status-stream", {}).get("produced", 0) for s in snaps]
    assert produced == sorted(produced) and produced[-1] > produced[0]
    puts = [s["rates"]["partitions"]["status-stream"]["put_rows_per_s"] for s in snaps[2:-1]]
    # about 40 rows/s; an interval with no put at all only when the machine starved the producer
    assert puts and all(0 <= r < 200 for r in puts) and max(puts) > 0, puts


def _default_sigint() -> None:
    """In the child: Ctrl-C (SIGINT) back to its default, which Python turns into
    KeyboardInterrupt. A test run started in the background (``cmd &`` in a script) has it
    ignored, and children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tmux(sock: Path, *args: str) -> str:
    env = {**os.environ, "TERM": "xterm-256color"}
    cmd = ["tmux", "-S", str(sock), "-f", os.devnull, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout


def _screen_until(sock: Path, pattern: str, timeout: float = 30) -> str:
    """The pane's text, captured until ``pattern`` is on it (or the timeout: the last one)."""
    deadline = time.monotonic() + timeout
    while True:
        screen = _tmux(sock, "capture-pane", "-p", "-t", "status")
        if re.search(pattern, screen) or time.monotonic() > deadline:
            return screen
        time.sleep(0.2)


@contextlib.contextmanager
def _terminal(address: str, tmp: Path) -> Iterator[Path]:
    """The live view of ``address`` in a 160x50 tmux terminal (on a tmux server of our own, not
    the user's), behind a shell that prints its exit status; yields the tmux server's socket. At
    the end the terminal is closed, and the command must be gone."""
    sock = tmp / "tmux"
    cmd = shlex.join(["env", "TERM=xterm-256color", *STATUS, address, "--interval", "0.5"])
    _tmux(sock, "new-session", "-d", "-s", "status", "-x", "160", "-y", "50",
          f'{cmd}; echo "exit status $?"; sleep 60')  # fmt: skip
    try:
        yield sock
    finally:
        _tmux(sock, "kill-server")  # the terminal goes away: SIGHUP to what runs in it
    deadline = time.monotonic() + 10
    while _commands(address) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _commands(address), "the status command outlived its terminal"


def _commands(address: str) -> list[int]:
    """The processes running ``tqstream.cli status address``."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:  # not a process, or it just exited
            continue
        if b"tqstream.cli" in args and address.encode() in args:
            pids.append(int(entry))
    return pids


@pytest.mark.skipif(shutil.which("tmux") is None, reason="the live view test needs tmux")
def test_live_view_in_a_terminal(
    cluster: tuple[ProcessCluster, tqstream.Client], tmp_path: Path
) -> None:
    pc, client = cluster
    with _terminal(pc.address, tmp_path) as sock:
        part = client.stats().partitions[PART]
        rows = rf"{PART}\s+{part.rows}\s+{part.produced}\s"  # rows held, produced
        screen = _screen_until(sock, rows)
        assert "tqstream status" in screen and pc.address in screen, screen
        assert re.search(rows, screen), screen
        for task in ("actor", "critic"):
            t = part.tasks[task]
            row = rf"{task} \(registered\)\s+{t.available}\s+{t.leased}\s+{t.acked}\s"
            assert re.search(row, screen), screen
        for address in pc.unit_addresses:
            assert re.search(rf"{re.escape(address)}\s+alive\s", screen), screen
        assert re.search(r"rollout\s+capacity", screen), screen

        _put(client, PART, 8, version=3)  # the view refreshes: the new rows show up
        rows = rf"{PART}\s+{part.rows + 8}\s+{part.produced + 8}\s"
        screen = _screen_until(sock, rows)
        print(screen)  # docs/observability.md shows it
        assert re.search(rows, screen), screen
        actor = re.search(r"actor \(registered\)\s+(\d+)", screen)
        assert actor is not None and int(actor.group(1)) == part.tasks["actor"].available + 8

        _tmux(sock, "send-keys", "-t", "status", "C-c")  # quiet, exit status 0, screen restored
        screen = _screen_until(sock, r"exit status \d+", timeout=10)
        assert screen.strip() == "exit status 0", screen


@pytest.mark.skipif(shutil.which("tmux") is None, reason="the live view test needs tmux")
def test_closing_the_terminal_ends_the_view(
    cluster: tuple[ProcessCluster, tqstream.Client], tmp_path: Path
) -> None:
    pc, _ = cluster
    with _terminal(pc.address, tmp_path) as sock:
        assert "storage units" in _screen_until(sock, "storage units")
        assert _commands(pc.address)  # _terminal checks it is gone after the terminal


def test_unreachable_controller_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    code = main(["status", address, "--once", "--connect-timeout", "1"])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 1 and elapsed < 4, elapsed
    assert err.count("\n") == 1 and err.startswith(
        f"tqstream status: cannot connect to the controller at {address}: "
    ), err


def _pty(columns: int = 160, rows: int = 50) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) of that size: the live view draws frames only to a
    terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    return master, slave


def _read_until(fd: int, pattern: str, timeout: float, seen: bytearray) -> bool:
    """Read ``fd`` into ``seen`` until ``pattern`` is in it; False at the timeout or its end."""
    deadline = time.monotonic() + timeout
    while pattern.encode() not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every process holding the terminal has exited
            return False
        if not chunk:
            return False
        seen += chunk
    return True


def test_a_controller_killed_while_watching_ends_it_with_exit_1() -> None:
    with ProcessCluster(storage_units=1) as pc:
        args = [pc.address, "--interval", "0.3", "--connect-timeout", "1"]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        json_lines = subprocess.Popen([*STATUS, *args, "--json"], **pipes)
        master, slave = _pty()
        env = {**os.environ, "TERM": "xterm-256color"}
        live = subprocess.Popen([*STATUS, *args], stdout=slave, stderr=subprocess.PIPE,
                                text=True, env=env)  # fmt: skip
        os.close(slave)
        screen = bytearray()
        try:
            assert json_lines.stdout is not None
            assert json.loads(json_lines.stdout.readline())["units"]  # it is watching
            assert _read_until(master, "storage units", 60, screen), screen  # and so is the view
            pc.procs[0].kill()  # the controller
            _read_until(master, "lost the controller", 30, screen)
            outs = [p.communicate(timeout=30) for p in (json_lines, live)]
        finally:
            os.close(master)
            for p in (json_lines, live):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for p, (_, err) in zip((json_lines, live), outs, strict=True):
        assert p.returncode == 1, err
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert err.startswith(f"tqstream status: lost the controller at {pc.address}: "), err
    assert b"lost the controller" in screen  # the view says so, above its last sample


def test_once_prints_the_tables_as_plain_text(
    cluster: tuple[ProcessCluster, tqstream.Client],
) -> None:
    pc, client = cluster
    out = _status(pc.address, "--once", "--interval", "0.2")
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout  # not a terminal: no colours, no cursor moves
    for title in ("partitions", "tasks", "storage units", "admissions"):
        assert re.search(rf"^{title}\s*$", out.stdout, re.M), out.stdout
    assert re.search(rf"{PART}\s+\d+\s+\d+\s+0\.0\s+input_ids,rewards \d+/\d+", out.stdout)
    critic = client.stats().partitions[PART].tasks["critic"]
    # available, leased, acked (0: its 4 rows were freed), consumed (the 4 it acked)
    row = rf"critic \(registered\)\s+{critic.available}\s+0\s+0\s+4\s"
    assert re.search(row, out.stdout), out.stdout
    assert all(a in out.stdout for a in pc.unit_addresses)


def test_an_empty_cluster_reads_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with tqstream.init() as client:
        assert main(["status", client.address, "--once", "--interval", "0"]) == 0
    out = capsys.readouterr().out
    assert "no partitions yet" in out and "no consumer tasks yet" in out
    assert "admissions: none" in out and re.search(r"0\s+tcp://\S+\s+alive", out), out
    assert "put/s" not in out  # no partitions table at all
