"""producers: P producer processes (8) each put one trajectory, or one group of 8, at a time
(ragged, 768-1280 tokens) — or 32 trajectories in flight, put as soon as they can be or at the times
of a Poisson process of a set rate, or 32 rollouts each ending after a random 0-2 ms and building
its trajectory then (``_workload.Producers``) — while one consumer in the benchmark process reads
batches of 256 rows and acks them. A round is the exchange of a fixed number of rows (2048
trajectories, 4096 rows in groups, 8192 in the agent-loop pair), from the producers' common start
to the last batch acked, so rows / round time is the sustained rate; ``first_put_s`` is how long
after this process left the start barrier the first put began (a few ms either way: the processes
leave it one after the other), ``first_put_to_last_ack_s`` the exchange counted from that put.
Producers time each of their own puts and send the times back: p50 / p99 go into ``extra_info``,
with the CPU time each side used during the timed rounds, per row (user + system, every thread):
``producers_cpu_us_per_row`` (their trajectories' building included where it is timed),
``consumer_cpu_us_per_row`` (this process: the embedded servers too) and, for a tqstream process
cluster, ``controller_cpu_us_per_row`` and ``units_cpu_us_per_row`` (from ``/proc``). Every round
checks that no row was lost or read twice and nothing is left stored; the untimed warmup exchange
also compares the data.

The producer processes are spawned once per session and connected to one system after another
(to the Ray-based systems as drivers of the benchmark's Ray cluster); each gets one job per
exchange. Each put starts from the same input, a dict of lists of 1-D tensors, and includes what
the system needs done to it: tqstream encodes the lists itself, TransferQueue gets a TensorDict
of jagged nested tensors built in the timed put, the Ray queue a ``ray.cloudpickle`` blob, as
verl's fully-async rollouter sends its samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import math
import multiprocessing
import os
import random
import statistics
import time
import traceback
import warnings
import zlib
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from benchmarks._systems import (
    WAIT,
    Data,
    RawZmq,
    System,
    TaskSystem,
    TQStream,
    TransferQueue,
    flatten,
    ray_session,
)
from benchmarks._workload import (
    PRODUCERS,
    TRAJECTORY_FIELDS,
    Producers,
    Trajectories,
    make_trajectories,
    make_trajectory,
)

BENCH_SYSTEMS = (
    "tqstream-embedded",
    "tqstream-procs-shm",
    "tqstream-launch",
    "tqstream-launch-batched",
    "tqstream-launch-sync",
    "tqstream-replicas",
    "ray-actor-queue",
    "transferqueue",
    "zmq-tcp",
)
TASK = "consumer"
POLL = 1.0  # seconds a consumer waits for a batch before checking that every producer is alive
RAY_NAMESPACE = "tqstream-bench"
RAGGED = TRAJECTORY_FIELDS[:-1]  # every field but rewards
# the agent loop's rollouts put trajectories built beforehand: its random end times alone, without
# the CPU of building each trajectory when its rollout ends
PREBUILT = os.environ.get("TQSTREAM_BENCH_AGENT_PREBUILT", "0") not in ("", "0")


# --- producer side: one connection per producer process -----------------------------------------
class Producer:
    """A producer process's connection to a system; ``put`` is what each timed put does."""

    def put(self, item: Trajectories, tag: str) -> None:
        raise NotImplementedError

    async def async_put(self, item: Trajectories, tag: str) -> None:
        """The put of one of several rollouts in flight (the system's own async put)."""
        raise NotImplementedError

    def close(self) -> None:
        """Disconnect."""


class TQStreamProducer(Producer):
    """``tqstream.connect`` to the cluster's TCP address; rows of a group share a group id."""

    def __init__(self, address: str, shared_memory: str) -> None:
        import tqstream
        from tqstream.config import ClientConfig, from_env

        # TQSTREAM_<FIELD> variables apply (e.g. TQSTREAM_COALESCE_WINDOW=none to compare)
        config = from_env(ClientConfig, shared_memory=shared_memory)
        self.client = tqstream.connect(address, config=config)

    def put(self, item: Trajectories, tag: str) -> None:
        self.client.put(item.fields(), tag, groups=self._groups(item))

    async def async_put(self, item: Trajectories, tag: str) -> None:
        await self.client.async_put(item.fields(), tag, groups=self._groups(item))

    @staticmethod
    def _groups(item: Trajectories) -> list[str] | None:
        rows = len(item.rewards)
        return None if rows == 1 else [f"g{int(item.rewards[0])}"] * rows

    def close(self) -> None:
        self.client.close()


@dataclasses.dataclass(frozen=True)
class RayCluster:
    """How a process joins the benchmark's Ray cluster: its GCS address and the ``RAY_*``
    environment ``ray.init`` left in the benchmark process (e.g. ``RAY_AUTH_MODE=token``), which
    producer processes started before Ray was do not have."""

    address: str
    env: dict[str, str]

    @classmethod
    def current(cls) -> RayCluster:
        ray = ray_session()
        env = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
        return cls(ray.get_runtime_context().gcs_address, env)

    def join(self) -> Any:
        """Join as a driver of this process; return the ``ray`` module."""
        os.environ.update(self.env)
        import ray

        ray.init(
            address=self.address,
            namespace=RAY_NAMESPACE,
            _node_ip_address="127.0.0.1",
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        return ray


class TransferQueueProducer(Producer):
    """``tq.init()`` in a process of the same Ray cluster attaches to the running controller."""

    def __init__(self, cluster: RayCluster) -> None:
        self.ray = cluster.join()
        import transfer_queue as tq

        tq.init()
        self.client = tq.get_client()

    def put(self, item: Trajectories, tag: str) -> None:
        self.client.put(data=self._data(item), partition_id=tag)

    async def async_put(self, item: Trajectories, tag: str) -> None:
        await self.client.async_put(data=self._data(item), partition_id=tag)

    @staticmethod
    def _data(item: Trajectories) -> Any:
        from tensordict import TensorDict

        data = {name: _jagged(rows) for name, rows in item.ragged.items()}
        data["rewards"] = item.rewards
        return TensorDict(data, batch_size=[len(item.rewards)])

    def close(self) -> None:
        self.ray.shutdown()


class RayQueueProducer(Producer):
    """verl's fully-async rollouter: ``put_sample.remote(ray.cloudpickle.dumps(sample))``."""

    def __init__(self, cluster: RayCluster, queue: str) -> None:
        self.ray = cluster.join()
        self.queue = self.ray.get_actor(queue, namespace=RAY_NAMESPACE)

    def put(self, item: Trajectories, tag: str) -> None:
        blob = self.ray.cloudpickle.dumps(item.fields())
        if not self.ray.get(self.queue.put_sample.remote(blob)):
            raise RuntimeError("the Ray queue dropped a sample (queue full)")

    async def async_put(self, item: Trajectories, tag: str) -> None:
        blob = self.ray.cloudpickle.dumps(item.fields())
        if not await self.queue.put_sample.remote(blob):
            raise RuntimeError("the Ray queue dropped a sample (queue full)")

    def close(self) -> None:
        self.ray.shutdown()


class ZmqProducer(Producer):
    """The floor of the pattern: one request/reply per put to a raw pyzmq store process (a
    DEALER socket, zero-copy frames: each ragged field as values + lengths, and the rewards).

    Rollouts in flight (``async_put``, on a ``zmq.asyncio`` socket of its own) coalesce as
    tqstream's client does, with none of its work: one message in flight at a time, and the puts
    issued meanwhile (or in the same loop turn) go together as the next one, their trajectories
    concatenated — after waiting, as tqstream's client does, for the callers of the message that
    returned to put again when they came back fast before (its ``Flights``, with the client's
    ``coalesce_rejoin``: ``TQSTREAM_COALESCE_REJOIN=0`` turns it off here too); each caller
    returns with that message's reply. ``TQSTREAM_BENCH_ZMQ_COALESCE=0`` sends each put as a
    message of its own instead (pipelined: the store answers in order)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.asock: Any = None  # made on the first async_put
        self.coalesce = os.environ.get("TQSTREAM_BENCH_ZMQ_COALESCE", "1") != "0"
        from tqstream.client.coalesce import Flights
        from tqstream.config import ClientConfig, from_env

        self.flights = Flights(from_env(ClientConfig).coalesce_rejoin)
        self.waiting: list[tuple[Trajectories, asyncio.Future[None], Any]] = []
        self.sending = False
        self.keys = itertools.count()
        self.prefix = f"{os.getpid()}:".encode()

    def _message(self, item: Trajectories) -> list[Any]:
        flat = _flat(item)
        header = json.dumps([[k, str(v.dtype).removeprefix("torch."), list(v.shape)]
                             for k, v in flat.items()]).encode()  # fmt: skip
        key = self.prefix + str(next(self.keys)).encode()
        rows = str(len(item.rewards)).encode()
        buffers = [v.view(torch.uint8).numpy().data for v in flat.values()]
        return [b"putrows", key, rows, header, *buffers]

    def put(self, item: Trajectories, tag: str) -> None:
        self.sock.send_multipart(self._message(item), copy=False)
        if self.sock.recv() != b"ok":
            raise RuntimeError("the zmq store refused a put")

    async def async_put(self, item: Trajectories, tag: str) -> None:
        if self.asock is None:
            import zmq
            import zmq.asyncio

            self.asock = zmq.asyncio.Context.shadow(self.ctx).socket(zmq.DEALER)
            self.asock.setsockopt(zmq.LINGER, 0)
            self.asock.connect(self.endpoint)
        if not self.coalesce:
            await self._exchange(item)
            return
        caller = asyncio.current_task()
        self.flights.issued(None, caller)
        done = asyncio.get_running_loop().create_future()
        self.waiting.append((item, done, caller))
        if not self.sending:
            self.sending = True
            asyncio.get_running_loop().create_task(self._send_waiting())
        await done

    async def _send_waiting(self) -> None:
        try:
            while self.waiting:
                await asyncio.sleep(0)  # the puts of this loop turn join
                await self.flights.rejoined(None, len(self.waiting))
                batch, self.waiting = self.waiting, []
                items = [item for item, _, _ in batch]
                merged = Trajectories(
                    {name: [t for x in items for t in x.ragged[name]] for name in RAGGED},
                    torch.cat([x.rewards for x in items]),
                )
                with self.flights.flying(None, [caller for _, _, caller in batch]):
                    try:
                        await self._exchange(merged)
                    except Exception as exc:
                        for _, done, _ in batch:
                            done.set_exception(exc)
                    else:
                        for _, done, _ in batch:
                            done.set_result(None)
        finally:
            self.sending = False

    async def _exchange(self, item: Trajectories) -> None:
        await self.asock.send_multipart(self._message(item), copy=False)
        if await self.asock.recv() != b"ok":
            raise RuntimeError("the zmq store refused a put")

    def close(self) -> None:
        if self.asock is not None:
            self.asock.close()
        self.sock.close()
        self.ctx.term()


def _flat(item: Trajectories) -> dict[str, torch.Tensor]:
    """A put's fields as flat tensors: each ragged field's values back to back and its rows'
    lengths; the rewards."""
    flat = {}
    for name, rows in item.ragged.items():
        flat[name] = torch.cat(rows)
        flat[f"{name}.lengths"] = torch.tensor([len(t) for t in rows], dtype=torch.int64)
    flat["rewards"] = item.rewards
    return flat


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    """A list of 1-D tensors as one jagged nested tensor (values back to back + offsets)."""
    lengths = torch.tensor([0] + [len(t) for t in rows], dtype=torch.int64)
    return torch.nested.nested_tensor_from_jagged(torch.cat(rows), lengths.cumsum(0))


@dataclasses.dataclass(frozen=True)
class Connect:
    """Connect to the next system: ``factory(*args)`` in each producer process."""

    factory: type[Producer]
    args: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Job:
    """One producer's part of one exchange."""

    tag: str
    config: Producers
    puts: int
    first_id: int
    seed: int


DISCONNECT = "disconnect"


def producer_main(conn: Connection, start: Any) -> None:
    """A producer process, serving one system after another: on :class:`Connect` it connects, on
    each :class:`Job` it builds its trajectories (untimed), waits for the common start, puts them
    one at a time (or ``in_flight`` at a time, on the process's one event loop) and sends back
    each put's duration, on ``DISCONNECT`` it disconnects. A failure is sent back as its traceback
    and breaks the start barrier, so the benchmark never waits on it; the process then exits."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    producer: Producer | None = None
    loop = asyncio.new_event_loop()  # kept: clients keep what they set up on it (connections)
    try:
        conn.send(("ready", None))
        while (command := conn.recv()) is not None:
            if isinstance(command, Connect):
                producer = command.factory(*command.args)
                conn.send(("connected", None))
            elif isinstance(command, Job):
                assert producer is not None, "a job before Connect"
                job = command
                # an agent loop's rollouts build their trajectories when they end (_in_flight)
                built = not job.config.generate or PREBUILT
                items = make_trajectories(
                    job.config, job.puts, first_id=job.first_id, seed=job.seed
                ) if built else []  # fmt: skip
                # what a rollout worker should do once set up (docs/deployment.md): full
                # collections then skip everything made so far — here also the modules of every
                # system these processes have served (Ray's and TransferQueue's), which made one
                # take ~0.35 s and stall a round
                gc.freeze()
                conn.send(("armed", None))
                start.wait(WAIT)
                times = Times(cpu=-time.process_time())
                if job.config.in_flight > 1:
                    flight = _in_flight(producer, items, job, times)
                    loop.run_until_complete(flight)
                else:
                    for item in items:
                        began = times.began()
                        producer.put(item, job.tag)
                        times.ended(began)
                times.cpu += time.process_time()
                conn.send(("done", times))
            elif command == DISCONNECT and producer is not None:
                closing: Producer = producer
                producer = None
                closing.close()
                conn.send(("disconnected", None))
    except BaseException:
        start.abort()
        conn.send(("error", traceback.format_exc()))
    finally:
        if producer is not None:
            producer.close()
        loop.close()
        conn.close()


@dataclasses.dataclass
class Times:
    """A producer's puts in one exchange: each one's duration, when the first one began
    (``time.monotonic``, the system-wide clock the consumer's process reads too) and the CPU
    seconds the process used (every thread, from the start to its last put's return)."""

    durations: list[float] = dataclasses.field(default_factory=list)
    first: float = math.inf
    cpu: float = 0.0

    def began(self) -> float:
        now = time.monotonic()
        self.first = min(self.first, now)
        return now

    def ended(self, began: float) -> None:
        self.durations.append(time.monotonic() - began)


async def _in_flight(producer: Producer, items: list[Trajectories], job: Job, times: Times) -> None:
    """``in_flight`` rollouts at once: each task puts the next trajectory when its last put
    returned; with a ``rate``, trajectories end at the times of a Poisson process instead (this
    producer's share of the rate) and each is put then, ``in_flight`` puts at most at once; with
    ``generate``, each task's rollout generates for a random 0..``generate`` s, builds its
    trajectory then and puts it."""
    c = job.config

    async def put(item: Trajectories) -> None:
        began = times.began()
        await producer.async_put(item, job.tag)
        times.ended(began)

    if c.generate:
        ends = random.Random(job.seed)
        indices = iter(range(job.puts))

        async def agent() -> None:
            for index in indices:
                await asyncio.sleep(ends.uniform(0.0, c.generate))
                if items:  # TQSTREAM_BENCH_AGENT_PREBUILT=1
                    await put(items[index])
                else:
                    await put(make_trajectory(c, index, first_id=job.first_id, seed=job.seed))

        await asyncio.gather(*(agent() for _ in range(c.in_flight)))
        return
    if not c.rate:
        queue = iter(items)

        async def rollouts() -> None:
            for item in queue:
                await put(item)

        await asyncio.gather(*(rollouts() for _ in range(c.in_flight)))
        return
    gaps = random.Random(job.seed)
    mean = c.producers * c.group / c.rate  # seconds between this producer's puts, on average
    slots = asyncio.Semaphore(c.in_flight)
    loop = asyncio.get_running_loop()
    due = loop.time()

    async def paced(item: Trajectories) -> None:
        try:
            await put(item)
        finally:
            slots.release()

    tasks = []
    for item in items:
        due += gaps.expovariate(1.0 / mean)
        await asyncio.sleep(max(0.0, due - loop.time()))
        await slots.acquire()
        tasks.append(asyncio.create_task(paced(item)))
    await asyncio.gather(*tasks)


class Pool:
    """``count`` producer processes, started once (importing torch in 8 processes takes seconds
    on 2 cores) and connected to one system after another; one job each per exchange."""

    def __init__(self, count: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.start = ctx.Barrier(count + 1)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self._done: dict[int, Times] = {}
        self.running = False  # a job was handed out and its times not collected yet
        try:
            for i in range(count):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=producer_main,
                    args=(theirs, self.start),
                    name=f"bench-producer-{i}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self.conns.append(mine)
                self.procs.append(proc)
            self._expect("ready")
        except BaseException:
            self.close()
            raise

    @property
    def usable(self) -> bool:
        """Every producer is alive (a failed one exits) and no exchange was left half-run."""
        return all(p.is_alive() for p in self.procs) and not self.start.broken

    def _recv(self, i: int, timeout: float) -> tuple[str, Any]:
        conn, proc = self.conns[i], self.procs[i]
        try:
            if not conn.poll(timeout):
                raise TimeoutError(f"producer {i} did not answer within {timeout:.0f} s")
            kind, value = conn.recv()
        except EOFError:
            raise RuntimeError(f"producer {i} exited (code {proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"producer {i} failed:\n{value}")
        return kind, value

    def _expect(self, kind: str) -> None:
        for i in range(len(self.conns)):
            got, _ = self._recv(i, WAIT)
            assert got == kind, f"producer {i}: expected {kind!r}, got {got!r}"

    def _send_all(self, message: Any) -> None:
        for conn in self.conns:
            conn.send(message)

    def connect(self, factory: type[Producer], args: tuple[Any, ...]) -> None:
        self._send_all(Connect(factory, args))
        self._expect("connected")

    def disconnect(self) -> None:
        self._send_all(DISCONNECT)
        self._expect("disconnected")

    def arm(self, jobs: Sequence[Job]) -> None:
        """Hand out the jobs; return once every producer has built its trajectories."""
        self._done.clear()
        self.running = True
        for conn, job in zip(self.conns, jobs, strict=True):
            conn.send(job)
        self._expect("armed")

    def go(self) -> None:
        """Release the producers together."""
        self.start.wait(WAIT)

    def check(self) -> None:
        """Raise if a producer failed; keep the times of those that finished."""
        for i, conn in enumerate(self.conns):
            if i not in self._done and conn.poll(0):
                _, self._done[i] = self._recv(i, 0)

    def times(self) -> list[Times]:
        """Each producer's puts in the last exchange."""
        for i in range(len(self.conns)):
            if i not in self._done:
                _, self._done[i] = self._recv(i, WAIT)
        self.running = False
        return [self._done[i] for i in range(len(self.conns))]

    def close(self) -> None:
        self.start.abort()  # a producer still waiting for the start gives up at once
        for conn in self.conns:
            with contextlib.suppress(OSError):  # the producer is gone already
                conn.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


# --- consumer side: this process ----------------------------------------------------------------
class Consumer:
    """A system as the scenario's consumer sees it, and how its producers connect."""

    def __init__(self, system: System) -> None:
        self.system = system

    def producer(self) -> tuple[type[Producer], tuple[Any, ...]]:
        """The producer class and the arguments a producer process builds it with."""
        raise NotImplementedError

    def begin(self, tag: str) -> None:
        """Before an exchange: e.g. create its partition."""

    def take(self, rows: int, timeout: float) -> tuple[Data, Any] | None:
        """``rows`` rows, or None if they are not there within ``timeout`` seconds."""
        raise NotImplementedError

    def done(self, token: Any) -> None:
        """The consumer is done with the rows of ``token``; the system may free them."""

    def held(self) -> int:
        """Rows still stored."""
        raise NotImplementedError

    def end(self) -> None:
        """After an exchange."""

    def close(self) -> None:
        """Stop what this consumer started."""


class TaskConsumer(Consumer):
    """A system with partitions and consumer tasks: one task reads every row."""

    system: TaskSystem

    def begin(self, tag: str) -> None:
        self.tag = tag

    def take(self, rows: int, timeout: float) -> tuple[Data, Any] | None:
        try:
            return self.system.take(self.tag, rows, TASK, fields=TRAJECTORY_FIELDS, timeout=timeout)
        except TimeoutError:
            return None

    def end(self) -> None:
        self.system.drop(self.tag)


class TQStreamConsumer(TaskConsumer):
    system: TQStream

    def producer(self) -> tuple[type[Producer], tuple[Any, ...]]:
        return TQStreamProducer, (self.system.client.address, self.system.shared_memory)

    def begin(self, tag: str) -> None:
        super().begin(tag)
        self.system.client.create_partition(tag, TRAJECTORY_FIELDS, tasks=[TASK])

    def done(self, token: Any) -> None:
        self.system.ack(token)  # the only registered task: the rows are freed

    def held(self) -> int:
        return self.system.rows(self.tag)


class TransferQueueConsumer(TaskConsumer):
    """Its partition is created by the first put; ``clear_samples`` frees what was read."""

    system: TransferQueue

    def producer(self) -> tuple[type[Producer], tuple[Any, ...]]:
        return TransferQueueProducer, (RayCluster.current(),)

    def done(self, token: Any) -> None:
        self.system.clear(token)

    def held(self) -> int:
        return self.system.rows(self.tag, TRAJECTORY_FIELDS)


def _local_message_queue() -> type:
    """A stand-in with the contract of verl's fully-async ``MessageQueue`` (an asyncio actor
    holding a deque: ``put_sample`` appends and wakes a waiting ``get_sample``, which returns
    ``(sample, remaining)``), for when verl is not installed."""
    import asyncio
    from collections import deque

    class MessageQueue:
        def __init__(self, config: Any, max_queue_size: int) -> None:
            self.queue: deque[Any] = deque(maxlen=max_queue_size)
            self.ready = asyncio.Condition()

        async def put_sample(self, sample: Any) -> bool:
            async with self.ready:
                full = len(self.queue) == self.queue.maxlen
                self.queue.append(sample)
                self.ready.notify_all()
                return not full

        async def get_sample(self) -> Any:
            async with self.ready:
                while not self.queue:
                    await self.ready.wait()
                return self.queue.popleft(), len(self.queue)

        async def get_queue_size(self) -> int:
            return len(self.queue)

    return MessageQueue


class RayQueueConsumer(Consumer):
    """verl's fully-async trainer: one ``get_sample`` call per sample until the batch is full,
    then the samples unpickled and their fields joined into jagged nested tensors. The queue is
    verl's own ``MessageQueue`` actor when verl is installed, else a stand-in with its contract."""

    def __init__(self, system: System) -> None:
        super().__init__(system)
        self.ray = ray_session()
        actor: Any
        try:
            from verl.experimental.fully_async_policy.message_queue import MessageQueue

            actor, self.mode = MessageQueue, "verl MessageQueue"
        except ImportError:
            actor = self.ray.remote(num_cpus=2, max_concurrency=20)(_local_message_queue())
            self.mode = "MessageQueue stand-in (verl not installed)"
        from omegaconf import OmegaConf

        self.name = f"producers-queue-{os.getpid()}"
        self.queue = actor.options(name=self.name, namespace=RAY_NAMESPACE).remote(
            OmegaConf.create({}), max_queue_size=1 << 20
        )
        self.samples: list[dict[str, Any]] = []  # unpickled, as a producer put them
        self.rows = 0  # in self.samples
        self.pending: Any = None
        self.held()  # the actor is up

    def producer(self) -> tuple[type[Producer], tuple[Any, ...]]:
        return RayQueueProducer, (RayCluster.current(), self.name)

    def take(self, rows: int, timeout: float) -> tuple[Data, Any] | None:
        deadline = time.monotonic() + timeout
        while self.rows < rows:
            if self.pending is None:
                self.pending = self.queue.get_sample.remote()
            try:
                blob, _ = self.ray.get(self.pending, timeout=max(deadline - time.monotonic(), 0))
            except self.ray.exceptions.GetTimeoutError:
                return None
            self.pending = None
            self.samples.append(self.ray.cloudpickle.loads(blob))
            self.rows += len(self.samples[-1]["rewards"])
        samples, self.samples, self.rows = self.samples, [], 0
        data = {name: _jagged([t for s in samples for t in s[name]]) for name in RAGGED}
        data["rewards"] = torch.cat([s["rewards"] for s in samples])
        return data, None

    def held(self) -> int:
        return int(self.ray.get(self.queue.get_queue_size.remote()))

    def close(self) -> None:
        self.ray.kill(self.queue)


class ZmqConsumer(Consumer):
    """The floor's consumer: one ``take`` of a batch's rows from the store process (the rows
    leave the store with it), each put's frames wrapped as tensors without a copy."""

    system: RawZmq

    def __init__(self, system: System) -> None:
        super().__init__(system)
        self.waiting = False  # a take was sent and not answered yet

    def producer(self) -> tuple[type[Producer], tuple[Any, ...]]:
        return ZmqProducer, (self.system.store.endpoint,)

    def take(self, rows: int, timeout: float) -> tuple[Data, Any] | None:
        sock = self.system.store.sock
        if not self.waiting:
            sock.send_multipart([b"take", str(rows).encode()])
            self.waiting = True
        if not sock.poll(timeout * 1000):
            return None
        self.waiting = False
        frames = sock.recv_multipart(copy=False)
        fields: dict[str, list[torch.Tensor]] = {name: [] for name in RAGGED}
        rewards = []
        i = 0
        with warnings.catch_warnings():  # frames are read-only; so are the tensors on them
            warnings.filterwarnings("ignore", message=".*not writable.*")
            while i < len(frames):
                count = int(frames[i].bytes)
                header, *buffers = frames[i + 1 : i + 1 + count]
                i += 1 + count
                described = zip(json.loads(header.bytes), buffers, strict=True)
                flat = {
                    name: torch.frombuffer(buf.buffer, dtype=getattr(torch, dtype)).view(shape)
                    for (name, dtype, shape), buf in described
                }
                for name in RAGGED:
                    fields[name] += flat[name].split(flat[f"{name}.lengths"].tolist())
                rewards.append(flat["rewards"])
        data: dict[str, Any] = dict(fields)
        data["rewards"] = torch.cat(rewards)
        return data, None

    def held(self) -> int:
        return self.system.held() or 0


def make_consumer(system: System) -> Consumer:
    if isinstance(system, TQStream):
        return TQStreamConsumer(system)
    if isinstance(system, TransferQueue):
        return TransferQueueConsumer(system)
    if system.name == "ray-actor-queue":
        return RayQueueConsumer(system)
    if system.name == "zmq-tcp":
        return ZmqConsumer(system)
    raise KeyError(f"{system.name}: no producers scenario")


# --- the exchange -------------------------------------------------------------------------------
@dataclasses.dataclass
class Exchange:
    """One exchange's consumer, producers and what the consumer received."""

    consumer: Consumer
    pool: Pool
    config: Producers
    rows: int
    tag: str
    keep: bool = False  # keep the received rows' data (for the data check)
    ids: list[int] = dataclasses.field(default_factory=list)
    data: dict[int, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    # CPU seconds in run(): producers, consumer (this process: the embedded servers too), servers
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    started: float = 0.0  # time.monotonic() at the common start
    acked: float = 0.0  # ... once the last batch was acked
    first_put: float = 0.0  # from started to the first put (finish()); < 0: a producer was first

    @property
    def seed(self) -> int:
        """Producer i's generator seed is this + i."""
        return zlib.crc32(self.tag.encode())

    def arm(self) -> None:
        """Untimed: the partition (or queue) ready, every producer holding its trajectories."""
        c = self.config
        puts = c.puts(self.rows)
        self.consumer.begin(self.tag)
        seed = self.seed
        jobs = [Job(self.tag, c, puts, i * puts * c.group, seed + i) for i in range(c.producers)]
        self.pool.arm(jobs)

    def run(self) -> None:
        """Timed: release the producers, read every row in batches, ack each batch."""
        system = self.consumer.system
        before = system.server_cpu() if isinstance(system, TQStream) else None
        consumer = time.process_time()
        self.pool.go()
        self.started = time.monotonic()
        while len(self.ids) < self.rows:
            # never more than is left: a raw store's take may hand over a little more than asked
            # (whole coalesced puts), and the last one would wait for rows that never come
            got = self.consumer.take(min(self.config.batch, self.rows - len(self.ids)), POLL)
            if got is None:
                self.pool.check()
                continue
            data, token = got
            ids = [int(x) for x in flatten(data["rewards"]).tolist()]
            if self.keep:
                rows = {name: _rows(data[name]) for name in RAGGED}
                for j, row_id in enumerate(ids):
                    self.data[row_id] = {name: rows[name][j] for name in RAGGED}
            self.ids += ids
            self.consumer.done(token)
        self.acked = time.monotonic()
        self.cpu["consumer"] = time.process_time() - consumer
        if before is not None:
            after = system.server_cpu()  # type: ignore[attr-defined]
            self.cpu |= {k: after[k] - v for k, v in before.items()}

    def finish(self) -> list[float]:
        """Untimed: every row read exactly once, nothing left stored; the put times."""
        done = self.pool.times()
        times = [t for d in done for t in d.durations]
        self.first_put = min(d.first for d in done) - self.started
        self.cpu["producers"] = sum(d.cpu for d in done)
        assert sorted(self.ids) == list(range(self.rows)), "rows lost or read twice"
        held = self.consumer.held()
        assert held == 0, f"{held} rows still stored after the exchange"
        self.consumer.end()
        return times

    def check_data(self) -> None:
        """The rows received are the trajectories the producers built, field by field."""
        c = self.config
        puts = c.puts(self.rows)
        seed = self.seed
        for i in range(c.producers):
            first = i * puts * c.group
            for item in make_trajectories(c, puts, first_id=first, seed=seed + i):
                for j, row_id in enumerate(int(x) for x in item.rewards.tolist()):
                    got = self.data[row_id]
                    for name, rows in item.ragged.items():
                        assert torch.equal(got[name], rows[j]), f"row {row_id}: {name} differs"


def _rows(value: Any) -> list[torch.Tensor]:
    """A field of a batch as one tensor per row, whatever form it came in."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return list(value.unbind())
    return list(value)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# --- the test -----------------------------------------------------------------------------------
class Pools:
    """The session's producer pool, started on first use and again after a failure broke it."""

    def __init__(self) -> None:
        self.pool: Pool | None = None

    def get(self) -> Pool:
        if self.pool is not None and not self.pool.usable:
            self.close()
        if self.pool is None:
            self.pool = Pool(PRODUCERS["trajectory"].sized().producers)
        return self.pool

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    """Idle between systems: the processes wait on their pipes, connected to nothing."""
    pools = Pools()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture(scope="module")
def producers(system: System, pools: Pools) -> Iterator[tuple[Consumer, Pool]]:
    """The system's consumer here and the producer processes connected to it, for both
    variants; disconnected before the system stops."""
    if system.name not in BENCH_SYSTEMS:
        pytest.skip(f"{system.name}: not applicable (no producers scenario)")
    consumer = make_consumer(system)
    try:
        pool = pools.get()
        pool.connect(*consumer.producer())
        try:
            yield consumer, pool
        finally:
            if pool.usable and not pool.running:
                pool.disconnect()
            else:  # an exchange failed half-way: start afresh for the next system
                pools.close()
    finally:
        consumer.close()


@pytest.mark.parametrize("variant", list(PRODUCERS))
def test_producers(
    benchmark: Any, system: System, producers: tuple[Consumer, Pool], variant: str
) -> None:
    consumer, pool = producers
    config = PRODUCERS[variant].sized()
    tags = (f"producers-{variant}-{i}" for i in itertools.count())
    warm = Exchange(consumer, pool, config, config.warmup_rows, next(tags), keep=True)
    warm.arm()
    warm.run()
    warm.finish()
    warm.check_data()
    del warm

    times: list[float] = []
    current: list[Exchange] = []
    cpu: dict[str, float] = {}  # each side's CPU seconds over the timed rounds
    exchanges: list[float] = []  # each round's first put to its last ack, seconds
    first_puts: list[float] = []  # each round's common start to its first put
    rows = 0

    def finish(exchange: Exchange) -> None:
        nonlocal rows
        times.extend(exchange.finish())
        first_puts.append(exchange.first_put)
        exchanges.append(exchange.acked - exchange.started - exchange.first_put)
        for k, v in exchange.cpu.items():
            cpu[k] = cpu.get(k, 0.0) + v
        rows += exchange.rows

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        if current:
            finish(current.pop())
        exchange = Exchange(consumer, pool, config, config.rows, next(tags))
        exchange.arm()
        current.append(exchange)
        return (), {}

    def run() -> None:
        current[-1].run()

    row_bytes = 16 * (config.min_length + config.max_length) / 2 + 4
    benchmark.group = "producers"
    benchmark.extra_info.update(
        system=system.name,
        mode=getattr(consumer, "mode", system.mode),
        note=system.note,
        case=config.case.replace("built then", "prebuilt") if PREBUILT else config.case,
        variant=variant,
        bytes=int(row_bytes * config.rows),
        batch=config.batch,
        length=config.max_length,
        rows=config.rows,
        producers=config.producers,
        group=config.group,
    )
    benchmark.pedantic(run, setup=setup, rounds=config.rounds, warmup_rounds=0, iterations=1)
    finish(current.pop())
    benchmark.extra_info.update(
        {f"{k}_cpu_us_per_row": v / rows * 1e6 for k, v in cpu.items()},
        puts=len(times),
        put_p50_s=percentile(times, 0.50),
        put_p99_s=percentile(times, 0.99),
        put_mean_s=statistics.fmean(times),
        first_put_s=max(first_puts),
        first_put_to_last_ack_s=statistics.median(exchanges),
    )
