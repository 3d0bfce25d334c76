"""Processes for the NeMo-RL adapter's tests.

python nemo_rl_worker.py claim ADDRESS PARTITION N
    a consumer: attaches as a NeMo-RL worker does (bootstrap=False, controller_address),
    claims N rows for task "train", prints their keys as JSON, then waits to be killed.

python nemo_rl_worker.py standin DIR ADDRESS PARTITION
    writes a minimal stand-in ``nemo_rl`` package (the interface's shape only) into DIR, puts
    it first on sys.path, and prints as JSON what the adapter does where NeMo-RL is
    importable: whose classes it subclasses and returns, and how install() routes NeMo-RL's
    factory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

STANDIN = {
    "nemo_rl/__init__.py": "",
    "nemo_rl/data_plane/__init__.py": (
        "from nemo_rl.data_plane.interfaces import DataPlaneClient, KVBatchMeta\n"
        "from nemo_rl.data_plane.factory import build_data_plane_client\n"
    ),
    "nemo_rl/data_plane/interfaces.py": """
import abc, dataclasses
from typing import Any

@dataclasses.dataclass
class KVBatchMeta:
    partition_id: str
    task_name: Any
    sample_ids: list
    fields: Any = None
    sequence_lengths: Any = None
    extra_info: dict = dataclasses.field(default_factory=dict)
    tags: Any = None

    @property
    def size(self):
        return len(self.sample_ids)

class DataPlaneClient(abc.ABC):
    @abc.abstractmethod
    def register_partition(self, partition_id, fields, num_samples, consumer_tasks,
                           grpo_group_size=None, enums=None): ...
    @abc.abstractmethod
    def claim_meta(self, partition_id, task_name, required_fields, batch_size, dp_rank=None,
                   blocking=True, timeout_s=60.0): ...
    @abc.abstractmethod
    def get_data(self, meta, select_fields=None): ...
    @abc.abstractmethod
    def check_consumption_status(self, partition_id, task_names): ...
    @abc.abstractmethod
    def put_samples(self, sample_ids, partition_id, fields=None, tags=None): ...
    @abc.abstractmethod
    def get_samples(self, sample_ids, partition_id, select_fields): ...
    @abc.abstractmethod
    def clear_samples(self, sample_ids, partition_id): ...
    @abc.abstractmethod
    def close(self): ...
""",
    "nemo_rl/data_plane/factory.py": """
def build_data_plane_client(cfg, *, bootstrap=True):
    if cfg.get("impl") == "transfer_queue":
        return "the stand-in transfer_queue client"
    raise ValueError("the stand-in factory builds transfer_queue only, not "
                     + repr(cfg.get("impl")))
""",
    "nemo_rl/data_plane/observability.py": """
EVENTS = []

def log_event(event):
    EVENTS.append(event)

class MetricsDataPlaneClient:
    def __init__(self, client, on_event):
        self.inner, self.on_event = client, on_event

    def close(self):
        self.on_event({"op": "close"})
        self.inner.close()
""",
    "nemo_rl/trainer_module.py": "from nemo_rl.data_plane import build_data_plane_client\n",
}


def claim(address: str, partition: str, n: int) -> None:
    from tqstream.adapters.nemo_rl import TQStreamDataPlaneClient

    cfg = {"enabled": True, "impl": "tqstream", "controller_address": address}
    dp = TQStreamDataPlaneClient(cfg, bootstrap=False)
    meta = dp.claim_meta(partition, "train", ["x"], n, timeout_s=10)
    print(json.dumps(meta.sample_ids), flush=True)
    time.sleep(600)  # "training" when killed: never closes, never clears


def standin(root: str, address: str, partition: str) -> None:
    for rel, text in STANDIN.items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    sys.path.insert(0, root)
    import nemo_rl.data_plane as nemo_dp
    import nemo_rl.data_plane.factory as nemo_factory
    import nemo_rl.trainer_module as trainer_module
    import torch
    from nemo_rl.data_plane import observability
    from tensordict import TensorDict

    from tqstream.adapters import nemo_rl as adapter

    cfg = {"enabled": True, "impl": "tqstream", "controller_address": address}
    out: dict[str, object] = {"flag": adapter.NEMO_RL}
    out["classes"] = [
        adapter.KVBatchMeta is nemo_dp.KVBatchMeta,
        adapter.DataPlaneClient is nemo_dp.DataPlaneClient,
        issubclass(adapter.TQStreamDataPlaneClient, nemo_dp.DataPlaneClient),
    ]
    out["routed_before"] = False
    try:
        nemo_factory.build_data_plane_client(cfg)
    except ValueError as exc:
        out["routed_before"] = str(exc)
    out["install"] = [adapter.install(), adapter.install()]
    built = [
        nemo_factory.build_data_plane_client(cfg, bootstrap=False),
        nemo_dp.build_data_plane_client(cfg, bootstrap=False),
        trainer_module.build_data_plane_client(cfg, bootstrap=False),
    ]
    out["built"] = [type(c).__name__ for c in built]
    out["other_impl"] = nemo_factory.build_data_plane_client({**cfg, "impl": "transfer_queue"})
    dp = built[0]
    put = dp.put_samples(["a", "b"], partition, TensorDict({"x": torch.arange(2)}, [2]))
    claimed = dp.claim_meta(partition, "train", ["x"], 2)
    out["metas"] = [isinstance(m, nemo_dp.KVBatchMeta) for m in (put, claimed)]
    out["claimed"] = sorted(claimed.sample_ids)
    wrapped = adapter.build_data_plane_client(
        {**cfg, "observability": {"enabled": True}}, bootstrap=False
    )
    out["wrapped"] = type(wrapped).__name__
    wrapped.close()
    out["events"] = observability.EVENTS
    for c in built:
        c.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "claim":
        claim(args[0], args[1], int(args[2]))
    else:
        standin(*args)
