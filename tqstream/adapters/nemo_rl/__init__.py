"""tqstream as NeMo-RL's data plane: its ``DataPlaneClient`` interface and staleness samplers.

- :class:`TQStreamDataPlaneClient` — NeMo-RL's ``DataPlaneClient`` (``register_partition``,
  ``claim_meta``, ``get_data``, ``check_consumption_status``, ``put_samples``, ``get_samples``,
  ``clear_samples``, ``close``) with its signatures, defaults and return types, on a tqstream
  cluster. Claims wait at the controller and come back if their claimer dies; tags merge at the
  controller; reads of missing keys or fields raise instead of returning fewer rows.
- :func:`build_data_plane_client` — NeMo-RL's factory for ``data_plane.impl: tqstream`` (connect
  to an address, attach to a Ray-launched cluster, or start one); :func:`install` routes NeMo-RL's
  own factory to it.
- :class:`WindowedSampler`, :class:`ReadyFirstSampler`, :func:`create_sampler` — NeMo-RL's
  ``admit`` / ``select`` / ``evict`` policies on tqstream's staleness windows and admission.
- :class:`NemoRLExperience` — ``put_experience`` / ``get_experience`` (and ``async_`` twins),
  every tqstream adapter's pair, through a staleness window, in NeMo-RL's types.

NeMo-RL itself is optional: where ``nemo_rl`` is importable the client subclasses its
``DataPlaneClient`` and returns its ``KVBatchMeta``; elsewhere :class:`KVBatchMeta` and
:class:`DataPlaneClient` are equivalents defined here. docs/adapters/nemo_rl.md says how to switch.
"""

from __future__ import annotations

from tqstream.adapters.nemo_rl.client import HOLD_TASK, TQStreamDataPlaneClient
from tqstream.adapters.nemo_rl.compat import NEMO_RL, DataPlaneClient, KVBatchMeta
from tqstream.adapters.nemo_rl.config import IMPL, TQStreamDataPlaneConfig
from tqstream.adapters.nemo_rl.errors import (
    ConfigError,
    FieldTypeError,
    NotProducedError,
    UnknownTaskError,
)
from tqstream.adapters.nemo_rl.experience import NemoRLExperience
from tqstream.adapters.nemo_rl.factory import build_data_plane_client, install
from tqstream.adapters.nemo_rl.samplers import ReadyFirstSampler, WindowedSampler, create_sampler

__all__ = [
    "HOLD_TASK",
    "IMPL",
    "NEMO_RL",
    "ConfigError",
    "DataPlaneClient",
    "FieldTypeError",
    "KVBatchMeta",
    "NemoRLExperience",
    "NotProducedError",
    "ReadyFirstSampler",
    "TQStreamDataPlaneClient",
    "TQStreamDataPlaneConfig",
    "UnknownTaskError",
    "WindowedSampler",
    "build_data_plane_client",
    "create_sampler",
    "install",
]
