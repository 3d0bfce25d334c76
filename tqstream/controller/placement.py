"""Placement of a put's rows on storage units: balance by bytes, contiguous runs per unit."""

from __future__ import annotations

import math

from tqstream.errors import CapacityError

SPLIT_BYTES = 64 << 20
"""A put larger than this is spread over several units (one contiguous run of rows each)."""


def place(unit_bytes: list[int], n_rows: int, nbytes: int) -> list[tuple[int, int, int]]:
    """``(unit, start, stop)`` runs covering rows ``[0, n_rows)``, least-loaded units first."""
    if not unit_bytes:
        raise CapacityError(
            "no storage unit is registered with the controller; start storage units "
            "(tqstream-launch --storage-units N) before putting data"
        )
    k = min(len(unit_bytes), n_rows, max(1, math.ceil(nbytes / SPLIT_BYTES)))
    order = sorted(range(len(unit_bytes)), key=lambda u: (unit_bytes[u], u))[:k]
    bounds = [i * n_rows // k for i in range(k + 1)]
    return [(u, bounds[i], bounds[i + 1]) for i, u in enumerate(sorted(order))]
