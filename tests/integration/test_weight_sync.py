"""Weight sync between real processes over gloo: a sender (this process, rank 0) and receiver
processes; bit-identical weights, metadata sent once, mismatches and dead or idle receivers as typed
errors, never a hang; the safetensors path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tqstream.errors import WeightMismatchError, WeightSyncError, WeightSyncTimeoutError
from tqstream.reference.weightsync import (
    TorchCollective,
    WeightHub,
    WeightMeta,
    WeightSender,
    WeightSubscription,
    load_weights,
    save_weights,
)

sys.path.insert(0, str(Path(__file__).parent))
from weight_worker import weights

WORKER = Path(__file__).with_name("weight_worker.py")


def spawn(port: int, rank: int, world: int, syncs: int, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(port), str(rank), str(world), str(syncs), *flags],
        stdout=subprocess.PIPE,
        text=True,
    )


def lines(proc: subprocess.Popen[str]) -> list[dict]:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return [json.loads(line) for line in out.splitlines()]


def test_receivers_get_bit_identical_weights_and_the_metadata_once() -> None:
    group = TorchCollective(0, 3, timeout=30.0)
    workers = [spawn(group.port, r, 3, 3) for r in (1, 2)]
    sender = WeightSender(group, bucket_bytes=2048)  # 3 tensors alone, 2 packed ranges
    stats = [sender.send(weights(v), version=v) for v in (1, 2, 3)]
    assert [s.header_bytes > 0 for s in stats] == [True, False, False]
    assert stats[0].nbytes == WeightMeta.of(weights(1)).total and stats[0].broadcasts == 5
    for w in workers:
        assert lines(w) == [{"version": v, "ok": True} for v in (1, 2, 3)]


def test_a_receiver_expecting_other_weights_fails_and_the_rest_go_on() -> None:
    group = TorchCollective(0, 3, timeout=30.0)
    good = spawn(group.port, 1, 3, 2)
    other = spawn(group.port, 2, 3, 2, "--expect-other")
    sender = WeightSender(group, bucket_bytes=1 << 12)
    for v in (1, 2):
        sender.send(weights(v), version=v)  # completes: the mismatched receiver still took part
    assert lines(good) == [{"version": 1, "ok": True}, {"version": 2, "ok": True}]
    message = (
        "rank 2: the weights of version {v} differ from this model's (expected vs sent: "
        "layers.0.mlp.bias: float32[47] vs float32[48]); nothing was loaded — the trainer and the "
        "rollout engine must hold the same architecture"
    )
    assert lines(other) == [
        {"error": "WeightMismatchError", "message": message.format(v=v)} for v in (1, 2)
    ]


def test_an_idle_receiver_times_the_sync_out() -> None:
    group = TorchCollective(0, 2, timeout=2.0)
    idle = spawn(group.port, 1, 2, 1, "--idle")
    try:
        # the group's 2 s bound the join too: the receiver must have started (imports take
        # longer than that on a busy machine) before rank 0 begins waiting for it
        assert idle.stdout is not None and json.loads(idle.stdout.readline()) == {"ready": True}
        group.join()
        assert json.loads(idle.stdout.readline()) == {"joined": True}
        t0 = time.monotonic()
        with pytest.raises(
            WeightSyncTimeoutError, match=r"did not complete within 2\.0s on rank 0"
        ):
            WeightSender(group).send(weights(1), version=1)
        assert time.monotonic() - t0 < 30
    finally:
        idle.kill()
        idle.wait()


def test_a_killed_receiver_fails_the_sync_promptly() -> None:
    group = TorchCollective(0, 2, timeout=20.0)
    idle = spawn(group.port, 1, 2, 1, "--idle")
    group.join()
    assert idle.stdout is not None and json.loads(idle.stdout.readline()) == {"ready": True}
    assert json.loads(idle.stdout.readline()) == {"joined": True}
    os.kill(idle.pid, signal.SIGKILL)
    idle.wait()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError):
        WeightSender(group).send(weights(1), version=1)
    assert time.monotonic() - t0 < 25


def test_group_arguments_are_checked() -> None:
    with pytest.raises(WeightSyncError, match="rank 3 is not in a group of 2"):
        TorchCollective(3, 2, port=1)
    with pytest.raises(WeightSyncError, match="need the port rank 0 listens on"):
        TorchCollective(1, 2)
    group = TorchCollective(0, 1)
    with pytest.raises(WeightSyncError, match="the sender is rank 0 of the group"):
        WeightSender(_Rank(group, 1))


class _Rank:
    def __init__(self, inner: TorchCollective, rank: int) -> None:
        self.rank, self.world_size, self.device = rank, inner.world_size, inner.device

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:  # pragma: no cover
        raise AssertionError

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:  # pragma: no cover
        raise AssertionError

    def close(self) -> None:  # pragma: no cover
        pass


def test_weights_through_disk(tmp_path: Path) -> None:
    path = save_weights(tmp_path / "policy.safetensors", weights(7), version=7)
    assert sorted(os.listdir(tmp_path)) == ["policy.safetensors"]  # no temporary file left
    version, got = load_weights(path, WeightMeta.of(weights(0)))
    assert version == 7 and list(got) == list(weights(7))
    assert all(torch.equal(got[k].float(), weights(7)[k].float()) for k in got)
    other = dict(weights(0))
    other["layers.0.mlp.bias"] = torch.zeros(47)
    with pytest.raises(WeightMismatchError, match=r"layers.0.mlp.bias: float32\[47\] vs float32"):
        load_weights(path, WeightMeta.of(other))
    tied = {"a": torch.ones(3)}
    tied["b"] = tied["a"]  # shared memory, as tied embeddings are
    version, got = load_weights(save_weights(tmp_path / "tied.safetensors", tied, 1))
    assert torch.equal(got["a"], got["b"])


def test_a_receiver_that_missed_the_metadata_loads_nothing() -> None:
    group = TorchCollective(0, 2, timeout=30.0)
    fresh = spawn(group.port, 1, 2, 2, "--fresh")
    sender = WeightSender(group, bucket_bytes=2048)
    for v in (1, 2):
        sender.send(weights(v), version=v)  # the second one without the header
    assert lines(fresh) == [
        {"version": 1, "ok": True},
        {
            "error": "WeightMismatchError",
            "message": "rank 1 received version 2's weights without their metadata (it joined "
            "after the first sync, or missed one): every receiver must take part in every sync "
            "from the first; restart the group",
        },
    ]


def test_ranks_out_of_step_are_told_so() -> None:
    group = TorchCollective(0, 2, timeout=30.0)
    worker = spawn(group.port, 1, 2, 1)
    group.broadcast(torch.arange(6, dtype=torch.int64))  # not a control record
    assert lines(worker) == [
        {
            "error": "WeightSyncError",
            "message": "rank 1 received 0x0 where a weight-sync control record starts; the "
            "group's ranks are out of step (a rank called something other than send/receive "
            "on this group)",
        }
    ]


def test_backend_and_bucket_arguments_are_checked() -> None:
    with pytest.raises(WeightSyncError, match="unknown backend 'mpi'; use 'gloo' or 'nccl'"):
        TorchCollective(0, 1, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(WeightSyncError, match="the nccl backend needs a CUDA device"):
            TorchCollective(0, 1, backend="nccl")
    with pytest.raises(WeightSyncError, match="bucket_bytes must be positive, got 0"):
        WeightSender(TorchCollective(0, 1), bucket_bytes=0)


def test_a_file_that_is_not_tqstreams_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(WeightMismatchError, match="is not a tqstream weights file"):
        load_weights(tmp_path / "other.safetensors")


# --- a hub: receivers that come and go ---


def hub_member(port: int, syncs: int, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(port), "hub", "-", str(syncs), *flags],
        stdout=subprocess.PIPE,
        text=True,
    )


def registered(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    return int(json.loads(proc.stdout.readline())["member"])


def test_a_hub_reaches_members_that_join_late_and_drops_one_that_died() -> None:
    hub = WeightHub(timeout=20.0, bucket_bytes=2048)
    first = [hub_member(hub.port, 4) for _ in range(2)]
    ids = [registered(p) for p in first]
    assert sorted(ids) == [0, 1]
    hub.wait_members(2)
    s1 = hub.send(weights(1), 1)
    assert (s1.receivers, s1.lost, s1.header_bytes > 0) == (2, (), True)
    late = hub_member(hub.port, 2)
    assert registered(late) == 2
    s2 = hub.send(weights(2), 2)  # the header again, for the new member only
    assert (s2.receivers, s2.lost, s2.header_bytes > 0) == (3, (), True)
    os.kill(first[0].pid, signal.SIGKILL)
    first[0].wait()
    t0 = time.monotonic()
    s3 = hub.send(weights(3), 3)
    assert time.monotonic() - t0 < 10  # a reset connection, not a timeout
    assert (s3.receivers, s3.lost, s3.header_bytes) == (2, (ids[0],), 0)
    assert hub.members == [ids[1], 2]
    assert hub.lost[ids[0]].startswith(
        f"member {ids[0]}: a weight-sync broadcast failed on rank 0 of 2: a peer went away mid-sync"
    )
    s4 = hub.send(weights(4), 4)
    assert (s4.receivers, s4.lost) == (1, (2,))  # the late one took its 2 syncs and left
    assert lines(first[1]) == [{"version": v, "ok": True} for v in (1, 2, 3, 4)]
    assert lines(late) == [{"version": v, "ok": True} for v in (2, 3)]
    hub.close()


def test_a_member_expecting_other_weights_fails_alone() -> None:
    hub = WeightHub(timeout=20.0)
    good, other = hub_member(hub.port, 1), hub_member(hub.port, 1, "--expect-other")
    registered(good), registered(other)
    hub.wait_members(2)
    stats = hub.send(weights(1), 1)
    assert (stats.receivers, stats.lost) == (2, ())  # it took part, then refused to load
    assert lines(good) == [{"version": 1, "ok": True}]
    [line] = lines(other)
    assert line["error"] == "WeightMismatchError"
    assert "layers.0.mlp.bias: float32[47] vs float32[48]" in line["message"]
    hub.close()


def test_a_subscription_stops_on_request_and_tells_when_the_hub_is_gone() -> None:
    import threading

    hub = WeightHub(timeout=5.0)
    sub = WeightSubscription("127.0.0.1", hub.port, timeout=5.0)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert sub.next(stop) is None
    assert hub.registered == 1 and hub.members == [0]
    with pytest.raises(WeightSyncError) as info:
        hub.wait_members(2, timeout=0.2)
    where = f"127.0.0.1:{hub.port}"
    assert str(info.value) == f"1 of 2 weight receivers registered at {where} within 0.2s"
    hub.close()
    del hub
    import gc

    gc.collect()
    with pytest.raises(WeightSyncError, match=r"the weight hub at 127\.0\.0\.1:\d+ is gone"):
        sub.next()


@pytest.mark.gpu
def test_a_hub_over_nccl_between_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: this test needs two")
    hub = WeightHub(timeout=60.0, backend="nccl", device="cuda:0", bucket_bytes=2048)
    worker = hub_member(hub.port, 2, "--nccl")
    registered(worker)
    for v in (1, 2):
        stats = hub.send({k: t.cuda() for k, t in weights(v).items()}, v)
        assert (stats.receivers, stats.lost) == (1, ())
    assert lines(worker) == [{"version": v, "ok": True} for v in (1, 2)]
    hub.close()


def test_a_subscription_to_no_hub_says_so() -> None:
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(WeightSyncTimeoutError) as err:
        WeightSubscription("127.0.0.1", port, timeout=1.0)
    message = str(err.value)
    assert message.startswith(f"could not reach the weight-sync rendezvous at 127.0.0.1:{port} "
                              "within 1.0s: ")  # fmt: skip
    assert message.endswith("; is the trainer up, and is the address right?")
