"""Producer-side checks shared by the verl experience surfaces: the version, and group members.

A GRPO group (one prompt's ``rollout.n`` samples, the ``uid``) may reach tqstream in several puts
when producers put one trajectory at a time (``group_size=n``). A ``whole_groups`` read serves a
group only once every member has every requested field, so a member put without a field that the
others have (or with one they lack) would keep its whole group from ever being served, silently.
:class:`GroupFields` catches that at the put that makes the mistake, before anything is stored.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence

from tqstream.errors import GroupError, InvalidRequestError

__all__ = ["GroupFields", "check_version"]


def check_version(version: object, who: str = "producer") -> int:
    """``version`` if it is an int policy version; else ``InvalidRequestError`` (sent nothing)."""
    if not isinstance(version, int) or isinstance(version, bool):
        raise InvalidRequestError(
            f"current_version must be the {who}'s policy version (an int, e.g. the trainer's "
            f"global step that produced the weights), got {version!r} "
            f"({type(version).__name__})"
        )
    return version


class GroupFields:
    """The field set of every group that this object has put part of and not completed.

    Checked and recorded under one lock, so two threads putting members of one group cannot both
    pass; a put that then fails is undone. Memory is one entry per incomplete group.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, tuple[frozenset[str], int]] = {}

    def reserve(
        self, groups: Sequence[str] | None, fields: Iterable[str], group_size: int | None
    ) -> dict[str, tuple[frozenset[str], int] | None]:
        """Check that the put's members agree with the group's earlier members and record them;
        returns what to hand to :meth:`undo` if the put fails."""
        if not groups:
            return {}
        names = frozenset(fields)
        counts = Counter(groups)
        with self._lock:
            for group in counts:
                seen = self._open.get(group)
                if seen is not None and seen[0] != names:
                    raise GroupError(_disagree(group, names, seen[0]), group=group)
            before = {g: self._open.get(g) for g in counts}
            for group, n in counts.items():
                seen = self._open.get(group)
                left = (seen[1] if seen is not None else (group_size or n)) - n
                if left > 0:
                    self._open[group] = (names, left)
                else:
                    self._open.pop(group, None)
            return before

    def undo(self, before: dict[str, tuple[frozenset[str], int] | None]) -> None:
        with self._lock:
            for group, state in before.items():
                if state is None:
                    self._open.pop(group, None)
                else:
                    self._open[group] = state


def _disagree(group: str, names: frozenset[str], earlier: frozenset[str]) -> str:
    missing, extra = sorted(earlier - names), sorted(names - earlier)
    parts = ([f"missing {missing}"] if missing else []) + ([f"extra {extra}"] if extra else [])
    return (
        f"group {group!r}: this put's members disagree on fields with the group's earlier "
        f"members ({', '.join(parts)}); every member of a group needs the same fields, or a "
        f"whole_groups read would wait for the group forever"
    )
