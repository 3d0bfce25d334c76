"""pytest-benchmark suite: tqstream side by side with baselines, one session-scoped instance per
system (tests are grouped by system, so one system runs at a time)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks._systems import (
    NAMED_ONLY,
    OPT_IN,
    SYSTEMS,
    System,
    make_system,
    missing,
    settle,
)
from benchmarks._workload import METADATA_ROWS, quick
from benchmarks.report import machine


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tqstream benchmarks")
    group.addoption(
        "--bench-quick",
        action="store_true",
        help="smallest size of every scenario, one round, no warmup (also TQSTREAM_BENCH_QUICK=1)",
    )
    group.addoption(
        "--bench-sweep",
        action="store_true",
        help="also run the batch-size sweep (throughput vs B at L=1024) used by make_docs",
    )
    group.addoption(
        "--bench-threads",
        type=int,
        default=1,
        help="torch intra-op threads (and OMP_NUM_THREADS for child processes); default 1, so "
        "that on a small machine OpenMP workers do not fight the servers for cores",
    )
    group.addoption(
        "--bench-systems",
        default="",
        help=f"comma-separated subset of: {', '.join(SYSTEMS)} (default: all but "
        f"{', '.join(OPT_IN)})",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--bench-quick"):
        os.environ["TQSTREAM_BENCH_QUICK"] = "1"
    import torch

    threads = config.getoption("--bench-threads")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _selected(config: pytest.Config) -> list[str]:
    raw = config.getoption("--bench-systems")
    default = set(SYSTEMS) - set(OPT_IN)
    names = {n.strip() for n in raw.split(",") if n.strip()} if raw else default
    unknown = sorted(names - set(SYSTEMS))
    if unknown:
        raise pytest.UsageError(f"--bench-systems: unknown {unknown}; choose from {SYSTEMS}")
    return [n for n in SYSTEMS if n in names]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "system" in metafunc.fixturenames:
        everywhere = tuple(s for s in SYSTEMS if s not in NAMED_ONLY)
        allowed = getattr(metafunc.module, "BENCH_SYSTEMS", everywhere)
        names = [n for n in _selected(metafunc.config) if n in allowed]
        metafunc.parametrize("system", names, indirect=True, scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The sweep runs only with --bench-sweep; quick mode builds only the smallest partition."""
    sweep = config.getoption("--bench-sweep")
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        rows = callspec.params.get("rows", 0) if callspec is not None else 0
        if (item.path.name == "test_sweep.py" and not sweep) or (
            quick() and rows > METADATA_ROWS[0]
        ):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def system(request: pytest.FixtureRequest) -> Iterator[System]:
    """The running system named by the test's parameter; closed before the next one starts."""
    instance = make_system(request.param)
    package = missing(instance)
    if package is not None:
        pytest.skip(f"{instance.name}: {package!r} is not installed (pip install -e '.[bench]')")
    try:
        instance.start()
        if not quick():
            settle()
        yield instance
    finally:
        instance.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def pytest_benchmark_update_machine_info(
    config: pytest.Config, machine_info: dict[str, Any]
) -> None:
    import torch

    machine_info["tqstream_bench"] = {
        **machine(),
        "quick": quick(),
        "torch_threads": torch.get_num_threads(),
    }
