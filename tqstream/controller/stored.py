"""The answer to a storage unit's ``PutStored``: one result per put, sent once all are in."""

from __future__ import annotations

from typing import Any

from tqstream.protocol.messages import ErrorReply, StoredReply, StoredResults
from tqstream.protocol.transport import error_reply

__all__ = ["Stored"]


class Stored:
    """The answer to a unit's ``PutStored``: one result per put, sent once all are in (a put that
    waits for room is answered later through the effects, like a waiting ``PreparePut``)."""

    def __init__(self, responder: Any, n: int) -> None:
        self.responder = responder
        self.results: list[StoredReply | ErrorReply | None] = [None] * n
        self.left = n

    def part(self, i: int) -> StoredPart:
        return StoredPart(self, i)

    def done(self, i: int, result: StoredReply | ErrorReply) -> None:
        self.results[i] = result
        self.left -= 1
        if not self.left:
            results = [r for r in self.results if r is not None]
            self.responder.reply(StoredResults(rid=self.responder.rid, results=results))


class StoredPart:
    """One put of a ``PutStored``: answered like a request (``reply``/``fail``, see Responder)."""

    __slots__ = ("i", "owner", "rid")

    def __init__(self, owner: Stored, i: int) -> None:
        self.owner, self.i, self.rid = owner, i, 0

    def reply(self, msg: Any) -> None:
        self.owner.done(self.i, msg)

    def fail(self, exc: BaseException) -> None:
        self.owner.done(self.i, error_reply(exc, "the controller failed on a stored put"))
