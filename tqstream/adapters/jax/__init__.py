"""JAX: an iterator of ``jax.Array`` batches through a staleness window, and a writer for JAX-side
producers. JAX is imported only when this module is (``pip install "tqstream[jax]"``).

- :class:`ExperienceIterator` — batches of ``batch_size`` rows leased by the controller, ragged
  fields padded to the smallest of your buckets that fits (or packed with segment ids), whole
  groups, per-row and per-token versions, a global ``jax.Array`` over a ``Sharding`` built from
  each process's share, checkpointable state (``state_dict`` / grain's ``get_state``).
- :class:`ExperienceWriter` — ``put_experience(data, current_version)`` of ``jax.Array``s and
  numpy arrays.

docs/adapters/jax.md shows both, the copies each path makes and JAX's 32-bit mode.
"""

from __future__ import annotations

from tqstream.adapters import require

require("jax", "JAX", 'pip install "tqstream[jax]"')
require("ml_dtypes", "JAX", 'pip install "tqstream[jax]"')

from tqstream.adapters.jax.batch import JaxBatch  # noqa: E402
from tqstream.adapters.jax.iterator import ExperienceIterator  # noqa: E402
from tqstream.adapters.jax.writer import ExperienceWriter  # noqa: E402

__all__ = ["ExperienceIterator", "ExperienceWriter", "JaxBatch"]
