"""verl 0.9.1's own ``tests/test_protocol_on_cpu.py``, unchanged, as the judge of the ``DataProto``
round trip.

The file comes from verl's sdist on the package index (it is not in the wheel), fetched at test
time, and runs in a pytest process of its own with the plugin ``verl_dataproto_recorder``: every
``DataProto`` verl's tests build goes through a tqstream cluster of real processes
(``dataproto_to_rows`` → put → get → ``rows_to_dataproto``) as it is built, and again in the state
its test leaves it in, and must come back equal (the plugin's ``difference``: exact types, dtypes,
shapes and bits), every one of them: those without rows (``test_len``, ``test_dataproto_no_batch``),
with two batch dims (``unfold_batch_dim``) and the ``[6]`` rows with ``[3, 2]`` labels that
``fold_batch_dim`` leaves in the ``DataProto`` it is given (``test_dataproto_fold_unfold``). verl's
own tests must pass too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("verl")

from tqstream.launch.processes import ProcessCluster

VERSION = "0.9.1"
FILE = "tests/test_protocol_on_cpu.py"
BUILT = 132
"""The ``DataProto``s verl 0.9.1's file builds (each constructor call, ``from_dict``, ``concat``,
``chunk``, ``select``, ... once)."""
VERL_PASSED = 38


def _verl_test_file(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
         "-d", str(dest), f"verl=={VERSION}"],
        check=True,
    )  # fmt: skip
    (sdist,) = dest.glob(f"verl-{VERSION}.tar.gz")
    target = dest / Path(FILE).name
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"verl-{VERSION}/{FILE}")
        assert member is not None
        target.write_bytes(member.read())
    return target


@pytest.mark.timeout(600)
def test_every_dataproto_verl_tests_build_round_trips(tmp_path: Path) -> None:
    test_file = _verl_test_file(tmp_path)
    report = tmp_path / "report.json"
    plugin_dir = str(Path(__file__).parent)
    with ProcessCluster(2) as cluster:
        env = {
            **os.environ,
            "VERL_ROUNDTRIP_ADDRESS": cluster.address,
            "VERL_ROUNDTRIP_REPORT": str(report),
            "PYTHONPATH": os.pathsep.join([plugin_dir, os.environ.get("PYTHONPATH", "")]),
        }
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
             "-p", "verl_dataproto_recorder", test_file.name],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540, check=False,
        )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None and int(passed.group(1)) == VERL_PASSED, summary
    doc = json.loads(report.read_text())
    print(
        f"verl {VERSION} {FILE}: {summary}; DataProtos built {doc['recorded']}, equal after the "
        f"round trip {doc['passed']}; at the end of their tests {doc['final_passed']} of "
        f"{doc['final']}"
    )
    assert doc["failures"] == []
    assert doc["recorded"] == doc["passed"] == BUILT
    assert doc["final"] == doc["final_passed"] == BUILT
