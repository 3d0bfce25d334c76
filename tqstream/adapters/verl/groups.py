"""The producer's version check shared by the verl experience surfaces.

(Group members that disagree on fields are refused by the controller, at the put that makes the
mistake, whichever producer process put the earlier members.)
"""

from __future__ import annotations

from tqstream.errors import InvalidRequestError

__all__ = ["check_version"]


def check_version(version: object, who: str = "producer") -> int:
    """``version`` if it is an int policy version; else ``InvalidRequestError`` (sent nothing)."""
    if not isinstance(version, int) or isinstance(version, bool):
        raise InvalidRequestError(
            f"current_version must be the {who}'s policy version (an int, e.g. the trainer's "
            f"global step that produced the weights), got {version!r} "
            f"({type(version).__name__})"
        )
    return version
