"""The ZMQ transport over real sockets on 127.0.0.1: matching, parking, errors, hostile peers,
dead servers. Each test runs its own event loop (``asyncio.run``) and its own ZMQ context."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import random
import re
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

import tqstream
from tqstream.protocol import server as server_module
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    ClearPartition,
    Columns,
    CreatePartition,
    DropRows,
    ErrorReply,
    Fetch,
    GetByKeys,
    GetMeta,
    GetStats,
    Hello,
    KeysReply,
    ListKeys,
    Ok,
    Welcome,
    decode_reply,
    encode,
)
from tqstream.protocol.server import Responder, Server

LIMIT = 1 << 20


class Handler:
    """A tiny server: stats count, fetch echoes buffers, get_meta parks until an ack of the same
    task, list_keys answers asynchronously, and a few requests fail in each possible way."""

    def __init__(self) -> None:
        self.count = 0
        self.parked: dict[str, Responder] = {}
        self.frames: list[Any] = []

    def __call__(self, msg: Any, frames: list[Any], responder: Responder) -> Any:
        self.count += 1
        match msg:
            case GetStats():
                return Ok(rid=msg.rid, count=self.count)
            case Fetch():
                self.frames = frames
                return Columns(rid=msg.rid, columns=[]), frames[1:]
            case GetMeta():
                self.parked[msg.task] = responder
                return None
            case Ack():
                self.parked.pop(msg.task).reply(Ok(rid=0, count=msg.lease_id))
                return Ok(rid=msg.rid)
            case DropRows():  # fail a parked request
                self.parked.pop(msg.partition).fail(tqstream.PartitionClearedError("cleared"))
                return Ok(rid=msg.rid)
            case ListKeys():
                return self._later(msg)
            case GetByKeys():
                raise tqstream.UnknownKeyError(
                    f"keys {msg.keys} are not in {msg.partition}", keys=msg.keys, obj=object()
                )
            case CreatePartition():
                return self._fail_later()
            case ClearPartition():
                raise ValueError("boom")
        raise AssertionError(msg)

    async def _later(self, msg: ListKeys) -> KeysReply:
        await asyncio.sleep(0.01)
        return KeysReply(rid=msg.rid, keys=[msg.partition])

    async def _fail_later(self) -> Any:
        await asyncio.sleep(0.01)
        raise tqstream.SchemaError("bad schema", field="x")


@contextlib.asynccontextmanager
async def serving(
    limit: int = LIMIT,
) -> AsyncIterator[tuple[Server, Handler, zmq.asyncio.Context]]:
    ctx = zmq.asyncio.Context()
    handler = Handler()
    server = Server(
        ctx, "127.0.0.1", 0, handler, name="test", max_message_bytes=limit, units=lambda: ["u0"]
    )
    task = asyncio.get_running_loop().create_task(server.serve(), name="test-serve")
    try:
        yield server, handler, ctx
    finally:
        await server.close()
        await server.close()
        await asyncio.wait_for(task, 5)  # serve() returns after close()
        ctx.destroy(linger=0)


async def connect(ctx: Any, address: str, limit: int = LIMIT, **kw: Any) -> Connection:
    kw = {"connect_timeout": 2.0, "heartbeat_interval": 0.2, **kw}
    return await Connection.open(ctx, address, max_message_bytes=limit, **kw)


async def raw_request(ctx: Any, address: str, frames: list[bytes]) -> ErrorReply:
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(address)
    try:
        await dealer.send_multipart(frames)
        reply = await asyncio.wait_for(dealer.recv_multipart(), 5)
    finally:
        dealer.close()
    return decode_reply(reply[0])


async def still_serving(ctx: Any, address: str) -> None:
    conn = await connect(ctx, address)
    reply, _ = await conn.request(GetStats(rid=0), timeout=5)
    assert isinstance(reply, Ok)
    conn.close()


def test_handshake() -> None:
    async def main() -> None:
        async with serving() as (server, _, ctx):
            assert server.address.startswith("tcp://127.0.0.1:")
            conn = await connect(ctx, server.address)
            assert conn.welcome == Welcome(
                rid=conn.welcome.rid,
                protocol=PROTOCOL_VERSION,
                server="test",
                max_message_bytes=LIMIT,
                units=["u0"],
            )
            conn.close()

    asyncio.run(main())


def test_concurrent_requests_are_matched_and_parked_ones_are_passed() -> None:
    async def main() -> None:
        async with serving() as (server, handler, ctx):
            conn = await connect(ctx, server.address)
            parked = asyncio.ensure_future(
                conn.request(
                    GetMeta(rid=0, partition="p", fields=[], batch_size=1, task="t"), timeout=5
                )
            )
            payloads = [os.urandom(random.randrange(1, 200_000)) for _ in range(200)]
            replies = await asyncio.gather(
                *(
                    conn.request(
                        Fetch(rid=0, partition="p", row_ids=[], fields=[]), [p], timeout=10
                    )
                    for p in payloads
                ),
                *(conn.request(ListKeys(rid=0, partition=f"k{i}"), timeout=10) for i in range(50)),
            )
            for p, (reply, frames) in zip(payloads, replies[:200], strict=True):
                assert isinstance(reply, Columns) and frames[1].bytes == p
            assert [r.keys for r, _ in replies[200:]] == [[f"k{i}"] for i in range(50)]
            assert not parked.done()
            reply, _ = await conn.request(
                Ack(rid=0, partition="p", task="t", lease_id=42, row_ids=[]), timeout=5
            )
            assert isinstance(reply, Ok)
            parked_reply, _ = await parked
            assert parked_reply == Ok(rid=parked_reply.rid, count=42)
            # a parked request can also be failed later
            failing = asyncio.ensure_future(
                conn.request(
                    GetMeta(rid=0, partition="p", fields=[], batch_size=1, task="q"), timeout=5
                )
            )
            while "q" not in handler.parked:
                await asyncio.sleep(0.005)
            handler.parked["p"] = handler.parked.pop("q")
            await conn.request(DropRows(rid=0, partition="p", row_ids=[]), timeout=5)
            with pytest.raises(tqstream.PartitionClearedError, match="cleared"):
                await failing
            assert not conn._pending
            conn.close()

    asyncio.run(main())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_errors_travel_as_their_class() -> None:
    """A peer's mistake travels as its class (logged at DEBUG); a handler's own bug reaches the
    peer as InternalError and is logged at ERROR with the operation and the request id the peer
    sees in its message, with the traceback."""
    # the handler hangs on the server's own logger object: AReaL's logging module (imported by
    # other tests) replaces logging's manager, after which loggers made later no longer reach the
    # root logger pytest's capture hangs on
    log = server_module._log
    caplog = _Records()

    async def main() -> None:
        async with serving() as (server, _, ctx):
            conn = await connect(ctx, server.address)
            with pytest.raises(tqstream.UnknownKeyError) as info:
                await conn.request(GetByKeys(rid=0, partition="p", keys=["a"]), timeout=5)
            assert info.value.message == "keys ['a'] are not in p"
            assert info.value.details["keys"] == ["a"]
            assert info.value.details["obj"].startswith("<object object")
            with pytest.raises(tqstream.SchemaError, match="bad schema") as info2:
                await conn.request(CreatePartition(rid=0, partition="p"), timeout=5)
            assert info2.value.details == {"field": "x"}
            with pytest.raises(
                tqstream.InternalError, match=r"clear_partition .*ValueError: boom"
            ) as info3:
                await conn.request(ClearPartition(rid=0, partition="p"), timeout=5)
            rid = int(re.search(r"\(request (\d+)\)", str(info3.value)).group(1))  # type: ignore
            await still_serving(ctx, server.address)
            conn.close()
            bugs = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(bugs) == 1 and bugs[0].name == "tqstream.server"
            assert f"failed on clear_partition (request {rid})" in bugs[0].getMessage()
            assert bugs[0].exc_info is not None and "boom" in str(bugs[0].exc_info[1])
            mistakes = [r for r in caplog.records if r.levelno == logging.DEBUG]
            assert any("UnknownKeyError" in r.getMessage() for r in mistakes)

    level = log.level
    log.addHandler(caplog)
    log.setLevel(logging.DEBUG)
    try:
        asyncio.run(main())
    finally:
        log.removeHandler(caplog)
        log.setLevel(level)


def test_garbage_gets_malformed_reply_and_server_keeps_serving() -> None:
    async def main() -> None:
        async with serving() as (server, _, ctx):
            reply = await raw_request(ctx, server.address, [b"\xc1 not msgpack"])
            assert reply.code == "malformed" and reply.rid == 0
            assert f"is not a tqstream protocol {PROTOCOL_VERSION} request" in reply.message
            bad = msgspec.msgpack.encode({"op": "get_stats", "rid": 7, "partition": 3})
            reply = await raw_request(ctx, server.address, [bad])
            assert reply.code == "malformed" and reply.rid == 7
            bad = msgspec.msgpack.encode({"op": "no_such_op", "rid": 8})
            reply = await raw_request(ctx, server.address, [bad, b"extra"])
            assert reply.code == "malformed" and reply.rid == 8
            reply = await raw_request(ctx, server.address, [b""])
            assert reply.code == "malformed"
            # raw TCP garbage, then a connection that just closes
            host, port = server.address[len("tcp://") :].rsplit(":", 1)
            for payload in (
                os.urandom(4096),
                b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(64),
                b"",
            ):
                with socket.create_connection((host, int(port))) as s:
                    s.sendall(payload)
                    await asyncio.sleep(0.05)
            await still_serving(ctx, server.address)

    asyncio.run(main())


def test_oversized_messages_are_refused_on_both_sides() -> None:
    async def main() -> None:
        async with serving(limit=LIMIT) as (server, handler, ctx):
            conn = await connect(ctx, server.address, limit=4 * LIMIT)
            fetch = Fetch(rid=0, partition="p", row_ids=[], fields=[])
            with pytest.raises(tqstream.MessageTooLargeError, match="max_message_bytes") as info:
                await conn.request(fetch, [bytes(LIMIT)], timeout=5)
            n = info.value.details["nbytes"]
            assert n > LIMIT and f"of {n} bytes exceeds the limit of {LIMIT} bytes" in str(
                info.value
            )
            assert not conn._pending
            # a client that believes the server takes more: the server refuses with a reply
            conn._limit = 4 * LIMIT
            with pytest.raises(tqstream.MessageTooLargeError) as info:
                await conn.request(fetch, [bytes(LIMIT)], timeout=5)
            n = info.value.details["nbytes"]
            assert str(info.value) == (
                f"fetch message of {n} bytes exceeds the test server's max_message_bytes of "
                f"{LIMIT}; split the batch into smaller ones or raise max_message_bytes on both "
                f"sides"
            )
            assert handler.count == 0
            # over the hard guard (limit + 1 MiB): libzmq drops the peer before buffering it all
            with pytest.raises(tqstream.ConnectionLostError, match="fetch"):
                await conn.request(fetch, [bytes(3 * LIMIT)], timeout=5)
            assert handler.count == 0
            conn.close()
            await still_serving(ctx, server.address)

    asyncio.run(main())


def test_protocol_mismatch() -> None:
    async def main() -> None:
        async with serving() as (server, _, ctx):
            reply = await raw_request(
                ctx, server.address, [encode(Hello(rid=3, protocol=999, role="storage"))]
            )
            assert reply.code == "protocol_version" and reply.rid == 3
            assert "storage speaks tqstream protocol 999" in reply.message
            assert "install the same tqstream version on both sides" in reply.message
            future = msgspec.msgpack.encode({"op": "hello", "rid": 4, "protocol": "v2"})
            reply = await raw_request(ctx, server.address, [future])
            assert reply.code == "protocol_version" and reply.rid == 4
            conn = await connect(ctx, server.address)
            with pytest.raises(tqstream.ProtocolVersionError, match="protocol 999"):
                await conn.request(Hello(rid=0, protocol=999), timeout=5)
            conn.close()

        # a server of another version (faked by a raw ROUTER) is refused by the client
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        async def fake() -> None:
            ident, hello = await router.recv_multipart()
            welcome = Welcome(
                rid=decode_reply_rid(hello), protocol=999, server="old", max_message_bytes=LIMIT
            )
            await router.send_multipart([ident, encode(welcome)])

        task = asyncio.ensure_future(fake())
        with pytest.raises(tqstream.ProtocolVersionError, match="speaks protocol 999"):
            await connect(ctx, f"tcp://127.0.0.1:{port}")
        await task
        router.close(linger=0)
        ctx.destroy(linger=0)

    asyncio.run(main())


def decode_reply_rid(header: bytes) -> int:
    return msgspec.msgpack.decode(header)["rid"]


def test_connect_to_nothing_fails_within_the_timeout() -> None:
    async def main() -> None:
        with socket.socket() as s:  # a port with nothing listening
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = zmq.asyncio.Context()
        start = time.monotonic()
        with pytest.raises(tqstream.ConnectError, match=rf"tcp://127.0.0.1:{port} within 0.5s"):
            await connect(ctx, f"tcp://127.0.0.1:{port}", connect_timeout=0.5)
        assert time.monotonic() - start < 0.5 + 1
        with pytest.raises(tqstream.ConnectError, match="tcp://HOST:PORT"):
            await connect(ctx, "nonsense")
        ctx.destroy(linger=0)  # would hang on a socket that open() failed to close

    asyncio.run(main())


def _serve_forever(conn: Any) -> None:
    """Child process: a server that parks every get_meta, announcing its address on ``conn``."""

    async def main() -> None:
        server = Server(
            zmq.asyncio.Context(), "127.0.0.1", 0, Handler(), name="child", max_message_bytes=LIMIT
        )
        conn.send(server.address)
        await server.serve()

    asyncio.run(main())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_dead_server_fails_pending_requests(sig: int) -> None:
    """A killed server drops the TCP connection; a frozen one is caught by the heartbeats."""
    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    proc = mp.Process(target=_serve_forever, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the server process did not start"
        address = parent.recv()

        async def main() -> None:
            ctx = zmq.asyncio.Context()
            conn = await connect(ctx, address, connect_timeout=10)
            get = GetMeta(rid=0, partition="p", fields=[], batch_size=1, task="t")
            pending = asyncio.ensure_future(conn.request(get, timeout=None))
            await asyncio.sleep(0.1)
            os.kill(proc.pid, sig)
            start = time.monotonic()
            with pytest.raises(tqstream.ConnectionLostError, match=r"while waiting for get_meta"):
                await asyncio.wait_for(pending, 10)
            assert time.monotonic() - start < 3
            assert address in str(pending.exception())
            conn.close()
            ctx.destroy(linger=0)

        asyncio.run(main())
    finally:
        proc.kill()
        proc.join(10)


def test_close_is_idempotent_and_fails_pending() -> None:
    async def main() -> None:
        async with serving() as (server, _, ctx):
            conn = await connect(ctx, server.address)
            get = GetMeta(rid=0, partition="p", fields=[], batch_size=1, task="t")
            pending = asyncio.ensure_future(conn.request(get, timeout=None))
            await asyncio.sleep(0.05)
            conn.close()
            conn.close()
            with pytest.raises(tqstream.ClosedError, match="get_meta"):
                await pending
            with pytest.raises(tqstream.ClosedError):
                await conn.request(GetStats(rid=0), timeout=1)
            with pytest.raises(tqstream.RequestTimeoutError, match=r"get_meta \(request \d+\)"):
                other = await connect(ctx, server.address)
                try:
                    await other.request(get, timeout=0.1)
                finally:
                    other.close()

    asyncio.run(main())


def test_large_buffers_are_not_copied() -> None:
    async def main() -> None:
        async with serving(limit=64 * LIMIT) as (server, handler, ctx):
            conn = await connect(ctx, server.address, limit=64 * LIMIT)
            data = bytearray(os.urandom(32 * LIMIT))
            reply, frames = await conn.request(
                Fetch(rid=0, partition="p", row_ids=[], fields=[]), [memoryview(data)], timeout=10
            )
            assert isinstance(reply, Columns)
            for received in (handler.frames[1], frames[1]):  # server side, then client side
                assert isinstance(received, zmq.Frame)
                view = received.buffer
                assert isinstance(view, memoryview) and view.obj is received
                assert view.nbytes == len(data) and view == data
            conn.close()

    asyncio.run(main())


def test_request_during_an_outage_waits_at_most_connect_timeout() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        first = Server(ctx, "127.0.0.1", 0, Handler(), name="a", max_message_bytes=LIMIT)
        serving_task = asyncio.ensure_future(first.serve())
        conn = await connect(ctx, first.address, connect_timeout=0.5)
        await first.close()
        await serving_task
        while not conn._down:  # the monitor saw the drop
            await asyncio.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(tqstream.ConnectionLostError, match=r"within 0.5s \(connect_timeout\)"):
            await conn.request(GetStats(rid=0), timeout=None)
        assert time.monotonic() - start < 0.5 + 1
        # a server back at the same address: the queued request goes through after reconnecting
        port = int(first.address.rsplit(":", 1)[1])
        second = Server(ctx, "127.0.0.1", port, Handler(), name="b", max_message_bytes=LIMIT)
        serving_task = asyncio.ensure_future(second.serve())
        reply, _ = await conn.request(GetStats(rid=0), timeout=5)
        assert isinstance(reply, Ok) and not conn._down
        conn.close()
        await second.close()
        await serving_task
        ctx.destroy(linger=0)

    asyncio.run(main())


def test_a_server_back_refusing_our_key_fails_the_waiting_request(tmp_path: Any) -> None:
    """A request queued during an outage ends with ``AuthenticationError`` once the server back
    at the address refuses our client key, at once rather than a connect_timeout later."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        ours = tqstream.generate_keys(tmp_path / "ours")
        public, secret = zmq.curve_keypair()  # the same server keys, another client admitted
        theirs = dataclasses.replace(ours, client_public=public, client_secret=secret)
        first = Server(ctx, "127.0.0.1", 0, Handler(), name="a", max_message_bytes=LIMIT, keys=ours)
        serving_task = asyncio.ensure_future(first.serve())
        conn = await connect(ctx, first.address, connect_timeout=3.0, keys=ours)
        reply, _ = await conn.request(GetStats(rid=0), timeout=5)
        assert isinstance(reply, Ok)
        await first.close()
        await serving_task
        while not conn._down:
            await asyncio.sleep(0.01)
        port = int(first.address.rsplit(":", 1)[1])
        second = Server(
            ctx, "127.0.0.1", port, Handler(), name="b", max_message_bytes=LIMIT, keys=theirs
        )
        serving_task = asyncio.ensure_future(second.serve())
        start = time.monotonic()
        with pytest.raises(tqstream.AuthenticationError, match="refused this client's client key"):
            await conn.request(GetStats(rid=0), timeout=None)
        assert time.monotonic() - start < 1.0
        conn.close()
        await second.close()
        await serving_task
        ctx.destroy(linger=0)

    asyncio.run(main())


def test_undecodable_replies() -> None:
    """A reply that fails to decode fails its request if its rid can be read, else is ignored."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        async def fake() -> None:
            ident, hello = await router.recv_multipart()
            welcome = Welcome(
                rid=decode_reply_rid(hello),
                protocol=PROTOCOL_VERSION,
                server="x",
                max_message_bytes=LIMIT,
            )
            await router.send_multipart([ident, encode(welcome)])
            ident, _ = await router.recv_multipart()
            await router.send_multipart([ident, b"\xc1"])
            ident, request = await router.recv_multipart()
            garbage = {"rid": decode_reply_rid(request), "op": "nonsense"}
            await router.send_multipart([ident, msgspec.msgpack.encode(garbage)])

        task = asyncio.ensure_future(fake())
        conn = await connect(ctx, f"tcp://127.0.0.1:{port}")
        with pytest.raises(tqstream.RequestTimeoutError, match=r"get_stats \(request \d+\)"):
            await conn.request(GetStats(rid=0), timeout=0.3)  # no rid in b"\xc1": ignored
        with pytest.raises(tqstream.MalformedMessageError, match=r"get_stats \(request \d+\)"):
            await conn.request(GetStats(rid=0), timeout=5)
        await task
        conn.close()
        router.close(linger=0)
        ctx.destroy(linger=0)

    asyncio.run(main())
