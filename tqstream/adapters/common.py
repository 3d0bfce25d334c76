"""What every adapter shares: a connection per process, and the producers' writer.

Neither imports a framework (torch's own adapter and JAX's build on them), so a JAX trainer does
not load tensordict or torch.utils.data to read from tqstream.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

import tqstream
from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Client
from tqstream.errors import InvalidRequestError
from tqstream.experience import Experience
from tqstream.staleness import StalenessPolicy
from tqstream.types import BatchMeta

__all__ = ["ACK_MODES", "Connection", "ExperienceWriter", "Position", "reader_window"]

ACK_MODES = ("next", "manual")


def reader_window(
    reader: str, example: str, ack: str, fields: Sequence[str], batch_size: Any,
    staleness: StalenessPolicy | None, version_fn: Callable[[], int] | None,
) -> StalenessPolicy:  # fmt: skip
    """A reader's arguments checked as every adapter's reader checks them; its window (none:
    every row is inside)."""
    if ack not in ACK_MODES:
        raise InvalidRequestError(f"ack must be 'next' or 'manual', got {ack!r}")
    if not fields:
        raise InvalidRequestError(f"{reader} needs the fields to read, e.g. [{example!r}]")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise InvalidRequestError(f"batch_size must be a positive int, got {batch_size!r}")
    staleness = StalenessPolicy() if staleness is None else staleness
    if staleness.max_staleness is not None and version_fn is None:
        raise InvalidRequestError(
            "a staleness window needs the trainer's version: pass version_fn=lambda: "
            "<current policy version>"
        )
    return staleness


class Connection:
    """A client per process: the given one in the process that built it, a new connection
    (to the same address) in any other, e.g. a DataLoader worker after the fork."""

    def __init__(self, source: str | Client) -> None:
        self._client: Client | None
        if isinstance(source, Client):
            self.address, self._client, self._pid = source.address, source, os.getpid()
        elif isinstance(source, str):
            self.address, self._client, self._pid = source, None, os.getpid()
        else:
            raise InvalidRequestError(
                f"pass the cluster's address (client.address, 'tcp://HOST:PORT') or a Client, "
                f"got {type(source).__name__}"
            )

    def client(self) -> Client:
        if self._client is None or self._pid != os.getpid():
            self._client, self._pid = tqstream.connect(self.address), os.getpid()
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.address, self._client, self._pid = state["address"], None, -1


class ExperienceWriter:
    """A producer's handle on a partition: put one trajectory or one group per call, tagged with
    the policy version that generated it; ``close()`` says this producer is done (see
    ``ExperienceDataset(finite=True)``). ``admission``: slots handed back by each put (see
    :class:`tqstream.Experience`). ``producers``: how many writers close the partition."""

    def __init__(
        self, source: str | Client, *, partition: str = "train",
        fields: Sequence[str] | None = None, admission: AdmissionHandle | None = None,
        versions_field: str | None = "versions", reject_mixed_versions: bool = False,
        producers: int | None = None,
    ) -> None:  # fmt: skip
        self._conn = Connection(source)
        client = self._conn.client()
        self.experience = Experience(
            client, partition=partition, fields=fields, admission=admission,
            versions_field=versions_field, reject_mixed_versions=reject_mixed_versions,
        )  # fmt: skip
        if producers is not None:
            client.create_partition(partition, producers=producers)
        self.partition = partition
        self.closed = False

    def put_experience(self, data: Any, current_version: int, **kwargs: Any) -> BatchMeta:
        """Store rows generated under ``current_version``; ``group=`` one id for all of them
        (one prompt's samples). Other arguments as :meth:`tqstream.Experience.put_experience`."""
        return self.experience.put_experience(data, current_version, **kwargs)

    async def async_put_experience(
        self, data: Any, current_version: int, **kwargs: Any
    ) -> BatchMeta:
        return await self.experience.async_put_experience(data, current_version, **kwargs)

    def close(self) -> None:
        """This producer is done: once every declared producer closed it, readers drain it."""
        if not self.closed:
            self.closed = True
            self._conn.client().close_partition(self.partition)

    def __enter__(self) -> ExperienceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Position:
    """A reader's place in its stream, for checkpoints: the controller holds what was consumed;
    this holds the batch yielded last and not acked yet (``ack="next"``: acked when the next one
    is asked for, i.e. after the step that trained on it), and, after a restore, the batch the
    checkpoint trained on, acked when reading starts."""

    def __init__(self) -> None:
        self.pending: BatchMeta | None = None
        self.restored: BatchMeta | None = None
        self.yielded = 0

    def yielded_batch(self, meta: BatchMeta, ack_next: bool) -> None:
        """``meta`` was handed to the trainer; with ``ack_next`` it is acked at the next read."""
        self.pending = meta if ack_next else None
        self.yielded += 1

    def ack_pending(self, client: Client) -> None:
        if self.pending is not None:
            client.ack(self.pending)
            self.pending = None

    def resume(self, client: Client) -> None:
        """Ack the restored batch (``resumed``: its lease may have ended while the trainer was
        down; rows no other reader took are consumed, others raise ``LeaseExpiredError``)."""
        if self.restored is not None:
            client.ack(self.restored, resumed=True)
            self.restored = None

    def state_dict(self) -> dict[str, Any]:
        pending = None if self.pending is None else msgspec.to_builtins(self.pending)
        return {"batches_yielded": self.yielded, "pending": pending}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.yielded = int(state.get("batches_yielded", 0))
        pending = state.get("pending")
        self.restored = None if pending is None else msgspec.convert(pending, BatchMeta)
