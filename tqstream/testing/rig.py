"""Several hosts on one machine, for multi-host tests and benchmarks.

Each *host* is a network namespace with an address of its own on a bridge (the machine itself is
``10.<net>.0.254`` there) and a ``/dev/shm`` of its own: a process started on a host (see
:meth:`Rig.command`) runs in its own mount namespace with the host's shared-memory directory
mounted over ``/dev/shm``, so processes on one host share memory and processes on different hosts
do not, as on separate machines. Each host's link is shaped by ``tc tbf`` (a rate, e.g.
``10gbit``), and can be cut (:meth:`Rig.cut`) to take the host off the network.

It needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip``, ``tc``, ``unshare`` and ``mount``;
:func:`unavailable` says why it cannot be built where it cannot.

    with Rig(hosts=3, rate="10gbit") as rig:
        subprocess.Popen([*rig.command(1), sys.executable, "-m", "tqstream.launch.worker", ...])
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import msgspec

from tqstream.config import ControllerConfig, StorageConfig
from tqstream.protocol.auth import ensure_keys

__all__ = ["Rig", "RigCluster", "unavailable"]


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.returncode}")


def unavailable() -> str:
    """Why a rig cannot be built on this machine ("" when it can)."""
    missing = [tool for tool in ("ip", "tc", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        with Rig(hosts=1):
            pass
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return ""


class Rig:
    """``hosts`` hosts, numbered from 1, joined by a bridge; see the module docstring."""

    def __init__(self, hosts: int = 3, rate: str = "10gbit", net: int | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"a rig has 1 to 200 hosts, not {hosts}")
        self.hosts = hosts
        self.rate = rate
        self.net = net if net is not None else 100 + secrets.randbelow(100)
        self.tag = secrets.token_hex(3)
        self.bridge = f"tqb{self.tag}"
        self._dir = ""
        self._made: list[tuple[str, ...]] = []  # commands that undo what was made, newest last

    # --- names ---
    def namespace(self, host: int) -> str:
        return f"tqh{self.tag}-{host}"

    def address(self, host: int) -> str:
        """Host ``host``'s IP address (0: this machine, on the bridge)."""
        return f"10.{self.net}.0.{254 if host == 0 else host}"

    def _veth(self, host: int) -> str:
        return f"tqv{self.tag}{host}"

    def shm(self, host: int) -> str:
        """The directory mounted over ``/dev/shm`` for the processes of ``host``."""
        return os.path.join(self._dir, f"h{host}")

    def command(self, host: int) -> list[str]:
        """A prefix that runs a command on ``host``: its network, its ``/dev/shm``."""
        mount = f'mount --bind {self.shm(host)} /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.namespace(host),
                "unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh"]  # fmt: skip

    # --- building ---
    def __enter__(self) -> Rig:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        self._dir = tempfile.mkdtemp(prefix=f"tqstream-rig-{self.tag}-")
        self._made.append(("rm", "-rf", self._dir))
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("ip", "link", "del", self.bridge))
        _run("ip", "addr", "add", f"{self.address(0)}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host in range(1, self.hosts + 1):
            ns, veth = self.namespace(host), self._veth(host)
            os.makedirs(self.shm(host))
            _run("mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", self.shm(host))
            self._made.append(("umount", "-l", self.shm(host)))
            _run("ip", "netns", "add", ns)
            self._made.append(("ip", "netns", "del", ns))
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            self.shape(host, self.rate)

    def shape(self, host: int, rate: str) -> None:
        """Limit the traffic to ``host`` (its bridge port) and from it (its eth0) to ``rate``."""
        for where in (["dev", self._veth(host)],
                      ["dev", "eth0"]):  # fmt: skip
            ns = [] if where[1] != "eth0" else ["-n", self.namespace(host)]
            _run("tc", *ns, "qdisc", "replace", *where, "root", "tbf", "rate", rate,
                 "burst", "2mb", "latency", "50ms")  # fmt: skip

    def cut(self, host: int, down: bool = True) -> None:
        """Take ``host`` off the network (its link down), or back on."""
        _run("ip", "link", "set", self._veth(host), "down" if down else "up")

    def down(self) -> None:
        """Undo everything, newest first (processes still running on a host lose their network)."""
        while self._made:
            with contextlib.suppress(OSError, RuntimeError, subprocess.TimeoutExpired):
                _run(*self._made.pop())


class RigCluster:
    """A cluster over a rig's hosts: the controller on host 1, a storage unit on every host (unit
    ``i - 1`` on host ``i``), CURVE keys (the servers bind non-loopback addresses); clients run
    on a host with :meth:`run` (:mod:`tqstream.testing.client`)."""

    def __init__(self, rig: Rig, keys: str, lease_timeout: float = 300.0) -> None:
        self.rig = rig
        self.keys = keys
        ensure_keys(keys)
        self.procs: list[subprocess.Popen[str]] = []
        try:
            config = ControllerConfig(host=rig.address(1), keys=keys, lease_timeout=lease_timeout)
            self.address = self._start(1, "controller", config)
            self.units = [
                self._start(host, "storage", StorageConfig(host=rig.address(host), keys=keys))
                for host in range(1, rig.hosts + 1)
            ]  # unit i - 1 on host i (they register in this order)
        except BaseException:
            self.close()
            raise

    def _start(self, host: int, role: str, config: Any) -> str:
        cmd = [*self.rig.command(host), sys.executable, "-m", "tqstream.launch.worker", role,
               "--config", msgspec.json.encode(config).decode(), "--watch-stdin"]  # fmt: skip
        if role == "storage":
            cmd += ["--controller", self.address]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("READY "):
            raise RuntimeError(f"{role} on host {host} did not start: {line!r}")
        return line.split()[1]

    def run(self, host: int, role: str, *args: object, timeout: float = 300.0) -> dict[str, Any]:
        """Run a client (:mod:`tqstream.testing.client`) on ``host``; what it printed."""
        printed = self.start(host, role, *args).communicate(timeout=timeout)[0]
        out: dict[str, Any] = json.loads(printed)
        return out

    def start(self, host: int, role: str, *args: object) -> subprocess.Popen[str]:
        """Start a client (:mod:`tqstream.testing.client`) on ``host``."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        cmd = [*self.rig.command(host), sys.executable, "-m", "tqstream.testing.client", role,
               self.address, self.keys, *map(str, args)]  # fmt: skip
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()  # --watch-stdin: they stop
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
