"""NeMo-RL's staleness samplers with their state at the tqstream controller.

NeMo-RL's samplers keep a list of prompt groups in the async controller's process and decide, per
trainer version ``W``, which groups to train on (``select``), which to discard (``evict``) and when
the rollout pump may dispatch the next batch (``admit``). Here the data plane is the buffer:

- a prompt group is the rows of one ``put_samples`` with keys ``{uid}_g{i}`` (their group) and the
  tag ``weight_version`` (their head version: the weights the rollout started with);
- ``select`` leases whole groups inside the window with one controller request
  (``get_meta(whole_groups=True, current_version=W, staleness=StalenessPolicy(s,
  measure="head", on_stale="drop"))``), oldest first, up to ``max_prompt_groups`` and at least
  ``min_prompt_groups``; the rows stay readable by key until the trainer clears them, and come
  back if the trainer dies first;
- ``evict``: the window reads drop groups older than ``W - s`` at the controller, counted in
  ``stats`` (``stale_dropped``); ``evict`` reports how many groups that was since its last call;
- ``admit``: a capacity admission at the controller (one slot per dispatched batch,
  ``max_staleness`` the gate window, ``consumer_batch_size`` one batch) lets batch ``d`` start
  only while ``d <= W + gate``, the gated samplers' rule, global across processes and kept over
  a restart.

``WindowedSampler`` and ``ReadyFirstSampler`` map exactly (but for the order among ready groups:
completion, not dispatch). NeMo-RL's ``in_order`` and ``weight_fifo`` select on what only its
driver-side buffer knows (target-step stamps, versions of rollouts still running), not on a window
over rows, so :func:`create_sampler` refuses them: they run unchanged on NeMo-RL's own buffer over
:class:`~tqstream.adapters.nemo_rl.TQStreamDataPlaneClient`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from tqstream.adapters.nemo_rl.client import TQStreamDataPlaneClient
from tqstream.adapters.nemo_rl.compat import KVBatchMeta
from tqstream.adapters.nemo_rl.errors import ConfigError
from tqstream.client.admission import AdmissionHandle
from tqstream.errors import InvalidRequestError, RequestTimeoutError, UnknownPartitionError
from tqstream.staleness import StalenessPolicy
from tqstream.types import BatchMeta

__all__ = ["ReadyFirstSampler", "WindowedSampler", "create_sampler"]

GATE_CONCURRENCY = 1 << 30
"""The gate admission's ``max_concurrent``: dispatch is bounded by the version rule alone."""


class _Sampler:
    """Shared machinery: the data plane and partition, the window lease, the version publishing
    and the dispatch cursor.

    ``data_plane``: a :class:`TQStreamDataPlaneClient`, or an object holding one the way NeMo-RL's
    replay buffer does (``_dp_client`` and ``_partition_id``), which is what NeMo-RL's
    ``create_sampler`` passes first to a custom sampler class. ``group_size``: rows per prompt
    group (generations per prompt). ``task``: the consumer task the trainer's selections are
    leased to. ``probe_field``: a field every committed group has (a group is ready once it is
    written). ``lengths_field``: the per-row length field read into ``sequence_lengths`` (None:
    not read). ``gate_poll_s``: how often a waiting ``admit`` re-reads the trainer version when no
    ``select``/``evict`` publishes a newer one.
    """

    supports_buffer_checkpoint: ClassVar[bool] = True  # the groups live at the controller

    def __init__(
        self,
        data_plane: Any,
        *,
        group_size: int,
        partition_id: str | None = None,
        task: str = "train",
        probe_field: str = "input_ids",
        lengths_field: str | None = "input_lengths",
        gate_poll_s: float = 1.0,
    ) -> None:
        dp = data_plane if isinstance(data_plane, TQStreamDataPlaneClient) else None
        if dp is None:
            dp = getattr(data_plane, "_dp_client", None)
            partition_id = partition_id or getattr(data_plane, "_partition_id", None)
        if not isinstance(dp, TQStreamDataPlaneClient):
            raise ConfigError(
                f"a tqstream sampler needs a TQStreamDataPlaneClient (or NeMo-RL's replay buffer "
                f"built on one), got {type(data_plane).__name__}; set data_plane.impl: tqstream"
            )
        if not isinstance(group_size, int) or group_size < 1:
            raise InvalidRequestError(f"group_size must be an int >= 1, got {group_size!r}")
        self.data_plane = dp
        self.client = dp.client
        self.partition_id = partition_id or "rollout_data"
        self.group_size, self.task = group_size, task
        self.probe_field, self.lengths_field = probe_field, lengths_field
        self.gate_poll_s = gate_poll_s
        self.gate: AdmissionHandle | None = None
        self._dispatch_index = -1
        self._published = -1  # newest trainer version told to the gate
        self._dropped_seen = self._dropped_total()  # the task's stale_dropped at the last evict
        self._dropped_rest = 0  # dropped rows not yet a whole group

    def _dropped_total(self, stats: Any = None) -> int:
        """Rows of the partition the controller dropped as stale on reads of the task."""
        if stats is None:
            try:
                stats = self.client.stats(self.partition_id)
            except UnknownPartitionError:
                return 0
        state = stats.partitions[self.partition_id].tasks.get(self.task)
        return 0 if state is None else int(state.stale_dropped)

    # --- admission (rollout pump) ---
    async def admit(self, *, trainer_version_fn: Callable[[], int]) -> int | None:
        """Wait until the next dispatch batch may start, then return its target-step stamp
        (these samplers stamp none)."""
        if self.gate is None:
            return None
        while True:
            try:
                ids = await self.gate.async_acquire(
                    1, version=trainer_version_fn(), timeout=self.gate_poll_s
                )
                break
            except RequestTimeoutError:
                continue  # re-read the trainer version
        await self.gate.async_release(ids, "accepted")  # counts for good: the batch is out
        self._dispatch_index += 1
        return None

    @property
    def dispatch_index(self) -> int:
        """The last admitted dispatch batch (-1: none yet)."""
        return self._dispatch_index

    def set_dispatch_index(self, resume_from_trainer_version: int) -> None:
        """Resume at ``resume_from_trainer_version``: the next batch admitted is that one (the
        gate restarts its count there, for every process)."""
        if resume_from_trainer_version < 0:
            raise InvalidRequestError(
                f"resume_from_trainer_version must be >= 0, got {resume_from_trainer_version}"
            )
        self._dispatch_index = resume_from_trainer_version - 1
        if self.gate is not None:
            self.gate.on_version_recovered(resume_from_trainer_version)

    async def _publish(self, version: int) -> None:
        if self.gate is not None and version > self._published:
            await self.gate.async_on_version(version)  # wakes admits parked at the controller
            self._published = version

    # --- selection (train pump) ---
    def _window(self, version: int) -> dict[str, Any]:
        return {}

    async def _lease(self, groups: int, version: int) -> BatchMeta | None:
        try:
            return await self.client.async_get_meta(
                self.partition_id,
                [self.probe_field],
                groups * self.group_size,
                self.task,
                whole_groups=True,
                lease_timeout=self.data_plane.config.claim_lease_timeout_s,
                timeout=0,
                **self._window(version),
            )
        except (RequestTimeoutError, UnknownPartitionError):
            return None  # not enough ready groups (or none put yet): never wait

    async def select(
        self, *, current_train_weight: int, min_prompt_groups: int, max_prompt_groups: int
    ) -> tuple[KVBatchMeta | None, int]:
        """Lease the oldest ready groups inside the window: as many as are ready up to
        ``max_prompt_groups``, or none (``(None, 0)``) when fewer than ``min_prompt_groups`` are.
        Never waits."""
        if min_prompt_groups < 1 or max_prompt_groups < min_prompt_groups:
            raise InvalidRequestError(
                f"select needs 1 <= min_prompt_groups <= max_prompt_groups, got "
                f"min_prompt_groups={min_prompt_groups}, max_prompt_groups={max_prompt_groups}"
            )
        w = current_train_weight
        await self._publish(w)
        leases: list[BatchMeta] = []
        first = await self._lease(max_prompt_groups, w)
        if first is None and min_prompt_groups < max_prompt_groups:
            first = await self._lease(min_prompt_groups, w)
        if first is None:
            return None, 0
        leases.append(first)
        left = max_prompt_groups - len(first) // self.group_size
        chunk = left
        while left and chunk:  # top up greedily, halving the request when it cannot be served
            more = await self._lease(min(chunk, left), w)
            if more is None:
                chunk //= 2
                continue
            leases.append(more)
            left -= len(more) // self.group_size
        return await self._meta(leases), max_prompt_groups - left

    async def _meta(self, leases: list[BatchMeta]) -> KVBatchMeta:
        keys = [k for m in leases for k in m.keys]
        tags = [dict(t) for m in leases for t in (m.tags or [{}] * len(m))]
        found = await self.client.async_lookup(self.partition_id, keys)
        lengths = None
        if self.lengths_field is not None and self.lengths_field in found.fields:
            data = await self.client.async_get_data(found, [self.lengths_field])
            lengths = [int(n) for n in data[self.lengths_field].reshape(len(keys), -1)[:, 0]]
        return KVBatchMeta(
            self.partition_id,
            self.task,
            keys,
            fields=list(found.fields),
            sequence_lengths=lengths,
            tags=tags,
        )

    async def evict(self, *, current_train_weight: int) -> int:
        """Groups dropped as stale by the controller since the last call (the window reads drop
        them; ``stats`` counts them): one ``stats`` request."""
        await self._publish(current_train_weight)
        try:
            stats = await self.client.async_stats(self.partition_id)
        except UnknownPartitionError:
            return 0
        total = self._dropped_total(stats)
        seen, self._dropped_seen = self._dropped_seen, total
        if total <= seen:
            return 0
        groups, self._dropped_rest = divmod(self._dropped_rest + total - seen, self.group_size)
        return groups

    # --- derived facts ---
    def _eviction_window(self) -> int:
        return 0

    @property
    def is_on_policy(self) -> bool:
        return self._eviction_window() == 0

    def should_abort_inflight(
        self, *, start_weight_version: int, current_train_weight: int
    ) -> bool:
        return False

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        return None


class WindowedSampler(_Sampler):
    """NeMo-RL's ``windowed`` policy: no dispatch gate; ``select`` takes ready groups whose head
    version is within ``max_staleness_versions`` of the trainer's, oldest first; older ones are
    dropped at the controller and reported by ``evict``; a rollout that started below the window
    should be aborted. ``sample_freshest_first`` is refused: the controller serves the oldest
    rows in the window first."""

    def __init__(
        self,
        data_plane: Any,
        *,
        max_staleness_versions: int,
        sample_freshest_first: bool = False,
        **options: Any,
    ) -> None:
        if not isinstance(max_staleness_versions, int) or max_staleness_versions < 0:
            raise InvalidRequestError(
                f"max_staleness_versions must be an int >= 0, got {max_staleness_versions!r}"
            )
        if sample_freshest_first:
            raise ConfigError(
                "sample_freshest_first=True is not available on tqstream: the controller serves "
                "the oldest groups inside the window first (the stale ones are dropped); use "
                "a smaller max_staleness_versions for fresher batches"
            )
        super().__init__(data_plane, **options)
        self.max_staleness_versions = max_staleness_versions
        self.staleness = StalenessPolicy(max_staleness_versions, measure="head", on_stale="drop")

    def _window(self, version: int) -> dict[str, Any]:
        return {"current_version": version, "staleness": self.staleness}

    def _eviction_window(self) -> int:
        return self.max_staleness_versions

    def should_abort_inflight(
        self, *, start_weight_version: int, current_train_weight: int
    ) -> bool:
        return start_weight_version < max(0, current_train_weight - self.max_staleness_versions)


class ReadyFirstSampler(_Sampler):
    """NeMo-RL's ``ready_first`` policy: batch ``d`` is dispatched only while ``d <= W +
    max_staleness_versions`` (the gate, at the controller); ``select`` takes any ready groups,
    versions mixed; nothing is ever evicted (importance sampling corrects the lag)."""

    supports_buffer_checkpoint: ClassVar[bool] = False  # restored groups would bypass the gate

    def __init__(self, data_plane: Any, *, max_staleness_versions: int, **options: Any) -> None:
        if not isinstance(max_staleness_versions, int) or max_staleness_versions < 0:
            raise InvalidRequestError(
                f"max_staleness_versions must be an int >= 0, got {max_staleness_versions!r}"
            )
        super().__init__(data_plane, **options)
        self.max_staleness_versions = max_staleness_versions
        self.gate = self.client.admission(
            "capacity",
            name=f"nemo_rl:{self.partition_id}",
            max_concurrent=GATE_CONCURRENCY,
            max_staleness=max_staleness_versions,
            consumer_batch_size=1,
        )

    async def evict(self, *, current_train_weight: int) -> int:
        await self._publish(current_train_weight)
        return 0

    def _eviction_window(self) -> int:
        return self.max_staleness_versions

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        return groups_per_step * (self.max_staleness_versions + 1)


_POLICIES: dict[str, type[_Sampler]] = {
    "windowed": WindowedSampler,
    "ready_first": ReadyFirstSampler,
}


def create_sampler(data_plane: Any, cfg: Mapping[str, Any] | Any, **options: Any) -> _Sampler:
    """A sampler from NeMo-RL's ``async_rl.sampler`` configuration (a dict, or its pydantic
    form): ``name`` picks the policy, its other keys and ``options`` (``group_size`` is required;
    ``partition_id``, ``task``, ...) go to the constructor."""
    dump = getattr(cfg, "model_dump", None)
    values = dict(dump() if callable(dump) else cfg)
    name = values.pop("name", None)
    policy = _POLICIES.get(str(name))
    if policy is None:
        why = (
            " selects on the driver-side buffer's target-step stamps / running rollouts, which "
            "the data plane never sees; run it on NeMo-RL's own replay buffer over "
            "TQStreamDataPlaneClient"
            if name in ("in_order", "weight_fifo")
            else ""
        )
        raise ConfigError(
            f"sampler {name!r} has no tqstream mapping{why}; tqstream samplers: {sorted(_POLICIES)}"
        )
    return policy(data_plane, **values, **options)
