"""One adapter per system, all with the same round-trip interface.

A round trip is ``put(data) -> handle``, ``get(handle) -> {field: tensor}`` (usable torch tensors
on the consumer side) and ``done(handle)`` (ack / clear: the system no longer holds the rows).
``prepare(batch)`` turns a workload batch into the system's native input outside the timed region.
Systems with consumer-task semantics (every task reads every row once) also implement
:class:`TaskSystem`, used by the metadata and concurrency scenarios.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from benchmarks._workload import FIELDS, Batch
from benchmarks._workload import flat as _flat

__all__ = [
    "NAMED_ONLY",
    "OPT_IN",
    "SYSTEMS",
    "System",
    "TaskSystem",
    "flatten",
    "make_system",
    "missing",
    "ray_session",
    "settle",
]

TASK = "bench"
WAIT = 120.0  # seconds a consumer waits for rows before the benchmark fails
Data = Mapping[str, torch.Tensor]


class System:
    """The round-trip interface; subclasses set ``name`` and ``note`` (what is measured)."""

    name: str = ""
    mode: str = ""  # the variant, e.g. the transport
    note: str = ""
    needs: ClassVar[tuple[str, ...]] = ()  # importable packages this system needs

    def start(self) -> None:
        """Start servers / connect. Called once per session."""

    def close(self) -> None:
        """Stop what ``start`` started."""

    def begin(self, tag: str) -> None:
        """Before a scenario's rounds: e.g. create a partition named after ``tag``."""

    def end(self) -> None:
        """After a scenario's rounds."""

    def prepare(self, batch: Batch) -> Any:
        """The batch as a rollout has it (ragged fields as lists of one tensor per row), for
        every system alike: what a system needs to do with it is in its timed ``put``."""
        return batch.fields

    def put(self, data: Any) -> Any:
        raise NotImplementedError

    def get(self, handle: Any) -> Data:
        raise NotImplementedError

    def done(self, handle: Any) -> None:
        """Release what the round stored."""

    def held(self) -> int | None:
        """Rows or bytes still stored (0 after every round), None where it cannot be asked."""
        return None

    def roundtrip(self, data: Any) -> Data:
        handle = self.put(data)
        out = self.get(handle)
        self.done(handle)
        return out


class TaskSystem(System):
    """A system with partitions and consumer tasks."""

    max_rows: ClassVar[int | None] = None  # largest partition the metadata scenario may build
    max_rows_reason: ClassVar[str] = ""

    def create(self, partition: str, tasks: Sequence[str]) -> None:
        """Create ``partition``; where the system can, rows are freed once ``tasks`` acked."""
        raise NotImplementedError

    def put_rows(self, partition: str, data: Any) -> None:
        raise NotImplementedError

    def take(
        self,
        partition: str,
        rows: int,
        task: str,
        *,
        fields: Sequence[str] = FIELDS,
        timeout: float = WAIT,
    ) -> tuple[Data, Any]:
        """Wait for ``rows`` rows ``task`` has not read; return their ``fields`` and a token.
        Raises ``TimeoutError`` after ``timeout`` seconds."""
        raise NotImplementedError

    def ack(self, token: Any) -> None:
        """``task`` is done with the rows of ``token``."""

    def clear(self, token: Any) -> None:
        """Delete the rows of ``token`` for every task and free their bytes."""
        raise NotImplementedError

    def consume(self, partition: str, rows: int, task: str) -> None:
        """Mark ``rows`` rows read by ``task`` without fetching their data (setup only)."""
        raise NotImplementedError

    def drop(self, partition: str) -> None:
        raise NotImplementedError

    def rows(self, partition: str) -> int:
        """Rows the partition holds."""
        raise NotImplementedError


def restore(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo :meth:`Batch.flat`: ``<name>`` + ``<name>.offsets`` become a jagged nested tensor."""
    out = {}
    for name in FIELDS:
        offsets = flat.get(f"{name}.offsets")
        out[name] = (
            flat[name]
            if offsets is None
            else torch.nested.nested_tensor_from_jagged(flat[name], offsets)
        )
    return out


def flatten(value: Any) -> torch.Tensor:
    """A field's values back to back, whatever form it came in (dense, nested, list)."""
    if isinstance(value, list):
        return torch.cat([t.reshape(-1) for t in value])
    if value.is_nested:
        return value.values().reshape(-1)
    return value.reshape(-1)


# --- in-memory limit ----------------------------------------------------------------------------
class Memcpy(System):
    name = "memcpy"
    note = (
        "two memcpys (put: copy into a preallocated buffer, get: copy out into another); the "
        "in-memory limit"
    )

    def prepare(self, batch: Batch) -> Any:
        flat = batch.flat()  # only to size the buffers (preallocated: not timed)
        store = {k: torch.empty_like(v) for k, v in flat.items()}
        out = {k: torch.empty_like(v) for k, v in flat.items()}
        return batch.fields, store, out

    def put(self, data: Any) -> Any:
        fields, store, out = data
        for k, v in fields.items():
            if isinstance(v, list):  # each row copied once into place, its offsets beside it
                torch.cat(v, out=store[k])
                lengths = torch.tensor([0] + [len(t) for t in v], dtype=torch.int64)
                torch.cumsum(lengths, 0, out=store[f"{k}.offsets"])
            else:
                store[k].copy_(v)
        return store, out

    def get(self, handle: Any) -> Data:
        store, out = handle
        for k, v in store.items():
            out[k].copy_(v)
        return restore(out)


# --- raw pyzmq ----------------------------------------------------------------------------------
_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (torch.int64, torch.int32, torch.bool)}
_DTYPES["float32"] = torch.float32


class _StoreProcess:
    """A ``_zmq_store.py`` process and a DEALER socket to it."""

    def __init__(self, ctx: Any, address: str) -> None:
        import zmq

        self._unanswered = 0  # requests sent with tell() whose replies are not read yet
        script = Path(__file__).with_name("_zmq_store.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), address], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.close()
            raise RuntimeError(f"zmq store did not start (exit code {self.proc.poll()})")
        self.endpoint = line[1]
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(line[1])

    def ask(self, *frames: Any, copy: bool = True) -> list[Any]:
        self.settle()
        self.sock.send_multipart(frames, copy=copy)
        return self.sock.recv_multipart(copy=False)  # type: ignore[no-any-return]

    def tell(self, *frames: Any) -> None:
        """Send a request without waiting for its reply (read by the next ``ask``)."""
        self.sock.send_multipart(frames)
        self._unanswered += 1

    def settle(self) -> None:
        """Read the replies of earlier ``tell``s."""
        for _ in range(self._unanswered):
            self.sock.recv_multipart()
        self._unanswered = 0

    def close(self) -> None:
        if hasattr(self, "sock"):
            self.ask(b"stop")
            self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class RawZmq(System):
    """A DEALER client and a ROUTER store process holding the received frames."""

    note = (
        "raw pyzmq, zero-copy frames: one store process holds each put's frames; get sends "
        "them back and the client wraps them with torch.frombuffer; del drops them. No metadata "
        "service, no tasks: the floor for a store in another process. Ragged fields as values "
        "+ offsets"
    )

    def __init__(self, transport: str) -> None:
        self.name = f"zmq-{transport}"
        self.mode = transport
        self._keys = itertools.count()
        self._stores: list[_StoreProcess] = []

    def start(self) -> None:
        import zmq

        self._dir = tempfile.mkdtemp(prefix="tqbench-")
        self._ctx = zmq.Context()
        self.store = self._store("store")

    def _store(self, name: str) -> _StoreProcess:
        tcp = "tcp://127.0.0.1:*"
        store = _StoreProcess(self._ctx, f"ipc://{self._dir}/{name}" if self.mode == "ipc" else tcp)
        self._stores.append(store)
        return store

    def close(self) -> None:
        for store in self._stores:
            store.close()
        if hasattr(self, "_ctx"):
            self._ctx.term()
        if hasattr(self, "_dir"):
            shutil.rmtree(self._dir, ignore_errors=True)

    def put(self, data: Any) -> Any:
        flat = _flat(data)  # ragged fields as values + offsets: part of this system's round
        header = json.dumps(
            [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in flat.items()]
        ).encode()
        key = str(next(self._keys)).encode()
        buffers = [v.view(torch.uint8).numpy().data for v in flat.values()]
        if self.store.ask(b"put", key, header, *buffers, copy=False)[0].bytes != b"ok":
            raise RuntimeError("zmq store refused a put")
        return key

    def get(self, handle: Any) -> Data:
        header, *frames = self.store.ask(b"get", handle)
        flat = {}
        with warnings.catch_warnings():  # frames are read-only; so are the tensors on them
            warnings.filterwarnings("ignore", message=".*not writable.*")
            for (name, dtype, shape), frame in zip(json.loads(header.bytes), frames, strict=True):
                flat[name] = torch.frombuffer(frame.buffer, dtype=_DTYPES[dtype]).view(shape)
        return restore(flat)

    def done(self, handle: Any) -> None:
        self.store.ask(b"del", handle)

    def held(self) -> int | None:
        return int(self.store.ask(b"len")[0].bytes)


META = b"m" * 256
"""The body of one emulated metadata request (and of its echoed reply)."""


class ZmqPattern(RawZmq):
    """Raw pyzmq exchanging tqstream's messages, with no work behind them."""

    note = (
        "raw pyzmq over TCP in tqstream's multi-process message pattern, with nothing behind "
        "the messages: a metadata process that echoes 256-byte requests (the put's commit, "
        "which tqstream's storage unit sends on the put's way, here sent by the client after "
        "the store; get meta; ack) and a store process as in zmq-tcp (store, fetch; the drop "
        "is sent without waiting, as the controller orders it after the ack). The floor of "
        "tqstream's multi-process deployment: what is left is tqstream's own work"
    )

    def __init__(self) -> None:
        super().__init__("tcp")
        self.name = "zmq-pattern"

    def start(self) -> None:
        super().start()
        self.meta = self._store("meta")

    def put(self, data: Any) -> Any:
        key = super().put(data)
        self.meta.ask(b"echo", META)
        return key

    def get(self, handle: Any) -> Data:
        self.meta.ask(b"echo", META)
        return super().get(handle)

    def done(self, handle: Any) -> None:
        self.meta.ask(b"echo", META)
        self.store.tell(b"del", handle)


# --- Ray ------------------------------------------------------------------------------------------
RAY_CPUS = 4


def ray_session() -> Any:
    """Start a local Ray on loopback (once per session) and return the ``ray`` module."""
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
        # TransferQueue sets torch's thread count around its puts and gets: the same as ours
        os.environ.setdefault("TQ_NUM_THREADS", str(torch.get_num_threads()))
        ray.init(
            address="local",
            num_cpus=RAY_CPUS,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
    return ray


class RayObjectStore(System):
    name = "ray-object-store"
    needs = ("ray",)
    note = (
        "ray.put of the dict of tensors in the driver, ray.get in the same driver (the object "
        "goes into the raylet's shared-memory object store; get maps it and deserializes), then "
        "the reference is dropped; no metadata service, no tasks. Ragged fields as values + "
        "offsets"
    )

    def start(self) -> None:
        self.ray = ray_session()

    def put(self, data: Any) -> Any:
        return self.ray.put(_flat(data))  # values + offsets: Ray's fastest form of ragged rows

    def get(self, handle: Any) -> Data:
        return restore(self.ray.get(handle))


class RayActorQueue(System):
    name = "ray-actor-queue"
    needs = ("ray",)
    note = (
        "a Ray actor holding a deque (the former verl MessageQueue pattern): "
        "ray.get(queue.put.remote(batch)), then ray.get(queue.get.remote()); torch tensors "
        "travel through Ray's serializer and object store both ways"
    )

    def start(self) -> None:
        ray = ray_session()

        class Queue:
            def __init__(self) -> None:
                from collections import deque

                self.items: Any = deque()

            def put(self, item: Any) -> None:
                self.items.append(item)

            def get(self) -> Any:
                return self.items.popleft()

            def size(self) -> int:
                return len(self.items)

        self.ray = ray
        self.queue = ray.remote(num_cpus=1)(Queue).remote()
        ray.get(self.queue.size.remote())

    def close(self) -> None:
        if hasattr(self, "queue"):
            self.ray.kill(self.queue)

    def put(self, data: Any) -> Any:
        self.ray.get(self.queue.put.remote(_flat(data)))

    def get(self, handle: Any) -> Data:
        return restore(self.ray.get(self.queue.get.remote()))

    def held(self) -> int | None:
        return int(self.ray.get(self.queue.size.remote()))


# --- tqstream -------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Launched:
    """A cluster started the way a user starts one: the ``tqstream-launch`` command (the
    virtualenv's script, else the one on ``PATH``) with ``args``, in a process of its own; its
    address read from the line it prints once every server serves. Its log lines (INFO, the
    command's default) go to a file, shown when it fails to start. ``close`` sends SIGINT, what
    Ctrl-C does, and waits for it to stop its children."""

    def __init__(self, args: Sequence[str]) -> None:
        script = Path(sys.executable).with_name("tqstream-launch")
        command = str(script) if script.exists() else shutil.which("tqstream-launch")
        if command is None:
            raise RuntimeError("tqstream-launch is not installed (pip install -e .)")
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            [command, *args], stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the launcher exits if a child cannot start
        if not line.startswith("tqstream ready at "):
            self.close()
            self.log.seek(0)
            raise RuntimeError(f"tqstream-launch {' '.join(args)} did not start: {line}"
                               f"{self.log.read()[-3000:]}")  # fmt: skip
        self.address = line.split()[3]
        self.pids = self._children()
        """The servers' pids: the controller first, then the storage units."""

    def _children(self) -> list[int]:
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.proc.pid:
                    cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
                    children.append((b"controller" not in cmdline, int(stat.parent.name)))
        return [pid for _, pid in sorted(children)]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


class TQStream(TaskSystem):
    """tqstream, embedded (controller + 1 storage unit in this process) or as processes
    (``ProcessCluster``, or the ``tqstream-launch`` command: ``deployment="launch"``)."""

    def __init__(
        self,
        name: str,
        deployment: str,
        shared_memory: str,
        replicas: int = 1,
        keys: bool = False,
        metrics: bool = False,
        durability: str = "off",
    ) -> None:
        self.name = name
        self.metrics = metrics
        self.durability = durability
        self.deployment = deployment
        self.shared_memory = shared_memory
        self.replicas = replicas
        self.keys = keys
        self.mode = f"{deployment}, shared_memory={shared_memory}" + (", CURVE" if keys else "")
        self.mode += ", metrics" if metrics else ""
        self.partition = ""
        where = (
            "embedded: controller + 1 storage unit on the benchmark process's loop thread, reached "
            "over inproc://; chunks of 1 MiB or more through /dev/shm, smaller ones as frames"
            if deployment == "embedded"
            else (
                "tqstream-launch --storage-units 1 (the command users run): controller + 1 "
                "storage unit as its child processes"
                if deployment == "launch"
                else "ProcessCluster: controller + 1 storage unit as child processes"
                if replicas == 1
                else f"ProcessCluster: controller + 2 storage units, replicas={replicas} (every "
                "row stored on both)"
            )
            + (
                ", chunks of 1 MiB or more through /dev/shm, smaller ones over TCP"
                if shared_memory == "auto"
                else ", bytes over TCP"
            )
        )
        if durability != "off":
            where += (
                f"; the controller journals every change before its reply (--durability "
                f"{durability} --journal DIR, on this machine's disk)"
            )
        if keys:
            where += "; every TCP socket authenticated and encrypted with CURVE (--keys)"
        if metrics:
            where += (
                "; the controller serves Prometheus metrics (--metrics-port), scraped every 1 s"
            )
        self.note = (
            f"tqstream {where}, ClientConfig(shared_memory={shared_memory!r}); put, get with a "
            f"consumer task (lease + fetch), ack; the partition registers the task, so the ack "
            f"frees the rows"
        )

    def start(self) -> None:
        import tqstream

        keys = ""
        if self.keys:
            self._keydir = tempfile.mkdtemp(prefix="tqstream-bench-keys-")
            keys = os.path.join(self._keydir, "cluster.keys")
        config = tqstream.ClientConfig(shared_memory=self.shared_memory, keys=keys)
        port = _free_port() if self.metrics else None
        if self.deployment == "embedded":
            self.client = tqstream.init(storage_units=1, client_config=config, metrics_port=port)
        elif self.deployment == "launch":
            args = ["--storage-units", str(self.replicas), "--replicas", str(self.replicas)]
            args += ["--keys", keys] if keys else []
            args += ["--metrics-port", str(port)] if port else []
            if self.durability != "off":
                self._journal = tempfile.mkdtemp(prefix="tqstream-bench-journal-")
                args += ["--durability", self.durability, "--journal", self._journal]
            self.launched = Launched(args)
            self.client = tqstream.connect(self.launched.address, config=config)
        else:
            self.cluster = tqstream.ProcessCluster(
                storage_units=self.replicas, replicas=self.replicas, keys=keys, metrics_port=port
            )
            self.client = tqstream.connect(self.cluster.address, config=config)
        if port is not None:
            self._scraping = threading.Event()
            url = f"http://127.0.0.1:{port}/metrics"
            threading.Thread(target=_scrape, args=(url, self._scraping), daemon=True).start()

    def server_cpu(self) -> dict[str, float] | None:
        """CPU seconds (user + system, every thread) the controller and the storage units have
        used so far; None for the embedded deployment, whose servers share this process."""
        if hasattr(self, "cluster"):
            pids = [p.pid for p in self.cluster.procs]
        elif hasattr(self, "launched"):
            pids = self.launched.pids
        else:
            return None
        seconds = [cpu_seconds(pid) for pid in pids]
        return {"controller": seconds[0], "units": sum(seconds[1:])}

    def close(self) -> None:
        if hasattr(self, "_scraping"):
            self._scraping.set()
        if hasattr(self, "client"):
            self.client.close()
        if hasattr(self, "cluster"):
            self.cluster.close()
        if hasattr(self, "launched"):
            self.launched.close()
        if hasattr(self, "_keydir"):
            shutil.rmtree(self._keydir, ignore_errors=True)
        if hasattr(self, "_journal"):
            shutil.rmtree(self._journal, ignore_errors=True)

    def begin(self, tag: str) -> None:
        self.partition = tag
        self.create(tag, [TASK])

    def end(self) -> None:
        self.drop(self.partition)

    def prepare(self, batch: Batch) -> Any:
        return batch.fields

    def put(self, data: Any) -> Any:
        return len(self.client.put(data, self.partition))

    def get(self, handle: Any) -> Data:
        data, self._lease = self.take(self.partition, handle, TASK)
        return data

    def done(self, handle: Any) -> None:
        self.client.ack(self._lease)

    def held(self) -> int | None:
        return sum(unit.bytes for unit in self.client.stats().units)

    def create(self, partition: str, tasks: Sequence[str]) -> None:
        self.client.create_partition(partition, FIELDS, tasks=list(tasks))

    def put_rows(self, partition: str, data: Any) -> None:
        self.client.put(data, partition)

    def take(
        self,
        partition: str,
        rows: int,
        task: str,
        *,
        fields: Sequence[str] = FIELDS,
        timeout: float = WAIT,
    ) -> tuple[Data, Any]:
        batch = self.client.get(
            partition, list(fields), batch_size=rows, task=task, timeout=timeout
        )
        return batch.data, batch.meta

    def ack(self, token: Any) -> None:
        self.client.ack(token)

    def clear(self, token: Any) -> None:
        self.client.clear_samples(token)

    def consume(self, partition: str, rows: int, task: str) -> None:
        self.client.ack(self.client.get_meta(partition, FIELDS, rows, task, timeout=WAIT))

    def drop(self, partition: str) -> None:
        self.client.clear_partition(partition)

    def rows(self, partition: str) -> int:
        return self.client.stats(partition).partitions[partition].rows


# --- TransferQueue --------------------------------------------------------------------------------
TQ_POLL = 0.002  # seconds between a TransferQueue consumer's polls while too few rows are ready


class TransferQueue(TaskSystem):
    name = "transferqueue"
    needs = ("ray", "transfer_queue")
    note = (
        "TransferQueue (SimpleStorage backend): controller + 1 storage unit as Ray actors on "
        "loopback; put(TensorDict), get_meta with a task + get_data, clear_samples. Its "
        "controller runs in polling mode (a get_meta with too few rows ready returns an empty "
        f"batch; the consumer polls every {TQ_POLL * 1000:.0f} ms) because a blocking get_meta "
        "stalls the whole controller. get_data returns nested (jagged) tensors, dense fields "
        "included"
    )
    max_rows = 10**6
    max_rows_reason = (
        "filling 10^6 rows already takes ~30 s and ~5 GB in its actors on 2 cores (a Python "
        "object per row and field); larger partitions are not measured"
    )

    def start(self) -> None:
        ray_session()
        import transfer_queue as tq
        from omegaconf import OmegaConf

        self.tq = tq
        conf = {
            "controller": {"polling_mode": True},
            "backend": {"SimpleStorage": {"num_data_storage_units": 1}},
        }
        tq.init(OmegaConf.create(conf))
        self.client = tq.get_client()
        self.partition = ""

    def close(self) -> None:
        if hasattr(self, "tq"):
            self.tq.close()

    def begin(self, tag: str) -> None:
        self.partition = tag

    def end(self) -> None:
        self.drop(self.partition)

    @staticmethod
    def _native(data: Any) -> Any:
        """A TensorDict with ragged fields as jagged nested tensors: TransferQueue's input (made
        inside the timed round, as every system makes its own form)."""
        from tensordict import TensorDict

        flat = _flat(data)
        fields = {
            name: torch.nested.nested_tensor_from_jagged(flat[name], flat[f"{name}.offsets"])
            if f"{name}.offsets" in flat
            else flat[name]
            for name in data
        }
        return TensorDict(fields, batch_size=[len(flat["rewards"])])

    def put(self, data: Any) -> Any:
        native = self._native(data)
        self.client.put(data=native, partition_id=self.partition)
        return int(native.batch_size[0])

    def get(self, handle: Any) -> Data:
        data, self._meta = self.take(self.partition, handle, TASK)
        return data

    def done(self, handle: Any) -> None:
        self.client.clear_samples(self._meta)

    def held(self) -> int | None:
        return self.rows(self.partition)

    def create(self, partition: str, tasks: Sequence[str]) -> None:
        """Partitions are created by their first put; consumption is tracked per task name."""

    def put_rows(self, partition: str, data: Any) -> None:
        self.client.put(data=self._native(data), partition_id=partition)

    def take(
        self,
        partition: str,
        rows: int,
        task: str,
        *,
        fields: Sequence[str] = FIELDS,
        timeout: float = WAIT,
    ) -> tuple[Data, Any]:
        deadline = time.monotonic() + timeout
        while True:
            meta = self.client.get_meta(
                data_fields=list(fields), batch_size=rows, partition_id=partition, task_name=task
            )
            if meta.size:
                return self.client.get_data(meta), meta
            if time.monotonic() > deadline:
                raise TimeoutError(f"{rows} rows of {partition!r} not ready for {task!r}")
            time.sleep(TQ_POLL)

    def clear(self, token: Any) -> None:
        self.client.clear_samples(token)

    def consume(self, partition: str, rows: int, task: str) -> None:
        meta = self.client.get_meta(
            data_fields=list(FIELDS), batch_size=rows, partition_id=partition, task_name=task
        )
        if meta.size != rows:
            raise RuntimeError(f"consumed {meta.size} of {rows} rows")

    def drop(self, partition: str) -> None:
        if partition in self.client.get_partition_list():
            self.client.clear_partition(partition)

    def rows(self, partition: str, fields: Sequence[str] = FIELDS) -> int:
        _, status = self.client.get_production_status(list(fields), partition)
        if status is None or status.numel() == 0:
            return 0
        return int(status.reshape(status.shape[0], -1).all(dim=1).sum())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str, stop: threading.Event, every: float = 1.0) -> None:
    """What a Prometheus server does, more often than usual (15 s is the default)."""
    while not stop.wait(every):
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                reply.read()
        except OSError:
            return  # the cluster is closing


# --- registry -------------------------------------------------------------------------------------
SYSTEMS = (
    "tqstream-embedded",
    "tqstream-procs-tcp",
    "tqstream-procs-shm",
    "tqstream-launch",
    "tqstream-launch-batched",
    "tqstream-launch-sync",
    "tqstream-replicas",
    "tqstream-procs-tcp-curve",
    "tqstream-procs-shm-curve",
    "tqstream-embedded-metrics",
    "tqstream-procs-tcp-metrics",
    "tqstream-procs-shm-metrics",
    "memcpy",
    "zmq-ipc",
    "zmq-tcp",
    "zmq-pattern",
    "ray-object-store",
    "ray-actor-queue",
    "transferqueue",
)
OPT_IN = (
    "tqstream-procs-tcp-curve",
    "tqstream-procs-shm-curve",
    "tqstream-embedded-metrics",
    "tqstream-procs-tcp-metrics",
    "tqstream-procs-shm-metrics",
)
"""Systems run only when named (``--bench-systems``, ``interleave --systems``): what CURVE keys
and the metrics endpoint cost, next to the same systems without them."""
NAMED_ONLY = ("tqstream-launch", "tqstream-launch-batched", "tqstream-launch-sync")
"""Systems only the scenarios naming them in their module's ``BENCH_SYSTEMS`` run: the cluster
``tqstream-launch`` starts is ``tqstream-procs-shm``'s (the same ``ProcessCluster``, from the
command), measured where the command is the point (the producers scenario), and with the
controller's journal (``--durability batched`` / ``sync``) where what durability costs is."""


def make_system(name: str) -> System:
    if name == "tqstream-embedded":
        return TQStream(name, "embedded", "auto")
    if name == "tqstream-procs-shm":
        return TQStream(name, "procs", "auto")
    if name == "tqstream-launch":
        return TQStream(name, "launch", "auto")
    if name.startswith("tqstream-launch-"):
        return TQStream(name, "launch", "auto", durability=name.removeprefix("tqstream-launch-"))
    if name == "tqstream-procs-tcp":
        return TQStream(name, "procs", "off")
    if name == "tqstream-replicas":
        return TQStream(name, "procs", "auto", replicas=2)
    if name == "tqstream-procs-shm-curve":
        return TQStream(name, "procs", "auto", keys=True)
    if name == "tqstream-procs-tcp-curve":
        return TQStream(name, "procs", "off", keys=True)
    if name.endswith("-metrics"):
        base = make_system(name.removesuffix("-metrics"))
        assert isinstance(base, TQStream)
        return TQStream(name, base.deployment, base.shared_memory, metrics=True)
    if name == "memcpy":
        return Memcpy()
    if name in ("zmq-ipc", "zmq-tcp"):
        return RawZmq(name.removeprefix("zmq-"))
    if name == "zmq-pattern":
        return ZmqPattern()
    if name == "ray-object-store":
        return RayObjectStore()
    if name == "ray-actor-queue":
        return RayActorQueue()
    if name == "transferqueue":
        return TransferQueue()
    raise KeyError(name)


def settle(limit: float = 15.0, idle: float = 0.8) -> None:
    """Wait, up to ``limit`` seconds, until the CPUs are at least ``idle`` idle over half a second:
    servers and Ray workers that just started may still be importing, which would skew the first
    scenario measured."""

    def ticks() -> list[int]:  # the "cpu" line: user nice system idle iowait ...
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]

    try:
        prev = ticks()
    except (OSError, ValueError):
        time.sleep(1.0)
        return
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.5)
        cur = ticks()
        delta = [c - p for c, p in zip(cur, prev, strict=True)]
        if sum(delta) and (delta[3] + delta[4]) / sum(delta) >= idle:
            return
        prev = cur


def missing(system: System) -> str | None:
    """The first package ``system`` needs that is not installed."""
    return next((p for p in system.needs if importlib.util.find_spec(p) is None), None)
