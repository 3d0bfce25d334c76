"""Bad input: each case raises a typed exception with an exact message; state stays consistent."""

from __future__ import annotations

import socket

import msgspec
import pytest
import torch
import zmq

import tqstream
from tqstream import Client
from tqstream.protocol.messages import PROTOCOL_VERSION, Hello, decode_reply, encode


def consistent(client: Client, partition: str, rows: int) -> None:
    st = client.stats(partition).partitions[partition]
    assert st.rows == rows and st.pending_puts == 0


def test_dtype_mismatch_names_field_and_schemas(client: Client, partition: str) -> None:
    client.put({"x": torch.zeros(2, 4)}, partition)
    with pytest.raises(tqstream.SchemaError) as err:
        client.put({"x": torch.zeros(2, 4, dtype=torch.int32)}, partition)
    assert str(err.value) == (
        f"field 'x' of partition '{partition}' is stored as dense float32[4] but this write "
        f"offers dense int32[4]; convert the data to the stored schema or write it under a new "
        f"field name"
    )
    with pytest.raises(tqstream.SchemaError, match=r"stored as dense float32\[4\].*ragged"):
        client.put({"x": [torch.zeros(3)]}, partition)
    consistent(client, partition, 2)


def test_shape_change_is_a_schema_error(client: Client, partition: str) -> None:
    client.put({"x": torch.zeros(2, 4)}, partition)
    with pytest.raises(tqstream.SchemaError, match=r"offers dense float32\[5\]"):
        client.put({"x": torch.zeros(2, 5)}, partition)
    consistent(client, partition, 2)


def test_row_count_mismatch(client: Client, partition: str) -> None:
    with pytest.raises(tqstream.BatchShapeError, match="rows"):
        client.put({"a": torch.zeros(3), "b": torch.zeros(4)}, partition)
    with pytest.raises(tqstream.UnknownPartitionError):
        client.stats(partition)  # nothing was created


def test_empty_put(client: Client, partition: str) -> None:
    with pytest.raises(tqstream.BatchShapeError, match="0 rows"):
        client.put({"a": torch.zeros(0, 3)}, partition)
    with pytest.raises(tqstream.BatchShapeError):
        client.put({}, partition)


@pytest.mark.parametrize("bad", [-5, float("nan"), 1.0, True, "3", 2**31])
def test_a_version_that_is_not_a_policy_version_is_refused(
    client: Client, partition: str, bad: object
) -> None:
    message = (
        "{name} must be a policy version: an int in 0..2147483647 (the trainer's weight version, "
        f"bumped at each update), or None; got {bad!r}"
    )
    with pytest.raises(tqstream.InvalidRequestError) as err:
        client.put({"x": torch.zeros(2)}, partition, version=bad)  # type: ignore[arg-type]
    assert str(err.value) == message.format(name="version")
    with pytest.raises(tqstream.InvalidRequestError) as err:
        client.put({"x": torch.zeros(2)}, partition, version=1, dispatch_version=[0, bad])  # type: ignore[list-item]
    assert str(err.value) == message.format(name="dispatch_version")
    with pytest.raises(tqstream.InvalidRequestError) as err:
        client.get(partition, "x", 1, "t", current_version=bad, max_staleness=1, timeout=0)  # type: ignore[arg-type]
    assert str(err.value) == message.format(name="current_version")
    with pytest.raises(tqstream.UnknownPartitionError):
        client.stats(partition)  # nothing was stored


def test_a_per_token_version_beyond_32_bits_is_refused_by_the_controller(
    client: Client, partition: str
) -> None:
    # the row's version range is derived from its tokens' versions; the controller keeps 32 bits
    versions = torch.tensor([[-1, 3, 2**31]])
    with pytest.raises(tqstream.InvalidRequestError) as err:
        client.put({"x": torch.zeros(1, 3), "versions": versions}, partition, version=3)
    assert "version_end 2147483648 is outside the versions tqstream keeps" in str(err.value)
    with pytest.raises(tqstream.UnknownPartitionError):
        client.stats(partition)  # nothing was stored


def test_sets_are_refused_not_turned_into_lists(client: Client, partition: str) -> None:
    with pytest.raises(
        tqstream.SchemaError, match=r"row 1 \(frozenset\) is not JSON-serial.*no sets"
    ):
        client.put({"s": [[1], frozenset({2})]}, partition)
    with pytest.raises(tqstream.UnknownPartitionError):
        client.stats(partition)


def test_duplicate_keys_within_put(client: Client, partition: str) -> None:
    with pytest.raises(tqstream.DuplicateKeyError, match="repeat within the put: 'k'"):
        client.put({"x": torch.zeros(2)}, partition, keys=["k", "k"])


def test_unknown_partition_and_field(client: Client, partition: str) -> None:
    with pytest.raises(tqstream.UnknownPartitionError, match=f"partition '{partition}' does not "):
        client.get_meta(partition, "x", 1, "t")
    client.put({"x": torch.zeros(1)}, partition)
    with pytest.raises(
        tqstream.UnknownFieldError,
        match=r"field 'y' is not in partition .* "
        r"\(known fields: 'x'\)",
    ):
        client.get_meta(partition, ["x", "y"], 1, "t")


@pytest.mark.parametrize("size", [0, -3])
def test_batch_size_must_be_positive(client: Client, partition: str, size: int) -> None:
    client.put({"x": torch.zeros(1)}, partition)
    with pytest.raises(
        tqstream.InvalidRequestError,
        match=f"batch_size must be a positive number of rows, got {size}",
    ):
        client.get_meta(partition, "x", size, "t")


def test_put_fields_row_mismatch(client: Client, partition: str) -> None:
    meta = client.put({"x": torch.zeros(3)}, partition)
    with pytest.raises(
        tqstream.BatchShapeError, match="put_fields got 2 rows of data for a batch of 3 rows"
    ):
        client.put_fields(meta, {"y": torch.zeros(2)})


def test_put_fields_on_cleared_rows(client: Client, partition: str) -> None:
    meta = client.put({"x": torch.zeros(3)}, partition)
    client.clear_samples(meta.select([0]))
    with pytest.raises(tqstream.UnknownRowError, match="1 of 3 rows no longer exist"):
        client.put_fields(meta, {"y": torch.zeros(3)})


def test_message_over_size_limit(deployment: tuple[str, str], partition: str) -> None:
    small = tqstream.ClientConfig(max_message_bytes=1 << 16)
    with tqstream.connect(deployment[1], small) as c:
        with pytest.raises(tqstream.MessageTooLargeError, match="max_message_bytes"):
            c.put({"x": torch.zeros(1 << 15)}, partition)
        c.put({"x": torch.zeros(16)}, partition)  # still usable
        st = c.stats(partition).partitions[partition]
        assert st.rows == 16 and st.pending_puts == 0


def test_unreachable_controller_fails_within_connect_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import time

    t0 = time.monotonic()
    with pytest.raises(tqstream.ConnectError, match=f"tcp://127.0.0.1:{port}"):
        tqstream.connect(f"tcp://127.0.0.1:{port}", tqstream.ClientConfig(connect_timeout=1.0))
    assert time.monotonic() - t0 < 3.0


def _server_addresses(client: Client) -> list[str]:
    return [client.address] + [u.address for u in client.stats().units]


def test_garbage_bytes_on_every_port(client: Client, partition: str) -> None:
    ctx = zmq.Context()
    try:
        for address in _server_addresses(client):
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=2) as raw:  # not even ZMTP
                raw.sendall(bytes(range(256)) * 16)
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.connect(address)
            for frames in (
                [b"\xff\x00garbage"],
                [b""],
                [encode(Hello(rid=7, protocol=1))[:5]],
                [msgspec.msgpack.encode({"op": "fetch", "rid": 9}), b"xx"],
            ):
                dealer.send_multipart(frames)
                assert dealer.poll(5000), f"no error reply from {address}"
                reply = decode_reply(dealer.recv_multipart()[0])
                assert reply.code == "malformed", reply
            dealer.close()
    finally:
        ctx.destroy(linger=0)
    client.put({"x": torch.arange(3)}, partition)  # every server still serves
    assert client.get(partition, "x", 3, "t").data["x"].tolist() == [0, 1, 2]


def test_other_protocol_version_is_refused(client: Client) -> None:
    ctx = zmq.Context()
    try:
        for address in _server_addresses(client):
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.connect(address)
            dealer.send_multipart([encode(Hello(rid=1, protocol=PROTOCOL_VERSION + 98))])
            assert dealer.poll(5000)
            reply = decode_reply(dealer.recv_multipart()[0])
            assert reply.code == tqstream.ProtocolVersionError.code
            assert f"{PROTOCOL_VERSION + 98}" in reply.message
            assert f"{PROTOCOL_VERSION}" in reply.message
            dealer.close()
    finally:
        ctx.destroy(linger=0)


def test_closed_client_raises(deployment: tuple[str, str]) -> None:
    c = tqstream.connect(deployment[1])
    c.close()
    c.close()
    with pytest.raises(tqstream.ClosedError, match="closed"):
        c.stats()
