"""Entry point of one server process started by ``tqstream-launch``: a controller or a storage unit.

It takes its configuration whole, as JSON of its ``ControllerConfig`` or ``StorageConfig``
(``--config``, decoded and type-checked by msgspec), so the settings are listed in one place:
``tqstream/config.py``.

It prints ``READY <address>`` on stdout once it serves (a storage unit: once registered), then
serves until SIGTERM/SIGINT, or until its stdin reaches EOF — the launcher holds the other end of
that pipe, so if the launcher dies for any reason, even SIGKILL, its children exit too and no
orphan process keeps a port.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from typing import Any

import msgspec

from tqstream.client.loop import log_loop_errors
from tqstream.config import ControllerConfig, StorageConfig
from tqstream.errors import TQStreamError

_log = logging.getLogger("tqstream")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


async def _run(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(log_loop_errors)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.watch_stdin:

        def on_stdin() -> None:
            if not os.read(sys.stdin.fileno(), 4096):
                loop.remove_reader(sys.stdin.fileno())
                stop.set()

        loop.add_reader(sys.stdin.fileno(), on_stdin)

    service: Any
    if args.role == "controller":  # the controller never imports torch: it starts in ~0.2 s
        from tqstream.controller.service import ControllerService

        service = ControllerService(msgspec.json.decode(args.config, type=ControllerConfig))
        serving = loop.create_task(service.serve(), name="tqstream-controller")
    else:
        from tqstream.storage.service import StorageService

        unit_threads()
        config = msgspec.json.decode(args.config, type=StorageConfig)
        service = StorageService(config, args.controller)
        serving = loop.create_task(service.serve(), name="tqstream-storage")
        await service.register()
    settle_heap()
    print(f"READY {service.address}", flush=True)
    stopper = loop.create_task(stop.wait(), name="tqstream-stop")
    done, _ = await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
    await service.close()
    serving.cancel()
    stopper.cancel()
    if serving in done and serving.exception() is not None:
        raise serving.exception()  # type: ignore[misc]


def settle_heap() -> None:
    """Keep everything a server process made while starting (its imports: torch's alone are
    ~170k objects in a unit) out of its full garbage collections for good. Each such collection
    otherwise scans them all — 65-70 ms of a unit's CPU, ~14 ms of the controller's, every put
    and fetch to it waiting meanwhile — where after this it scans only what came since (~1 ms).
    The process runs nothing but its server, so nothing of what it froze becomes garbage."""
    gc.collect()
    gc.freeze()


def unit_threads() -> None:
    """One torch intra-op thread in a storage unit's process unless ``OMP_NUM_THREADS`` says
    otherwise. A unit's tensor work is copies of one request's rows between many processes'
    requests: intra-op threads spin-wait for each other on the cores its clients need (on 2
    cores, 8 producers with 32 puts in flight each put 30-40% fewer rows a second with torch's
    default). Ray gives its actors one thread the same way."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tqstream.launch.worker")
    p.add_argument("role", choices=["controller", "storage"])
    p.add_argument(
        "--config", required=True, help="the role's ControllerConfig or StorageConfig, as JSON"
    )
    p.add_argument("--controller", default=None, help="the controller's address (storage)")
    p.add_argument("--watch-stdin", action="store_true")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        asyncio.run(_run(args))
    # cannot bind, bad keys or configuration (msgspec.ValidationError), no controller
    except (OSError, ValueError, TQStreamError) as exc:
        _log.error("tqstream %s cannot start: %s", args.role, exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
