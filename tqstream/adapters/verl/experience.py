"""``DataProto`` in, ``DataProto`` out: a verl trainer's experience partition on tqstream.

Producers put each rollout ``DataProto`` (one prompt's group, or one trajectory at a time with
``group_size``) under the policy version that generated it; the trainer gets a fresh
``DataProto`` of whole ``uid`` groups through a staleness window, trains, acks. Defaults follow
verl: the window measures from the *dispatch* version (the version when generation was requested,
which is what verl's v1 trainer and the AsyncRL recipe count staleness from; it is the put's version
unless ``dispatch_version`` says otherwise), groups are the ``uid``, and every read rebuilds the
padded ``input_ids`` / ``attention_mask`` / ``position_ids`` verl's workers expect.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from tqstream.adapters.verl.dataproto import RowBatch, dataproto_to_rows, stored_fields
from tqstream.adapters.verl.layout import DERIVED_FIELDS, LAYOUT_FIELD
from tqstream.adapters.verl.rebuild import Missing, convert
from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Client
from tqstream.errors import InvalidRequestError
from tqstream.experience import Experience, ExperienceBatch
from tqstream.staleness import StalenessPolicy, check_version
from tqstream.types import BatchMeta

__all__ = ["VerlBatch", "VerlExperience"]

Versions = int | Sequence[int | None] | None
DISPATCH_WINDOW = StalenessPolicy(measure="dispatch")
"""verl's default window: measured from the dispatch version, unbounded until configured."""


@dataclasses.dataclass
class VerlBatch:
    """A leased batch as a ``DataProto``: ``data``; ``meta`` (rows, lease); ``ack`` after the
    step (the rows are then consumed by this task), ``release`` to give them back."""

    meta: BatchMeta
    data: Any  # verl.protocol.DataProto
    client: Client = dataclasses.field(repr=False)

    def __len__(self) -> int:
        return len(self.meta)

    @property
    def versions(self) -> list[int | None]:
        return list(self.meta.version_start)

    @property
    def stale_dropped(self) -> int:
        return self.meta.stale_dropped

    def ack(self) -> int:
        return self.client.ack(self.meta)

    async def async_ack(self) -> int:
        return await self.client.async_ack(self.meta)

    def release(self) -> int:
        return self.client.release(self.meta)

    async def async_release(self) -> int:
        return await self.client.async_release(self.meta)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class VerlExperience:
    """A partition of verl rollouts: ``put_experience(DataProto, v)`` / ``get_experience(n, v)``.

    ``fields``: the ``DataProto`` keys the trainer reads (batch and non-tensor; naming
    ``prompts``, ``responses`` or a rebuilt ``input_ids``/``attention_mask``/``position_ids``
    reads both and rebuilds those, see :func:`stored_fields`); None reads every field the
    partition has when the get is made, and every object-valued ``non_tensor_batch`` key. Which
    keys are fields and which ride in the layout field (object values) is learnt from the
    partition's stats and the rows read; a key taken for an object value that the rows turn out
    not to have is a field not written yet: the rows are released and the get waits for it.
    ``staleness``: the read window (default: dispatch measure, no bound). ``admission``: a handle
    whose slot ids ``put_experience(slots=)`` releases. ``response_fields`` / ``pad_token_id``: see
    :func:`dataproto_to_rows`; ``prompt_length`` / ``response_length``: the widths reads re-pad to
    (None: the widest put's).
    """

    def __init__(
        self, client: Client, *, partition: str = "train", fields: Sequence[str] | None = None,
        staleness: StalenessPolicy = DISPATCH_WINDOW,
        admission: AdmissionHandle | None = None, tasks: Sequence[str] | None = None,
        response_fields: Sequence[str] = (), pad_token_id: int | None = None,
        prompt_length: int | None = None, response_length: int | None = None,
        lease_timeout: float | None = None, ttl: float | None = None,
    ) -> None:  # fmt: skip
        self.client = client
        self.keys = None if fields is None else list(fields)
        # the partition's fields as last seen, and keys known to be object values
        self._written: set[str] = set()
        self._carried: set[str] = set()
        # declared, so that a get can wait for any of them before it is written
        self.fields = None
        if fields is not None:
            self.fields = stored_fields(fields, [k for k in fields if k not in DERIVED_FIELDS])
        self.response_fields = tuple(response_fields)
        self.pad_token_id, self.prompt_length, self.response_length = (
            pad_token_id, prompt_length, response_length)  # fmt: skip
        self.experience = Experience(
            client, partition=partition, fields=self.fields, staleness=staleness,
            admission=admission, versions_field=None, tasks=tasks,
            lease_timeout=lease_timeout, ttl=ttl,
        )  # fmt: skip

    @property
    def partition(self) -> str:
        return self.experience.partition

    # --- producers ---
    def _rows(self, data: Any, version: object, group_size: int | None) -> RowBatch:
        check_version(version, "current_version", optional=False)
        rows = dataproto_to_rows(
            data, response_fields=self.response_fields, pad_token_id=self.pad_token_id
        )
        if group_size is not None and rows.groups is None:
            raise InvalidRequestError(
                "group_size= needs the rows' groups: give the DataProto a non_tensor_batch['uid'] "
                "(verl's GRPO group id)"
            )
        return rows

    def put_experience(
        self, data: Any, current_version: int, *, group_size: int | None = None,
        dispatch_version: Versions = None, slots: Sequence[int] | None = None,
        keys: Sequence[str] | None = None, timeout: float | None = None,
    ) -> BatchMeta:  # fmt: skip
        """Store a rollout ``DataProto`` generated under ``current_version``, in one put.

        Groups are its ``uid``; ``group_size``: the group's size when its members come in several
        puts (then they must agree on fields: ``GroupError``). ``dispatch_version``: the version
        when generation was requested (int or one per row; default ``current_version``).
        ``slots``: admission slot ids this put ends (see ``Experience.put_experience``). A bad
        ``DataProto`` or version raises before anything is stored.
        """
        rows = self._rows(data, current_version, group_size)
        return self.experience.put_experience(
            rows.data, current_version, groups=rows.groups, group_size=group_size,
            dispatch_version=dispatch_version, slots=slots, keys=keys, timeout=timeout,
        )  # fmt: skip

    async def async_put_experience(
        self, data: Any, current_version: int, *, group_size: int | None = None,
        dispatch_version: Versions = None, slots: Sequence[int] | None = None,
        keys: Sequence[str] | None = None, timeout: float | None = None,
    ) -> BatchMeta:  # fmt: skip
        rows = self._rows(data, current_version, group_size)
        return await self.experience.async_put_experience(
            rows.data, current_version, groups=rows.groups, group_size=group_size,
            dispatch_version=dispatch_version, slots=slots, keys=keys, timeout=timeout,
        )  # fmt: skip

    # --- trainer ---
    def _read(self, keys: Sequence[str] | None, part: Any) -> list[str]:
        """The row fields to read for ``keys`` (None: the partition's, from its stats ``part``)."""
        if keys is not None:
            return stored_fields(keys, self._written)
        if part is None or not part.schemas:
            raise InvalidRequestError(
                f"partition {self.partition!r} has no fields yet to read; pass fields=[...] (the "
                f"DataProto keys) to VerlExperience or get_experience so the trainer can wait for "
                f"producers"
            )
        return [*(k for k in part.schemas if k != LAYOUT_FIELD), LAYOUT_FIELD]

    def _unknown(self, keys: Sequence[str] | None) -> bool:
        """Whether the partition's stats are needed to tell ``keys``' fields from object values."""
        if keys is None:
            return True
        known = (self._written, self._carried, DERIVED_FIELDS, ("prompts", "responses"))
        return any(all(k not in where for where in known) for k in keys)

    def _learn(self, part: Any) -> None:
        if part is not None:
            self._written.update(part.schemas)

    def _convert(self, batch: ExperienceBatch, keys: Sequence[str] | None) -> Any:
        out = convert(batch, keys, self.prompt_length, self.response_length, self.pad_token_id)
        if not isinstance(out, Missing) and keys is not None:
            read = batch.data.keys() if batch.columns is None else batch.columns
            self._carried.update(k for k in out.non_tensor_batch if k not in read)
        return out

    def _missing(self, out: Missing) -> None:
        """After rows that lack ``out.keys``: they were taken for object values but are fields
        not written yet (never named by the read), so the next read names and waits for them."""
        self._written.update(out.keys)

    def get_experience(
        self, count: int, current_version: int, *, task: str = "actor",
        fields: Sequence[str] | None = None, whole_groups: bool = True,
        timeout: float | None = None,
    ) -> VerlBatch:  # fmt: skip
        """Lease the ``count`` oldest rows inside the window (whole ``uid`` groups by default) as
        one ``DataProto``; waits up to ``timeout`` seconds (None: forever). If the rows cannot be
        turned into a ``DataProto``, their lease is released and the error raised."""
        keys = self.keys if fields is None else list(fields)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            part = None
            if self._unknown(keys):
                part = self.client.stats(self.partition).partitions.get(self.partition)
                self._learn(part)
            read = self._read(keys, part)
            batch = self.experience.get_experience(
                count, current_version, task=task, fields=read, whole_groups=whole_groups,
                timeout=_left(deadline),
            )  # fmt: skip
            try:
                data = self._convert(batch, keys)
            except BaseException:
                batch.release()
                raise
            if not isinstance(data, Missing):
                return VerlBatch(batch.meta, data, self.client)
            batch.release()
            self._missing(data)

    async def async_get_experience(
        self, count: int, current_version: int, *, task: str = "actor",
        fields: Sequence[str] | None = None, whole_groups: bool = True,
        timeout: float | None = None,
    ) -> VerlBatch:  # fmt: skip
        keys = self.keys if fields is None else list(fields)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            part = None
            if self._unknown(keys):
                stats = await self.client.async_stats(self.partition)
                part = stats.partitions.get(self.partition)
                self._learn(part)
            read = self._read(keys, part)
            batch = await self.experience.async_get_experience(
                count, current_version, task=task, fields=read, whole_groups=whole_groups,
                timeout=_left(deadline),
            )  # fmt: skip
            try:
                data = self._convert(batch, keys)
            except BaseException:
                await batch.async_release()
                raise
            if not isinstance(data, Missing):
                return VerlBatch(batch.meta, data, self.client)
            await batch.async_release()
            self._missing(data)
