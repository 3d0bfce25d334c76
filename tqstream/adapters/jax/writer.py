"""``ExperienceWriter``: a JAX-side producer puts ``jax.Array``s and numpy arrays.

    writer = ExperienceWriter(address, partition="train")
    writer.put_experience({"input_ids": [ids0, ids1], "rewards": rewards}, current_version=v,
                          group=prompt_uid)      # jax.Array, numpy array, or lists of them

An array's bytes are not copied on their way to the client's encoder: a ``jax.Array`` on a CPU
device is read through DLPack, a numpy array through the buffer protocol (as torch tensors over
the same memory, the client's input type), and the one copy is the put's own, into the storage
unit's shared segment. An array on an accelerator is first copied to the host (``device_get``);
one sharded over several devices is gathered first. Dtypes tqstream lacks (float8, int4, ...)
are refused, naming the supported ones; nothing is stored or leased.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch

from tqstream.adapters.common import ExperienceWriter as _Writer
from tqstream.adapters.jax.arrays import torch_view, wire_name
from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Client
from tqstream.errors import InvalidRequestError
from tqstream.protocol.columns import Column
from tqstream.types import BatchMeta

__all__ = ["ExperienceWriter", "to_torch"]


class ExperienceWriter:
    """A producer's handle on a partition, as :class:`tqstream.adapters.torch.ExperienceWriter`
    (same arguments and calls), taking ``jax.Array``s and numpy arrays: a field is an array
    ``[B, ...]`` (dense) or a list of B arrays (ragged rows), or what the torch writer takes."""

    def __init__(
        self, source: str | Client, *, partition: str = "train",
        fields: Sequence[str] | None = None, admission: AdmissionHandle | None = None,
        versions_field: str | None = "versions", reject_mixed_versions: bool = False,
        producers: int | None = None,
    ) -> None:  # fmt: skip
        self._writer = _Writer(
            source, partition=partition, fields=fields, admission=admission,
            versions_field=versions_field, reject_mixed_versions=reject_mixed_versions,
            producers=producers,
        )  # fmt: skip
        self.partition = partition

    @property
    def closed(self) -> bool:
        return self._writer.closed

    def put_experience(self, data: Any, current_version: int, **kwargs: Any) -> BatchMeta:
        """Store rows generated under ``current_version``; ``group=`` one id for all of them.
        Other arguments as :meth:`tqstream.Experience.put_experience`."""
        return self._writer.put_experience(to_torch(data), current_version, **kwargs)

    async def async_put_experience(
        self, data: Any, current_version: int, **kwargs: Any
    ) -> BatchMeta:
        return await self._writer.async_put_experience(to_torch(data), current_version, **kwargs)

    def close(self) -> None:
        """This producer is done: once every declared producer closed it, readers drain it."""
        self._writer.close()

    def __enter__(self) -> ExperienceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_torch(data: Any) -> dict[str, Any]:
    """``data`` (a mapping of field name to values) with every JAX and numpy array as a torch
    tensor over the same memory; other values (torch tensors, Python lists, strings, Columns)
    as they are."""
    if not isinstance(data, Mapping):
        raise InvalidRequestError(
            f"put_experience takes a mapping of field name to arrays, got {type(data).__name__}"
        )
    return {name: _field(str(name), value) for name, value in data.items()}


def _field(name: str, value: Any) -> Any:
    if isinstance(value, jax.Array | np.ndarray):
        return _tensor(name, value)
    if isinstance(value, list | tuple) and value and isinstance(value[0], jax.Array | np.ndarray):
        return [_tensor(name, v) for v in value]
    if isinstance(value, torch.Tensor | Column | list | tuple):
        return value
    return value


def _tensor(name: str, value: Any) -> Any:
    """A torch tensor over an array's bytes (numpy strings and objects: a list of values)."""
    if isinstance(value, jax.Array):
        return _from_jax(name, value)
    if value.dtype.kind in "OUS":  # strings, objects: an object field
        return value.tolist()
    wire_name(value.dtype, name)
    return torch_view(np.ascontiguousarray(value))


def _from_jax(name: str, value: jax.Array) -> torch.Tensor:
    if value.is_deleted():
        raise InvalidRequestError(
            f"field {name!r}: this jax.Array was deleted (donated to a jitted call or "
            f"deleted); put it before donating it, or put a copy",
            field=name,
        )
    if not value.is_fully_addressable:
        raise InvalidRequestError(
            f"field {name!r}: this jax.Array spans devices of other processes (shape "
            f"{tuple(value.shape)}, sharding {value.sharding}); this process can only read its "
            f"own shards: put each process's share, e.g. value.addressable_shards[i].data, from "
            f"the process that holds it",
            field=name,
        )
    wire_name(value.dtype, name)
    devices = value.devices()
    if len(devices) == 1 and next(iter(devices)).platform == "cpu":
        return torch.from_dlpack(value)  # the array's own buffer
    return torch_view(np.asarray(jax.device_get(value)))  # gathered / copied to the host
