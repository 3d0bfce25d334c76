"""One trainer rank of a dp x tp job reading through ExperienceDataset(share_group=tp group)."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from tqstream.adapters.torch import ExperienceDataset


def main() -> None:
    address, partition, init, rank, dp, tp = sys.argv[1:7]
    rank_i, dp_i, tp_i = int(rank), int(dp), int(tp)
    dist.init_process_group("gloo", init_method=init, rank=rank_i, world_size=dp_i * tp_i)
    groups = [dist.new_group([d * tp_i + t for t in range(tp_i)]) for d in range(dp_i)]
    mine = groups[rank_i // tp_i]
    ds = ExperienceDataset(address, ["x"], 2, partition=partition, finite=True, share_group=mine)
    seen = [[int(row[0]) for row in batch["x"].unbind()] for batch in ds]
    print(json.dumps({"rank": rank_i, "dp": rank_i // tp_i, "batches": seen}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
