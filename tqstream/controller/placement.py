"""Placement of a put's rows on storage units: balance by bytes, one run per unit, quotas."""

from __future__ import annotations

import math

from tqstream.errors import CapacityError, InvalidRequestError

SPLIT_BYTES = 64 << 20
"""A put larger than this is spread over several units (one contiguous run of rows each)."""


def place(
    unit_bytes: list[int],
    n_rows: int,
    nbytes: int,
    quotas: list[int] | None = None,
    turn: int = 0,
) -> list[tuple[int, int, int]] | None:
    """``(unit, start, stop)`` runs covering rows ``[0, n_rows)``, least-loaded units first.

    ``quotas[u]`` is unit u's byte quota (0: unlimited). Units equally loaded are taken in turn,
    starting from unit ``turn`` (the caller advances it every put), so when consumers keep up and
    every unit holds 0 bytes the puts still spread over all of them. Returns None when the put
    does not fit now but could once bytes are freed (the caller waits); raises when it can never
    fit.
    """
    quotas = quotas or [0] * len(unit_bytes)
    _check_fits(unit_bytes, nbytes, quotas)
    room = [q - b if q else math.inf for q, b in zip(quotas, unit_bytes, strict=True)]
    k = min(len(unit_bytes), n_rows, max(1, math.ceil(nbytes / SPLIT_BYTES)))
    while k <= len(unit_bytes):
        n = len(unit_bytes)
        order = sorted(range(n), key=lambda u: (-room[u], unit_bytes[u], (u - turn) % n))[:k]
        bounds = [i * n_rows // k for i in range(k + 1)]
        runs = [(u, bounds[i], bounds[i + 1]) for i, u in enumerate(sorted(order))]
        if all(room[u] >= nbytes * (stop - start) / n_rows for u, start, stop in runs):
            return runs
        k += 1  # spread thinner over more units
        if k > n_rows:
            break
    return None


def place_on(
    unit: int, unit_bytes: list[int], n_rows: int, nbytes: int, quotas: list[int]
) -> list[tuple[int, int, int]] | None:
    """All rows on ``unit`` (which holds their data already); None while its quota has no room."""
    if not 0 <= unit < len(unit_bytes):
        raise InvalidRequestError(
            f"storage unit {unit} is not registered with this controller ({len(unit_bytes)} "
            "units are); was the controller restarted? restart the storage unit to register it",
            unit=unit,
        )
    _check_fits(unit_bytes, nbytes, quotas)
    quota = quotas[unit]
    if quota and nbytes > quota:
        raise CapacityError(
            f"a put of {nbytes} bytes can never fit on storage unit {unit}, whose quota is "
            f"{quota} bytes, and a put under the client's direct_put_bytes goes to one unit; "
            "split the batch, raise max_bytes on the units, or lower direct_put_bytes",
            nbytes=nbytes,
            quota=quota,
        )
    if quota and unit_bytes[unit] + nbytes > quota:
        return None
    return [(unit, 0, n_rows)]


def _check_fits(unit_bytes: list[int], nbytes: int, quotas: list[int]) -> None:
    if not unit_bytes:
        raise CapacityError(
            "no storage unit is registered with the controller; start storage units "
            "(tqstream-launch --storage-units N) before putting data"
        )
    if all(quotas) and nbytes > sum(quotas):
        raise CapacityError(
            f"a put of {nbytes} bytes can never fit: the storage units' quotas total "
            f"{sum(quotas)} bytes; split the batch or raise max_bytes on the units",
            nbytes=nbytes,
            quota=sum(quotas),
        )
