"""A trainer that leases one batch through ExperienceDataset, then waits to be SIGKILLed."""

from __future__ import annotations

import json
import sys
import time

from tqstream.adapters.torch import ExperienceDataset


def main() -> None:
    address, partition = sys.argv[1:3]
    ds = ExperienceDataset(address, ["x"], 3, partition=partition, lease_timeout=1.5)
    batch = next(iter(ds))  # leased, "training" when SIGKILLed: never acked
    print(json.dumps([int(row[0]) for row in batch["x"].unbind()]), flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main()
