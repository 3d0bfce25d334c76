"""A simulated asynchronous RL loop on a multi-process cluster.

Three producer processes (``async_rl_worker.py``, different speeds) generate groups under a shared
"capacity" admission and put them with per-token versions; the test process is the trainer: it
gets whole-group batches inside a staleness window (``on_stale="drop"``), acks them and publishes a
new version after each step. Checked: no row is ever consumed more than K versions stale (from the
batches and from the lag histogram), every row is accounted for (put + refused = consumed + dropped
as stale + left over, and every generated row was stored or refused at put; from the stats and
from what the processes report), groups are consumed whole, and the admission's counters match
what the producers did.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import tqstream
from tqstream.launch.processes import ProcessCluster

WORKER = str(Path(__file__).with_name("async_rl_worker.py"))
TRAIN_TIME = 0.03  # seconds per trainer step


def test_async_rl_loop_is_fresh_and_accounts_for_every_row(tmp_path: Path) -> None:
    import async_rl_worker as w

    partition = "rollouts"
    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address) as client:
        client.create_partition(partition, w.FIELDS, tasks=["trainer"])  # consumed rows are freed
        adm = client.admission(
            "capacity",
            name=w.ADMISSION,
            max_concurrent=w.MAX_CONCURRENT,
            max_staleness=w.K,
            consumer_batch_size=w.GROUPS_PER_STEP,
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        outs = [tmp_path / f"producer-{i}.json" for i in range(w.PRODUCERS)]
        procs = [
            subprocess.Popen(
                [sys.executable, WORKER, cluster.address, partition, str(i), str(outs[i])], env=env
            )
            for i in range(w.PRODUCERS)
        ]
        consumed: dict[str, int] = {}  # group -> rows consumed
        dropped = 0  # rows the trainer's requests reported as evicted stale
        v = 0
        try:
            for _ in range(w.STEPS):
                batch = client.get(
                    partition,
                    w.FIELDS,
                    w.B,
                    "trainer",
                    whole_groups=True,
                    current_version=v,
                    max_staleness=w.K,
                    on_stale="drop",
                    timeout=60,
                )
                meta = batch.meta
                assert len(meta) == w.B
                for i, row in enumerate(batch.data["versions"].unbind()):
                    start = meta.version_start[i]
                    assert start is not None and 0 <= v - start <= w.K, (v, meta.version_start)
                    generated = row[row >= 0]  # one version per row: mixed rows were refused
                    assert int(generated.min()) == int(generated.max()) == start
                    assert meta.version_end[i] == start == meta.dispatch_version[i]
                for group, run in itertools.groupby(meta.groups):  # whole groups, adjacent
                    assert group is not None and group not in consumed
                    consumed[group] = len(list(run))
                dropped += meta.stale_dropped
                time.sleep(TRAIN_TIME)
                assert batch.ack() == w.B
                v += 1
                adm.on_version(v)  # version STEPS also tells the producers to stop
            for p in procs:
                assert p.wait(60) == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        reports = [json.loads(out.read_text()) for out in outs]

        # --- freshness: nothing consumed more than K versions behind the trainer ---
        st = client.stats(partition).partitions[partition]
        trainer = st.tasks["trainer"]
        assert trainer.lag and all(0 <= lag <= w.K for lag in trainer.lag)

        # --- accounting, from the stats and from the processes ---
        generated = w.G * sum(r["groups"] for r in reports)
        produced = sum(r["rows_put"] for r in reports)  # stored
        rejected = sum(r["rows_rejected"] for r in reports)  # refused at put, never stored
        assert generated == produced + rejected
        n_consumed = w.STEPS * w.B
        assert sum(consumed.values()) == n_consumed == sum(trainer.lag.values()) == st.freed
        assert st.produced == produced and st.rejected == rejected
        assert st.stale_dropped == trainer.stale_dropped == dropped
        remaining = st.rows
        assert trainer.available == remaining and trainer.leased == 0
        assert produced == n_consumed + dropped + remaining
        assert generated == rejected + n_consumed + dropped + remaining
        assert st.produced == st.freed + st.stale_dropped + st.rows
        assert rejected > 0  # mixed-version rows were refused (and counted, never stored)
        stored = {uid: n for r in reports for uid, n in r["stored"].items()}
        assert all(stored[g] == n for g, n in consumed.items())  # every group consumed whole
        assert sum(stored.values()) == produced
        straggled = reports[w.STRAGGLER]["straggled"]
        assert straggled in stored and straggled not in consumed  # stale: dropped, never trained

        # --- the admission saw exactly what the producers did ---
        state = adm.state()
        print(f"generated {generated}, refused {rejected}, consumed {n_consumed}, stale-dropped "
              f"{dropped}, left {remaining}; lag {trainer.lag}; admission {state}")  # fmt: skip
        assert state["version"] == w.STEPS and state["running"] == 0
        assert state["granted"] == sum(r["groups"] for r in reports)
        assert state["accepted"] == sum(r["slots_accepted"] for r in reports)
        assert state["rejected"] == sum(r["slots_rejected"] for r in reports)
        assert state["granted"] == state["accepted"] + state["rejected"]
        # the global staleness bound: accepted groups never outran the trainer by > K + 1 steps
        assert state["accepted"] <= (w.K + w.STEPS + 1) * w.GROUPS_PER_STEP

        # --- drain: what is left is consumed if fresh, dropped if stale ---
        while True:
            try:
                rest = client.get_meta(partition, w.FIELDS, 1, "trainer", current_version=v,
                                       max_staleness=w.K, on_stale="drop", timeout=0)  # fmt: skip
            except tqstream.RequestTimeoutError:
                break
            assert v - rest.version_start[0] <= w.K
            assert rest.groups[0] != straggled
            client.ack(rest)
        st = client.stats(partition).partitions[partition]
        assert st.rows == 0 and all(0 <= lag <= w.K for lag in st.tasks["trainer"].lag)
        assert st.stale_dropped >= stored[straggled]
        assert produced == st.freed + st.stale_dropped
        assert generated == st.rejected + st.freed + st.stale_dropped
        assert sum(st.tasks["trainer"].lag.values()) == st.freed
        client.clear_partition(partition)
        deadline = time.monotonic() + 10
        while client.stats().storage_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats().storage_bytes == 0
