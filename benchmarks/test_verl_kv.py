"""verl-kv: one training step of verl 0.9.1's v1 trainer on TransferQueue's KV API, through
tqstream's ``tqstream.compat.transfer_queue`` and through TransferQueue 0.1.11 itself.

A round is what the trainer and its workers do with the data plane per step:

1. ``put``: ``kv_batch_put`` of the rollout batch, 256 rows (keys ``uid{i}_0_0``) of about 1k
   prompt + 2k response tokens with tags, as the agent-loop workers write it: a TensorDict built
   like verl's ``list_of_dict_to_tensordict`` (per-token fields as jagged nested tensors, the
   non-tensor fields as ``NonTensorStack``);
2. ``get``: ``kv_batch_get`` of the fields the log-prob / ref / critic workers read;
3. ``columns``: three ``kv_batch_put`` by key, one new column each (``old_log_probs``,
   ``ref_log_prob``, ``values``: float32 per response token);
4. ``list``: ``kv_list()``, which verl's ReplayBuffer polls;
5. ``clear``: ``kv_clear`` of the step's keys (the round leaves nothing stored).

Each phase is timed too; their medians go into ``extra_info`` (``phase_<name>_s``). The data read
back is compared with what was written once per system, outside the timed rounds (keys asked in
another order than they were written, every field row by row, tags), and the partition is checked
empty after the rounds.

Systems: ``tqstream-compat-embedded`` (the cluster in the benchmark process),
``tqstream-compat-ray`` (tqstream's controller and storage units as Ray actors) and
``transferqueue`` (TransferQueue 0.1.11, its controller and SimpleStorage units as Ray actors);
2 storage units each. Only one of them is initialised at a time. ``--bench-systems`` picks among
them by name (naming none of them deselects the scenario); ``-k`` works too.

    python -m pytest benchmarks/test_verl_kv.py --benchmark-json=FILE
    python -m benchmarks.test_verl_kv FILE    # step and phase medians, ratios, from that json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from benchmarks._systems import ray_session, settle
from benchmarks._workload import quick

SYSTEMS = ("tqstream-compat-embedded", "tqstream-compat-ray", "transferqueue")
GROUP = "verl-kv"
PARTITION = "train"
STORAGE_UNITS = 2
ROWS = 256
QUICK_ROWS = 32
PROMPT = (768, 1280)  # tokens, inclusive, uniform per row
RESPONSE = (1536, 2560)
VOCAB = 151_936
SEED = 1234
READ = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
"""What the compute_log_prob / ref / critic workers read."""
COLUMNS = ("old_log_probs", "ref_log_prob", "values")
"""What the trainer writes back after each of them (one kv_batch_put each)."""
PHASES = ("put", "get", "columns", "list", "clear")
ROUNDS = {"transferqueue": 10}  # rounds per system; tqstream's: DEFAULT_ROUNDS
DEFAULT_ROUNDS, WARMUP = 20, 1

NOTES = {
    "tqstream-compat-embedded": "tqstream.compat.transfer_queue, tqstream.deployment='embedded': "
    "controller + 2 storage units on the benchmark process's loop thread (inproc://; chunks of "
    "1 MiB or more through /dev/shm)",
    "tqstream-compat-ray": "tqstream.compat.transfer_queue with Ray initialised: tqstream's "
    "controller + 2 storage units as Ray actors, the benchmark process their client over "
    "tqstream's sockets (loopback TCP; chunks of 1 MiB or more through /dev/shm)",
    "transferqueue": "TransferQueue 0.1.11, SimpleStorage: controller + 2 storage units as Ray "
    "actors, the benchmark process their client over ZMQ (loopback TCP)",
}


# --- workload ------------------------------------------------------------------------------------
def rollout_rows(n: int, seed: int = SEED) -> list[dict[str, Any]]:
    """``n`` agent-loop outputs as verl's ``AgentLoopWorkerTQ._agent_loop_postprocess`` makes
    each row (``AgentLoopOutput.as_dict`` + the prompt's kwargs + input_ids / position_ids), with
    ``attention_mask`` added; seeded lengths and values."""
    g = torch.Generator().manual_seed(seed)

    def between(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    rows = []
    for i in range(n):
        p, r = between(*PROMPT), between(*RESPONSE)
        prompts = torch.randint(0, VOCAB, (p,), generator=g)
        responses = torch.randint(0, VOCAB, (r,), generator=g)
        input_ids = torch.cat([prompts, responses])
        attention_mask = torch.ones_like(input_ids)
        response_mask = (torch.rand(r, generator=g) > 0.05).long()  # 0: tool tokens
        reward = float(between(0, 1))
        rm_scores = torch.zeros(r, dtype=torch.float32)
        rm_scores[-1] = reward
        rows.append(
            {
                "prompts": prompts,
                "responses": responses,
                "response_mask": response_mask,
                "rollout_log_probs": -5.0 * torch.rand(r, generator=g),
                "rm_scores": rm_scores,
                "extra_fields": {
                    "reward_extra_info": {"acc": reward},
                    "min_global_steps": 0,
                    "max_global_steps": 0,
                },
                "uid": f"uid{i}",
                "data_source": "openai/gsm8k",
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": torch.arange(p + r),
            }
        )
    return rows


def to_tensordict(rows: Sequence[dict[str, Any]]) -> TensorDict:
    """verl's ``list_of_dict_to_tensordict``: tensors of one shape stacked, tensors of different
    shapes as a jagged nested tensor, anything else a ``NonTensorStack``."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if all(isinstance(v, torch.Tensor) for v in values):
            same = all(v.shape == values[0].shape for v in values)
            out[key] = (
                torch.stack(values)
                if same
                else torch.nested.as_nested_tensor(values, layout=torch.jagged)
            )
        else:
            out[key] = NonTensorStack(*values)
    return TensorDict(out, batch_size=[len(rows)])


def column_rows(rows: Sequence[dict[str, Any]], seed: int = SEED + 1) -> dict[str, list[Any]]:
    """One float32 value per response token for each of :data:`COLUMNS`, per row."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: [torch.randn(len(row["responses"]), generator=g) for row in rows] for name in COLUMNS
    }


def nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        t = value.values() if value.is_nested else value
        return t.numel() * t.element_size()
    return 0


@dataclasses.dataclass
class Step:
    """One step's data, built once: the rows (the reference for the checks) and the TensorDicts
    the rounds put."""

    keys: list[str]
    rows: list[dict[str, Any]]
    tags: list[dict[str, Any]]
    rollout: TensorDict
    columns: dict[str, list[Any]]
    column_puts: list[TensorDict]
    nbytes: int  # tensor payload of a round: the rollout put + the get + the three column puts

    @classmethod
    def make(cls, n: int) -> Step:
        rows = rollout_rows(n)
        tags = [
            {
                "status": "success",
                "prompt_len": len(row["prompts"]),
                "response_len": len(row["responses"]),
                "seq_len": len(row["input_ids"]),
            }
            for row in rows
        ]
        columns = column_rows(rows)
        column_puts = [to_tensordict([{name: v} for v in vals]) for name, vals in columns.items()]
        rollout = to_tensordict(rows)
        moved = sum(nbytes(rollout.get(k)) for k in rollout.keys())  # noqa: SIM118
        moved += sum(nbytes(rollout.get(k)) for k in READ)
        moved += sum(nbytes(td.get(k)) for td in column_puts for k in td.keys())  # noqa: SIM118
        keys = [f"uid{i}_0_0" for i in range(n)]
        return cls(keys, rows, tags, rollout, columns, column_puts, moved)

    def step_tags(self, step: int) -> list[dict[str, Any]]:
        return [{**tag, "global_steps": step} for tag in self.tags]


# --- systems -------------------------------------------------------------------------------------
CONTROLLER = ("TransferQueueController", "transfer_queue")  # the named actor both use in Ray


def _controller_alive() -> bool:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        ray.get_actor(CONTROLLER[0], namespace=CONTROLLER[1])
    except ValueError:
        return False
    return True


def _wait_released(timeout: float = 30.0) -> None:
    """Until no TransferQueue controller actor is registered in Ray (one just closed may linger
    for a moment, and the next ``init`` would attach to it)."""
    deadline = time.monotonic() + timeout
    while _controller_alive():
        if time.monotonic() > deadline:
            raise RuntimeError("a TransferQueueController actor is still registered in Ray")
        time.sleep(0.1)


class KV:
    """One TransferQueue-API module (tqstream's compat package or TransferQueue itself),
    initialised with 2 storage units."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tq: Any = None

    def start(self, later: Sequence[pytest.Item] = ()) -> None:
        from omegaconf import OmegaConf

        if self.name != "tqstream-compat-embedded":
            ray_session()
        if _controller_alive():
            _take_over(self.name, later)
        conf: dict[str, Any] = {
            "controller": {"polling_mode": True},
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {
                    "num_data_storage_units": STORAGE_UNITS,
                    "total_storage_size": None,
                },
            },
        }
        if self.name == "transferqueue":
            import transfer_queue as tq
        else:
            import tqstream.compat.transfer_queue as tq

            conf["tqstream"] = {"deployment": self.name.removeprefix("tqstream-compat-")}
        tq.init(OmegaConf.create(conf))
        self.tq = tq

    def close(self) -> None:
        if self.tq is not None:
            self.tq.close()
            self.tq = None
            _wait_released()


def _take_over(name: str, later: Sequence[pytest.Item]) -> None:
    """Close the TransferQueue the other scenarios' ``transferqueue`` system left initialised
    (its session fixture ends only with the session) when no test after this scenario uses it:
    its controller holds the actor name every ``init`` here looks up. Skip otherwise."""
    tq = sys.modules.get("transfer_queue.interface")
    owned = tq is not None and getattr(tq, "_TQ_CLIENT", None) is not None
    needed = any(
        getattr(item, "callspec", None) is not None
        and item.callspec.params.get("system") == "transferqueue"  # type: ignore[attr-defined]
        for item in later
    )
    if not owned or needed:
        pytest.skip(
            f"{name}: another TransferQueue controller runs in this Ray session and is still "
            "needed; run this scenario on its own (-k verl_kv)"
        )
    tq.close()  # type: ignore[union-attr]
    _wait_released()


def _chosen(config: pytest.Config) -> list[str]:
    raw = config.getoption("--bench-systems")
    named = {n.strip() for n in raw.split(",") if n.strip()}
    return [n for n in SYSTEMS if not named or n in named]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kv" in metafunc.fixturenames:
        names: list[Any] = _chosen(metafunc.config)
        if not names:
            reason = f"--bench-systems names none of {', '.join(SYSTEMS)}"
            names = [pytest.param("none", marks=pytest.mark.skip(reason=reason))]
        metafunc.parametrize("kv", names, indirect=True, scope="module")


@pytest.fixture(scope="module")
def kv(request: pytest.FixtureRequest) -> Iterator[KV]:
    need = {"transferqueue": ("ray", "transfer_queue"), "tqstream-compat-ray": ("ray",)}.get(
        request.param, ()
    )
    for package in need:
        pytest.importorskip(package, reason=f"{request.param} needs {package} (.[bench])")
    system = KV(request.param)
    items = request.session.items
    last = max(
        (i for i, it in enumerate(items) if getattr(it, "module", None) is request.module),
        default=-1,
    )
    try:
        system.start(items[last + 1 :])
        if not quick():
            settle()
        yield system
    finally:
        system.close()


# --- checks --------------------------------------------------------------------------------------
def samples(value: Any) -> list[Any]:
    """A field of a get, one entry per row."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    if isinstance(value, NonTensorStack):
        return list(value.tolist())
    if isinstance(value, NonTensorData):
        return list(value.data)
    return list(value)


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got, want)
        )
    return bool(got == want)


def check_rows(data: TensorDict, want: Sequence[dict[str, Any]], fields: Sequence[str]) -> None:
    """``data`` holds ``fields`` of the rows ``want``, in that order."""
    assert int(data.batch_size[0]) == len(want), f"{data.batch_size[0]} rows, not {len(want)}"
    for name in fields:
        got = samples(data.get(name))
        assert len(got) == len(want), f"{name}: {len(got)} rows, not {len(want)}"
        for i, (g, row) in enumerate(zip(got, want, strict=True)):
            assert same(g, row[name]), f"{name} of {row['uid']} came back different (row {i})"


def listed(tq: Any) -> dict[str, dict[str, Any]]:
    """The step partition's keys and tags (``{}`` when it is gone)."""
    return dict((tq.kv_list() or {}).get(PARTITION) or {})


def verify(tq: Any, step: Step) -> None:
    """One step, untimed, with every read compared with what was written."""
    n = len(step.keys)
    tags = step.step_tags(0)
    tq.kv_batch_put(keys=step.keys, partition_id=PARTITION, fields=step.rollout, tags=tags)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED)).tolist()
    everything = list(step.rows[0])
    data = tq.kv_batch_get(
        keys=[step.keys[i] for i in order], partition_id=PARTITION, select_fields=everything
    )
    check_rows(data, [step.rows[i] for i in order], everything)
    data = tq.kv_batch_get(keys=step.keys, partition_id=PARTITION, select_fields=list(READ))
    assert sorted(data.keys()) == sorted(READ), sorted(data.keys())
    check_rows(data, step.rows, READ)
    for td in step.column_puts:
        tq.kv_batch_put(keys=step.keys, partition_id=PARTITION, fields=td)
    back = tq.kv_batch_get(
        keys=step.keys[::-1], partition_id=PARTITION, select_fields=list(COLUMNS)
    )
    written = [
        {"uid": row["uid"], **{c: step.columns[c][i] for c in COLUMNS}}
        for i, row in enumerate(step.rows)
    ]
    check_rows(back, written[::-1], COLUMNS)
    listing = listed(tq)
    assert sorted(listing) == sorted(step.keys), f"kv_list: {len(listing)} keys"
    for key, tag in zip(step.keys, tags, strict=True):
        assert {k: listing[key].get(k) for k in tag} == tag, f"tags of {key}: {listing[key]}"
    tq.kv_clear(keys=step.keys, partition_id=PARTITION)
    assert not listed(tq), "kv_clear left rows"


# --- the benchmark -------------------------------------------------------------------------------
def test_verl_kv(benchmark: Any, kv: KV) -> None:
    tq = kv.tq
    n = QUICK_ROWS if quick() else ROWS
    rounds, warmup = (1, 0) if quick() else (ROUNDS.get(kv.name, DEFAULT_ROUNDS), WARMUP)
    step = Step.make(n)
    benchmark.group = GROUP
    benchmark.extra_info.update(
        system=kv.name,
        mode=kv.name.removeprefix("tqstream-compat-"),
        note=NOTES[kv.name],
        case=f"B={n} prompt {PROMPT[0]}-{PROMPT[1]} + response {RESPONSE[0]}-{RESPONSE[1]} tokens",
        bytes=step.nbytes,
        batch=n,
        rows=n,
        storage_units=STORAGE_UNITS,
        phases=list(PHASES),
    )
    verify(tq, step)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    counter = iter(range(1, 1 << 30))

    def one_step() -> None:
        global_step = next(counter)
        t0 = time.perf_counter()
        tq.kv_batch_put(
            keys=step.keys,
            partition_id=PARTITION,
            fields=step.rollout,
            tags=step.step_tags(global_step),
        )
        t1 = time.perf_counter()
        data = tq.kv_batch_get(keys=step.keys, partition_id=PARTITION, select_fields=list(READ))
        t2 = time.perf_counter()
        for td in step.column_puts:
            tq.kv_batch_put(keys=step.keys, partition_id=PARTITION, fields=td)
        t3 = time.perf_counter()
        listing = tq.kv_list()
        t4 = time.perf_counter()
        tq.kv_clear(keys=step.keys, partition_id=PARTITION)
        t5 = time.perf_counter()
        assert int(data.batch_size[0]) == n and len(listing[PARTITION]) == n
        for phase, took in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[phase].append(took)

    benchmark.pedantic(one_step, rounds=rounds, warmup_rounds=warmup, iterations=1)
    for phase, took in times.items():  # the timed rounds: the last `rounds` recorded
        benchmark.extra_info[f"phase_{phase}_s"] = statistics.median(took[-rounds:])
    assert not listed(tq), f"{kv.name} still holds rows after the rounds"


# --- summary from a --benchmark-json -------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def summary(doc: dict[str, Any]) -> str:
    """Markdown: each system's step median, TransferQueue's step time over it and the phase
    medians, from a pytest-benchmark json holding this scenario."""
    found = {
        b["extra_info"]["system"]: b
        for b in doc.get("benchmarks", [])
        if b.get("group") == GROUP and "system" in b.get("extra_info", {})
    }
    order = [s for s in SYSTEMS if s in found]
    if not order:
        return f"no {GROUP} results"
    tq = found.get("transferqueue")
    head = ["system", "step (median)", "steps/s", "TransferQueue / system"]
    head += [f"{p} (median)" for p in PHASES]
    rule = "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"
    lines = ["| " + " | ".join(head) + " |", rule]
    for name in order:
        bench = found[name]
        median = bench["stats"]["median"]
        ratio = f"{tq['stats']['median'] / median:.3g}x" if tq is not None else "-"
        cells = [f"`{name}`", _ms(median), f"{1 / median:.3g}", ratio]
        cells += [_ms(float(bench["extra_info"][f"phase_{p}_s"])) for p in PHASES]
        lines.append("| " + " | ".join(cells) + " |")
    first = found[order[0]]
    rounds = ", ".join(f"{found[s]['stats']['rounds']} ({s})" for s in order)
    mb = first["extra_info"]["bytes"] / 1e6
    return "\n".join(
        [f"{first['extra_info']['case']}, {mb:.3g} MB of tensors moved per step; rounds: "
         f"{rounds}", "", *lines]
    )  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m benchmarks.test_verl_kv BENCHMARK_JSON")
    print(summary(json.loads(Path(sys.argv[1]).read_text())))
