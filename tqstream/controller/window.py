"""Staleness windows at the controller: which version of a row a window compares, the checks of a
window's bounds, and whether a row is inside. The arithmetic itself (the oldest version a window
admits) is :func:`tqstream.staleness.oldest_version`, shared with the client and the admissions."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tqstream.controller.rows import Row
from tqstream.errors import InvalidRequestError
from tqstream.protocol.messages import GetMeta
from tqstream.staleness import oldest_version
from tqstream.types import Measure


def version_of(r: Row, measure: Measure) -> int | None:
    """The version a staleness window compares: head = the oldest generated token's (AReaL's
    bound), tail = the newest's, dispatch = the policy version when generation was requested;
    token = the newest's too (a row is read while any token is inside; the client masks the
    tokens outside, see ``client/versions.fresh_mask``)."""
    if measure in ("tail", "token"):
        return r.version_end
    if measure == "dispatch" and r.dispatch_version is not None:
        return r.dispatch_version
    return r.version_start


def check_window(req: GetMeta) -> None:
    """The window checks left to the controller: a negative bound from a peer that skipped the
    client's (``StalenessPolicy`` checks them all; a ``measure`` or ``on_stale`` outside its set
    is refused at decoding), and a bound without a version to place it."""
    if req.max_staleness is not None:
        if req.max_staleness < 0:
            raise InvalidRequestError(f"max_staleness must be >= 0, got {req.max_staleness}")
        if req.current_version is None:
            raise InvalidRequestError(
                "max_staleness needs current_version (the trainer's policy version) to place the "
                "window: pass current_version=v"
            )


class Window(NamedTuple):
    """A get's staleness window: rows whose ``measure`` version is at least ``oldest``."""

    current_version: int
    max_staleness: int
    measure: Measure
    oldest: int

    @classmethod
    def of(cls, req: GetMeta) -> Window | None:
        """The window of a checked request (:func:`check_window`), None when it has none."""
        if req.max_staleness is None or req.current_version is None:
            return None
        cv, ms = req.current_version, req.max_staleness
        return cls(cv, ms, req.measure, oldest_version(cv, ms))

    def admits(self, r: Row) -> bool:
        """Whether row ``r`` is inside (a row without a version always is)."""
        v = version_of(r, self.measure)
        return v is None or v >= self.oldest

    def by_id(self, row: Callable[[int], Row]) -> Callable[[int], bool]:
        """:meth:`admits` of the row of an id, ``row`` finding it."""
        oldest, measure = self.oldest, self.measure

        def fresh(rid: int) -> bool:
            v = version_of(row(rid), measure)
            return v is None or v >= oldest

        return fresh

    def describe(self) -> str:
        return (
            f"{self.measure} version < {self.oldest} = current_version {self.current_version} - "
            f"max_staleness {self.max_staleness}"
        )
