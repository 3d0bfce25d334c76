"""Shared fixtures: the same contract suite runs against the embedded and the multi-process
deployment, with real processes and sockets."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import tqstream
from tqstream.launch.processes import ProcessCluster

_names = itertools.count()

# short timeouts make expiry tests fast; every deployment gets the same settings
LEASE_TIMEOUT = 30.0
PUT_TIMEOUT = 3.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", params=["embedded", "processes"])
def deployment(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(kind, address) of a running deployment shared by the session."""
    if request.param == "embedded":
        owner = tqstream.init(storage_units=1, lease_timeout=LEASE_TIMEOUT, put_timeout=PUT_TIMEOUT)
        yield "embedded", owner.address
        owner.close()
    else:
        with ProcessCluster(2, lease_timeout=LEASE_TIMEOUT, put_timeout=PUT_TIMEOUT) as cluster:
            yield "processes", cluster.address


@pytest.fixture
def client(deployment: tuple[str, str]) -> Iterator[tqstream.Client]:
    c = tqstream.connect(deployment[1])
    yield c
    c.close()


@pytest.fixture
def partition() -> str:
    """A fresh partition name per test, so tests share servers without sharing state."""
    return f"p{next(_names)}-{os.getpid()}"


def run_python(code: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )
