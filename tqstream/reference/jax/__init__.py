"""The reference pipeline's JAX trainer: the tiny Qwen2 in flax.nnx, decoupled PPO in jax.numpy and
optax, and its glue to the loop (``PipelineConfig(trainer="jax")``, ``tqstream demo --trainer
jax``). Needs the jax extra: ``pip install "tqstream[jax]"``.

- :mod:`.model` — ``Qwen2`` and its weights to and from Hugging Face's state dict;
- :mod:`.loss` — ``loss.py``'s objective on fixed-shape arrays;
- :mod:`.trainer` — ``JaxPPOTrainer``, ``PPOTrainer``'s step as one jitted call;
- :mod:`.learner` — the format warm start, the greedy evaluation and ``JaxLearner``.

Nothing else in tqstream imports JAX, flax or optax.
"""

from __future__ import annotations

__all__ = ["JaxLearner", "JaxPPOTrainer", "Qwen2"]

import importlib.util


def _missing() -> list[str]:
    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    return [name for name in ("jax", "flax", "optax") if not found(name)]


if _missing():
    raise ImportError(
        f"the JAX trainer (tqstream.reference.jax) needs {', '.join(_missing())}: "
        'pip install "tqstream[jax]"'
    )

from tqstream.reference.jax.learner import JaxLearner  # noqa: E402
from tqstream.reference.jax.model import Qwen2  # noqa: E402
from tqstream.reference.jax.trainer import JaxPPOTrainer  # noqa: E402
