"""``tqstream-launch``: a controller and N storage units as separate processes.

The launcher starts the controller, then the storage units (each registers with the controller),
prints one line with the connect address once all of them serve, and stays in the foreground. A
storage unit that exits is started again at the same address (``--on-unit-exit restart``, the
default; the controller has counted its rows lost, unless they had replicas, and the new process
registers and takes new rows) or stops the cluster (``stop``). A controller with a journal
(``--durability batched|sync --journal DIR``) that exits is started again at its address: it
replays its journal, the units stay, the clients' requests wait and are sent again
(docs/faults.md). On SIGINT/SIGTERM, or if a controller without a journal dies, it stops every
child (SIGTERM, then SIGKILL after a grace period) and exits; the children also exit on their own
if the launcher dies (they watch a pipe from it), so no orphan keeps a port.

Its flags are the cluster settings (``tqstream.config.cluster_settings``: one per field of the
configuration dataclasses, with their docstrings as help), and each child gets its component's
configuration whole, as JSON of the dataclass (``python -m tqstream.launch.worker ROLE --config
JSON``), so a new setting needs no edit here.

With ``--keys PATH`` (made if missing) every server serves only peers that hold that CURVE key
file. A ``--host`` other than loopback needs keys, or ``--insecure`` to serve anyone who reaches
the port (docs/security.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec

from tqstream.config import (
    ClusterConfig,
    ControllerConfig,
    StorageConfig,
    cluster_config,
    cluster_settings,
    is_loopback,
)
from tqstream.errors import ConfigError
from tqstream.launch.worker import LOG_FORMAT
from tqstream.protocol import shm
from tqstream.protocol.auth import ensure_keys

__all__ = ["ProcessCluster", "main"]

READY_TIMEOUT = 60.0

_log = logging.getLogger("tqstream.launch")


class ProcessCluster:
    """A controller and its storage units in child processes (what ``tqstream-launch`` runs).

    ``config``: the cluster (:class:`tqstream.ClusterConfig`; None: the defaults, then the
    ``TQSTREAM_*`` environment variables); ``storage_units`` (default 1) and the keyword
    ``settings`` change it by name, as every deployment takes them (docs/deployment.md):
    ``host``, ``port``, ``keys``, ``storage_max_bytes``, ``replicas``, ``metrics_port``, ...
    ``keys``: path of the cluster's CURVE key file, made if missing; clients pass the same path.
    A ``host`` other than loopback refuses to start without keys unless ``insecure``.
    ``log_level``: of the children's ``tqstream`` log lines on stderr (``tqstream-launch`` uses
    INFO). Each child gets its component's configuration as JSON of the dataclass."""

    def __init__(
        self,
        storage_units: int | None = None,
        *,
        config: ClusterConfig | None = None,
        insecure: bool = False,
        log_level: str = "WARNING",
        **settings: Any,
    ) -> None:
        config = cluster_config(config, storage_units=storage_units, **settings)
        config = config.with_settings(
            storage_units=config.storage_units or 1,
            keys=os.path.abspath(config.controller.keys) if config.controller.keys else None,
        )
        self.config = config
        """The cluster as started: environment and settings applied, the key file's path made
        absolute."""
        self.keys = config.controller.keys
        """The key file clients need ("": none)."""
        host = config.controller.host
        if not self.keys and not insecure and not is_loopback(host):
            raise ConfigError(
                f"--host {host} is reachable from other machines and the cluster has no keys: "
                f"anyone reaching the port could read, write and clear every partition; pass "
                f"--keys PATH (made if missing; clients then set TQSTREAM_KEYS=PATH), or "
                f"--insecure on a network you trust",
                setting="host",
            )
        if self.keys:
            ensure_keys(self.keys)  # before any child: they all load the same file
        self.procs: list[subprocess.Popen[str]] = []
        self._prefixes: dict[int, list[str]] = {}  # unit -> the command it runs under
        self.restarts = 0
        self.controller_restarts = 0
        self._log_level = log_level
        try:
            controller = self._spawn("controller", config.controller)
            self.address = self._ready(controller, "controller")
            port = config.controller.metrics_port
            self.metrics_address = f"http://{host}:{port}/metrics" if port else ""
            """The controller's Prometheus endpoint ("": none)."""
            units = [
                self._spawn("storage", config.storage) for _ in range(config.storage_units or 1)
            ]  # start together, then wait for each
            self.unit_addresses = [self._ready(u, "storage unit") for u in units]
        except BaseException:
            self.close()
            raise

    @property
    def durable(self) -> bool:
        """Whether the controller has a journal (and is started again when it exits)."""
        return self.config.controller.durability != "off"

    def restart_controller(self) -> str:
        """Start the controller again (after it exited, or stop it first) at its address, on its
        journal: it carries on where it was (a controller with a journal only)."""
        if not self.durable:
            raise ConfigError(
                "a controller without a journal cannot be restarted: it would start empty, its "
                "units and clients knowing another state; start the cluster with --durability "
                "batched --journal DIR",
                setting="durability",
            )
        self._reap(0)
        port = int(self.address.rsplit(":", 1)[1])
        proc = self._spawn("controller", replace(self.config.controller, port=port), at=0)
        self.address = self._ready(proc, "controller")
        self.controller_restarts += 1
        return self.address

    def _reap(self, at: int) -> None:
        old = self.procs[at]
        if old.poll() is None:
            old.kill()
        old.wait()
        for stream in (old.stdin, old.stdout):
            if stream is not None:
                stream.close()

    def restart_unit(self, i: int) -> str:
        """Start storage unit ``i`` again (after it exited, or stop it first) at its address, so
        clients and the controller find it where it was; returns the address."""
        self._reap(i + 1)
        port = int(self.unit_addresses[i].rsplit(":", 1)[1])
        prefix = self._prefixes.get(i, ())
        proc = self._spawn("storage", replace(self.config.storage, port=port), at=i + 1,
                           prefix=prefix)  # fmt: skip
        self.unit_addresses[i] = self._ready(proc, "storage unit")
        self.restarts += 1
        return self.unit_addresses[i]

    def add_unit(self, prefix: Sequence[str] = ()) -> str:
        """Start one more storage unit with the cluster's storage settings, registered with its
        controller and stopped with the cluster; returns its address. ``prefix``: a command the
        unit runs under, e.g. one that enters another mount namespace (a private ``/dev/shm``:
        for the clients, a unit on another host)."""
        proc = self._spawn("storage", self.config.storage, prefix=prefix)
        address = self._ready(proc, "storage unit")
        self._prefixes[len(self.unit_addresses)] = list(prefix)  # a restart runs under it too
        self.unit_addresses.append(address)
        return address

    def _spawn(
        self,
        role: str,
        config: ControllerConfig | StorageConfig,
        at: int | None = None,
        prefix: Sequence[str] = (),
    ) -> subprocess.Popen[str]:
        """Start a child with its configuration, as ``procs[at]`` (None: appended)."""
        cmd = [*prefix, sys.executable, "-m", "tqstream.launch.worker", role]
        cmd += ["--config", msgspec.json.encode(config).decode(), "--log-level", self._log_level]
        if role == "storage":
            cmd += ["--controller", self.address]
        proc = subprocess.Popen(
            [*cmd, "--watch-stdin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if at is None:
            self.procs.append(proc)
        else:
            self.procs[at] = proc
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tqstream-launch",
        description="Start a tqstream controller and storage units as processes. Prints "
        "'tqstream ready at tcp://HOST:PORT' once all serve; clients then call "
        "tqstream.connect(that address). Stops everything on SIGINT/SIGTERM. Every cluster "
        "setting has a flag; one not given comes from its TQSTREAM_* variable, else its default.",
    )
    for s in cluster_settings().values():
        default = "unset" if s.default is None else repr(s.default)
        p.add_argument(
            s.flag,
            dest=s.name,
            type=s.kind,
            default=None,
            metavar=s.kind.__name__.upper(),
            help=f"{s.doc} (default: {default}; {s.env})".replace("%", "%%"),
        )
    p.add_argument(
        "--on-unit-exit",
        choices=["restart", "stop"],
        default="restart",
        help="What to do when a storage-unit process exits: start it again at the same address "
        "(its rows are counted lost unless replicated) or stop the whole cluster "
        "(default: restart).",
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
            insecure=args.insecure,
            log_level=args.log_level,
            **{name: getattr(args, name) for name in cluster_settings()},
        )
    except (RuntimeError, ValueError, OSError) as exc:  # ConfigError, KeyFileError: ValueErrors
        _log.error("%s", exc)
        return 1
    keys = f"clients set TQSTREAM_KEYS={cluster.keys}; " if cluster.keys else ""
    if cluster.metrics_address:
        keys += f"metrics at {cluster.metrics_address}; "
    print(
        f"tqstream ready at {cluster.address} (controller + {len(cluster.unit_addresses)} storage "
        f"units; {keys}stop with Ctrl-C)",
        flush=True,
    )
    code = 0
    try:
        while not stop.wait(0.5):
            if cluster.durable and cluster.procs[0].poll() is not None:
                exit_code = cluster.procs[0].returncode
                try:
                    cluster.restart_controller()
                except (RuntimeError, OSError) as exc:
                    _log.error("the controller cannot restart: %s", exc)
                    code = 1
                    break
                _log.warning(
                    "the controller exited with code %s; restarted at %s on its journal",
                    exit_code, cluster.address,
                )  # fmt: skip
                continue
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
