"""AReaL trajectories in and out of a tqstream partition: the producer's put, the trainer's read.

:class:`ArealExperience` is :class:`tqstream.Experience` speaking AReaL's trajectory format. A
put takes what ``RolloutWorkflow.arun_episode`` returns (one group's padded ``[n, L]`` dict) and
stores it as ``n`` unpadded rows of one group; a read returns what ``prepare_batch`` returns — one
padded dict per group, whole groups, oldest first — through the head-version window that is
AReaL's staleness bound. It holds no state of its own: any number of producer and trainer
processes may build one on the same partition.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tqstream.adapters.areal.trajectory import MASK, Rows, regroup, to_rows
from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Client
from tqstream.errors import InvalidRequestError, SchemaError
from tqstream.experience import Experience, ExperienceBatch
from tqstream.staleness import StalenessPolicy
from tqstream.types import BatchMeta

if TYPE_CHECKING:
    from tqstream.adapters.areal.staleness import StalenessManager

__all__ = ["AREAL_FIELDS", "AREAL_STALENESS", "ArealBatch", "ArealExperience"]

# what AReaL's RLVR and multi-turn workflows return (attention_mask is implied by the lengths)
AREAL_FIELDS = ("input_ids", "loss_mask", "logprobs", "versions", "rewards")
# AReaL's bound: a sample is as old as its oldest generated token; stale groups are evicted
AREAL_STALENESS = StalenessPolicy(measure="head", on_stale="drop")


class ArealBatch:
    """Whole groups leased by one read: ``trajectories`` is ``prepare_batch``'s list (one padded
    dict per group, in batch order). Ack after the training step; until then the rows are leased
    and a crashed trainer's lease expires, giving them back."""

    def __init__(self, batch: ExperienceBatch, trajectories: list[dict[str, torch.Tensor]]) -> None:
        self._batch = batch
        self.trajectories = trajectories
        self.lengths: torch.Tensor = batch.data["input_ids_lengths"]

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(self.trajectories)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.trajectories[i]

    @property
    def meta(self) -> BatchMeta:
        return self._batch.meta

    @property
    def versions(self) -> list[int | None]:
        """Each row's ``version_start``: the oldest policy version among its generated tokens."""
        return self._batch.versions

    @property
    def stale_dropped(self) -> int:
        """Rows this read evicted as stale on its way to these ones."""
        return self._batch.stale_dropped

    def ack(self) -> int:
        return self._batch.ack()

    async def async_ack(self) -> int:
        return await self._batch.async_ack()

    def release(self) -> int:
        return self._batch.release()

    async def async_release(self) -> int:
        return await self._batch.async_release()

    def put_fields(self, data: Mapping[str, Any]) -> None:
        """Store columns computed later (``prox_logp``, ``ref_logp``, ``values``) on these rows.

        Each value is either one tensor for the whole batch, in the layout
        ``concat_padded_tensors(batch.trajectories)`` has (``[rows, W, ...]`` per token, ``W``
        the longest row, or ``[rows]`` per sample), or a list with one tensor per group in that
        group's own layout (``[n, W_group, ...]`` or ``[n]``). Per-token columns are stored
        unpadded, like the trajectory, so a later read re-pads them with the rest. Fields are
        never overwritten (``FieldExistsError``); another shape raises ``SchemaError``.
        """
        self._batch.client.put_fields(self.meta, self._rows(data))

    async def async_put_fields(self, data: Mapping[str, Any]) -> None:
        await self._batch.client.async_put_fields(self.meta, self._rows(data))

    def _rows(self, data: Mapping[str, Any]) -> Rows:
        return {name: self._column(name, value) for name, value in data.items()}

    def _column(self, name: str, value: Any) -> list[torch.Tensor] | torch.Tensor:
        n = len(self.lengths)
        if isinstance(value, list | tuple):
            if len(value) != len(self.trajectories):
                raise SchemaError(
                    f"put_fields: {name!r} is a list of {len(value)} tensors but the batch has "
                    f"{len(self.trajectories)} groups; pass one per group, or one tensor for "
                    f"all {n} rows",
                    field=name,
                )
            parts = [self._group_column(name, v, g) for g, v in enumerate(value)]
            if all(isinstance(p, list) for p in parts):
                return [row for p in parts for row in p]
            if any(isinstance(p, list) for p in parts):
                raise SchemaError(
                    f"put_fields: {name!r} is per token in some groups and per sample in others",
                    field=name,
                )
            return torch.cat(parts)  # type: ignore[arg-type]
        width = int(self.lengths.max()) if n else 0
        column = _unpad(value, self.lengths, width)
        if column is None:
            raise SchemaError(
                f"put_fields: {name!r} is {_shape(value)}; for this batch of {n} rows a column is "
                f"[{n}, {width}, ...] (per token, padded like concat_padded_tensors) or [{n}] (per "
                f"sample), or a list with one tensor per group",
                field=name,
            )
        return column

    def _group_column(self, name: str, value: Any, g: int) -> list[torch.Tensor] | torch.Tensor:
        mask = self.trajectories[g][MASK]
        n, width = mask.shape
        column = _unpad(value, mask.sum(dim=1), width)
        if column is None:
            raise SchemaError(
                f"put_fields: {name!r} for group {g} is {_shape(value)}; for that group a column "
                f"is [{n}, {width}, ...] (per token) or [{n}] (per sample)",
                field=name,
            )
        return column


def _unpad(
    value: Any, lengths: torch.Tensor, width: int
) -> list[torch.Tensor] | torch.Tensor | None:
    """Rows of a column padded like its batch: per token ``[n, width, ...]`` (cut to each row's
    length) or per sample ``[n]``; None for anything else. A per-token column padded to another
    width is refused rather than stored as a per-sample vector, which it would silently become."""
    n = len(lengths)
    if not isinstance(value, torch.Tensor):
        return None
    if value.ndim >= 2 and tuple(value.shape[:2]) == (n, width):
        return [value[i, :k] for i, k in enumerate(lengths.tolist())]
    return value if value.shape == (n,) else None


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


class ArealExperience:
    """A partition of AReaL trajectories with its staleness window and registered tasks.

    ``fields``: what every trajectory carries and a read returns (``attention_mask`` is always
    returned, never stored). ``staleness``: the read window, by default AReaL's head measure
    (a sample is as old as its oldest generated token) with stale groups dropped; set
    ``max_staleness`` to ``max_head_offpolicyness``. ``admission``: link the partition to a
    :class:`StalenessManager` (or capacity ``AdmissionHandle``) so that rows the window drops give
    their staleness budget back — one unit per dropped row, which is right only when each rollout
    puts one row (``group_size=1``); with groups of ``n`` leave it out (see docs/adapters/areal.md).
    ``tasks``: consumer tasks whose acks free a row.
    """

    def __init__(
        self, client: Client, *, partition: str = "train", fields: Sequence[str] = AREAL_FIELDS,
        staleness: StalenessPolicy = AREAL_STALENESS,
        admission: StalenessManager | AdmissionHandle | None = None,
        tasks: Sequence[str] | None = ("actor",), pad_value: float = 0.0,
        lease_timeout: float | None = None, ttl: float | None = None,
    ) -> None:  # fmt: skip
        names = [f for f in fields if f != MASK]
        if "input_ids" not in names:
            raise InvalidRequestError(
                f"ArealExperience needs 'input_ids' among fields= (got {list(fields)}): it gives "
                f"each sample's length"
            )
        handle = admission
        if admission is not None and not isinstance(admission, AdmissionHandle):
            # the partition names its manager's budget: the controller returns stale drops there
            handle = AdmissionHandle(client, admission.name, "budget")
        self.fields, self.pad_value = names, pad_value
        self.experience = Experience(
            client, partition=partition, fields=names, staleness=staleness, admission=handle,
            versions_field="versions", tasks=tasks, lease_timeout=lease_timeout, ttl=ttl,
        )  # fmt: skip

    @classmethod
    def from_config(cls, client: Client, config: Any, **kwargs: Any) -> ArealExperience:
        """From AReaL's ``InferenceEngineConfig``: the window is ``max_head_offpolicyness``."""
        policy = StalenessPolicy(config.max_head_offpolicyness, measure="head", on_stale="drop")
        return cls(client, staleness=kwargs.pop("staleness", policy), **kwargs)

    @property
    def client(self) -> Client:
        return self.experience.client

    @property
    def partition(self) -> str:
        return self.experience.partition

    def _rows(self, data: Any) -> tuple[Rows, int]:
        rows, n = to_rows(data)
        missing = [f for f in self.fields if f not in rows]
        extra = sorted(set(rows) - set(self.fields))
        if missing or extra:
            parts = [f"lacks {missing}"] if missing else []
            parts += [f"has {extra} that fields= does not name"] if extra else []
            raise SchemaError(
                f"the trajectory {' and '.join(parts)}; this ArealExperience stores "
                f"fields={self.fields} (+ attention_mask): return those from arun_episode or "
                f"build the ArealExperience with the fields your workflow returns",
                missing=missing,
                extra=extra,
            )
        return rows, n

    def _put_args(self, data: Any, group: str | None) -> tuple[Rows, dict[str, Any]]:
        rows, n = self._rows(data)
        gid = uuid.uuid4().hex if group is None else group
        return rows, dict(group=gid, group_size=n)

    def put_experience(
        self, data: Any, current_version: int, *, group: str | None = None,
        dispatch_version: int | None = None, timeout: float | None = None,
    ) -> BatchMeta:  # fmt: skip
        """Store one episode's result as one group of unpadded rows.

        ``data``: a trajectory dict of ``[n, L]`` tensors (what ``arun_episode`` returns), or a
        list of such dicts that are the samples of one group. ``current_version``: the policy
        version the episode ran under (rows whose ``versions`` field has generated tokens take
        their versions from it instead). ``group``: the group id (a fresh one by default; an id
        names one group for the partition's lifetime). Nothing is stored if any check fails.
        """
        rows, args = self._put_args(data, group)
        return self.experience.put_experience(
            rows, current_version, dispatch_version=dispatch_version, timeout=timeout, **args
        )

    async def async_put_experience(
        self, data: Any, current_version: int, *, group: str | None = None,
        dispatch_version: int | None = None, timeout: float | None = None,
    ) -> BatchMeta:  # fmt: skip
        rows, args = self._put_args(data, group)
        return await self.experience.async_put_experience(
            rows, current_version, dispatch_version=dispatch_version, timeout=timeout, **args
        )

    def _read_fields(self, fields: Sequence[str] | None) -> list[str]:
        names = [f for f in (self.fields if fields is None else fields) if f != MASK]
        return names if "input_ids" in names else ["input_ids", *names]

    def _get_args(self, fields: Sequence[str] | None, timeout: float | None) -> dict[str, Any]:
        return dict(fields=self._read_fields(fields), whole_groups=True, timeout=timeout,
                    padded=True, pad_values=self.pad_value)  # fmt: skip

    def get_experience(
        self, count: int, current_version: int, *, task: str = "actor",
        fields: Sequence[str] | None = None, timeout: float | None = None,
    ) -> ArealBatch:  # fmt: skip
        """Lease ``count`` samples (rows) of whole groups, oldest first, inside the window of
        ``current_version``; ``batch.trajectories`` has one padded dict per group.

        ``count`` is in samples: AReaL's ``consumer_batch_size`` (prompts) times the group size.
        Waits at the controller until they exist (``timeout``: seconds, None forever, then
        ``RequestTimeoutError``). ``input_ids`` and ``attention_mask`` are always returned.
        """
        args = self._get_args(fields, timeout)
        batch = self.experience.get_experience(count, current_version, task=task, **args)
        return ArealBatch(batch, regroup(batch.data, batch.meta.groups, args["fields"]))

    async def async_get_experience(
        self, count: int, current_version: int, *, task: str = "actor",
        fields: Sequence[str] | None = None, timeout: float | None = None,
    ) -> ArealBatch:  # fmt: skip
        args = self._get_args(fields, timeout)
        batch = await self.experience.async_get_experience(
            count, current_version, task=task, **args
        )
        return ArealBatch(batch, regroup(batch.data, batch.meta.groups, args["fields"]))
