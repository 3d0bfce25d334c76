"""TransferQueue 0.1.11's own tests of its public API, unchanged, on tqstream.

The test files come from the ``transferqueue`` wheel (installed by the ``bench`` extra, which
carries its ``tests/``; downloaded from the package index when it is not installed) and run in a
pytest process of their own with ``TQSTREAM_TRANSFER_QUEUE=1``: ``import transfer_queue`` in that
process and in the Ray workers its tests start is tqstream's compatibility layer.

Run: the KV interface, the lifecycle (client API), the checkpoint and the metadata tests. Left
out, each for the reason given in ``LEFT_OUT``: tests that assert TransferQueue's own files on
disk or patch its internals. The rest of TransferQueue's tests exercise its controller, storage
units, samplers, wire protocol and other backends, none of which tqstream has.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

VERSION = "0.1.11"
FILES = [
    "tests/test_metadata.py",
    "tests/e2e/test_kv_interface_e2e.py",
    "tests/e2e/test_e2e_lifecycle_consistency.py",
    "tests/e2e/test_checkpoint_e2e.py",
]
LEFT_OUT = {
    "tests/test_metadata.py::TestStorageUnitDataStrict::test_put_data_length_mismatch_raises":
        "TransferQueue's storage unit class, not metadata",
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_tensor_fields":
        "TransferQueue's checkpoint files (controller_state.pkl, simple_storage/)",
    "tests/e2e/test_checkpoint_e2e.py::TestIncludeStorageFalse::test_storage_saved_is_true":
        "TransferQueue's checkpoint files (simple_storage/)",
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors::test_save_raises_if_not_initialized":
        "patches transfer_queue.interface._TQ_CONTROLLER",
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors::test_load_raises_if_not_initialized":
        "patches transfer_queue.interface._TQ_CONTROLLER",
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors::"
    "test_load_raises_on_storage_unit_count_mismatch":
        "edits TransferQueue's simple_storage/storage_unit_info.json",
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors::test_no_partial_state_on_failed_save":
        "patches TransferQueueClient.save_storage_checkpoint",
}  # fmt: skip
EXPECTED_PASSED = 121  # every test of FILES but LEFT_OUT (and 2 that need CUDA)


def _wheel_tests(dest: Path) -> None:
    """Copy ``FILES`` of the transferqueue distribution to ``dest``."""
    try:
        dist = importlib.metadata.distribution("transferqueue")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version == VERSION:
        for name in FILES:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(str(dist.locate_file(name))), target)
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
         f"transferqueue=={VERSION}"],
        check=True,
    )  # fmt: skip
    (wheel,) = dest.glob("transferqueue-*.whl")
    with zipfile.ZipFile(wheel) as z:
        for name in FILES:
            z.extract(name, dest)


def test_transferqueue_public_api_tests_pass_on_tqstream(tmp_path: Path) -> None:
    _wheel_tests(tmp_path)
    env = {**os.environ, "TQSTREAM_TRANSFER_QUEUE": "1", "RAY_DEDUP_LOGS": "0"}
    deselect = [arg for test in LEFT_OUT for arg in ("--deselect", test)]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         *FILES, *deselect],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    counts = {
        kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|error|skipped)", summary)
    }
    print(f"TransferQueue {VERSION} public-API tests on tqstream: {summary}")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert counts.get("passed") == EXPECTED_PASSED, summary
    assert "failed" not in counts and "error" not in counts, summary


def test_the_switch_is_what_the_suite_imports(tmp_path: Path) -> None:
    """The run above imports tqstream's layer, not the installed transferqueue package."""
    code = "import transfer_queue as tq; print(tq.__name__, tq.__version__)"
    env = {**os.environ, "TQSTREAM_TRANSFER_QUEUE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["tqstream.compat.transfer_queue", VERSION]


pytestmark = pytest.mark.timeout(900)
