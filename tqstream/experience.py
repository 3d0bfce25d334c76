"""The experience API: put rollouts under a policy version, get fresh batches, free what is done.

The common core of the framework adapters (verl, AReaL, plain PyTorch). An ``Experience`` binds a
partition to what every call would repeat: the staleness window trainers read through, the
admission whose slots producers hand back, the tasks whose acks free storage. Its state lives at
the controller, so every producer and trainer process may build one on the same partition:

    exp = Experience(client, fields=["input_ids"], staleness=StalenessPolicy(max_staleness=2))
    exp.put_experience(rollout, current_version=v, group=prompt_uid)      # producer
    exp.get_experience(64, current_version=v, task="actor").ack()         # trainer

docs/staleness.md explains the version model, the window and flow control.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Batch, Client, PadValues
from tqstream.client.versions import row_versions
from tqstream.convert.inputs import columns_from_data
from tqstream.errors import InvalidRequestError, TQStreamError
from tqstream.staleness import StalenessPolicy, check_version
from tqstream.types import BatchMeta

__all__ = ["Experience", "ExperienceBatch", "StalenessPolicy"]  # the window's home: staleness.py

Versions = int | Sequence[int | None] | None
NO_WINDOW = StalenessPolicy()
"""The default window: none, every row is inside."""


class ExperienceBatch(Batch):
    """A :class:`~tqstream.client.client.Batch` (``meta``, ``data``, ``ack``, ``release``) read
    through a staleness window. ``ack`` frees rows that every registered task has acked."""

    @property
    def stale_dropped(self) -> int:
        """Rows this read evicted as stale (``on_stale="drop"``) on its way to these ones."""
        return self.meta.stale_dropped

    @property
    def versions(self) -> list[int | None]:
        """Each row's ``version_start`` (None: put without a version)."""
        return list(self.meta.version_start)

    def put_fields(self, data: Any) -> None:
        """Add columns (e.g. ``advantages``) to these rows, in batch order, for later tasks."""
        self.client.put_fields(self.meta, data)

    async def async_put_fields(self, data: Any) -> None:
        await self.client.async_put_fields(self.meta, data)


class Experience:
    """A partition of experience with its staleness window, admission and registered tasks.

    The constructor creates the partition (``create_partition(partition, fields, tasks=, ttl=)``:
    one round trip, harmless again from other processes), so a bad setting fails here and trainers
    can wait for the declared ``fields`` before any producer put. With ``tasks``, a row is freed as
    soon as every one of them acked it.
    """

    def __init__(
        self, client: Client, *, partition: str = "train", fields: Sequence[str] | None = None,
        staleness: StalenessPolicy = NO_WINDOW, admission: AdmissionHandle | None = None,
        versions_field: str | None = "versions", tasks: Sequence[str] | None = None,
        reject_mixed_versions: bool = False, lease_timeout: float | None = None,
        ttl: float | None = None,
    ) -> None:  # fmt: skip
        if reject_mixed_versions and versions_field is None:
            raise InvalidRequestError(
                "reject_mixed_versions=True needs a per-token versions field to find mixed rows; "
                "pass versions_field='<name>' (the default is 'versions')"
            )
        self.client, self.partition, self.staleness = client, partition, staleness
        self.fields = None if fields is None else list(fields)
        self.tasks = None if tasks is None else list(tasks)
        self.admission, self.versions_field = admission, versions_field
        self.reject_mixed_versions, self.lease_timeout, self.ttl = (
            reject_mixed_versions, lease_timeout, ttl)  # fmt: skip
        client.create_partition(
            partition,
            self.fields or (),
            tasks=self.tasks,
            ttl=ttl,
            admission=None if admission is None else admission.name,
        )

    def _put_args(self, data: Any, version: int, group: Any, groups: Sequence[Any] | None,
                  slots: Sequence[int] | None, **rest: Any) -> dict[str, Any]:  # fmt: skip
        check_version(version, "current_version", optional=False)
        if group is not None and groups is not None:
            raise InvalidRequestError("pass group= (one id for every row) or groups=, not both")
        if slots is not None and self.admission is None:
            raise InvalidRequestError(
                "slots= needs an admission to release them to: build the Experience with "
                "admission=client.admission(style, ...)"
            )
        from tensordict import TensorDictBase  # imported when first used: it takes seconds

        if group is not None and isinstance(data, Mapping | TensorDictBase):  # else put raises
            first = data if isinstance(data, TensorDictBase) else next(iter(data.values()), ())
            groups = [group] * len(first)
        return dict(partition=self.partition, groups=groups, version=version,
                    versions_field=self.versions_field,
                    reject_mixed_versions=self.reject_mixed_versions, **rest)  # fmt: skip

    def _slot_outcomes(self, data: Any, meta: BatchMeta, version: int, slots: Sequence[int] | None
                       ) -> list[tuple[AdmissionHandle, list[int], str]]:  # fmt: skip
        """``(admission, slot ids, outcome)`` to release after a put that returned ``meta``."""
        adm, ids = self.admission, list(slots or ())
        if adm is None or not ids:
            return []
        if len(ids) != len(meta) + meta.rejected or not meta.rejected:
            return [(adm, ids, "accepted" if len(meta) else "rejected")]
        name = self.versions_field
        assert name is not None  # rows are refused only with a versions field
        _, cols = columns_from_data({name: data[name]})  # the client's per-row reduction, again
        starts, ends = row_versions(name, cols[name], version)
        accepted = [i for i, a, b in zip(ids, starts, ends, strict=True) if a == b]
        rejected = [i for i, a, b in zip(ids, starts, ends, strict=True) if a != b]
        return [(adm, x, o) for x, o in ((accepted, "accepted"), (rejected, "rejected")) if x]

    def put_experience(
        self, data: Any, current_version: int, *, group: Any = None,
        groups: Sequence[Any] | None = None, group_size: int | None = None,
        keys: Sequence[str] | None = None, dispatch_version: Versions = None,
        slots: Sequence[int] | None = None, timeout: float | None = None,
    ) -> BatchMeta:  # fmt: skip
        """Store rollouts generated under ``current_version`` (the put's ``version=``).

        ``group``: one group id for every row (one prompt's samples); ``groups``: one per row.
        ``slots``: the admission slot ids this put ends. With one slot per row (as many ids as
        ``data`` has rows) slot ``i`` is released "accepted" if row ``i`` was stored and "rejected"
        if ``reject_mixed_versions`` refused it; with any other number the slots belong to the put
        as a whole: "accepted" if at least one row was stored, else "rejected". If the put raises,
        every slot is released "rejected" (its staleness budget comes back) and the put's error
        propagates. ``timeout``: seconds to wait for room under storage byte quotas (None:
        forever), then ``CapacityError``. Returns the stored rows (``meta.rejected``: refused).
        """
        args = self._put_args(data, current_version, group, groups, slots, keys=keys,
                              group_size=group_size, dispatch_version=dispatch_version,
                              timeout=timeout)  # fmt: skip
        try:
            meta = self.client.put(data, **args)
        except BaseException:
            if slots and self.admission:
                with contextlib.suppress(TQStreamError):  # the put's error is the one to report
                    self.admission.release(slots, "rejected")
            raise
        for adm, ids, outcome in self._slot_outcomes(data, meta, current_version, slots):
            adm.release(ids, outcome)
        return meta

    async def async_put_experience(
        self, data: Any, current_version: int, *, group: Any = None,
        groups: Sequence[Any] | None = None, group_size: int | None = None,
        keys: Sequence[str] | None = None, dispatch_version: Versions = None,
        slots: Sequence[int] | None = None, timeout: float | None = None,
    ) -> BatchMeta:  # fmt: skip
        args = self._put_args(data, current_version, group, groups, slots, keys=keys,
                              group_size=group_size, dispatch_version=dispatch_version,
                              timeout=timeout)  # fmt: skip
        try:
            meta = await self.client.async_put(data, **args)
        except BaseException:
            if slots and self.admission:
                with contextlib.suppress(TQStreamError):
                    await self.admission.async_release(slots, "rejected")
            raise
        for adm, ids, outcome in self._slot_outcomes(data, meta, current_version, slots):
            await adm.async_release(ids, outcome)
        return meta

    def _get_args(self, count: int, version: int, task: str, fields: Sequence[str] | None,
                  **rest: Any) -> dict[str, Any]:  # fmt: skip
        fields = self.fields if fields is None else list(fields)
        if not fields:
            raise InvalidRequestError(
                "get_experience needs the fields to read: pass fields=[...] to it or to Experience"
            )
        check_version(version, "current_version", optional=False)
        return dict(partition=self.partition, fields=fields, batch_size=count, task=task,
                    lease_timeout=self.lease_timeout, current_version=version,
                    staleness=self.staleness, **rest)  # fmt: skip

    def get_experience(
        self, count: int, current_version: int, *, task: str, fields: Sequence[str] | None = None,
        whole_groups: bool = True, timeout: float | None = None, padded: bool = False,
        pad_values: PadValues = 0,
    ) -> ExperienceBatch:  # fmt: skip
        """Lease the ``count`` oldest rows inside the window (whole groups by default) for ``task``.

        Waits at the controller until they exist (``timeout``: seconds, None forever; then
        ``RequestTimeoutError``). ``current_version`` places the window and, at ack, feeds the
        task's lag histogram (``stats().partitions[p].tasks[task].lag``), window or not.
        """
        args = self._get_args(count, current_version, task, fields, whole_groups=whole_groups,
                              timeout=timeout, padded=padded, pad_values=pad_values)  # fmt: skip
        batch = self.client.get(**args)
        return ExperienceBatch.of(batch)

    async def async_get_experience(
        self, count: int, current_version: int, *, task: str, fields: Sequence[str] | None = None,
        whole_groups: bool = True, timeout: float | None = None, padded: bool = False,
        pad_values: PadValues = 0,
    ) -> ExperienceBatch:  # fmt: skip
        args = self._get_args(count, current_version, task, fields, whole_groups=whole_groups,
                              timeout=timeout, padded=padded, pad_values=pad_values)  # fmt: skip
        batch = await self.client.async_get(**args)
        return ExperienceBatch.of(batch)
