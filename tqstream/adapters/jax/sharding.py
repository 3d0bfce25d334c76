"""Several devices and hosts: which rows of a global batch this process reads, and the global
``jax.Array`` built from every process's share.

The batch axis is split by the ``Sharding``'s first dimension: each process leases the rows its
own devices hold (the controller splits a task's rows among readers, so the processes' shares are
disjoint and each row is read once), and ``jax.make_array_from_process_local_data`` joins the
shares without moving bytes between hosts. Padded lengths must agree across processes (one
global shape): with several processes each batch's longest row per field is exchanged first (a
small all-gather over JAX's collectives), and every process pads to the bucket of the longest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from tqstream.errors import InvalidRequestError

__all__ = ["Placement"]


class Placement:
    """The batch axis of ``batch_size`` rows under ``sharding`` (None: this process reads the
    whole batch and the arrays stay on the default device)."""

    def __init__(self, sharding: Any, batch_size: int) -> None:
        self.sharding = sharding
        self.processes = 1 if sharding is None else jax.process_count()
        self.batch_size = batch_size
        self.local_rows, self.first_row = batch_size, 0
        if sharding is None:
            return
        if not isinstance(sharding, NamedSharding | SingleDeviceSharding):
            raise InvalidRequestError(
                f"sharding must be a jax.sharding.NamedSharding (e.g. NamedSharding(mesh, "
                f"PartitionSpec('data'))) or a SingleDeviceSharding, got {type(sharding).__name__}"
            )
        rows = self.for_ndim(1)
        shards = _shards(rows)
        if batch_size % shards:
            raise InvalidRequestError(
                f"batch_size={batch_size} does not divide among the {shards} shards of the "
                f"sharding's data axis ({_axis(sharding)}); use a multiple of {shards}",
                batch_size=batch_size,
                shards=shards,
            )
        held = rows.addressable_devices_indices_map((batch_size,))
        starts = sorted({_start(index[0], batch_size) for index in held.values()})
        stops = sorted({_stop(index[0], batch_size) for index in held.values()})
        self.local_rows = sum(b - a for a, b in zip(starts, stops, strict=True))
        self.first_row = starts[0]
        if self.local_rows * self.processes != batch_size:
            raise InvalidRequestError(
                f"each process must hold its own share of the batch axis: this one's devices "
                f"hold {self.local_rows} of {batch_size} rows and there are {self.processes} "
                f"processes; shard the first dimension over every process's devices (e.g. a "
                f"mesh over jax.devices() with PartitionSpec('data'))",
                local_rows=self.local_rows,
            )

    def for_ndim(self, ndim: int) -> Any:
        """The sharding of a field of ``ndim`` dimensions: the batch axis as given, the rest
        replicated."""
        if isinstance(self.sharding, NamedSharding):
            spec = tuple(self.sharding.spec)
            return NamedSharding(self.sharding.mesh, PartitionSpec(spec[0] if spec else None))
        return self.sharding

    def agree(self, lengths: Sequence[int]) -> list[int]:
        """The longest row of each ragged field over every process (the lengths of this one's
        rows, in the same order on every process)."""
        if self.processes == 1 or not lengths:
            return list(lengths)
        from jax.experimental import multihost_utils

        mine = np.asarray(lengths, dtype=np.int32)
        every = np.asarray(multihost_utils.process_allgather(mine))
        return [int(v) for v in every.reshape(self.processes, -1).max(axis=0)]

    def globalize(self, arrays: Mapping[str, jax.Array], batch_axis: set[str]) -> dict[str, Any]:
        """The global arrays of this process's ``arrays`` (those in ``batch_axis`` have a row per
        row of the batch; the others, e.g. packed tokens, are refused before reading)."""
        if self.sharding is None:
            return dict(arrays)
        out: dict[str, Any] = {}
        for name, arr in arrays.items():
            assert name in batch_axis
            shape = (arr.shape[0] * self.processes, *arr.shape[1:])
            out[name] = jax.make_array_from_process_local_data(self.for_ndim(arr.ndim), arr, shape)
        return out


def _shards(sharding: Any) -> int:
    if isinstance(sharding, SingleDeviceSharding):
        return 1
    axes = sharding.spec[0] if len(sharding.spec) else None
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([sharding.mesh.shape[a] for a in names]))


def _axis(sharding: Any) -> str:
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        return f"PartitionSpec{spec[:1]!r} over mesh {dict(sharding.mesh.shape)}"
    return type(sharding).__name__


def _start(index: Any, n: int) -> int:
    return index.indices(n)[0] if isinstance(index, slice) else int(index)


def _stop(index: Any, n: int) -> int:
    return index.indices(n)[1] if isinstance(index, slice) else int(index) + 1
