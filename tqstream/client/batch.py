"""What a read returns: a :class:`Batch` (metadata, data, and the lease to ack). The window a
read is made under is a :class:`~tqstream.staleness.StalenessPolicy`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, Self

from tqstream.convert.tensordict import to_tensordict
from tqstream.protocol.columns import Column
from tqstream.types import BatchMeta

if TYPE_CHECKING:
    from tensordict import TensorDict


class BatchClient(Protocol):
    """What a batch (and code holding one) needs of its client (``tqstream.Client``): a
    protocol, so this module does not import the client's (which imports it)."""

    def ack(self, meta: BatchMeta) -> int: ...

    async def async_ack(self, meta: BatchMeta) -> int: ...

    def release(self, meta: BatchMeta) -> int: ...

    async def async_release(self, meta: BatchMeta) -> int: ...

    def put_fields(self, meta: BatchMeta, data: Any) -> None: ...

    async def async_put_fields(self, meta: BatchMeta, data: Any) -> None: ...


class Batch:
    """A batch read by ``get``/``get_by_keys``: ``meta`` (rows, lease), ``data`` (TensorDict) and
    ``columns`` (each field read as a :class:`~tqstream.Column`: packed values and offsets).

    ``data`` is built from ``columns`` on first use (a jagged nested tensor costs ~40 µs to make),
    so code that takes the packed rows apart anyway reads ``columns`` and skips it; both alias the
    same memory. ``columns`` is None for a batch made from a TensorDict.
    """

    def __init__(
        self,
        meta: BatchMeta,
        data: TensorDict | None,
        client: BatchClient,
        columns: Mapping[str, Column] | None = None,
    ) -> None:
        if data is None and columns is None:
            raise ValueError("a Batch needs its data or its columns")
        self.meta, self.client, self.columns = meta, client, columns
        self._data = data

    @classmethod
    def of(cls, batch: Batch) -> Self:
        """The same read as this class (e.g. an ``ExperienceBatch``), without building its data."""
        return cls(batch.meta, batch._data, batch.client, batch.columns)

    @property
    def data(self) -> TensorDict:
        if self._data is None:
            assert self.columns is not None
            self._data = to_tensordict(len(self.meta), self.columns)
        return self._data

    def __repr__(self) -> str:
        return f"{type(self).__name__}(meta={self.meta!r})"

    def __len__(self) -> int:
        return len(self.meta)

    def ack(self) -> int:
        return self.client.ack(self.meta)

    async def async_ack(self) -> int:
        return await self.client.async_ack(self.meta)

    def release(self) -> int:
        return self.client.release(self.meta)

    async def async_release(self) -> int:
        return await self.client.async_release(self.meta)
