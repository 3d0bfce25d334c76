"""4 producer processes, 3 tasks with 2 consumer processes each, 20k ragged rows: every task gets
every row exactly once (verified by content), and storage bytes return to zero after clearing."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import tqstream
from tqstream.launch.processes import ProcessCluster

WORKER = str(Path(__file__).with_name("stress_worker.py"))
TASKS = ["actor", "critic", "ref"]


def test_stress_every_task_gets_every_row_once(tmp_path: Path) -> None:
    import stress_worker as w

    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address) as client:
        client.create_partition("stress", w.FIELDS)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        procs = []
        for task in TASKS:
            for j in range(2):
                out = tmp_path / f"{task}-{j}.txt"
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            WORKER,
                            "consume",
                            cluster.address,
                            "stress",
                            task,
                            str(out),
                        ],
                        env=env,
                    )
                )
        for i in range(w.PRODUCERS):
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, "produce", cluster.address, "stress", str(i)], env=env
                )
            )
        for p in procs:
            assert p.wait(600) == 0
        for task in TASKS:
            counts = collections.Counter()
            for j in range(2):
                text = (tmp_path / f"{task}-{j}.txt").read_text()
                counts.update(int(x) for x in text.split())
            assert len(counts) == w.TOTAL, f"{task}: {w.TOTAL - len(counts)} rows lost"
            assert max(counts.values()) == 1, f"{task}: rows delivered twice"
        st = client.stats("stress").partitions["stress"]
        assert st.rows == w.TOTAL
        assert all(st.tasks[t].acked == w.TOTAL for t in TASKS)
        assert client.stats().storage_bytes > 0
        client.clear_partition("stress")
        assert client.stats().storage_bytes == 0
        assert all(u.chunks == 0 and u.rows == 0 for u in client.stats().units)
