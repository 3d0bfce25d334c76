"""A client process that takes something from the controller and then waits to be killed.

    python fault_client.py ADDRESS MODE PARTITION

MODE: ``park-get`` (a get that waits for rows), ``lease`` (holds a leased batch), ``slots``
(holds every slot of admission ``adm``), ``park-acquire`` (waits for a slot of ``adm``),
``wait-put`` (a put waiting for room under the units' byte quota). Prints ``READY`` once the
request is sent (or, for held things, granted).
"""

from __future__ import annotations

import sys
import threading
import time

import torch

import tqstream


def main() -> None:
    address, mode, partition = sys.argv[1:4]
    # a put placed by the controller first (a direct put's data is at the unit already, so it
    # is stored even if its producer dies while it waits for room)
    client = tqstream.connect(address, tqstream.ClientConfig(direct_put_bytes=0))
    if mode == "lease":
        meta = client.get_meta(partition, "x", 4, "t", lease_timeout=300, timeout=10)
        assert len(meta) == 4
        print("READY", flush=True)
    elif mode == "slots":
        ids = client.admission("slots", name="adm", max_pending_slots=2, max_version_slots=100)
        assert len(ids.acquire(2, timeout=10)) == 2
        print("READY", flush=True)
    else:
        work = {
            "park-get": lambda: client.get_meta(partition, "x", 4, "t", lease_timeout=300),
            "park-acquire": lambda: client.admission(
                "slots", name="adm", max_pending_slots=2, max_version_slots=100
            ).acquire(1),
            "wait-put": lambda: client.put({"x": torch.zeros(4, 1000)}, partition, timeout=300),
        }[mode]
        threading.Thread(target=work, daemon=True).start()
        time.sleep(0.5)
        print("READY", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
