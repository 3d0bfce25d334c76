"""NeMo-RL's own ``KVBatchMeta`` and ``DataPlaneClient`` when ``nemo_rl`` is importable, else the
equivalents of ``meta.py``.

With NeMo-RL installed, the adapter's client subclasses NeMo-RL's abstract ``DataPlaneClient`` and
returns NeMo-RL's ``KVBatchMeta``, so NeMo-RL's ``isinstance`` checks and its metadata transforms
see their own classes. The choice is made once, at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tqstream.adapters.nemo_rl.meta import DataPlaneClient as _DataPlaneClient
from tqstream.adapters.nemo_rl.meta import KVBatchMeta as _KVBatchMeta

__all__ = ["NEMO_RL", "DataPlaneClient", "KVBatchMeta"]

if TYPE_CHECKING:
    KVBatchMeta = _KVBatchMeta
    DataPlaneClient = _DataPlaneClient
    NEMO_RL: bool
else:
    try:
        from nemo_rl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
    except ImportError:
        KVBatchMeta, DataPlaneClient, NEMO_RL = _KVBatchMeta, _DataPlaneClient, False
    else:
        NEMO_RL = True
