"""verl's fully-async ``MessageQueue`` and ``MessageQueueClient`` on tqstream: change the import.

verl 0.9.1's recipe (``verl.experimental.fully_async_policy``) builds ``MessageQueue.remote(config,
max_queue_size)`` in its driver, wraps it in ``MessageQueueClient(message_queue)`` and hands the
client to its rollouter and trainer Ray actors; the rollouter puts
``ray.cloudpickle.dumps(rollout_sample)``, the trainer ``ray.cloudpickle.loads`` what ``get_sample``
returns. Here ``MessageQueue.remote`` makes the queue in a tqstream cluster (the one given, else the
job's: see :func:`_cluster`) and returns a handle that names it: the cluster's address and key file,
the queue's name and settings, never a socket. Every process that unpickles a client connects to the
cluster itself (one connection per process and cluster), and the samples move over tqstream's
sockets (shared memory on one host), never through Ray.

Samples are opaque bytes: stored as they come and handed back as the same bytes; nothing here
unpickles them (docs/security.md). Capacity is a ``slots`` admission ``name + ".queue"`` of
``max_queue_size`` slots, global across processes: each queued sample holds one (its id in the
row's tag ``slot``) until it is taken (released "accepted"), evicted by ``drop_oldest`` ("dropped":
verl's ``dropped_samples``) or cleared ("rejected"). A full queue makes ``put_sample`` wait until
the trainer takes a sample, or, with ``drop_oldest=True``, evict the oldest queued sample as verl's
deque does.

Storage: partition ``name`` holds the queued samples (field ``sample``, consumed by task
``trainer``), ``name + ".validate"`` the ``put_validate`` values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import sys
import threading
from typing import Any

from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Client
from tqstream.config import ClientConfig, from_env
from tqstream.errors import (
    AdmissionError,
    ConnectError,
    InvalidRequestError,
    PartitionDrainedError,
    RequestTimeoutError,
    TQStreamError,
)
from tqstream.types import BatchMeta, CheckpointSummary, Stats

__all__ = ["MessageQueue", "MessageQueueClient"]

SAMPLE_FIELD = "sample"
TASK = "trainer"
RAY_CLUSTER = "tqstream"
"""The Ray cluster (``tqstream.ray.launch(name=...)``) a queue uses, or starts, in a Ray job."""
_NO_WINDOW = (
    2**62
)  # the queue bounds samples queued (pending slots), not samples per weight version


@dataclasses.dataclass(frozen=True)
class MessageQueue:
    """A queue of opaque samples in a tqstream cluster, what verl's ``MessageQueue`` actor is to
    the recipe: make it with ``MessageQueue.remote(config, max_queue_size)`` (see :meth:`remote`),
    use it through ``MessageQueueClient(queue)``. This object only names the queue (the fields
    below), so it pickles as them."""

    address: str
    """The cluster's controller, ``tcp://HOST:PORT``."""
    keys: str
    """The cluster's CURVE key file ("": none), for the clients of other processes."""
    name: str
    """The queue's name in the cluster (its partitions and admission are named after it)."""
    max_queue_size: int
    """Samples queued at most."""
    drop_oldest: bool
    """A full queue evicts its oldest sample (as verl's deque) instead of making puts wait."""
    put_timeout: float | None
    """Seconds ``put_sample`` waits for room before it gives up, storing nothing (None: forever)."""

    @classmethod
    def remote(
        cls,
        config: Any = None,
        max_queue_size: int = 1000,
        *,
        drop_oldest: bool = False,
        put_timeout: float | None = None,
        name: str = "fully_async",
        cluster: Client | str | None = None,
    ) -> MessageQueue:
        """Make the queue, as verl's ``MessageQueue.remote(config, max_queue_size)`` makes its
        actor; returns at once, the queue ready. ``config`` (verl's trainer config) is accepted
        and not used.

        ``cluster``: a tqstream client or a cluster's address; by default the job's: in a Ray job
        (Ray initialised) the Ray cluster named ``"tqstream"`` in this job's namespace, launched
        with one storage unit if none runs (``tqstream.ray.launch``; its actors end with this
        process), else an embedded cluster in this process (``tqstream.init()``; other processes
        on this host reach it while this process lives). ``name``: several queues in one cluster
        need several names; a queue made again with the same name and settings is the same queue
        (what it holds stays), with other settings AdmissionError.
        """
        size = _queue_size(max_queue_size)
        if type(drop_oldest) is not bool:
            raise InvalidRequestError(f"drop_oldest must be True or False, got {drop_oldest!r}")
        if put_timeout is not None and not put_timeout >= 0:
            raise InvalidRequestError(
                f"put_timeout must be None (wait for room as long as it takes) or seconds >= 0, "
                f"got {put_timeout!r}"
            )
        client = _cluster(cluster)
        queue = cls(client.address, client.config.keys, name, size, drop_oldest, put_timeout)
        try:
            client.admission(
                "slots", name=queue.admission, max_pending_slots=size, max_version_slots=_NO_WINDOW
            )
        except AdmissionError as exc:
            raise AdmissionError(
                f"a queue named {name!r} already exists in this cluster with another "
                f"max_queue_size ({exc}); make it with the same max_queue_size, or pass another "
                f"name= for another queue",
                name=name,
            ) from exc
        client.create_partition(name, [SAMPLE_FIELD], tasks=[TASK])
        client.create_partition(queue.validate, [SAMPLE_FIELD], tasks=[TASK])
        return queue

    @property
    def admission(self) -> str:
        return f"{self.name}.queue"

    @property
    def validate(self) -> str:
        return f"{self.name}.validate"


class MessageQueueClient:
    """verl's ``MessageQueueClient``, same methods (async or ``*_sync`` as in verl, same parameters,
    same return shapes), on the queue that ``MessageQueue.remote`` made. It pickles as that queue,
    so Ray hands it to actors as verl does; each process connects on first use."""

    def __init__(self, queue_actor: MessageQueue) -> None:
        if not isinstance(queue_actor, MessageQueue):
            raise InvalidRequestError(
                f"MessageQueueClient takes the queue that tqstream's MessageQueue.remote(config, "
                f"max_queue_size) returns, got {type(queue_actor).__name__}: import both "
                f"MessageQueue and MessageQueueClient from tqstream.adapters.verl"
            )
        self.queue_actor = queue_actor  # verl's name for what it wraps

    @property
    def client(self) -> Client:
        """This process's connection to the queue's cluster."""
        return _connect(self.queue_actor.address, self.queue_actor.keys)

    @property
    def _admission(self) -> AdmissionHandle:
        return AdmissionHandle(self.client, self.queue_actor.admission, "slots")

    # --- producer ---
    async def put_sample(self, sample: Any) -> bool:
        """Queue ``sample``, the bytes of ``ray.cloudpickle.dumps(rollout_sample)`` (None: the end
        of the stream, see :meth:`shutdown`). True once stored. When the queue is full it waits for
        room (False if ``put_timeout`` passed first: nothing stored), or with ``drop_oldest``
        evicts the oldest queued sample to make room and returns False, as verl does."""
        if sample is None:
            await self.shutdown()
            return True
        blob = _bytes("put_sample", sample)
        q, client, admission = self.queue_actor, self.client, self._admission
        dropped = False
        ids = await admission.async_try_acquire(1)
        while not ids:
            if q.drop_oldest and await self._drop_oldest():
                dropped = True
                ids = await admission.async_try_acquire(1)
                continue
            # wait for room: every queued sample is being taken right now (drop_oldest), or
            # the trainer takes one (back-pressure)
            try:
                ids = await admission.async_acquire(1, timeout=q.put_timeout)
            except RequestTimeoutError:
                return False
        try:
            await client.async_put({SAMPLE_FIELD: [blob]}, q.name, tags=[{"slot": ids[0]}])
        except BaseException:  # nothing stored: the slot goes back; the put's error is reported
            with contextlib.suppress(TQStreamError):
                await admission.async_release(ids, "rejected")
            raise
        return not dropped

    async def _drop_oldest(self) -> bool:
        """Evict the oldest queued sample (its row freed, its slot released as "dropped");
        False if none is queued that no getter is taking."""
        q, client = self.queue_actor, self.client
        try:
            meta = await client.async_get_meta(q.name, [SAMPLE_FIELD], 1, TASK, timeout=0)
        except (RequestTimeoutError, PartitionDrainedError):
            return False
        await client.async_clear_samples(meta)
        await self._admission.async_release(_slots(meta), "dropped")
        return True

    async def put_validate(self, data: Any) -> bool:
        """Queue a validation result, the bytes of ``ray.cloudpickle.dumps(...)`` as verl's
        rollouter passes them, for :meth:`get_validate_sync`."""
        blob = _bytes("put_validate", data)
        await self.client.async_put({SAMPLE_FIELD: [blob]}, self.queue_actor.validate)
        return True

    # --- consumer ---
    async def get_sample(self) -> Any | None:
        """``(sample bytes, samples still queued)``, the oldest first, waiting for one; after the
        end of the stream, once the queue is drained, ``(None, 0)``."""
        q, client = self.queue_actor, self.client
        try:
            batch = await client.async_get(q.name, [SAMPLE_FIELD], 1, TASK, auto_ack=True)
        except PartitionDrainedError:
            return None, 0
        await self._admission.async_release(_slots(batch.meta), "accepted")
        return _blob(batch.data), await self.get_queue_size()

    def get_sample_sync(self) -> Any | None:
        q, client = self.queue_actor, self.client
        try:
            batch = client.get(q.name, [SAMPLE_FIELD], 1, TASK, auto_ack=True)
        except PartitionDrainedError:
            return None, 0
        self._admission.release(_slots(batch.meta), "accepted")
        return _blob(batch.data), self.get_queue_size_sync()

    def get_validate_sync(self) -> Any | None:
        """The oldest validation result's bytes, or None when there is none (never waits)."""
        try:
            batch = self.client.get(
                self.queue_actor.validate, [SAMPLE_FIELD], 1, TASK, timeout=0, auto_ack=True
            )
        except (RequestTimeoutError, PartitionDrainedError):
            return None
        return _blob(batch.data)

    # --- state ---
    async def get_queue_size(self) -> int:
        """Samples queued and not yet taken."""
        return self._statistics(await self.client.async_stats(self.queue_actor.name))["queue_size"]

    def get_queue_size_sync(self) -> int:
        return self._statistics(self.client.stats(self.queue_actor.name))["queue_size"]

    async def get_statistics(self) -> dict[str, Any]:
        """verl's keys: ``queue_size``, ``total_produced`` (samples stored), ``total_consumed``
        (taken by ``get_sample``), ``dropped_samples`` (evicted by ``drop_oldest``),
        ``max_queue_size``; counted at the controller, so every process sees the same."""
        return self._statistics(await self.client.async_stats(self.queue_actor.name))

    def get_statistics_sync(self) -> dict[str, Any]:
        return self._statistics(self.client.stats(self.queue_actor.name))

    def _statistics(self, stats: Stats) -> dict[str, Any]:
        q = self.queue_actor
        part = stats.partitions.get(q.name)
        task = None if part is None else part.tasks.get(TASK)
        queued = 0 if part is None else part.rows if task is None else task.available
        return {
            "queue_size": queued,  # a task no get has named yet has no stats: all rows wait
            "total_produced": 0 if part is None else part.produced,
            "total_consumed": 0 if task is None else task.consumed,
            "dropped_samples": int(stats.admissions.get(q.admission, {}).get("dropped", 0)),
            "max_queue_size": q.max_queue_size,
        }

    async def get_memory_usage(self) -> dict:
        """``queue_samples``, and the bytes the cluster's storage units hold (every partition's)."""
        stats = await self.client.async_stats(self.queue_actor.name)
        nbytes = stats.storage_bytes
        return {
            "queue_samples": self._statistics(stats)["queue_size"],
            "estimated_memory_bytes": nbytes,
            "estimated_memory_mb": nbytes / (1024 * 1024),
        }

    async def clear_queue(self) -> None:
        """Remove every queued sample and give its room back (released as "rejected"); the
        counters of ``get_statistics`` stay."""
        q, client, admission = self.queue_actor, self.client, self._admission
        while n := await self.get_queue_size():
            try:
                meta = await client.async_get_meta(q.name, [SAMPLE_FIELD], n, TASK, timeout=0)
            except RequestTimeoutError:
                continue  # a getter took some meanwhile: count again
            except PartitionDrainedError:
                return
            await client.async_clear_samples(meta)
            await admission.async_release(_slots(meta), "rejected")

    async def shutdown(self) -> None:
        """The end of the stream: puts are refused from now on (PartitionClosedError); getters
        drain the queue, then get ``(None, 0)``."""
        await self.client.async_close_partition(self.queue_actor.name)

    # --- checkpoints: transfer_queue's save_checkpoint / load_checkpoint, as verl calls them ---
    def save_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike[str],
        *,
        include_storage: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> CheckpointSummary:
        """verl's ``tq.save_checkpoint(path, metadata={"global_steps": step})``: a consistent
        checkpoint of the whole cluster (this queue's samples, their slots, every other partition)
        in directory ``checkpoint_dir``, replaced atomically if it exists. Blocking, as verl's
        trainer calls it (``async_save_checkpoint``: the coroutine). ``include_storage`` is
        accepted for its signature and ignored: the samples are in memory, so they are always
        saved (TransferQueue's in-memory storage ignores it too). See docs/checkpoints.md."""
        return self.client.save_checkpoint(checkpoint_dir, metadata=metadata)

    async def async_save_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike[str],
        *,
        include_storage: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> CheckpointSummary:
        return await self.client.async_save_checkpoint(checkpoint_dir, metadata=metadata)

    def load_checkpoint(self, checkpoint_dir: str | os.PathLike[str]) -> CheckpointSummary:
        """verl's ``tq.load_checkpoint(path)``, into a cluster that holds no samples yet (the
        queue, empty since ``MessageQueue.remote`` made it, is replaced): then ``get_sample``
        returns the samples queued at the save, oldest first, their slots counted as before."""
        return self.client.load_checkpoint(checkpoint_dir)

    async def async_load_checkpoint(
        self, checkpoint_dir: str | os.PathLike[str]
    ) -> CheckpointSummary:
        return await self.client.async_load_checkpoint(checkpoint_dir)


# --- helpers ---
def _queue_size(value: Any) -> int:
    try:
        size = operator.index(value) if type(value) is not bool else 0
    except TypeError:
        size = 0
    if size < 1:
        raise InvalidRequestError(
            f"max_queue_size must be an int >= 1 (the samples the queue may hold), got {value!r}"
        )
    return size


def _bytes(call: str, value: Any) -> bytes | bytearray:
    if isinstance(value, (bytes, bytearray)):
        return value
    raise InvalidRequestError(
        f"{call} stores bytes (verl 0.9.1's rollouter passes ray.cloudpickle.dumps(...)), got "
        f"{type(value).__name__}: pass ray.cloudpickle.dumps(value) and ray.cloudpickle.loads "
        f"what comes back"
    )


def _slots(meta: BatchMeta) -> list[int]:
    """The slots the rows of ``meta`` hold (a row put there by other means holds none)."""
    return [slot for tags in meta.tags if isinstance(slot := tags.get("slot"), int)]


def _blob(data: Any) -> bytes:
    return bytes(data.get(SAMPLE_FIELD).tolist()[0])


_lock = threading.Lock()
_clients: dict[tuple[str, str], tuple[int, Client]] = {}
"""This process's connection to each cluster a queue lives in, by (address, key file): the queue's
clients share it, and it lives as long as the process (an embedded cluster lives in it)."""
_embedded: tuple[int, Client] | None = None  # the cluster this process runs, if any
_launched: list[Any] = []  # the Ray clusters this process launched (their actors end with it)


def _cluster(cluster: Client | str | None) -> Client:
    """The client of the cluster a new queue goes to (see ``MessageQueue.remote``)."""
    if isinstance(cluster, Client):
        with _lock:  # the queue's clients in this process use it
            _clients[(cluster.address, cluster.config.keys)] = (os.getpid(), cluster)
        return cluster
    if isinstance(cluster, str):
        return _connect(cluster, from_env(ClientConfig).keys)
    if cluster is not None:
        raise InvalidRequestError(
            f"cluster must be a tqstream Client, an address 'tcp://HOST:PORT' or None (the job's "
            f"cluster), got {type(cluster).__name__}"
        )
    ray = sys.modules.get("ray")  # a Ray job has imported Ray
    if ray is not None and ray.is_initialized():
        address, keys = _ray_cluster()
        return _connect(address, keys)
    global _embedded
    with _lock:
        if _embedded is None or _embedded[0] != os.getpid() or _embedded[1].closed:
            import tqstream

            client = tqstream.init()
            _embedded = (os.getpid(), client)
            _clients[(client.address, client.config.keys)] = _embedded
        return _embedded[1]


def _ray_cluster() -> tuple[str, str]:
    """Address and key file of this job's Ray cluster ``RAY_CLUSTER``, launched if none runs."""
    from tqstream.ray import RayCluster, launch

    try:
        found = RayCluster.attach(RAY_CLUSTER)
    except ConnectError:
        try:
            found = launch(1, name=RAY_CLUSTER)
            _launched.append(found)
        except ValueError:  # another process of the job launched it meanwhile
            found = RayCluster.attach(RAY_CLUSTER)
    return found.address, found.keys


def _connect(address: str, keys: str) -> Client:
    """This process's client of the cluster at ``address`` (made on first use)."""
    with _lock:
        pid, client = _clients.get((address, keys), (0, None))
        if client is None or pid != os.getpid() or client.closed:
            config = from_env(ClientConfig)
            if keys and not config.keys:
                config = dataclasses.replace(config, keys=keys)
            client = Client(address, config)
            _clients[(address, keys)] = (os.getpid(), client)
        return client
