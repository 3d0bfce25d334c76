"""Framework adapters: tqstream as verl, AReaL and plain PyTorch trainers expect to see it.

``import tqstream.adapters`` loads no framework: each adapter module imports its framework when it
is itself imported, and raises an ImportError naming the install command if that framework is
missing.

- :mod:`tqstream.adapters.torch` — ``ExperienceDataset`` (an ``IterableDataset`` for
  ``DataLoader``/``StatefulDataLoader``) and ``ExperienceWriter`` for producers.
- :mod:`tqstream.adapters.areal` — AReaL's ``StalenessManager`` backed by the controller, a
  ``RolloutWorkflow`` wrapper that stores each accepted trajectory, a ``prepare_batch``-shaped
  consumer.
- :mod:`tqstream.adapters.verl` — ``DataProto`` ⇄ rows, the fully-async recipe's ``MessageQueue``
  and ``MessageQueueClient`` (a drop-in), the AsyncRL recipe's experience calls and the slot API.
- :mod:`tqstream.adapters.jax` — ``ExperienceIterator`` of ``jax.Array`` batches (ragged fields
  padded to buckets, global arrays over a ``Sharding``) and ``ExperienceWriter`` for jax/numpy.
- :mod:`tqstream.adapters.nemo_rl` — NeMo-RL's ``DataPlaneClient`` on tqstream, with its staleness
  samplers on tqstream's windows and admission.

Each provides ``async_put_experience(data, current_version, ...)`` and
``async_get_experience(count, current_version, ...)`` (and sync twins) through a staleness window,
with that framework's defaults. docs/adapters.md says how to wire each into its trainer.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["areal", "jax", "nemo_rl", "require", "torch", "verl"]

_SUBMODULES = ("areal", "jax", "nemo_rl", "torch", "verl")


def require(module: str, framework: str, install: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that says how to install ``framework``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"this tqstream adapter needs {framework} ({module!r} could not be imported: {e}); "
            f"install it with: {install}"
        ) from e


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
