"""Policy versions and the staleness window, as callers give them.

A policy version is the trainer's weight version, an int >= 0 bumped at each update:
:func:`is_version` is the one test of a value given as one, and :func:`check_version` the one
refusal of a bad one. :class:`StalenessPolicy` is the one window type, from the adapters to the
wire: ``Experience`` and the adapters hold one, ``Client.get``/``get_meta`` take one (or build one
from their keywords), and ``GetMeta`` carries its fields. Each is checked once, where the caller
makes it; the server's decoder refuses a ``measure`` or ``on_stale`` outside its set from a peer
that skipped the check. docs/staleness.md explains the version model and the window.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TypeGuard, cast, get_args

from tqstream.errors import InvalidRequestError
from tqstream.types import Measure, OnStale

__all__ = [
    "MAX_VERSION",
    "StalenessPolicy",
    "capacity_bound",
    "check_version",
    "is_version",
    "oldest_version",
]

MAX_VERSION = 2**31 - 1
"""The largest policy version (the controller keeps versions as 32-bit integers)."""


def is_version(value: object) -> TypeGuard[numbers.Integral]:
    """Whether ``value`` is a policy version: an int in 0..MAX_VERSION (numpy integers too, never
    a bool); ``int(value)`` is then the version as a Python int."""
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and 0 <= int(value) <= MAX_VERSION
    )


def check_version(value: object, name: str, *, optional: bool = True) -> int | None:
    """``value`` as a policy version (a Python ``int``), or None when it is None and ``optional``;
    else ``InvalidRequestError`` naming the argument ``name`` and saying what a version is."""
    if value is None and optional:
        return None
    if not is_version(value):
        none = ", or None" if optional else ""
        raise InvalidRequestError(
            f"{name} must be a policy version: an int in 0..{MAX_VERSION} (the trainer's weight "
            f"version, bumped at each update){none}; got {value!r}",
            **{name: repr(value)},
        )
    return int(value)


def oldest_version(current_version: int, max_staleness: int) -> int:
    """The oldest policy version a trainer at ``current_version`` reads under ``max_staleness``:
    a row of version ``v`` is inside the window while ``current_version - v <= max_staleness``."""
    return current_version - max_staleness


def capacity_bound(max_staleness: int, version: int, consumer_batch_size: int) -> int:
    """AReaL's staleness bound on the rollouts accepted or running at ``version``: at most
    ``max_staleness + 1`` batches beyond the ``version`` ones consumed,
    ``(max_staleness + version + 1) * consumer_batch_size``."""
    return (max_staleness + version + 1) * consumer_batch_size


@dataclasses.dataclass(frozen=True, init=False)
class StalenessPolicy:
    """A trainer at version ``v`` reads only rows with ``v - version <= max_staleness``.

    ``measure`` picks a row's version: "head" (its oldest generated token: AReaL's bound), "tail"
    (its newest token) or "dispatch" (when generation was requested); "token" reads a row while
    any of its generated tokens is inside the window and masks the others (``fresh_mask``, see
    ``Client.get``): a trajectory that spans a weight update keeps its fresh part. ``on_stale``:
    "drop" evicts stale rows for every task (they can never be fresh again) and counts them;
    "keep" leaves them stored and every read steps over them again.

    Checked here, where a typo is made: the constructor takes any ``str`` (a config file's, a
    command line's) and keeps it only if it is in its set, so the fields hold
    :data:`~tqstream.types.Measure` and :data:`~tqstream.types.OnStale` values. ``Client.get``
    builds one from its keywords, with ``on_stale="keep"`` by default there.
    """

    max_staleness: int | None  # None: no window
    measure: Measure
    on_stale: OnStale

    def __init__(
        self, max_staleness: int | None = None, measure: str = "head", on_stale: str = "drop"
    ) -> None:
        k = max_staleness
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise InvalidRequestError(
                f"StalenessPolicy.max_staleness must be an int >= 0 or None (no window), got {k!r}"
            )
        if measure not in get_args(Measure):
            raise InvalidRequestError(
                f"StalenessPolicy.measure must be 'head', 'tail', 'dispatch' or 'token', got "
                f"{measure!r}"
            )
        if on_stale not in get_args(OnStale):
            raise InvalidRequestError(
                f"StalenessPolicy.on_stale must be 'drop' or 'keep', got {on_stale!r}"
            )
        object.__setattr__(self, "max_staleness", k)  # frozen: set once, here
        object.__setattr__(self, "measure", cast(Measure, measure))
        object.__setattr__(self, "on_stale", cast(OnStale, on_stale))
