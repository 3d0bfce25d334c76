"""Errors of the NeMo-RL adapter: tqstream errors that are also the builtins NeMo-RL's callers
and tests catch (``KeyError`` for a missing task or an unproduced field, ``TypeError`` for a field
value that cannot be stored, ``ValueError`` for a bad configuration).

They are raised in the client process only, by the adapter, so they never cross the wire; their
codes are registered like every tqstream error's so that pickling them (Ray, multiprocessing)
rebuilds the same class.
"""

from __future__ import annotations

from tqstream.errors import NotReadyError, TQStreamError

__all__ = ["ConfigError", "FieldTypeError", "NotProducedError", "UnknownTaskError"]


class ConfigError(TQStreamError, ValueError):
    """A NeMo-RL ``data_plane`` configuration this adapter cannot build a client from (disabled,
    another ``impl``, an unknown ``tqstream:`` key, no way to reach a cluster)."""

    code = "nemo_rl_config"


class UnknownTaskError(TQStreamError, KeyError):
    """``claim_meta`` for a consumer task the partition was not registered with."""

    code = "nemo_rl_unknown_task"


class NotProducedError(NotReadyError, KeyError):
    """A read names a field that is not written yet for some of the rows (NeMo-RL's contract:
    reading an unproduced field fails loudly with a ``KeyError``)."""

    code = "nemo_rl_not_produced"


class FieldTypeError(TQStreamError, TypeError):
    """``put_samples`` got a ``fields`` value it cannot store: not a TensorDict or mapping, or a
    non-tensor leaf that is not str / bytes / JSON (tqstream never pickles), or any non-tensor
    leaf when the configuration rejects them."""

    code = "nemo_rl_field_type"
