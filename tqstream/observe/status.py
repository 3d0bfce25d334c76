"""tqstream status ADDRESS: watch a running cluster, as a live terminal view or as JSON.

It polls the controller's stats once per --interval (at a fixed pace: a slow reply does not push
the next sample later) and computes rates between consecutive samples over the time that actually
elapsed. --once takes two samples --interval apart and prints the second, so its rates are real
(--interval 0: one sample, rates "-" / null). --json prints the stats, the address, the time and
the rates as one JSON object with --once, else one per line (JSON Lines) until interrupted
(docs/observability.md has the shape).

Exit status: 0 when --once is done or Ctrl-C stops it; 1, with one line on stderr, when the
controller cannot be reached within --connect-timeout or is lost while watching (the live view
shows why before it stops); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import msgspec

from tqstream.config import ClientConfig, from_env
from tqstream.errors import InternalError, TQStreamError
from tqstream.observe.sample import Rates, Sample, Snapshot, rates
from tqstream.protocol.auth import load_keys
from tqstream.protocol.connection import Connection, not_a_controller
from tqstream.protocol.messages import GetStats, StatsReply
from tqstream.types import Stats

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["add_arguments", "main", "run"]

CONNECT_TIMEOUT = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="the controller's address, tcp://HOST:PORT (or HOST:PORT)")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between samples (default: %(default)s)")  # fmt: skip
    p.add_argument("--once", action="store_true",
                   help="print one sample (rates over one --interval) and exit")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="JSON: one object with --once, else one per line per interval")  # fmt: skip
    p.add_argument("--keys", default=None,
                   help="the cluster's CURVE key file (default: TQSTREAM_KEYS)")  # fmt: skip
    p.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT,
                   help="seconds to wait for the controller (default: %(default)s)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tqstream status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(p)
    return run(p.parse_args(argv), p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.interval < 0 or (args.interval == 0 and not args.once):
        parser.error("--interval must be positive (0 only with --once: one sample, no rates)")
    if args.connect_timeout <= 0:
        parser.error("--connect-timeout must be positive")
    address = args.address if "://" in args.address else f"tcp://{args.address}"
    try:
        return _run(args, address)
    except KeyboardInterrupt:
        return 0


def _run(args: argparse.Namespace, address: str) -> int:
    try:
        config = dataclasses.replace(
            from_env(ClientConfig, keys=args.keys), connect_timeout=args.connect_timeout
        )
        client = StatsClient(address, config)
    except (TQStreamError, ValueError) as exc:
        return _fail(f"cannot connect to the controller at {address}: {exc}")
    try:
        samples = _samples(client.stats, args.interval)
        if args.json:
            return _json(address, samples, args.once, args.interval)
        if args.once:
            return _print_once(address, samples, args.interval)
        return _live(address, samples, args.interval)
    except TQStreamError as exc:
        return _fail(_stopped(address, exc))
    finally:
        client.close()


class StatsClient:
    """The controller's ``stats`` over one connection of its own, driven on this thread: what a
    status view needs, without the data client (which imports torch: seconds of start-up)."""

    def __init__(self, address: str, config: ClientConfig) -> None:
        import zmq

        self._timeout = config.connect_timeout
        self._loop = asyncio.new_event_loop()
        self._ctx = zmq.Context()
        try:
            keys = load_keys(config.keys) if config.keys else None
            self._conn = self._loop.run_until_complete(
                Connection.open(
                    self._ctx,
                    address,
                    connect_timeout=config.connect_timeout,
                    heartbeat_interval=config.heartbeat_interval,
                    max_message_bytes=config.max_message_bytes,
                    keys=keys,
                )
            )
            if self._conn.welcome.server != "controller":
                self._conn.close()
                raise not_a_controller(address, self._conn.welcome)
        except BaseException:
            self._ctx.destroy(linger=0)
            self._loop.close()
            raise

    def stats(self) -> Stats:
        request = GetStats(rid=0, partition=None)
        with _interrupt_after():
            reply, _ = self._loop.run_until_complete(
                self._conn.request(request, timeout=self._timeout + 30.0)  # units: within 30 s
            )
        if not isinstance(reply, StatsReply):
            raise InternalError(f"the controller answered stats with {type(reply).__name__}")
        return reply.stats

    def close(self) -> None:
        self._conn.close()
        self._ctx.destroy(linger=0)
        self._loop.close()


@contextlib.contextmanager
def _interrupt_after() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that comes during the block until it ends: a request interrupted
    half way would leave its coroutine and its connection half done (and warnings on stderr)."""
    held: list[int] = []
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            raise ValueError("Ctrl-C is ignored, or someone else's")
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except ValueError:  # that, or not the main thread: leave SIGINT alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            raise KeyboardInterrupt


def _stopped(address: str, exc: TQStreamError) -> str:
    """Why watching stopped, on one line."""
    if isinstance(exc, (ConnectionError, TimeoutError)):  # ConnectionLostError, no reply, ...
        return _one_line(f"lost the controller at {address}: {exc}")
    return _one_line(f"the controller at {address} failed to answer stats: {exc}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _fail(message: str) -> int:
    print(f"tqstream status: {_one_line(message)}", file=sys.stderr)
    return 1


def _samples(stats: Callable[[], Stats], interval: float) -> Iterator[tuple[Sample, Rates]]:
    """Samples at a fixed pace, each with the rates since the one before."""
    prev: Sample | None = None
    due = time.monotonic()
    while True:
        cur = Sample(stats(), time.time(), time.monotonic())
        yield cur, rates(prev, cur)
        prev = cur
        due = max(due + interval, time.monotonic())  # after a stall: one sample, not a burst
        time.sleep(max(0.0, due - time.monotonic()))


def _once(samples: Iterator[tuple[Sample, Rates]], interval: float) -> tuple[Sample, Rates]:
    first = next(samples)
    return first if interval == 0 else next(samples)


def _json(
    address: str, samples: Iterator[tuple[Sample, Rates]], once: bool, interval: float
) -> int:
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    try:
        for sample, r in [_once(samples, interval)] if once else samples:
            out.write(encoder.encode(Snapshot.of(address, sample, r)) + b"\n")
            out.flush()
    except BrokenPipeError:  # `tqstream status ... --json | head -3`: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0


def _console() -> Console:
    from rich.console import Console

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 200  # a file or a pipe: wide enough that no table wraps
    return console


def _print_once(address: str, samples: Iterator[tuple[Sample, Rates]], interval: float) -> int:
    from tqstream.observe.view import render

    sample, r = _once(samples, interval)
    _console().print(render(address, sample, r, interval=interval))
    return 0


def _live(address: str, samples: Iterator[tuple[Sample, Rates]], interval: float) -> int:
    """Redraw the screen per sample on the terminal's alternate screen (as ``top`` does: drawn
    from its top-left corner each time, so a resize or an echoed ``^C`` leaves no debris, and
    Ctrl-C gives the screen back as it was). A lost controller leaves the last sample, with why,
    on the normal screen; without a terminal only that last frame is printed, when it stops."""
    from rich.live import Live

    from tqstream.observe.view import render

    console = _console()
    last: tuple[Sample | None, Rates | None] = (None, None)
    lost: TQStreamError | None = None
    screen = render(address, None, None, interval=interval)
    with Live(screen, console=console, auto_refresh=False, screen=True) as live:
        try:
            for last in samples:
                live.update(render(address, *last, interval=interval), refresh=True)
        except TQStreamError as exc:
            lost = exc
            error = _stopped(address, exc)
            if last[0] is not None:
                at = time.strftime("%H:%M:%S", time.localtime(last[0].time))
                error += f"; its last sample, of {at}:"
            screen = render(address, *last, interval=interval, error=error)
            live.update(screen)  # what Live prints at its end when it has no terminal
    if lost is None:  # the samples ran out (they do not: only an error or Ctrl-C ends them)
        return 0
    if console.is_terminal:
        console.print(screen)
    raise lost
