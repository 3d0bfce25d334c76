"""Interleaved round trips: several systems take turns in short blocks of rounds, so a drift of the
machine (other load, a noisy neighbour, frequency changes) hits every system alike. Sub-millisecond
medians of the pytest-benchmark suite move by up to 2x between runs on a small shared machine,
because each system's rounds run in one stretch; this gives their ratios to a few percent.

    python -m benchmarks.interleave --systems tqstream-procs-tcp,zmq-pattern,zmq-tcp
    python -m benchmarks.interleave --systems tqstream-embedded,zmq-ipc --scenario mid --rounds 200

Each system runs in a worker process of its own, started once and checked once (the data must come
back intact); the last system named is the reference of the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._systems import SYSTEMS

ROOT = Path(__file__).resolve().parents[1]


def worker(name: str, scenario_name: str, threads: int) -> int:
    """Serve the driver on stdin/stdout: ``go N`` runs N timed rounds, ``report`` prints them."""
    import torch

    from benchmarks._bench import check
    from benchmarks._systems import make_system, missing
    from benchmarks._workload import SCENARIOS, make_batch

    torch.set_num_threads(threads)
    scenario = SCENARIOS[scenario_name].sized()
    system = make_system(name)
    package = missing(system)
    if package is not None:
        print(f"skip {package!r} is not installed (pip install -e '.[bench]')", flush=True)
        return 0
    times: list[float] = []
    try:
        system.start()
        system.begin(f"interleave-{scenario.name}")
        batch = make_batch(scenario.batch, scenario.length, ragged=scenario.ragged)
        data = system.prepare(batch)
        check(batch, system.roundtrip(data))
        print(f"ready {batch.nbytes}", flush=True)
        for line in sys.stdin:
            command = line.split()
            if command[0] == "go":
                for _ in range(int(command[1])):
                    start = time.perf_counter()
                    system.roundtrip(data)
                    times.append(time.perf_counter() - start)
                print("done", flush=True)
            elif command[0] == "forget":  # the warmup
                times.clear()
                print("done", flush=True)
            else:
                held = system.held()
                assert held in (None, 0), f"{name} still holds {held} after the rounds"
                print(json.dumps(times), flush=True)
                break
        system.end()
    finally:
        system.close()
    return 0


class Worker:
    def __init__(self, name: str, scenario: str, threads: int) -> None:
        self.name = name
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "benchmarks.interleave", "--worker", name,
               "--scenario", scenario, "--threads", str(threads)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        first = self._line().split()
        self.skipped = first[0] == "skip"
        self.reason = " ".join(first[1:])
        self.nbytes = 0 if self.skipped else int(first[1])

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (code {self.proc.wait()})")
        return line.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--systems",
        default="tqstream-procs-tcp,zmq-pattern,zmq-tcp",
        help=f"comma-separated, the reference last; from: {', '.join(SYSTEMS)}",
    )
    parser.add_argument("--scenario", default="small", choices=("small", "mid", "large", "ragged"))
    parser.add_argument("--rounds", type=int, default=3000, help="timed rounds per system")
    parser.add_argument("--block", type=int, default=200, help="rounds per turn")
    parser.add_argument("--warmup", type=int, default=20, help="untimed rounds per system")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="the scenario's smallest size")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        os.environ["TQSTREAM_BENCH_QUICK"] = "1"
    if args.worker:
        return worker(args.worker, args.scenario, args.threads)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or len(names) < 2:
        parser.error(f"--systems: name two or more of {', '.join(SYSTEMS)} (unknown: {unknown})")
    workers: list[Worker] = []
    try:
        for name in names:  # one at a time: a starting system would slow the others' start
            workers.append(Worker(name, args.scenario, args.threads))
        running = [w for w in workers if not w.skipped]
        for w in workers:
            if w.skipped:
                print(f"{w.name}: skipped, {w.reason}")
        if len(running) < 2:
            print("fewer than two systems can run: nothing to compare")
            return 1
        for w in running:
            w.ask(f"go {args.warmup}")
            w.ask("forget")
        for _ in range(max(1, args.rounds // args.block)):
            for w in running:
                w.ask(f"go {args.block}")
        medians = {w.name: statistics.median(json.loads(w.ask("report"))) for w in running}
    finally:
        for w in workers:
            w.close()
    reference = running[-1].name
    nbytes = running[0].nbytes
    print(f"{args.scenario}: {nbytes / 1e6:.3g} MB per round, {args.rounds} rounds per system "
          f"in turns of {args.block}; ratio = median / {reference}'s")  # fmt: skip
    width = max(len(n) for n in medians)
    for name, median in medians.items():
        rate, ratio = nbytes / median / 1e6, median / medians[reference]
        print(f"{name:<{width}}  {_time(median):>9}  {rate:9.1f} MB/s  {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
