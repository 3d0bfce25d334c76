"""What an :class:`~tqstream.adapters.jax.ExperienceIterator` yields: a mapping of field name to
``jax.Array`` that carries its lease, and that ``jax.jit`` takes as it is (a pytree node whose
leaves are the arrays; the lease and the object fields stay outside the trace)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax

from tqstream.types import BatchMeta

__all__ = ["JaxBatch"]


class JaxBatch(Mapping[str, jax.Array]):
    """Field name -> ``jax.Array``: the fields read (ragged ones padded, with
    ``<field>_lengths``; packed ones with ``<field>_segment_ids``), and ``group_ids`` (each row's
    group, numbered in the batch) for whole-group reads, ``fresh_mask`` for token-measure
    reads, ``version_start`` / ``version_end`` when asked.

    ``meta``: the rows' metadata and lease (``meta.groups``, ``meta.row_ids``, ...; ack it with
    the iterator). ``objects``: object fields (strings, JSON values), which JAX has no type for,
    as lists of Python values. Inside a ``jax.jit`` the batch is rebuilt without either (its
    leaves are the arrays; the lease changes every batch and must not retrace the step).
    """

    __slots__ = ("_arrays", "meta", "objects")

    def __init__(
        self,
        arrays: dict[str, jax.Array],
        meta: BatchMeta | None = None,
        objects: dict[str, list[Any]] | None = None,
    ) -> None:
        self._arrays = arrays
        self.meta = meta
        self.objects = {} if objects is None else objects

    def __getitem__(self, name: str) -> jax.Array:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def rows(self) -> int:
        """Rows in this process's share of the batch (``len(meta)``)."""
        return 0 if self.meta is None else len(self.meta)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self._arrays.items())
        return f"JaxBatch({shapes}; {self.rows} rows leased)"


def _flatten(batch: JaxBatch) -> tuple[list[jax.Array], tuple[str, ...]]:
    return list(batch._arrays.values()), tuple(batch._arrays)


def _unflatten(names: tuple[str, ...], leaves: Any) -> JaxBatch:
    return JaxBatch(dict(zip(names, leaves, strict=True)))


jax.tree_util.register_pytree_node(JaxBatch, _flatten, _unflatten)
