"""verl-dataproto: the round trip of one verl agent-loop ``DataProto`` (batch 64, prompt 512,
response 1024) through tqstream, through Ray's object store and through pickle, side by side.

The ``DataProto`` is made by verl 0.9.1's own ``AgentLoopWorker._postprocess`` from 64 padded
``_InternalAgentLoopOutput``s, as its agent loop makes them (``_agent_loop_postprocess``: prompts
left-padded to 512, responses right-padded to 1024, ``response_mask`` with tool tokens,
``rollout_log_probs``, a reward score → ``rm_scores``), with the non-tensor fields of a GSM8K
batch (``data_source``, ``reward_model``, ``extra_info``, ``raw_prompt``, ``index``,
``tools_kwargs``, ``interaction_kwargs``, ``uid``, ``agent_name``): 8 batch tensors and 17
non-tensor fields, among them ``reward_extra_info`` dicts holding NaN and ``extras`` dicts holding
a tuple, and ``meta_info`` with the per-sample metrics.

A round trip, per system:

- ``tqstream-embedded`` / ``tqstream-procs-shm``: ``VerlExperience.put_experience`` (rows via
  ``dataproto_to_rows``: prompts and responses unpadded, object values encoded), ``get_experience``
  of the 64 rows (whole ``uid`` groups, back through ``rows_to_dataproto``), ``ack`` (the task is
  registered, so the rows are freed). Embedded: the cluster on the benchmark process's loop thread;
  procs-shm: a ``ProcessCluster`` (controller + 1 storage unit) with shared memory;
- ``ray-object-store``: ``ray.get(ray.put(dp))`` in one driver (what verl does between workers);
- ``pickle``: ``pickle.loads(pickle.dumps(dp))`` in the process.

The ``DataProto`` that comes back is compared with the one put (exact: values, dtypes, Python
types, NaN) once per system, outside the timed rounds. ``extra_info`` holds the medians of the
two halves (``phase_put_s``: put / ``ray.put`` / ``dumps``; ``phase_get_s``: the rest).

    python -m pytest benchmarks/test_verl_dataproto.py --benchmark-json=FILE
    python -m benchmarks.test_verl_dataproto FILE    # medians, ratios, from that json
    python -m benchmarks.test_verl_dataproto --interleave [BLOCKS [BLOCK]]   # taking turns
"""

from __future__ import annotations

import json
import math
import pickle
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks._systems import ray_session, settle
from benchmarks._workload import quick

GROUP = "verl-dataproto"
SYSTEMS = ("tqstream-embedded", "tqstream-procs-shm", "ray-object-store", "pickle")
ROWS, PROMPT, RESPONSE = 64, 512, 1024
QUICK_ROWS = 8
GROUP_SIZE = 8  # rollout.n: each prompt's samples share a uid
SEED = 20
ROUNDS, WARMUP = 20, 2
NOTES = {
    "tqstream-embedded": "VerlExperience on tqstream.init(storage_units=1): controller + storage "
    "unit on the benchmark process's loop thread (inproc://; chunks of 1 MiB or more through "
    "/dev/shm); put_experience, get_experience (DataProto back), ack",
    "tqstream-procs-shm": "VerlExperience on a ProcessCluster (controller + 1 storage unit as "
    "child processes), shared_memory='auto'; put_experience, get_experience, ack",
    "ray-object-store": "ray.get(ray.put(dp)) in one driver: DataProto.__getstate__ (torch.save "
    "of the consolidated batch, pickled numpy arrays) into the object store and back",
    "pickle": "pickle.loads(pickle.dumps(dp, protocol=5)) in the process",
}


# --- workload ------------------------------------------------------------------------------------
def agent_loop_dataproto(n: int = ROWS, seed: int = SEED) -> Any:
    """verl's agent-loop output for ``n`` samples (see the module docstring)."""
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopMetrics,
        AgentLoopWorker,
        _InternalAgentLoopOutput,
    )
    from verl.utils.model import compute_position_id_with_mask

    g = torch.Generator().manual_seed(seed)
    outputs, rows = [], []
    for i in range(n):
        p = int(torch.randint(PROMPT // 4, PROMPT + 1, (1,), generator=g))
        r = int(torch.randint(16, RESPONSE + 1, (1,), generator=g))
        prompt = torch.zeros(1, PROMPT, dtype=torch.int64)
        prompt[0, PROMPT - p :] = torch.randint(1, 151_000, (p,), generator=g)
        response = torch.zeros(1, RESPONSE, dtype=torch.int64)
        response[0, :r] = torch.randint(1, 151_000, (r,), generator=g)
        mask = torch.zeros(1, PROMPT + RESPONSE, dtype=torch.int64)
        mask[0, PROMPT - p : PROMPT + r] = 1
        response_mask = torch.zeros(1, RESPONSE, dtype=torch.int64)
        response_mask[0, :r] = (torch.rand(r, generator=g) > 0.1).long()  # 0: tool tokens
        logprobs = torch.zeros(1, RESPONSE, dtype=torch.float32)
        logprobs[0, :r] = -5 * torch.rand(r, generator=g)
        acc = float(i % 3 == 0)
        question = (
            f"Natalia sold clips to {48 + i} of her friends in April, and then she sold half as "
            f"many clips in May. How many clips did Natalia sell altogether in April and May?"
        )
        messages = [{"role": "user", "content": question + ' Output the answer after "####".'}]
        outputs.append(
            _InternalAgentLoopOutput(
                prompt_ids=prompt,
                response_ids=response,
                input_ids=torch.cat([prompt, response], dim=1),
                position_ids=compute_position_id_with_mask(mask),
                response_mask=response_mask,
                attention_mask=mask,
                response_logprobs=logprobs,
                reward_score=acc,
                num_turns=2,
                metrics=AgentLoopMetrics(generate_sequences=0.5 + i / 100, compute_score=0.01),
                extra_fields={
                    # NaN where the answer could not be scored
                    "reward_extra_info": {"acc": math.nan if i % 4 == 3 else acc},
                    "raw_prompt": messages,
                    "turn_scores": [],
                    "tool_rewards": [],
                    "extras": {"tool_calls": ("calculator", i % 5)} if i % 2 else None,
                },
            )
        )
        rows.append((i // GROUP_SIZE, question, messages))
    column: dict[str, list[Any]] = {
        "data_source": ["openai/gsm8k"] * n,
        "reward_model": [{"ground_truth": str(72 + k), "style": "rule"} for k, _, _ in rows],
        "extra_info": [
            {
                "answer": "48/2 = 24 clips in May.\n#### 72",
                "index": k,
                "question": q,
                "split": "train",
            }
            for k, q, _ in rows
        ],
        "raw_prompt": [m for _, _, m in rows],
        "index": [k for k, _, _ in rows],
        "tools_kwargs": [{} for _ in rows],
        "interaction_kwargs": [{} for _ in rows],
        "uid": [f"{k:08x}-5c1e-4f6a-9d1b-uid" for k, _, _ in rows],
        "agent_name": ["single_turn_agent"] * n,
    }
    non_tensor = {}
    for key, values in column.items():  # verl's collate_fn: one object array per key
        non_tensor[key] = np.fromiter(values, dtype=object, count=n)
    worker = SimpleNamespace(reward_loop_worker_handles=None)
    postprocess: Any = AgentLoopWorker._postprocess
    return postprocess(worker, outputs, input_non_tensor_batch=non_tensor)


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.hasobject:
            return all(map(same, a.flat, b.flat))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


def check(dp: Any, back: Any) -> None:
    assert sorted(back.batch.keys()) == sorted(dp.batch.keys())
    for key in dp.batch.keys():  # noqa: SIM118
        assert same(dp.batch[key], back.batch[key]), f"batch[{key!r}] came back different"
    assert list(back.non_tensor_batch) == list(dp.non_tensor_batch)
    for key, value in dp.non_tensor_batch.items():
        assert same(value, back.non_tensor_batch[key]), f"{key!r} came back different"
    assert same(dp.meta_info, back.meta_info), "meta_info came back different"


# --- systems -------------------------------------------------------------------------------------
class RoundTrip:
    """One system: ``put(dp) -> handle`` and ``get(handle) -> DataProto``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closers: list[Any] = []

    def start(self, dp: Any) -> None:
        if self.name.startswith("tqstream"):
            import tqstream
            from tqstream.adapters.verl import VerlExperience

            if self.name == "tqstream-embedded":
                client = tqstream.init(storage_units=1)
            else:
                cluster = tqstream.ProcessCluster(storage_units=1)
                self.closers.append(cluster)
                client = tqstream.connect(
                    cluster.address, config=tqstream.ClientConfig(shared_memory="auto")
                )
            self.closers.insert(0, client)
            fields = [*dp.batch.keys(), *dp.non_tensor_batch]
            self.exp = VerlExperience(client, partition=GROUP, fields=fields, tasks=["actor"])
        elif self.name == "ray-object-store":
            self.ray = ray_session()

    def put(self, dp: Any) -> Any:
        if self.name.startswith("tqstream"):
            return self.exp.put_experience(dp, 0)
        if self.name == "ray-object-store":
            return self.ray.put(dp)
        return pickle.dumps(dp, protocol=5)

    def get(self, handle: Any, n: int) -> Any:
        if self.name.startswith("tqstream"):
            batch = self.exp.get_experience(n, 0, timeout=60)
            batch.ack()
            return batch.data
        if self.name == "ray-object-store":
            return self.ray.get(handle)
        return pickle.loads(handle)

    def held(self) -> int:
        if self.name.startswith("tqstream"):
            return self.exp.client.stats(GROUP).partitions[GROUP].rows
        return 0

    def close(self) -> None:
        for closer in self.closers:
            closer.close()


def _chosen(config: pytest.Config) -> list[str]:
    """The systems ``--bench-systems`` names (pickle, the reference, with any of them)."""
    raw = config.getoption("--bench-systems")
    named = {n.strip() for n in raw.split(",") if n.strip()}
    if not named:
        return list(SYSTEMS)
    chosen = [n for n in SYSTEMS if n in named]
    return [*chosen, "pickle"] if chosen and "pickle" not in chosen else chosen


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "trip" in metafunc.fixturenames:
        names: list[Any] = _chosen(metafunc.config)
        if not names:
            reason = f"--bench-systems names none of {', '.join(SYSTEMS)}"
            names = [pytest.param("none", marks=pytest.mark.skip(reason=reason))]
        metafunc.parametrize("trip", names, indirect=True, scope="module")


@pytest.fixture(scope="module")
def workload() -> Any:
    pytest.importorskip("verl", reason="verl-dataproto needs verl (pip install verl==0.9.1)")
    return agent_loop_dataproto(QUICK_ROWS if quick() else ROWS)


@pytest.fixture(scope="module")
def trip(request: pytest.FixtureRequest, workload: Any) -> Iterator[RoundTrip]:
    if request.param == "ray-object-store":
        pytest.importorskip("ray", reason="ray-object-store needs ray (.[bench])")
    system = RoundTrip(request.param)
    try:
        system.start(workload)
        if not quick():
            settle()
        yield system
    finally:
        system.close()


def _nbytes(dp: Any) -> int:
    return sum(t.numel() * t.element_size() for t in dp.batch.values())


# --- the benchmark -------------------------------------------------------------------------------
def test_verl_dataproto(benchmark: Any, trip: RoundTrip, workload: Any) -> None:
    dp, n = workload, len(workload)
    rounds, warmup = (1, 0) if quick() else (ROUNDS, WARMUP)
    benchmark.group = GROUP
    benchmark.extra_info.update(
        system=trip.name,
        mode=trip.name,
        note=NOTES[trip.name],
        case=f"B={n} prompt {PROMPT} + response {RESPONSE}, {len(dp.non_tensor_batch)} "
        f"non-tensor fields",
        bytes=_nbytes(dp),
        batch=n,
        rows=n,
    )
    check(dp, trip.get(trip.put(dp), n))
    times: dict[str, list[float]] = {"put": [], "get": []}

    def one() -> None:
        t0 = time.perf_counter()
        handle = trip.put(dp)
        t1 = time.perf_counter()
        trip.get(handle, n)
        t2 = time.perf_counter()
        times["put"].append(t1 - t0)
        times["get"].append(t2 - t1)

    benchmark.pedantic(one, rounds=rounds, warmup_rounds=warmup, iterations=1)
    for phase, took in times.items():
        benchmark.extra_info[f"phase_{phase}_s"] = statistics.median(took[-rounds:])
    assert trip.held() == 0, f"{trip.name} still holds rows after the rounds"


# --- summary from a --benchmark-json -------------------------------------------------------------
def summary(doc: dict[str, Any]) -> str:
    """Markdown: each system's median, its two halves, and each tqstream system's time over it."""
    found = {
        b["extra_info"]["system"]: b
        for b in doc.get("benchmarks", [])
        if b.get("group") == GROUP and "system" in b.get("extra_info", {})
    }
    order = [s for s in SYSTEMS if s in found]
    if not order:
        return f"no {GROUP} results"
    tq = [s for s in order if s.startswith("tqstream")]
    head = ["system", "round trip (median)", "put", "get", *(f"{t} / system" for t in tq)]
    rule = "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"
    lines = ["| " + " | ".join(head) + " |", rule]
    for name in order:
        bench = found[name]
        median = bench["stats"]["median"]
        cells = [f"`{name}`", f"{median * 1e3:.3g} ms"]
        for phase in ("put", "get"):
            cells.append(f"{float(bench['extra_info'][f'phase_{phase}_s']) * 1e3:.3g} ms")
        cells += [f"{found[t]['stats']['median'] / median:.3g}x" for t in tq]
        lines.append("| " + " | ".join(cells) + " |")
    first = found[order[0]]["extra_info"]
    return "\n".join([f"{first['case']}, {first['bytes'] / 1e6:.3g} MB of tensors", "", *lines])


# --- interleaved: the systems take turns, so a drift of the machine hits them alike ---------------
def _worker(name: str) -> int:
    """One system in a process of its own, driven on stdin: ``go N`` times N round trips,
    ``report`` prints their times (JSON) and ends."""
    dp = agent_loop_dataproto()
    trip = RoundTrip(name)
    times: list[float] = []
    try:
        trip.start(dp)
        check(dp, trip.get(trip.put(dp), len(dp)))
        print("ready", flush=True)
        for line in sys.stdin:
            command = line.split()
            if command[0] == "go":
                for _ in range(int(command[1])):
                    t0 = time.perf_counter()
                    trip.get(trip.put(dp), len(dp))
                    times.append(time.perf_counter() - t0)
                print("done", flush=True)
            elif command[0] == "forget":
                times.clear()
                print("done", flush=True)
            else:
                assert trip.held() == 0, f"{name} still holds rows after the rounds"
                print(json.dumps(times), flush=True)
                break
    finally:
        trip.close()
    return 0


def interleaved(turns: int = 30, block: int = 3, systems: tuple[str, ...] = SYSTEMS) -> str:
    """Markdown: each system in a worker process of its own (no shared heap or threads), the
    workers taking turns of ``block`` round trips, ``turns`` turns each after a warm-up turn;
    medians, p90 and each system over Ray's object store (or the last one named)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    procs: dict[str, subprocess.Popen[str]] = {}

    def ask(name: str, command: str) -> str:
        proc = procs[name]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {name} worker exited (code {proc.wait()})")
        return line.strip()

    try:
        for name in systems:  # one at a time: a starting system would slow the others' start
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.test_verl_dataproto", "--worker", name],
                cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            out = procs[name].stdout
            assert out is not None
            if out.readline().strip() != "ready":
                raise RuntimeError(f"the {name} worker did not start (code {procs[name].wait()})")
        settle()
        for name in systems:
            ask(name, f"go {block}")
            ask(name, "forget")
        for _ in range(turns):
            for name in systems:
                ask(name, f"go {block}")
        times = {name: json.loads(ask(name, "report")) for name in systems}
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    medians = {name: statistics.median(took) for name, took in times.items()}
    ref = "ray-object-store" if "ray-object-store" in medians else systems[-1]
    lines = [
        f"B={ROWS} prompt {PROMPT} + response {RESPONSE}; each system in a process of its own, "
        f"{turns} turns of {block} round trips, interleaved",
        "",
        f"| system | round trip (median) | p90 | / {ref} |",
        "|---|---:|---:|---:|",
    ]
    for name, took in times.items():
        p90 = statistics.quantiles(took, n=10)[-1]
        lines.append(
            f"| `{name}` | {medians[name] * 1e3:.3g} ms | {p90 * 1e3:.3g} ms | "
            f"{medians[name] / medians[ref]:.3g}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker(sys.argv[2]))
    if sys.argv[1:2] == ["--interleave"]:
        given = [int(a) for a in sys.argv[2:4]]
        turns, block = given + [30, 3][len(given) :]
        print(interleaved(turns, block))
    elif len(sys.argv) == 2:
        print(summary(json.loads(Path(sys.argv[1]).read_text())))
    else:
        sys.exit(
            "usage: python -m benchmarks.test_verl_dataproto BENCHMARK_JSON\n"
            "       python -m benchmarks.test_verl_dataproto --interleave [BLOCKS [BLOCK]]"
        )
