"""A pytest plugin that round-trips every verl ``DataProto`` a test session builds through tqstream.

Loaded with ``-p verl_dataproto_recorder`` into a pytest run of another project's tests (verl's
own ``tests/test_protocol_on_cpu.py``, unchanged): it wraps ``DataProto.__post_init__`` (every
constructor, ``from_dict``, ``concat``, ``chunk``, ``select``, ... ends there) to record each
``DataProto`` built. Each one goes through the tqstream cluster at ``$VERL_ROUNDTRIP_ADDRESS``
(``dataproto_to_rows`` → put → get by key → ``rows_to_dataproto``) as soon as it is built, and
what comes back is compared with it by :func:`difference`. After the test's teardown each goes
through again in the state the test left it in (tests mutate them: ``__setstate__`` fills an empty
one, ``unfold_batch_dim`` gives one a second batch dim, ``fold_batch_dim`` reshapes the
``non_tensor_batch`` of the one it is given in place, ``[6]`` rows with ``[3, 2]`` labels, a state
verl's own ``check_consistency`` refuses) and must come back equal too. The session's counts and
failures go to the JSON file ``$VERL_ROUNDTRIP_REPORT``.

:func:`difference` is stricter than verl's ``_deep_equal``: types are compared exactly at every
level (dict keys too), tensors and numpy arrays by dtype, shape and bits (NaN equal to itself),
numpy scalars by dtype and bits.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any

import numpy as np
import pytest
import torch

ADDRESS_ENV = "VERL_ROUNDTRIP_ADDRESS"
REPORT_ENV = "VERL_ROUNDTRIP_REPORT"


# --- equality ------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are equal values of the same types, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (a == b and math.copysign(1, a) == math.copysign(1, b)) or (a != a and b != b)
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            same(x, y) and same(a[x], b[y]) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.hasobject:
            return all(same(x, y) for x, y in zip(a.flat, b.flat, strict=True))
        return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.is_nested != b.is_nested:
            return False
        if a.is_nested:
            return same(a.offsets(), b.offsets()) and same(a.values(), b.values())
        return a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    return bool(a == b)


def difference(a: Any, b: Any) -> str | None:
    """What differs between two ``DataProto``s (None: nothing)."""
    if (a.batch is None) != (b.batch is None):
        return f"batch: {type(a.batch).__name__} vs {type(b.batch).__name__}"
    if a.batch is not None:
        if a.batch.batch_size != b.batch.batch_size:
            return f"batch_size: {a.batch.batch_size} vs {b.batch.batch_size}"
        if sorted(a.batch.keys()) != sorted(b.batch.keys()):
            return f"batch keys: {sorted(a.batch.keys())} vs {sorted(b.batch.keys())}"
        for key in a.batch.keys():  # noqa: SIM118
            if not same(a.batch.get(key), b.batch.get(key)):
                return f"batch[{key!r}]: {a.batch.get(key)!r:.200} vs {b.batch.get(key)!r:.200}"
    x, y = a.non_tensor_batch, b.non_tensor_batch
    if (x is None) != (y is None):
        return f"non_tensor_batch: {x!r:.100} vs {y!r:.100}"
    if x is not None:
        if sorted(x) != sorted(y):
            return f"non_tensor_batch keys: {sorted(x)} vs {sorted(y)}"
        for key in x:
            if not same(x[key], y[key]):
                return f"non_tensor_batch[{key!r}]: {x[key]!r:.200} vs {y[key]!r:.200}"
    if type(a.meta_info) is not type(b.meta_info) or (
        isinstance(a.meta_info, dict)
        and (
            a.meta_info.keys() != b.meta_info.keys()
            or not all(same(v, b.meta_info[k]) for k, v in a.meta_info.items())
        )
    ):
        return f"meta_info: {a.meta_info!r:.200} vs {b.meta_info!r:.200}"
    return None


# --- the plugin ----------------------------------------------------------------------------------
class Recorder:
    """Round-trips each ``DataProto`` as it is built, and again at the end of its test."""

    def __init__(self, address: str, report: str) -> None:
        from verl.protocol import DataProto

        import tqstream

        self.client = tqstream.connect(address)
        self.report = report
        self.test = ""
        self.pending: list[Any] = []
        self.recording = True  # not while round-tripping (rows_to_dataproto builds DataProtos)
        self.counts = dict.fromkeys(("recorded", "passed", "final", "final_passed"), 0)
        self.failures: list[dict[str, Any]] = []
        self.names = itertools.count()
        original = DataProto.__post_init__
        recorder = self

        def post_init(dp: Any) -> None:
            original(dp)
            if recorder.recording:
                recorder.pending.append(dp)
                recorder.check(dp, "built")

        DataProto.__post_init__ = post_init  # type: ignore[method-assign]

    def round_trip(self, dp: Any) -> str | None:
        from tqstream.adapters.verl import dataproto_to_rows, rows_to_dataproto

        partition = f"verl-dp-{next(self.names)}"
        stored = False
        try:
            rows = dataproto_to_rows(dp)
            meta = self.client.put(rows.data, partition, groups=rows.groups, versions_field=None)
            stored = True
            batch = self.client.get_by_keys(partition, meta.keys, rows.fields)
            back = rows_to_dataproto(batch)
        except Exception as exc:  # a failure to report, with the rest of the session
            return f"{type(exc).__name__}: {exc}"
        finally:
            if stored:
                self.client.clear_partition(partition)
        return difference(dp, back)

    def check(self, dp: Any, when: str) -> None:
        self.recording = False
        try:
            problem = self.round_trip(dp)
        finally:
            self.recording = True
        built = when == "built"
        self.counts["recorded" if built else "final"] += 1
        if problem is None:
            self.counts["passed" if built else "final_passed"] += 1
        else:
            self.failures.append({"test": self.test, "when": when, "problem": problem})

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for dp in pending:
            self.check(dp, "at the end of its test")

    def write(self) -> None:
        doc = {**self.counts, "failures": self.failures}
        with open(self.report, "w") as f:
            json.dump(doc, f, indent=1)


_RECORDER: Recorder | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _RECORDER
    _RECORDER = Recorder(os.environ[ADDRESS_ENV], os.environ[REPORT_ENV])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    assert _RECORDER is not None
    _RECORDER.flush()  # what module-level code built, attributed to no test
    _RECORDER.test = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    yield
    assert _RECORDER is not None
    _RECORDER.flush()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _RECORDER is not None:
        _RECORDER.test = "(session)"
        _RECORDER.flush()
        _RECORDER.write()
        _RECORDER.client.close()
