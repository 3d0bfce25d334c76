"""The errors TransferQueue's API raises where its callers catch them, as tqstream errors.

Each is a :class:`~tqstream.errors.TQStreamError` (with the details of what went wrong) and also
the builtin exception TransferQueue 0.1.11 raises in the same situation, so code written for
TransferQueue (``except ValueError``, ``except RuntimeError``) keeps working.
"""

from __future__ import annotations

from tqstream.errors import TQStreamError, UnknownKeyError, UnknownRowError

__all__ = [
    "ForeignControllerError",
    "ForeignMetadataError",
    "KeyNotFoundError",
    "NotInitializedError",
    "StorageKeyNotFoundError",
]

StorageKeyNotFoundError = UnknownRowError
"""What a read of rows cleared since their metadata was obtained raises (a ``KeyError``)."""


class NotInitializedError(TQStreamError, RuntimeError):
    """The call needs ``transfer_queue.init()`` first in this process."""

    code = "tq_not_initialized"


class KeyNotFoundError(UnknownKeyError, ValueError):
    """Keys (or the partition) of a read do not exist; a ``ValueError`` as TransferQueue raises."""

    code = "tq_key_not_found"


class ForeignMetadataError(TQStreamError, ValueError):
    """A ``BatchMeta`` handed to a cluster that did not issue it (another cluster, or this one
    before its controller restarted): its row ids mean nothing here."""

    code = "tq_foreign_metadata"


class ForeignControllerError(TQStreamError, RuntimeError):
    """The job's Ray namespace ``transfer_queue`` already holds a ``TransferQueueController``
    actor that is not tqstream's (TransferQueue itself runs in this Ray job), so there is no
    tqstream cluster to attach to there and none can be started under that name."""

    code = "tq_foreign_controller"
