"""CURVE keys on both deployments, with real processes and sockets: a peer without the cluster's
keys can do nothing (its connect fails at once with ``AuthenticationError``; what a raw socket
sends never reaches a server), a peer with them can do everything; ``tqstream-launch`` refuses a
non-loopback ``--host`` without keys unless ``--insecure``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

import tqstream
from tqstream import ClientConfig
from tqstream.convert.inputs import columns_from_data
from tqstream.protocol.auth import load_keys
from tqstream.protocol.messages import (
    PROTOCOL_VERSION,
    ClearPartition,
    DropPartition,
    Fetch,
    GetMeta,
    Hello,
    PreparePut,
    PutRows,
    encode,
)
from tqstream.protocol.wire import columns_to_wire

# a refusal comes with the handshake, long before this
CONNECT_TIMEOUT = 10.0
PROMPT = 2.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("keys") / "cluster.keys")


@pytest.fixture(scope="module")
def cluster(keys: str) -> Iterator[tqstream.ProcessCluster]:
    with tqstream.ProcessCluster(storage_units=2, keys=keys) as c:
        yield c


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tqstream.Client]:
    path = str(tmp_path_factory.mktemp("keys") / "embedded.keys")
    owner = tqstream.init(storage_units=2, keys=path)
    yield owner
    owner.close()


@pytest.fixture(params=["processes", "embedded"])
def deployed(request: pytest.FixtureRequest, keys: str) -> tuple[str, str]:
    """(TCP address, key file) of each deployment."""
    if request.param == "processes":
        return request.getfixturevalue("cluster").address, keys
    owner = request.getfixturevalue("embedded")
    return owner.address, owner.config.keys


def _refused(address: str, **config: Any) -> tqstream.AuthenticationError:
    tqstream.connect  # noqa: B018 - the client's imports (torch) are not part of the wait
    start = time.monotonic()
    with pytest.raises(tqstream.AuthenticationError) as err:
        tqstream.connect(address, ClientConfig(connect_timeout=CONNECT_TIMEOUT, **config))
    assert time.monotonic() - start < PROMPT, "the refusal waited for connect_timeout"
    assert isinstance(err.value, tqstream.ConnectError)
    return err.value


def _other_client_key(keys: str, path: Path) -> str:
    """A key file with the cluster's server keys but a client keypair of its own."""
    value = json.loads(Path(keys).read_text())
    public, secret = zmq.curve_keypair()
    value.update(client_public=public.decode(), client_secret=secret.decode())
    path.write_text(json.dumps(value))
    return str(path)


def test_key_file_is_private(keys: str, cluster: tqstream.ProcessCluster) -> None:
    assert cluster.keys == keys
    assert os.stat(keys).st_mode & 0o777 == 0o600


def test_client_without_keys_is_refused(deployed: tuple[str, str]) -> None:
    address, _ = deployed
    err = _refused(address)
    assert f"the ZMQ handshake with the server at {address} failed" in str(err)
    assert "the server requires CURVE keys and this client has none" in str(err)
    assert "TQSTREAM_KEYS=PATH" in str(err)


def test_client_of_another_cluster_is_refused(deployed: tuple[str, str], tmp_path: Path) -> None:
    other = str(tmp_path / "other.keys")
    tqstream.generate_keys(other)
    err = _refused(deployed[0], keys=other)
    assert f"the server's public key is not the one in {other}" in str(err)


def test_client_key_not_the_clusters_is_refused(deployed: tuple[str, str], tmp_path: Path) -> None:
    address, keys = deployed
    stranger = _other_client_key(keys, tmp_path / "stranger.keys")
    err = _refused(address, keys=stranger)
    assert f"the server refused this client's client key from {stranger} (status 400)" in str(err)


def test_units_refuse_too(deployed: tuple[str, str]) -> None:
    address, keys = deployed
    with tqstream.connect(address, ClientConfig(keys=keys)) as client:
        units = [u.address for u in client.stats().units]
    assert len(units) == 2
    for unit in units:
        _refused(unit)


def test_keys_on_a_server_without(tmp_path: Path) -> None:
    keys = str(tmp_path / "k")
    tqstream.generate_keys(keys)
    with tqstream.init() as owner:
        err = _refused(owner.address, keys=keys)
        assert "the server has no keys" in str(err)


def _put_rows(partition: str) -> tuple[PutRows, list[Any]]:
    n, cols = columns_from_data({"x": torch.tensor([[-1.0, -1.0]])})
    refs, frames = columns_to_wire(cols, packed=True)
    schemas = {k: c.schema for k, c in cols.items()}
    put = PreparePut(rid=7, partition=partition, n_rows=n, nbytes=0, schemas=schemas)
    return PutRows(rid=7, put=put, columns=refs), frames


@pytest.mark.parametrize("curve", ["plain", "stranger"])
def test_raw_requests_never_reach_a_server(
    deployed: tuple[str, str], tmp_path: Path, curve: str
) -> None:
    """A raw DEALER — plain, or a CURVE client with a key not the cluster's — sends a hello, a
    put, a get and a clear to the controller and a put, a fetch and a drop to every unit: no answer
    comes, and the partition is as it was."""
    address, keys = deployed
    partition = f"raw-{curve}-{os.getpid()}-{time.monotonic_ns()}"
    with tqstream.connect(address, ClientConfig(keys=keys)) as client:
        client.put({"x": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, partition)
        units = [u.address for u in client.stats().units]
        before = client.stats(partition).partitions
        ctx = zmq.Context()
        socks = []
        try:
            targets = [
                (address, [Hello(rid=1, protocol=PROTOCOL_VERSION), ClearPartition(rid=2,
                 partition=partition), GetMeta(rid=3, partition=partition, fields=["x"],
                 batch_size=1, task="thief")]),
                *[(u, [DropPartition(rid=4, partition=partition), Fetch(rid=5,
                  partition=partition, row_ids=[0, 1], fields=["x"])]) for u in units],
            ]  # fmt: skip
            for target, msgs in targets:
                sock = ctx.socket(zmq.DEALER)
                socks.append(sock)
                sock.linger = 0
                if curve == "stranger":
                    stranger = load_keys(_other_client_key(keys, tmp_path / "s.keys"))
                    sock.curve_serverkey = stranger.server_public
                    sock.curve_publickey = stranger.client_public
                    sock.curve_secretkey = stranger.client_secret
                sock.connect(target)
                put, frames = _put_rows(partition)
                for parts in [*([encode(msg)] for msg in msgs), [encode(put), *frames]]:
                    # once libzmq dropped the refused connection's pipe a send would block: the
                    # message goes nowhere either way
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart(parts, zmq.NOBLOCK)
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            assert poller.poll(1000) == [], "a server answered a peer without the keys"
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()
        assert client.stats(partition).partitions == before
        got = client.get(partition, "x", 2, "t", timeout=5)
        assert got.data["x"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("shared_memory", ["auto", "off"])
def test_with_keys_everything_works(deployed: tuple[str, str], shared_memory: str) -> None:
    """Small puts (direct, to each unit in turn) and large ones (placed by the controller, through
    shared memory or frames), gets, clears: all over CURVE, on both units."""
    address, keys = deployed
    small, large = (f"{k}-{shared_memory}-{os.getpid()}-{time.monotonic_ns()}" for k in "sl")
    config = ClientConfig(keys=keys, shared_memory=shared_memory)
    with tqstream.connect(address, config) as client:
        for i in range(4):
            client.put({"x": torch.full((2, 3), float(i))}, small)
            client.put({"y": torch.full((2, 1 << 19), float(i))}, large)
        assert [u.rows > 0 for u in client.stats().units] == [True, True]
        got = client.get(small, "x", 8, "t", timeout=5).data["x"]
        assert sorted(got[:, 0].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
        got = client.get(large, "y", 8, "t", timeout=5).data["y"]
        assert got.shape == (8, 1 << 19) and sorted(got[:, -1].tolist()) == sorted(got[:, 0])
        assert client.clear_partition(small) and client.clear_partition(large)
        assert not {small, large} & set(client.stats().partitions)


def test_embedded_owner_needs_no_keys(embedded: tqstream.Client) -> None:
    """The embedded client reaches its servers in-process: no handshake, no keys needed."""
    partition = f"own-{os.getpid()}"
    embedded.put({"x": torch.arange(3)}, partition)
    assert embedded.get(partition, "x", 3, "t").data["x"].tolist() == [0, 1, 2]
    embedded.clear_partition(partition)


def test_env_var_gives_the_keys(
    cluster: tqstream.ProcessCluster, keys: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TQSTREAM_KEYS", keys)
    with tqstream.connect(cluster.address) as client:
        assert client.config.keys == keys
        assert len(client.stats().units) == 2


def test_missing_key_file(cluster: tqstream.ProcessCluster, tmp_path: Path) -> None:
    missing = tmp_path / "nope.keys"
    with pytest.raises(tqstream.KeyFileError) as err:
        tqstream.connect(cluster.address, ClientConfig(keys=str(missing)))
    assert f"cannot read the key file {missing}: No such file or directory" in str(err.value)


# --- tqstream-launch ---
def _launch(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "TQSTREAM_KEYS"}
    return subprocess.Popen(
        [sys.executable, "-m", "tqstream.launch.processes", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_launch_refuses_an_open_host_without_keys() -> None:
    proc = _launch("--host", "0.0.0.0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "--host 0.0.0.0 is reachable from other machines and the cluster has no keys" in err
    assert "--keys PATH" in err and "--insecure" in err


@pytest.mark.parametrize("secure", [False, True])
def test_launch_on_an_open_host(tmp_path: Path, secure: bool) -> None:
    keys = str(tmp_path / "launch.keys")
    proc = _launch("--host", "0.0.0.0", *(["--keys", keys] if secure else ["--insecure"]))
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        m = re.search(r"tcp://[\d.]+:(\d+)", line)
        assert m, f"no address in {line!r}"
        address = f"tcp://127.0.0.1:{m.group(1)}"
        if secure:
            assert f"clients set TQSTREAM_KEYS={keys}" in line
            _refused(address)
        with tqstream.connect(address, ClientConfig(keys=keys if secure else "")) as client:
            client.put({"x": torch.arange(2)}, "p")
            assert client.get("p", "x", 2, "t").data["x"].tolist() == [0, 1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
