"""One data-parallel rank of an AReaL job, as AReaL builds it: ``install()``, then AReaL's own
``WorkflowExecutor`` (training, then evaluation) makes its ``StalenessManager`` s. The cluster and
the shared budget come from the environment (``TQSTREAM_ADDRESS``, ``TQSTREAM_AREAL_BUDGET``).

Reads commands on stdin, one per line, and answers each with one JSON line:
``submit N`` / ``accept N`` / ``reject N`` (AReaL's callbacks on the training manager),
``capacity``, ``stats``, ``exit``.
"""

from __future__ import annotations

import json
import sys

from areal.api.cli_args import InferenceEngineConfig
from areal.infra.workflow_executor import WorkflowExecutor

from tqstream.adapters.areal import StalenessManager, install


class Engine:
    def __init__(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


def main() -> None:
    dp, version = int(sys.argv[1]), int(sys.argv[2])
    install()
    engine = Engine(version)
    train = WorkflowExecutor(
        InferenceEngineConfig(
            consumer_batch_size=8, max_concurrent_rollouts=8, max_head_offpolicyness=1
        ),
        engine,  # type: ignore[arg-type]
    )
    evaluate = WorkflowExecutor(
        InferenceEngineConfig(
            consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=0
        ),
        engine,  # type: ignore[arg-type]
    )
    train.initialize(train_data_parallel_size=dp)
    evaluate.initialize(train_data_parallel_size=dp)
    manager = train.staleness_manager
    assert isinstance(manager, StalenessManager)
    assert isinstance(evaluate.staleness_manager, StalenessManager)
    print(json.dumps({"train": manager.name, "eval": evaluate.staleness_manager.name}), flush=True)
    try:
        for line in sys.stdin:
            cmd, *arg = line.split()
            n = int(arg[0]) if arg else 0
            if cmd == "submit":
                for _ in range(n):
                    manager.on_rollout_enqueued()
                    manager.on_rollout_submitted()
                out: object = manager.get_stats().running
            elif cmd in ("accept", "reject"):
                for _ in range(n):
                    getattr(manager, f"on_rollout_{cmd}ed")()
                out = manager.get_stats().running
            elif cmd == "capacity":
                out = manager.get_capacity()
            elif cmd == "stats":
                out = vars(manager.get_stats())
            else:
                break
            print(json.dumps(out), flush=True)
    finally:
        train.destroy()
        evaluate.destroy()


if __name__ == "__main__":
    main()
