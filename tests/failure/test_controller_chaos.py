"""The controller SIGKILLed every 10-20 s for three minutes under load: 8 producer processes with
rollouts in flight and 8 consumer processes of two tasks, through ``tqstream-launch``'s cluster
(which restarts the controller on its journal; one and two replicas) and through the Ray
deployment (Ray restarts the controller actor). Every row a put returned for is read exactly
once by each task, no row holds another's bytes, the counters add up and no client hangs."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tqstream
from tqstream.launch.processes import ProcessCluster

WORKER = Path(__file__).with_name("chaos_worker.py")
SECONDS = float(os.environ.get("TQSTREAM_CHAOS_SECONDS", "180"))
TASKS = ("actor", "critic")
LEASE = 10.0
# (a get whose client gave up while the controller was away may have leased rows: they come back
# at lease_timeout)


def _start(jobs: list[list[str]]) -> list[subprocess.Popen[str]]:
    """The client processes of ``jobs``, started together; once each has said READY."""
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), *a], stdout=subprocess.PIPE, text=True)
        for a in jobs
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return procs


def _result(proc: subprocess.Popen[str], limit: float) -> dict[str, list]:
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"client {proc.args[2:4]} hung") from None
    assert proc.returncode == 0, f"client {proc.args[2:4]} exited with {proc.returncode}"
    return json.loads(out.strip().splitlines()[-1])


def _chaos(address: str, kill: Callable[[], None], stop: str, seed: int) -> None:
    """Drive 16 clients at ``address`` for ``SECONDS`` while ``kill()`` (which returns once the
    controller's process is dead and another one is starting) runs every 10-20 s; then check
    that each task read every acked row once and the counters add up."""
    rng = random.Random(seed)
    with tqstream.connect(address) as c:
        c.create_partition("p", ["id", "tokens"], tasks=list(TASKS))
    consumers = _start([[address, "consume", TASKS[i % 2], stop] for i in range(8)])
    producers = _start([[address, "produce", str(i + 1), stop] for i in range(8)])
    kills = 0
    end = time.monotonic() + SECONDS
    while time.monotonic() < end:
        time.sleep(min(rng.uniform(10.0, 20.0), max(0.0, end - time.monotonic())))
        if time.monotonic() >= end:
            break
        kill()
        kills += 1
    Path(stop).touch()
    made = [_result(p, 180) for p in producers]
    read = [_result(p, 180) for p in consumers]
    errors = [e for r in made + read for e in r["errors"]]
    assert not errors, errors[:5]
    put = [row for r in made for row in r["put"]]
    assert len(put) == len(set(put)) and len(put) > 1000
    with tqstream.connect(address) as c:
        for i, task in enumerate(TASKS):
            ids = [row for r in read[i::2] for row in r["read"]]
            quiet_until = time.monotonic() + LEASE + 5.0
            while time.monotonic() < quiet_until:  # what the consumers left, leases expiring
                left = c.stats("p").partitions["p"].tasks[task]
                if not left.available:
                    if not left.leased:
                        break
                    time.sleep(0.2)
                    continue
                batch = c.get("p", ["id"], min(256, left.available), task, timeout=5)
                ids += batch.data["id"].view(-1).tolist()
                batch.ack()
            assert len(ids) == len(set(ids)), f"{task}: rows read twice"
            assert set(ids) == set(put), (
                f"{task}: {len(set(put) - set(ids))} acked rows never read, "
                f"{len(set(ids) - set(put))} read that no put returned for"
            )
        stats = c.stats("p").partitions["p"]
        assert stats.lost == 0
        assert stats.produced == len(put)
        for task in TASKS:
            t = stats.tasks[task]
            assert t.consumed + t.lost + t.stale_dropped == stats.produced
    assert kills >= SECONDS // 20


@pytest.mark.timeout(SECONDS + 240)  # the kills, then the clients' last reads and the checks
@pytest.mark.parametrize("replicas", [1, 2])
def test_every_acked_row_is_read_once_by_each_task_while_the_controller_dies(
    tmp_path: Path, replicas: int
) -> None:
    journal = str(tmp_path / "journal")
    with ProcessCluster(
        2, durability="batched", journal=journal, replicas=replicas, lease_timeout=LEASE
    ) as cluster:

        def kill() -> None:
            cluster.procs[0].send_signal(signal.SIGKILL)
            cluster.procs[0].wait()
            cluster.restart_controller()

        _chaos(cluster.address, kill, str(tmp_path / "STOP"), replicas)


@pytest.mark.timeout(SECONDS + 300)  # Ray's start, the kills, the clients' last reads, the checks
def test_the_same_when_ray_restarts_the_controller_actor(tmp_path: Path) -> None:
    """The Ray deployment, two replicas: each kill is the controller actor's process SIGKILLed
    (as the OOM killer would); Ray starts it again at its port, on its journal."""
    ray = pytest.importorskip("ray")
    import tqstream.ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    journal = str(tmp_path / "journal")
    try:
        settings: dict[str, Any] = {
            "durability": "batched",
            "journal": journal,
            "lease_timeout": LEASE,
        }
        with tqstream.ray.launch(2, name="chaos", num_cpus=0, replicas=2, **settings) as cluster:
            controller = cluster.controller

            def kill() -> None:
                pid = ray.get(controller.pid.remote(), timeout=60)
                os.kill(pid, signal.SIGKILL)
                _restarted(ray, controller, pid)

            _chaos(cluster.address, kill, str(tmp_path / "STOP"), 3)
    finally:
        if started:
            ray.shutdown()


def _restarted(ray: Any, actor: Any, pid: int) -> None:
    """Wait until Ray serves ``actor`` from a process other than ``pid``."""
    limit = time.monotonic() + 60.0
    while time.monotonic() < limit:
        try:
            if ray.get(actor.pid.remote(), timeout=10) != pid:
                return
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"Ray did not restart the controller actor (process {pid}) in 60 s")
