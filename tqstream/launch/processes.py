"""``tqstream-launch``: a controller and N storage units as separate processes.

The launcher starts the controller, then the storage units (each registers with the controller),
prints one line with the connect address once all of them serve, and stays in the foreground. A
storage unit that exits is started again at the same address (``--on-unit-exit restart``, the
default; the controller has counted its rows lost, unless they had replicas, and the new process
registers and takes new rows) or stops the cluster (``stop``). On SIGINT/SIGTERM, or if the
controller dies, it stops every child (SIGTERM, then SIGKILL after a grace period) and exits; the
children also exit on their own if the launcher dies (they watch a pipe from it), so no orphan
keeps a port.

With ``--keys PATH`` (made if missing) every server serves only peers that hold that CURVE key
file. A ``--host`` other than loopback needs keys, or ``--insecure`` to serve anyone who reaches
the port (docs/security.md).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import ipaddress
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from tqstream.config import ControllerConfig, StorageConfig, from_env
from tqstream.launch.worker import LOG_FORMAT
from tqstream.protocol import shm
from tqstream.protocol.auth import ensure_keys

__all__ = ["ProcessCluster", "main"]

READY_TIMEOUT = 60.0

_log = logging.getLogger("tqstream.launch")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the servers reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or * (every interface)
        return False


class ProcessCluster:
    """A controller and ``storage_units`` storage units in child processes.

    ``keys``: path of the cluster's CURVE key file, made if missing (None: ``TQSTREAM_KEYS``, if
    set); clients pass the same path. A ``host`` other than loopback refuses to start without keys
    unless ``insecure``. ``metrics_port``: the controller serves Prometheus metrics there
    (``metrics_address``). ``log_level``: of the children's ``tqstream`` log lines on stderr
    (``tqstream-launch`` uses INFO)."""

    def __init__(
        self,
        storage_units: int = 1,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_timeout: float | None = None,
        put_timeout: float | None = None,
        max_message_bytes: int | None = None,
        storage_max_bytes: int | None = None,
        replicas: int | None = None,
        keys: str | None = None,
        insecure: bool = False,
        metrics_port: int | None = None,
        log_level: str = "WARNING",
    ) -> None:
        if storage_units < 1:
            raise ValueError(f"--storage-units must be at least 1, got {storage_units}")
        if replicas is not None and replicas not in (1, 2):
            raise ValueError(f"--replicas must be 1 or 2, got {replicas}")
        keys = from_env(ControllerConfig).keys if keys is None else keys
        self.keys = os.path.abspath(keys) if keys else ""
        """The key file clients need ("": none)."""
        if not self.keys and not insecure and not is_loopback(host):
            raise ValueError(
                f"--host {host} is reachable from other machines and the cluster has no keys: "
                f"anyone reaching the port could read, write and clear every partition; pass "
                f"--keys PATH (made if missing; clients then set TQSTREAM_KEYS=PATH), or "
                f"--insecure on a network you trust"
            )
        if self.keys:
            ensure_keys(self.keys)  # before any child: they all load the same file
        self.procs: list[subprocess.Popen[str]] = []
        self.restarts = 0
        extra = ["--keys", self.keys, "--log-level", log_level]
        for flag, value in (
            ("--lease-timeout", lease_timeout),
            ("--put-timeout", put_timeout),
            ("--max-message-bytes", max_message_bytes),
        ):
            if value is not None:
                extra += [flag, str(value)]
        try:
            ctrl_args = [] if replicas is None else ["--replicas", str(replicas)]
            if metrics_port:
                ctrl_args += ["--metrics-port", str(metrics_port)]
            controller = self._spawn(
                ["controller", "--host", host, "--port", str(port), *extra, *ctrl_args]
            )
            self.address = self._ready(controller, "controller")
            self.metrics_address = (
                f"http://{host}:{metrics_port}/metrics" if metrics_port else ""
            )  # fmt: skip
            """The controller's Prometheus endpoint ("": none)."""
            quota = [] if storage_max_bytes is None else ["--max-bytes", str(storage_max_bytes)]
            self._unit_args = ["--host", host, "--controller", self.address, *extra, *quota]
            units = [
                self._spawn(["storage", *self._unit_args]) for _ in range(storage_units)
            ]  # start together, then wait for each
            self.unit_addresses = [self._ready(u, "storage unit") for u in units]
        except BaseException:
            self.close()
            raise

    def restart_unit(self, i: int) -> str:
        """Start storage unit ``i`` again (after it exited, or stop it first) at its address, so
        clients and the controller find it where it was; returns the address."""
        old = self.procs[i + 1]
        if old.poll() is None:
            old.kill()
        old.wait()
        for stream in (old.stdin, old.stdout):
            if stream is not None:
                stream.close()
        port = self.unit_addresses[i].rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "tqstream.launch.worker", "storage", *self._unit_args]
        cmd += ["--port", port, "--watch-stdin"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs[i + 1] = proc
        self.unit_addresses[i] = self._ready(proc, "storage unit")
        self.restarts += 1
        return self.unit_addresses[i]

    def _spawn(self, args: list[str]) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "tqstream.launch.worker", *args, "--watch-stdin"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _ready(proc: subprocess.Popen[str], what: str) -> str:
        """The address from the child's ``READY <address>`` line."""
        assert proc.stdout is not None
        stdout = proc.stdout
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(stdout.readline()), name="tqstream-launch-ready", daemon=True
        )
        reader.start()
        reader.join(READY_TIMEOUT)
        if not line or not line[0].startswith("READY "):
            raise RuntimeError(
                f"tqstream {what} process did not start within "
                f"{READY_TIMEOUT:.0f}s (exit code {proc.poll()}); see its error "
                f"above"
            )
        return line[0].split()[1]

    def dead_child(self) -> subprocess.Popen[str] | None:
        return next((p for p in self.procs if p.poll() is not None), None)

    def dead_units(self) -> list[int]:
        """Indices of the storage units whose process exited."""
        return [i for i, p in enumerate(self.procs[1:]) if p.poll() is not None]

    def close(self, grace: float = 5.0) -> None:
        """Stop every child: SIGTERM, then SIGKILL after ``grace`` seconds. Idempotent.

        The storage units go first: each holds a connection to the controller, and the side that
        closes a TCP connection first keeps it in TIME_WAIT, which must not be the controller's
        port (it could not be bound again at once without SO_REUSEADDR)."""
        deadline = time.monotonic() + grace
        for group in (self.procs[1:], self.procs[:1]):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                for stream in (p.stdin, p.stdout):
                    if stream is not None:
                        stream.close()
        # a unit killed (SIGKILL, the OOM killer) could not unlink its segments: nobody else would
        if any(p.returncode is not None and p.returncode < 0 for p in self.procs[1:]):
            swept = shm.sweep_dead_units()
            if swept:
                _log.info("removed the shared memory of %d killed storage units", swept)

    def __enter__(self) -> ProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, so flags and config share one description."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = str(after.value.value)
    return docs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tqstream-launch",
        description="Start a tqstream controller and storage units as processes. Prints "
        "'tqstream ready at tcp://HOST:PORT' once all serve; clients then call "
        "tqstream.connect(that address). Stops everything on SIGINT/SIGTERM.",
    )
    p.add_argument(
        "--storage-units",
        type=int,
        default=1,
        help="Number of storage-unit processes (default: 1).",
    )
    p.add_argument(
        "--on-unit-exit",
        choices=["restart", "stop"],
        default="restart",
        help="What to do when a storage-unit process exits: start it again at the same address "
        "(its rows are counted lost unless replicated) or stop the whole cluster "
        "(default: restart).",
    )
    docs = _field_docs(ControllerConfig)
    for f in dataclasses.fields(ControllerConfig):
        if f.name in ("storage_timeout", "keys"):
            continue
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(f.default),
            default=f.default,
            help=f"{docs.get(f.name, '')} (default: {f.default})",
        )
    sdocs = _field_docs(StorageConfig)
    p.add_argument(
        "--storage-max-bytes",
        type=int,
        default=StorageConfig.max_bytes,
        help=f"{sdocs['max_bytes']} Per storage unit. (default: {StorageConfig.max_bytes})",
    )
    p.add_argument(
        "--keys",
        default=None,
        metavar="PATH",
        help="The cluster's CURVE key file, made (mode 0600) if missing: every server then "
        "serves only peers holding it, encrypted; clients pass ClientConfig(keys=PATH) or set "
        "TQSTREAM_KEYS=PATH. (default: $TQSTREAM_KEYS, else no keys)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="Serve a --host other than loopback without keys: anyone who reaches the port can "
        "read, write and clear every partition.",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="Level of the 'tqstream' log lines every process writes to stderr (default: INFO).",
    )
    return p


def _restart(cluster: ProcessCluster, units: list[int]) -> bool:
    for i in units:
        exit_code = cluster.procs[i + 1].returncode
        try:
            address = cluster.restart_unit(i)
        except (RuntimeError, OSError) as exc:
            _log.error("storage unit %d cannot restart: %s", i, exc)
            return False
        _log.warning("storage unit %d exited with code %s; restarted at %s", i, exit_code, address)
    return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster = ProcessCluster(
            args.storage_units,
            host=args.host,
            port=args.port,
            lease_timeout=args.lease_timeout,
            put_timeout=args.put_timeout,
            max_message_bytes=args.max_message_bytes,
            storage_max_bytes=args.storage_max_bytes or None,
            replicas=args.replicas,
            keys=args.keys,
            insecure=args.insecure,
            metrics_port=args.metrics_port or None,
            log_level=args.log_level,
        )
    except (RuntimeError, ValueError, OSError) as exc:  # KeyFileError is a ValueError
        _log.error("%s", exc)
        return 1
    keys = f"clients set TQSTREAM_KEYS={cluster.keys}; " if cluster.keys else ""
    if cluster.metrics_address:
        keys += f"metrics at {cluster.metrics_address}; "
    print(
        f"tqstream ready at {cluster.address} (controller + {args.storage_units} storage "
        f"units; {keys}stop with Ctrl-C)",
        flush=True,
    )
    code = 0
    try:
        while not stop.wait(0.5):
            units = cluster.dead_units()
            if units and args.on_unit_exit == "restart" and cluster.procs[0].poll() is None:
                if not _restart(cluster, units):
                    code = 1
                    break
                continue
            dead = cluster.dead_child()
            if dead is not None:
                _log.error(
                    "child process %d exited with code %s; shutting down", dead.pid, dead.returncode
                )
                code = 1
                break
    finally:
        cluster.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
