"""What a read returns: a :class:`Batch` (metadata, data, and the lease to ack). The window a
read is made under is a :class:`~tqstream.staleness.StalenessPolicy`."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from tensordict import TensorDict

from tqstream.types import BatchMeta


class BatchClient(Protocol):
    """What a batch (and code holding one) needs of its client (``tqstream.Client``): a
    protocol, so this module does not import the client's (which imports it)."""

    def ack(self, meta: BatchMeta) -> int: ...

    async def async_ack(self, meta: BatchMeta) -> int: ...

    def release(self, meta: BatchMeta) -> int: ...

    async def async_release(self, meta: BatchMeta) -> int: ...

    def put_fields(self, meta: BatchMeta, data: Any) -> None: ...

    async def async_put_fields(self, meta: BatchMeta, data: Any) -> None: ...


@dataclasses.dataclass
class Batch:
    """A batch read by ``get``/``get_by_keys``: ``meta`` (rows, lease) and ``data`` (TensorDict)."""

    meta: BatchMeta
    data: TensorDict
    client: BatchClient = dataclasses.field(repr=False)

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
