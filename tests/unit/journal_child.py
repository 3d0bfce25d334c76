"""A process that writes a journal, for the tests that need a real process around it.

    python journal_child.py DIRECTORY appends DURABILITY REBASE_EVERY
    python journal_child.py DIRECTORY full LIMIT_BYTES

``appends``: appends bursts of records (the payload of record ``seq`` is :func:`payload`) and
prints ``ACK <seq>`` once the record's batch is durable, forever (the test kills it); with
``REBASE_EVERY`` > 0 it rebases about that often, the snapshot being :func:`snapshot`.

``full``: the process may write files of at most ``LIMIT_BYTES`` (``RLIMIT_FSIZE``: writes past it
fail with EFBIG; SIGXFSZ is ignored). It appends until the journal degrades, keeps appending,
rebases with a snapshot too large to be written, then with one that fits, appends again and
prints a JSON report on its last line.
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import signal
import sys
import warnings

from tqstream.controller.journal import Journal, JournalConfig
from tqstream.errors import DurabilityWarning

CLUSTER = "child-cluster"


def payload(seq: int) -> bytes:
    return seq.to_bytes(8, "little") * (1 + seq % 97)


def snapshot(base: int) -> bytes:
    return b"snapshot@" + base.to_bytes(8, "little")


async def appends(directory: str, durability: str, rebase_every: int) -> None:
    journal, _ = Journal.open(directory, CLUSTER, JournalConfig(durability))  # type: ignore[arg-type]
    rng = random.Random(7)
    print("READY", flush=True)
    while True:
        for _ in range(rng.randint(1, 40)):
            journal.append(seq_kind(journal.seq + 1), payload(journal.seq + 1))
        last = journal.seq
        if rebase_every and not journal.rebasing and rng.random() < 20 / rebase_every:
            journal.rebase(snapshot(last))
        wait = journal.durable(last)
        if wait is not None:
            assert await wait
        print(f"ACK {last}", flush=True)


def seq_kind(seq: int) -> int:
    return seq % 7


async def full(directory: str, limit: int) -> dict[str, object]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    journal, _ = Journal.open(directory, CLUSTER, JournalConfig("sync"))
    report: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while journal.degraded is None:
            journal.append(1, bytes(1000))
            wait = journal.durable()
            report["last_durable_result"] = None if wait is None else await wait
        report["degraded_at"] = journal.seq
        report["reason"] = journal.degraded
        for _ in range(50):  # serving goes on: nothing raises, nothing waits
            journal.append(1, bytes(1000))
            assert journal.durable() is None
        report["warnings"] = [
            str(w.message) for w in caught if issubclass(w.category, DurabilityWarning)
        ]
    report["too_large_rebase"] = await journal.rebase(bytes(2 * limit))
    report["degraded_after_failed_rebase"] = journal.degraded
    report["base"] = journal.seq
    task = journal.rebase(snapshot(journal.seq))
    for i in range(5):  # while the snapshot is being written: held, written after it
        journal.append(2, payload(i))
    report["rebase"] = await task
    report["degraded_after_rebase"] = journal.degraded
    for i in range(5, 25):
        journal.append(2, payload(i))
    wait = journal.durable()
    report["durable_after"] = True if wait is None else await wait
    report["stats"] = {"lost": journal.stats().lost, "seq": journal.seq}
    journal.close()
    return report


def main() -> None:
    directory, mode = sys.argv[1:3]
    if mode == "appends":
        asyncio.run(appends(directory, sys.argv[3], int(sys.argv[4])))
    else:
        print(json.dumps(asyncio.run(full(directory, int(sys.argv[3])))), flush=True)


if __name__ == "__main__":
    main()
