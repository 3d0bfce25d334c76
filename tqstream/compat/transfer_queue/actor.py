"""The Ray actor TransferQueue's processes look up by name (see ``deploy.py``).

It holds no data and no metadata of rows: it tells a process where the job's tqstream cluster is
(``endpoint``) and answers TransferQueue's controller-actor calls that code outside TransferQueue
makes (``get_config``, ``list_partitions``, ``clear_partition``) through a tqstream client of its
own. It runs with ``num_cpus=0``: it is idle but for those calls.

``get_partition_snapshot`` gives tqstream's rows of a partition in the shape of TransferQueue's
partition snapshot (keys to global indexes, tags, field columns, production matrix), for tools
and tests that inspect it; it is built by scanning the partition, so it is not for hot paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tqstream.config import ClientConfig, from_env

__all__ = ["PartitionSnapshot", "TransferQueueController"]


@dataclasses.dataclass
class PartitionSnapshot:
    """A partition's rows as TransferQueue's controller describes them."""

    partition_id: str
    keys_mapping: dict[str, int]
    """key -> global index (tqstream row id)."""
    global_indexes: set[int]
    custom_meta: dict[int, dict[str, Any]]
    """global index -> tags (rows without tags are not listed)."""
    field_name_mapping: dict[str, int]
    """field -> column of ``production_status``."""
    production_status: Any
    """int8 tensor [largest global index + 1, fields]: 1 where the row has the field written."""


class TransferQueueController:
    def __init__(self, address: str, keys: str, conf: dict[str, Any]) -> None:
        self._address, self._keys, self._conf = address, keys, conf
        self._client: Any = None

    def endpoint(self) -> tuple[str, str, dict[str, Any]]:
        """``(address, key file, merged config)``: what a bare ``init()`` needs to attach."""
        return self._address, self._keys, self._conf

    def get_config(self) -> dict[str, Any]:
        return self._conf

    def list_partitions(self) -> list[str]:
        return list(self._tqstream().list_rows(None))

    def clear_partition(self, partition_id: str) -> None:
        self._tqstream().clear_partition(partition_id)

    def get_partition_snapshot(self, partition_id: str) -> PartitionSnapshot | None:
        import torch

        from tqstream.errors import UnknownPartitionError

        client = self._tqstream()
        try:
            stats = client.stats(partition_id).partitions[partition_id]
        except UnknownPartitionError:
            return None
        fields = list(stats.fields)
        listing = client.list_rows(partition_id)[partition_id]
        meta = listing.meta
        rows = list(meta.row_ids)
        status = torch.zeros((max(rows, default=-1) + 1, len(fields)), dtype=torch.int8)
        index = torch.tensor(rows, dtype=torch.int64)
        for col, name in enumerate(fields):
            ready = client.list_rows(partition_id, fields=[name])[partition_id].ready
            status[index, col] = torch.tensor(ready, dtype=torch.int8)
        tags = meta.tags or [{}] * len(rows)
        return PartitionSnapshot(
            partition_id=partition_id,
            keys_mapping=dict(zip(meta.keys, rows, strict=True)),
            global_indexes=set(rows),
            custom_meta={r: dict(t) for r, t in zip(rows, tags, strict=True) if t},
            field_name_mapping={name: col for col, name in enumerate(fields)},
            production_status=status,
        )

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _tqstream(self) -> Any:
        if self._client is None:
            import tqstream

            config = from_env(ClientConfig)
            if self._keys and not config.keys:
                config = dataclasses.replace(config, keys=self._keys)
            self._client = tqstream.connect(self._address, config)
        return self._client
