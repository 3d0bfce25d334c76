"""Run the benchmark suite once and print, per scenario, each system's median time, throughput and
the time ratio tqstream / system for every tqstream mode (< 1: tqstream is faster).

    python -m benchmarks.report [pytest args]       # e.g. --bench-quick, --bench-systems=...
    python -m benchmarks.report --from-json FILE    # tables from an existing --benchmark-json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks._systems import SYSTEMS

ROOT = Path(__file__).resolve().parents[1]
GROUPS = (
    "small",
    "mid",
    "large",
    "ragged",
    "metadata",
    "concurrency",
    "producers",
    "weightsync",
    "rollout",
    "verl-kv",
    "areal-staleness",
    "verl-dataproto",
    "jax-get",
    "durability-small",
    "durability-large",
    "recovery",
    "sweep",
)
# the verl-kv scenario's systems (benchmarks/test_verl_kv.py) are its own: tqstream's first;
# verl-dataproto's in-process pickle round trip comes last
ORDER = ("tqstream-compat-embedded", "tqstream-compat-ray", *SYSTEMS, "pickle")
RATIO_NOTE = "ratio = tqstream median time / that system's median time (< 1: tqstream is faster)"
ALIAS_NOTE = (
    "(!) the tensors the consumer got are the producer's own input memory: nothing was copied, "
    "and a producer reusing its buffers after put would change the stored rows"
)
METADATA_NOTE = (
    "metadata: first get = the first get after filling the partition (not in the median), "
    "fill = time to put the N rows"
)
PRODUCERS_NOTE = (
    "producers: rows/s = rows of the exchange / its median time; there the ratio columns divide "
    "tqstream's rows/s by that system's (> 1: tqstream is faster); put p50 / p99 over every put "
    "of every producer; ray-actor-queue there is verl's fully-async MessageQueue actor "
    "(put_sample / get_sample of ray.cloudpickle'd samples)"
)


def machine() -> dict[str, Any]:
    """nproc, CPU model, memory and the versions that matter, for the docs."""
    cpu = platform.processor() or platform.machine()
    mem = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in text.splitlines()
                if ln.startswith("model name")
            ),
            cpu,
        )
        kib = next(
            ln.split()[1]
            for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemTotal")
        )
        mem = f"{int(kib) / 2**20:.0f} GiB"
    except OSError:
        pass
    versions = {}
    for package in ("tqstream", "torch", "pyzmq", "ray", "TransferQueue", "tensordict"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": mem,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": versions,
    }


@dataclasses.dataclass
class Row:
    system: str
    median: float
    nbytes: int
    extra: dict[str, Any]

    @property
    def mbps(self) -> float:
        return self.nbytes / self.median / 1e6 if self.median > 0 else float("nan")


@dataclasses.dataclass
class Table:
    group: str
    case: str
    rows: list[Row]

    @property
    def title(self) -> str:
        mb = max((r.nbytes for r in self.rows), default=0) / 1e6
        return f"{self.group} — {self.case}" + (f", {mb:.3g} MB per round" if mb else "")

    def ratios(self) -> list[str]:
        """The tqstream systems in the table: one ratio column each."""
        return [r.system for r in self.rows if r.system.startswith("tqstream")]


def tables(doc: dict[str, Any]) -> list[Table]:
    """One table per (group, case), groups and systems in a fixed order."""
    found: dict[tuple[str, str], list[Row]] = {}
    for bench in doc.get("benchmarks", []):
        info = bench.get("extra_info", {})
        key = (bench.get("group") or "?", str(info.get("case", bench["name"])))
        row = Row(str(info.get("system", bench["name"])), bench["stats"]["median"], 0, info)
        row.nbytes = int(info.get("bytes", 0))
        found.setdefault(key, []).append(row)

    def group_rank(key: tuple[str, str]) -> tuple[int, float, str]:
        group, case = key
        rank = GROUPS.index(group) if group in GROUPS else len(GROUPS)
        extra = found[key][0].extra
        order = {"metadata": "rows", "producers": "group"}.get(group, "batch")
        return rank, float(extra.get(order, 0)), case

    def system_rank(row: Row) -> int:
        return ORDER.index(row.system) if row.system in ORDER else len(ORDER)

    return [
        Table(g, c, sorted(found[(g, c)], key=system_rank))
        for g, c in sorted(found, key=group_rank)
    ]


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _producer_cells(table: Table) -> tuple[list[str], list[list[str]]]:
    """Sustained rows/s, put latency and tqstream's rows/s over each system's."""
    tq = table.ratios()
    rate = {r.system: r.extra["rows"] / r.median for r in table.rows}
    head = ["system", "rows/s", "MB/s", "put p50", "put p99", *(f"{t}/x rows/s" for t in tq)]
    body = []
    for r in table.rows:
        cells = [r.system, f"{rate[r.system]:,.0f}", f"{r.mbps:,.1f}"]
        cells += [_time(float(r.extra["put_p50_s"])), _time(float(r.extra["put_p99_s"]))]
        cells += [f"{rate[t] / rate[r.system]:.3g}" for t in tq]
        body.append(cells)
    return head, body


def _recovery_cells(table: Table) -> tuple[list[str], list[list[str]]]:
    """A killed controller's time back to serving, by snapshot interval."""
    head = ["system", "snapshot every", "kill → first answer (median)", "journal bytes / row"]
    body = [
        [
            r.system,
            f"{int(r.extra['snapshot_records']):,} records",
            _time(r.median),
            f"{float(r.extra['journal_bytes_per_row']):.3g}",
        ]
        for r in sorted(table.rows, key=lambda r: int(r.extra["snapshot_records"]))
    ]
    return head, body


def _cells(table: Table) -> tuple[list[str], list[list[str]]]:
    if "put_p50_s" in table.rows[0].extra:
        return _producer_cells(table)
    if "journal_bytes_per_row" in table.rows[0].extra:
        return _recovery_cells(table)
    tq = table.ratios()
    medians = {r.system: r.median for r in table.rows}
    extra = "first_get_s" in table.rows[0].extra
    head = ["system", "median", "MB/s", *(f"{t}/x" for t in tq)]
    if extra:
        head += ["first get", "fill"]
    body = []
    for r in table.rows:
        cells = [r.system + (" (!)" if r.extra.get("aliases_input") else ""), _time(r.median)]
        cells.append(f"{r.mbps:,.1f}")
        cells += [f"{medians[t] / r.median:.3g}" for t in tq]
        if extra:
            cells += [
                _time(float(r.extra.get("first_get_s", 0))),
                _time(float(r.extra.get("fill_s", 0))),
            ]
        body.append(cells)
    return head, body


def _aliased(all_tables: Sequence[Table]) -> bool:
    return any(r.extra.get("aliases_input") for t in all_tables for r in t.rows)


def render_text(all_tables: Sequence[Table]) -> str:
    out = [RATIO_NOTE, "MB/s = payload bytes of one round / median round time", METADATA_NOTE]
    if any(t.group == "producers" for t in all_tables):
        out.append(PRODUCERS_NOTE)
    out += [ALIAS_NOTE, ""] if _aliased(all_tables) else [""]
    for table in all_tables:
        head, body = _cells(table)
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        out.append(table.title)
        for row in [head, *body]:
            out.append(
                "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(row, widths, strict=True))
                )
            )
        out.append("")
    return "\n".join(out)


def render_markdown(all_tables: Sequence[Table]) -> str:
    out = [textwrap.fill(ALIAS_NOTE, 100), ""] if _aliased(all_tables) else []
    for table in all_tables:
        head, body = _cells(table)
        out += [f"#### {table.title}", ""]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
        out += ["| " + " | ".join(row) + " |" for row in body]
        out.append("")
    return "\n".join(out)


def run_suite(pytest_args: Sequence[str], json_path: Path) -> int:
    """One pytest run of the whole suite writing ``json_path``; returns pytest's exit code."""
    cmd = [
        sys.executable, "-m", "pytest", "benchmarks", f"--benchmark-json={json_path}",
        "-p", "no:cacheprovider", "-q", *pytest_args,
    ]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--from-json", type=Path, help="print from an existing benchmark json")
    parser.add_argument("--save-json", type=Path, help="keep the json of this run here")
    args, pytest_args = parser.parse_known_args(argv)
    code = 0
    path = args.from_json
    if path is None:
        path = args.save_json or Path(tempfile.mkdtemp(prefix="tqbench-")) / "benchmarks.json"
        code = run_suite(pytest_args, path.resolve())
        if not path.exists():
            print(f"no results: pytest exited with {code}", file=sys.stderr)
            return code or 1
        print(f"\nresults: {path}\n")
    print(render_text(tables(json.loads(path.read_text()))))
    return code


if __name__ == "__main__":
    sys.exit(main())
