"""A trainer process reading global batches over a mesh of every device: of this process alone
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), or of several processes joined by
``jax.distributed`` over gloo. Also puts an array spread over the devices through the writer.
Writes what it read (and what was refused) to a JSON report.

    jax_mesh_worker.py ADDRESS PARTITION PROCESSES PROCESS_ID COORDINATOR_PORT BATCHES OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np


def local_rows(arr: jax.Array) -> list[Any]:
    """This process's rows of a global array, in the order of the batch axis."""
    shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards]).tolist()


def main() -> None:
    address, partition, processes, process_id, port, batches, out = sys.argv[1:8]
    if int(processes) > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=int(processes),
            process_id=int(process_id),
        )  # fmt: skip
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tqstream.adapters.jax import ExperienceIterator, ExperienceWriter, JaxBatch
    from tqstream.errors import InvalidRequestError

    devices = jax.devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    report: dict[str, Any] = {"devices": len(devices), "batches": []}
    try:
        ExperienceIterator(address, ["ids"], 12, partition=partition, sharding=sharding)
    except InvalidRequestError as exc:
        report["refused"] = str(exc)
    if int(processes) > 1:  # the batch axis within each process, replicated across them
        across = Mesh(np.array(devices).reshape(int(processes), -1).T, ("data", "model"))
        try:
            ExperienceIterator(address, ["ids"], 8, partition=partition,
                               sharding=NamedSharding(across, PartitionSpec("data")))  # fmt: skip
        except InvalidRequestError as exc:
            report["replicated"] = str(exc)
    # a producer's array sharded over the devices: gathered by the writer (or, when other
    # processes hold some of it, refused)
    spread = jax.make_array_from_process_local_data(
        sharding, np.arange(16 // int(processes), dtype=np.int32) + 100 * int(process_id), (16,)
    )
    writer = ExperienceWriter(address, partition=f"{partition}-spread")
    try:
        writer.put_experience({"x": spread}, current_version=0)
        back = ExperienceIterator(address, ["x"], 16, partition=f"{partition}-spread")
        report["spread"] = np.asarray(back.get_experience()["x"]).tolist()
    except InvalidRequestError as exc:
        report["spread"] = str(exc)

    @jax.jit
    def sums(batch: JaxBatch) -> tuple[jax.Array, jax.Array]:
        return batch["ids"].sum(), batch["reward"].sum()

    it = ExperienceIterator(
        address, ["ids", "reward"], 8, partition=partition, sharding=sharding,
        buckets={"ids": (4, 8, 16)}, ack="manual", timeout=60,
    )  # fmt: skip
    report["local_rows"] = it.placement.local_rows
    for _ in range(int(batches)):
        batch = next(it)
        assert batch.meta is not None
        ids_sum, reward_sum = sums(batch)  # over the global arrays; the result is replicated
        entry: dict[str, Any] = {
            "keys": list(batch.meta.keys),
            "shape": {k: list(v.shape) for k, v in batch.items()},
            "devices": {  # each field's devices, as positions in jax.devices()
                k: sorted(devices.index(d) for d in v.sharding.device_set) for k, v in batch.items()
            },
            "shards": {  # this process's shards: (device position, shape)
                k: sorted(
                    [devices.index(s.device), list(s.data.shape)] for s in v.addressable_shards
                )
                for k, v in batch.items()
            },
            "local": {k: local_rows(v) for k, v in batch.items()},
            "ids_sum": int(ids_sum.addressable_data(0)),
            "reward_sum": float(reward_sum.addressable_data(0)),
        }
        if int(processes) == 1:
            entry["global"] = {k: np.asarray(v).tolist() for k, v in batch.items()}
        report["batches"].append(entry)
        it.ack(batch)
    it.close()
    Path(out).write_text(json.dumps(report))
    if int(processes) > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
