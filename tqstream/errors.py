"""The tqstream exception tree.

Every error a user can see derives from :class:`TQStreamError` and also from the builtin exception a
caller would naturally catch (``ValueError`` for bad input, ``TimeoutError`` for timeouts,
``ConnectionError`` for dead peers). Errors raised inside a server travel back as a typed error
reply (``code`` + ``message`` + ``details``) and are re-raised in the client as the same class, so
``except tqstream.SchemaError`` works the same in the embedded and the multi-process deployment.

Messages are composed where the error is raised and always say what was expected, what was observed
and which setting or call to change.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AdmissionError",
    "AuthenticationError",
    "BatchShapeError",
    "BucketError",
    "CapacityError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "ClosedError",
    "ConfigError",
    "ConnectError",
    "ConnectionLostError",
    "ControllerUnavailableError",
    "DuplicateKeyError",
    "DurabilityWarning",
    "FieldExistsError",
    "GroupError",
    "InternalError",
    "InvalidRequestError",
    "JournalClusterError",
    "JournalCorruptError",
    "JournalError",
    "JournalVersionError",
    "KeyFileError",
    "LeaseError",
    "LeaseExpiredError",
    "MalformedMessageError",
    "MessageTooLargeError",
    "NotReadyError",
    "PartitionClearedError",
    "PartitionClosedError",
    "PartitionDrainedError",
    "PlacementRequiredError",
    "ProtocolError",
    "ProtocolVersionError",
    "RequestTimeoutError",
    "SchemaError",
    "StaleRowError",
    "TQStreamError",
    "TagError",
    "UnitLostError",
    "UnknownFieldError",
    "UnknownKeyError",
    "UnknownLeaseError",
    "UnknownPartitionError",
    "UnknownRowError",
    "WeightMismatchError",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "error_class",
]

_REGISTRY: dict[str, type[TQStreamError]] = {}


class TQStreamError(Exception):
    """Base of every tqstream error. ``details`` holds the numbers the message was composed from."""

    code: ClassVar[str] = "error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("code") is None:
            raise TypeError(f"{cls.__name__} must define a wire code")
        if cls.code in _REGISTRY:
            raise TypeError(f"duplicate wire code {cls.code!r}")
        _REGISTRY[cls.code] = cls

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:  # keep exceptions picklable for multiprocessing users
        return (_rebuild, (self.code, self.message, self.details))


def _rebuild(code: str, message: str, details: dict[str, Any]) -> TQStreamError:
    return error_class(code)(message, **details)


def error_class(code: str) -> type[TQStreamError]:
    """The exception class for a wire error code (``InternalError`` for unknown codes)."""
    return _REGISTRY.get(code, InternalError)


_REGISTRY[TQStreamError.code] = TQStreamError


# --- bad input ---
class SchemaError(TQStreamError, ValueError):
    """Data offered for a field differs from the schema fixed by the field's first write."""

    code = "schema"


class BatchShapeError(TQStreamError, ValueError):
    """A put whose fields disagree on the row count, or that has no rows or no fields."""

    code = "batch_shape"


class BucketError(TQStreamError, ValueError):
    """Buckets that are empty, not positive or not increasing, or a ragged row longer than the
    largest bucket a read pads to (the JAX adapter's fixed shapes)."""

    code = "bucket"


class DuplicateKeyError(TQStreamError, ValueError):
    """A put names a key that already exists in the partition (or twice in the same put)."""

    code = "duplicate_key"


class FieldExistsError(TQStreamError, ValueError):
    """``put_fields`` would overwrite a field that is already written for some rows."""

    code = "field_exists"


class TagError(TQStreamError, ValueError):
    """A row's tags are not a small flat mapping of str to scalars (or flat lists of scalars)."""

    code = "tag"


class GroupError(TQStreamError, ValueError):
    """Inconsistent group declarations: a group over its declared size, or sizes that disagree."""

    code = "group"


class InvalidRequestError(TQStreamError, ValueError):
    """A request argument is out of range (``batch_size <= 0``, a negative timeout, ...)."""

    code = "invalid_request"


class ConfigError(TQStreamError, ValueError):
    """A refused cluster setting: an unknown name, a value of the wrong type or out of range, an
    old name given together with its new one, components that disagree on a cluster-wide value."""

    code = "config"


class AdmissionError(TQStreamError, ValueError):
    """A refused admission configuration (it would deadlock or means nothing) or a misuse of
    admission slots (release of an id never issued, an unknown outcome)."""

    code = "admission"


class UnknownPartitionError(TQStreamError, KeyError):
    """The partition does not exist (never put to, never declared, or cleared)."""

    code = "unknown_partition"


class UnknownFieldError(TQStreamError, KeyError):
    """A request names a field that the partition has neither written nor declared."""

    code = "unknown_field"


class UnknownKeyError(TQStreamError, KeyError):
    """``get_by_keys`` names keys that are not in the partition."""

    code = "unknown_key"


class UnknownRowError(TQStreamError, KeyError):
    """A request refers to rows that no longer exist (cleared since the metadata was obtained)."""

    code = "unknown_row"


class StaleRowError(UnknownRowError):
    """A read or a write names rows of an earlier incarnation (generation) of their partition than
    the one a storage unit holds: the partition was cleared or restored since the metadata was
    obtained, so its row ids may name other samples now. An ``UnknownRowError``: the rows the
    metadata knew are gone."""

    code = "stale_row"


class NotReadyError(TQStreamError, LookupError):
    """``get_by_keys`` asks for a field that is not written yet for some of the rows."""

    code = "not_ready"


class LeaseError(TQStreamError, ValueError):
    """Base of lease errors."""

    code = "lease"


class UnknownLeaseError(LeaseError):
    """``ack``/``release`` of a lease this controller never granted."""

    code = "unknown_lease"


class LeaseExpiredError(LeaseError):
    """``ack``/``release`` of a lease that expired: its rows went back to available."""

    code = "lease_expired"


class MessageTooLargeError(TQStreamError, ValueError):
    """A message is larger than the configured ``max_message_bytes``."""

    code = "message_too_large"


class CapacityError(TQStreamError, MemoryError):
    """Storage has no room for a put within its timeout."""

    code = "capacity"


# --- waiting ---
class RequestTimeoutError(TQStreamError, TimeoutError):
    """A request could not be served within its timeout; the message says what was missing."""

    code = "timeout"


class PartitionClearedError(TQStreamError, RuntimeError):
    """A parked request's partition was cleared while it waited."""

    code = "partition_cleared"


class PartitionClosedError(TQStreamError, RuntimeError):
    """A put of new rows to a partition its producers have closed."""

    code = "partition_closed"


class PartitionDrainedError(TQStreamError, EOFError):
    """The partition is closed and the task has consumed every row it could ever be served: the
    end of a finite stream (``ExperienceDataset(finite=True)`` ends its iteration on it)."""

    code = "partition_drained"


# --- peers ---
class ConnectError(TQStreamError, ConnectionError):
    """No tqstream server answered at the address within the connect timeout."""

    code = "connect"


class AuthenticationError(ConnectError):
    """The CURVE handshake with a server failed: this side has no keys and the server requires
    them, the keys are not the server's cluster's, or this side has keys and the server none."""

    code = "authentication"


class KeyFileError(TQStreamError, ValueError):
    """A CURVE key file is missing, unreadable or not a tqstream key file."""

    code = "key_file"


class ConnectionLostError(TQStreamError, ConnectionError):
    """The connection to a server dropped while requests were in flight."""

    code = "connection_lost"


class ControllerUnavailableError(ConnectionLostError):
    """The controller went away and did not come back within ``ClientConfig.reconnect_timeout``
    (a controller with a journal is restarted and carries on: docs/faults.md); the request was
    not answered; or the controller there is another cluster now (restarted without its
    journal: ``details['cluster']`` and ``details['expected']``). ``details['address']`` names
    the controller."""

    code = "controller_unavailable"


class UnitLostError(TQStreamError, ConnectionError):
    """A storage unit died or became unreachable: the rows it held alone are lost (counted as
    ``lost`` in stats), and a request that needed them fails with this error naming the unit."""

    code = "unit_lost"


class PlacementRequiredError(TQStreamError, RuntimeError):
    """A put sent straight to a storage unit must be placed by the controller instead (its
    partition keeps two copies of every row, or the unit's quota is full while other units have
    room). The client retries it placed by itself."""

    code = "placement_required"


class ClosedError(TQStreamError, RuntimeError):
    """The client or server was used after ``close()``."""

    code = "closed"


class ProtocolError(TQStreamError):
    """Base of wire-protocol errors."""

    code = "protocol"


class ProtocolVersionError(ProtocolError):
    """The peers speak different protocol versions."""

    code = "protocol_version"


class MalformedMessageError(ProtocolError, ValueError):
    """A message could not be decoded (garbage, truncation, unknown type)."""

    code = "malformed"


class InternalError(TQStreamError, RuntimeError):
    """An unexpected failure inside a server; the message carries the original exception."""

    code = "internal"


class WeightSyncError(TQStreamError, RuntimeError):
    """Base of weight-synchronization errors (trainer -> rollout workers)."""

    code = "weight_sync"


class WeightMismatchError(WeightSyncError, ValueError):
    """The weights a receiver expects differ from those sent (names, dtypes, shapes)."""

    code = "weight_mismatch"


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A peer of a weight sync did not take part within the timeout."""

    code = "weight_sync_timeout"


# --- checkpoints ---
class CheckpointError(TQStreamError, RuntimeError):
    """A checkpoint could not be saved or loaded: a storage unit failed, the cluster to load into
    holds data, another checkpoint is under way. Nothing is half done: a failed save leaves no
    checkpoint (an older one at the path stays), a failed load leaves no rows."""

    code = "checkpoint"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the path (or a file of it is missing)."""

    code = "checkpoint_not_found"


class CheckpointCorruptError(CheckpointError, ValueError):
    """The path holds something that is not a readable tqstream checkpoint: truncated or altered
    files, or not a checkpoint at all."""

    code = "checkpoint_corrupt"


class CheckpointVersionError(CheckpointCorruptError):
    """The checkpoint was written in a format version this tqstream does not read."""

    code = "checkpoint_version"


# --- the controller's journal ---
class JournalError(TQStreamError, RuntimeError):
    """The controller's write-ahead journal cannot be opened or used: its directory is open in
    another controller, a rebase is already under way, a record is too large to frame."""

    code = "journal"


class JournalCorruptError(JournalError, ValueError):
    """A journal file is damaged before its end (a record that fails its CRC-32 with records
    after it, records missing between two segments, a damaged snapshot) or is not a tqstream
    journal file. A torn last record is not this: opening drops it and says how many bytes."""

    code = "journal_corrupt"


class JournalVersionError(JournalCorruptError):
    """The journal was written in a format version this tqstream does not read (the message
    names both)."""

    code = "journal_version"


class JournalClusterError(JournalError, ValueError):
    """The journal belongs to another cluster than the controller opening it (the message names
    both identities)."""

    code = "journal_cluster"


class DurabilityWarning(UserWarning):
    """The journal could not write (disk full, an I/O error): the controller keeps serving, but
    what it tells clients is not durable until a snapshot re-bases the journal. Not an error:
    nothing is refused. ``details`` holds the reason and the journal's directory."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
