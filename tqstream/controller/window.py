"""Staleness windows at the controller: which version of a row a window compares, the checks of a
window's bounds, and whether a row is inside. The arithmetic itself (the oldest version a window
admits) is :func:`tqstream.staleness.oldest_version`, shared with the client and the admissions."""

from __future__ import annotations

from tqstream.controller.rows import Row
from tqstream.errors import InvalidRequestError
from tqstream.protocol.messages import GetMeta
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
