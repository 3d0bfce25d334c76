"""``put_experience`` / ``get_experience``, every tqstream adapter's pair, in NeMo-RL's types.

A producer stores one prompt group per call under the policy version that generated it, the way
NeMo-RL's replay buffer commits one (keys ``{uid}_g{i}``, the tag ``weight_version``); a trainer
takes the oldest whole groups inside its staleness window as a claim of its data-plane client
(kept from other claims of the task, acked when that client closes, given back if it dies) and
clears them after training. Everything goes through :class:`TQStreamDataPlaneClient`, so rows
written here are NeMo-RL rows like any other.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from tqstream.adapters.nemo_rl.client import LENGTHS_TAG, TQStreamDataPlaneClient
from tqstream.adapters.nemo_rl.compat import KVBatchMeta
from tqstream.adapters.nemo_rl.convert import check_names, densify
from tqstream.staleness import StalenessPolicy

__all__ = ["NemoRLExperience"]

NO_WINDOW = StalenessPolicy()
"""The default: every row is inside (``max_staleness=None``)."""


class NemoRLExperience:
    """One partition of rollouts (``partition_id``, NeMo-RL's ``rollout_data`` by default) with
    the trainer's staleness window (``staleness``: measured on the head version, the rollout's
    start weight; no window by default). ``fields`` are declared, so a trainer waits for them
    before any producer wrote. ``task``: the consumer task trainers claim for."""

    def __init__(
        self,
        data_plane: TQStreamDataPlaneClient,
        *,
        fields: Sequence[str],
        partition_id: str = "rollout_data",
        task: str = "train",
        staleness: StalenessPolicy = NO_WINDOW,
    ) -> None:
        self.data_plane, self.partition_id, self.task = data_plane, partition_id, task
        self.fields = check_names(fields, "fields", empty_ok=False)
        self.staleness = staleness
        data_plane.client.create_partition(partition_id, self.fields)

    def put_experience(
        self,
        data: TensorDict,
        current_version: int,
        *,
        sample_ids: list[str] | None = None,
        group: str | None = None,
    ) -> KVBatchMeta:
        """Store one prompt group generated under ``current_version``: keys ``sample_ids``, or
        ``{group}_g{i}`` (a fresh group id when None), tagged ``weight_version``."""
        n = (
            int(data.batch_size[0])
            if isinstance(data, TensorDict)
            else len(next(iter(data.values())))
        )
        if sample_ids is None:
            uid = group if group is not None else uuid.uuid4().hex
            sample_ids = [f"{uid}_g{i}" for i in range(n)]
        tags = [{self.data_plane.config.version_tag: current_version} for _ in range(n)]
        return self.data_plane.put_samples(sample_ids, self.partition_id, data, tags)

    def get_experience(
        self,
        count: int,
        current_version: int,
        *,
        fields: Sequence[str] | None = None,
        whole_groups: bool = True,
        timeout: float | None = None,
    ) -> tuple[KVBatchMeta, TensorDict]:
        """Claim the ``count`` oldest rows inside the window (whole groups by default; rows
        outside it are dropped or kept per ``staleness``) and read them: waits at the controller
        up to ``timeout`` (None: forever), then ``RequestTimeoutError``. Returns the claim and its
        data; clear the rows with ``data_plane.clear_samples(meta.sample_ids, ...)`` after
        training."""
        names = self.fields if fields is None else check_names(fields, "fields", empty_ok=False)
        window: dict[str, Any] = {}
        if self.staleness.max_staleness is not None:
            window = {"current_version": current_version, "staleness": self.staleness}
        dp = self.data_plane
        lease = dp._claim(
            self.partition_id, names, count, self.task, whole_groups=whole_groups,
            timeout=timeout, **window,
        )  # fmt: skip
        data = densify(dp.client.get_data(lease, names))
        meta = dp._claimed(lease, names)
        if meta.sequence_lengths is None and LENGTHS_TAG in names:  # for length-balanced shards
            meta.sequence_lengths = [
                int(n) for n in data[LENGTHS_TAG].reshape(len(lease), -1)[:, 0]
            ]
        return meta, data

    async def async_put_experience(
        self,
        data: TensorDict,
        current_version: int,
        *,
        sample_ids: list[str] | None = None,
        group: str | None = None,
    ) -> KVBatchMeta:
        return await asyncio.to_thread(
            self.put_experience, data, current_version, sample_ids=sample_ids, group=group
        )

    async def async_get_experience(
        self,
        count: int,
        current_version: int,
        *,
        fields: Sequence[str] | None = None,
        whole_groups: bool = True,
        timeout: float | None = None,
    ) -> tuple[KVBatchMeta, TensorDict]:
        return await asyncio.to_thread(
            self.get_experience, count, current_version, fields=fields,
            whole_groups=whole_groups, timeout=timeout,
        )  # fmt: skip
