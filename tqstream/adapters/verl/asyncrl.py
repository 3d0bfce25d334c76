"""The AsyncRL recipe's experience calls on tqstream: one request with a real staleness window.

The recipe's TransferQueue adapter (``AsyncRLTransferQueueAdapter``) takes
``async_put_experience(data: dict[str, Tensor], current_version)``, stores it under
``global_step=current_version``, and answers ``async_get_experience(experience_count,
current_version) -> dict`` by asking TransferQueue for one ``global_step`` after another, from
``current_version`` down to ``current_version - max_staleness``, then concatenating. Here the same
two calls are one put and one get: the controller selects the oldest rows whose version is inside
the window in one request (no loop over steps, no partial batches glued together), and with
``on_stale="drop"`` evicts, and counts, the rows that fell out of it. Rows are consumed on delivery,
as TransferQueue's ``mode="fetch"`` consumed them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Client
from tqstream.experience import Experience, ExperienceBatch
from tqstream.staleness import StalenessPolicy
from tqstream.types import BatchMeta

__all__ = ["AsyncRLExperience"]

Versions = int | Sequence[int | None] | None


class AsyncRLExperience:
    """``async_put_experience`` / ``async_get_experience`` of the AsyncRL recipe (and sync twins).

    ``experience_columns``: the fields a get returns (the recipe's ``DEFAULT_EXPERIENCE_COLUMNS``).
    ``max_staleness``: the window (None: none); ``measure`` defaults to ``"dispatch"``, the put's
    ``current_version`` unless ``dispatch_version`` is given, which is the recipe's
    ``global_step``. ``versions_field``: the per-token policy versions (the recipe's
    ``token_policy_versions``) that set each row's ``version_start``/``version_end`` when present;
    ``reject_mixed_versions`` refuses rows whose tokens span versions, as the recipe's
    ``StalenessValidator`` does (the field must then be in every put). ``tasks``: the consumer
    tasks whose acks free a row; None registers ``task_name``, so a row is freed once delivered,
    as TransferQueue's clear after a fetch did (``()``: none, rows stay until cleared).
    """

    def __init__(
        self, client: Client, experience_columns: Sequence[str], *,
        max_staleness: int | None = None, partition: str = "async_rl",
        task_name: str = "async_rl_training", measure: str = "dispatch", on_stale: str = "drop",
        versions_field: str | None = "token_policy_versions", reject_mixed_versions: bool = False,
        admission: AdmissionHandle | None = None, tasks: Sequence[str] | None = None,
        lease_timeout: float | None = None, ttl: float | None = None,
    ) -> None:  # fmt: skip
        self.client = client
        self.experience_columns = list(experience_columns)
        self.task_name = task_name
        self.max_staleness = max_staleness
        self.experience = Experience(
            client, partition=partition, fields=self.experience_columns,
            staleness=StalenessPolicy(max_staleness, measure, on_stale), admission=admission,
            versions_field=versions_field, tasks=[task_name] if tasks is None else tasks,
            reject_mixed_versions=reject_mixed_versions, lease_timeout=lease_timeout, ttl=ttl,
        )  # fmt: skip

    @property
    def partition(self) -> str:
        return self.experience.partition

    def put_experience(
        self, data: Mapping[str, Any], current_version: int, *, group: Any = None,
        groups: Sequence[Any] | None = None, group_size: int | None = None,
        dispatch_version: Versions = None, slots: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> BatchMeta:  # fmt: skip
        """Store ``data`` (field -> ``[B, ...]`` tensor, or lists of per-row tensors) generated
        under ``current_version``; ``group``/``groups``/``group_size`` as in
        ``Experience.put_experience`` (members of one group must agree on fields)."""
        return self.experience.put_experience(
            data, current_version, group=group, groups=groups, group_size=group_size,
            dispatch_version=dispatch_version, slots=slots, timeout=timeout,
        )  # fmt: skip

    async def async_put_experience(
        self, data: Mapping[str, Any], current_version: int, *, group: Any = None,
        groups: Sequence[Any] | None = None, group_size: int | None = None,
        dispatch_version: Versions = None, slots: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> BatchMeta:  # fmt: skip
        return await self.experience.async_put_experience(
            data, current_version, group=group, groups=groups, group_size=group_size,
            dispatch_version=dispatch_version, slots=slots, timeout=timeout,
        )  # fmt: skip

    def get_experience(
        self, experience_count: int, current_version: int, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """``experience_count`` rows inside the window, oldest first (whole groups), as
        ``{column: tensor or list}``; consumed (acked) once delivered. Waits up to ``timeout``
        seconds (None: forever), then ``RequestTimeoutError`` saying how many rows were stale."""
        batch = self.experience.get_experience(
            experience_count, current_version, task=self.task_name, timeout=timeout
        )
        batch.ack()
        return _as_dict(batch)

    async def async_get_experience(
        self, experience_count: int, current_version: int, *, timeout: float | None = None
    ) -> dict[str, Any]:
        batch = await self.experience.async_get_experience(
            experience_count, current_version, task=self.task_name, timeout=timeout
        )
        await batch.async_ack()
        return _as_dict(batch)


def _as_dict(batch: ExperienceBatch) -> dict[str, Any]:
    """The recipe returned ``dict(tensordict)``: tensors, and object fields as lists."""
    td = batch.data
    out: dict[str, Any] = {}
    for key in td.keys():  # noqa: SIM118 (iterating a TensorDict yields rows)
        value = td.get(key)
        out[key] = value if hasattr(value, "is_nested") else value.tolist()
    return out
