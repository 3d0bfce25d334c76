"""tqstream as AReaL expects to see it: its staleness manager, its workflows, its batches.

- :class:`StalenessManager` — AReaL's ``StalenessManager`` (same arguments, methods,
  ``RolloutStat`` counters, capacity formula) with its budget kept at the tqstream controller,
  where managers of several ranks and processes can pool it. :func:`install` makes AReaL's own
  ``WorkflowExecutor`` build it; or inject one with ``WorkflowExecutor(..., staleness_manager=)``.
- :class:`ExperienceWorkflow` — wraps any ``RolloutWorkflow``; each accepted episode result is
  stored as one group of unpadded rows (per-token ``versions`` with -1 on prompt tokens,
  ``logprobs``, ``loss_mask``, ``rewards``; dtypes as given).
- :class:`ArealExperience` — ``put_experience`` / ``get_experience`` (and ``async_`` twins) on
  AReaL trajectories; a read returns ``prepare_batch``'s shape (one padded dict per group, whole
  groups, oldest first) through the head-version window; later columns go back with
  ``batch.put_fields``.

Importing this module imports AReaL (``pip install areal``; see docs/adapters/areal.md for an
environment whose torch is newer than AReaL's pin).
"""

from __future__ import annotations

from tqstream.adapters import require

require(
    "areal",
    "AReaL",
    "pip install areal==1.0.4 (or, with a torch newer than AReaL's torch<2.11 pin: pip install "
    "--no-deps areal==1.0.4 plus its import deps, see docs/adapters/areal.md)",
)

from tqstream.adapters.areal.experience import (  # noqa: E402  (after the framework check)
    AREAL_FIELDS,
    ArealBatch,
    ArealExperience,
)
from tqstream.adapters.areal.staleness import StalenessManager, install  # noqa: E402
from tqstream.adapters.areal.workflow import ExperienceWorkflow  # noqa: E402
from tqstream.staleness import StalenessPolicy  # noqa: E402

__all__ = [
    "AREAL_FIELDS",
    "ArealBatch",
    "ArealExperience",
    "ExperienceWorkflow",
    "StalenessManager",
    "StalenessPolicy",
    "install",
]
