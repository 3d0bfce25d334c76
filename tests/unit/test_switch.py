"""``TQSTREAM_TRANSFER_QUEUE`` in fresh interpreters, as a job's processes (Ray workers too) start.

Each check runs ``sys.executable -c`` with the variable set or removed, so what it sees is what
tqstream-compat.pth did at interpreter start. ``find_spec`` answers where ``import transfer_queue``
would go without importing it: the real package imports Ray, the compat layer torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from importlib.machinery import PathFinder
from pathlib import Path

import pytest

from tqstream.compat import switch

ENV = switch.ENV
COMPAT = Path(switch.__file__).parent / "transfer_queue"
LOG_LINE = "import transfer_queue resolved to tqstream's TransferQueue compatibility layer"
ORIGIN = "import importlib.util; print(importlib.util.find_spec('transfer_queue').origin)"


def _python(code: str, value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if value is not None:
        env[ENV] = value
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )


def _ok(code: str, value: str | None) -> subprocess.CompletedProcess[str]:
    out = _python(code, value)
    assert out.returncode == 0, out.stderr
    return out


def test_the_pth_is_installed() -> None:
    pth = Path(sysconfig.get_paths()["purelib"]) / "tqstream-compat.pth"
    assert pth.is_file(), "reinstall tqstream (pip install -e .) to get tqstream-compat.pth"
    lines = [line for line in pth.read_text().splitlines() if not line.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("import ") and ENV in lines[0]


def test_unset_keeps_the_transferqueue_package() -> None:
    real = PathFinder.find_spec("transfer_queue")
    if real is None:
        pytest.skip("the transferqueue distribution is not installed (the bench extra)")
    assert _ok(ORIGIN, None).stdout.strip() == real.origin


@pytest.mark.parametrize("value", ["1", "true", "YES", "On", " on "])
def test_on_resolves_to_the_compat_layer(value: str) -> None:
    assert _ok(ORIGIN, value).stdout.strip() == str(COMPAT / "__init__.py")


def test_processes_started_later_inherit_it() -> None:
    """A Ray worker gets its raylet's environment (or runtime_env's env_vars) the same way."""
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {ORIGIN!r}])"
    assert _ok(child, "1").stdout.strip() == str(COMPAT / "__init__.py")


def test_modules_are_the_compat_modules_and_one_line_says_so() -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import transfer_queue.metadata as m, transfer_queue\n"
        "import tqstream.compat.transfer_queue as tq\n"
        "import tqstream.compat.transfer_queue.metadata as c\n"
        "import transfer_queue.metadata\n"
        "from tqstream.compat import switch; switch.install(); switch.maybe_install()\n"
        "assert m is c and transfer_queue is tq and sys.modules['transfer_queue.metadata'] is c\n"
        "assert c.__name__ == c.__spec__.name == 'tqstream.compat.transfer_queue.metadata'\n"
        "try:\n"
        "    import transfer_queue.no_such_module\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, e, sep='\\n')\n"
    )
    out = _ok("import sys\n" + code, "1")
    name, message = out.stdout.strip().splitlines()
    assert name == "transfer_queue.no_such_module"
    assert "TransferQueue compatibility layer, which has no module" in message
    assert f"unset {ENV}" in message
    assert out.stderr.count(LOG_LINE) == 1, out.stderr


def test_an_unknown_value_warns_once_and_stays_off() -> None:
    code = "import sys; print([type(f).__module__ for f in sys.meta_path])"
    out = _ok(code, "maybe")
    assert "tqstream.compat.switch" not in out.stdout
    assert out.stderr.count(f"{ENV}='maybe' is not a recognised value") == 1, out.stderr
    assert "on: 1, true, yes, on; off: 0, false, no, off or unset" in out.stderr


@pytest.mark.parametrize("value", [None, *switch._OFF])
def test_off_never_loads_tqstream(value: str | None) -> None:
    """The .pth repeats the off values; a process where the switch is off must not pay for it."""
    code = "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'tqstream'))"
    assert _ok(code, value).stdout.strip() == "[]"


def test_importing_tqstream_redirects_nothing() -> None:
    code = (
        "import sys, tqstream, tqstream.compat.switch\n"
        "print([f for f in sys.meta_path if type(f).__module__.startswith('tqstream')])"
    )
    assert _ok(code, None).stdout.strip() == "[]"


def test_too_late_warns_and_keeps_the_loaded_package() -> None:
    """A module already in sys.modules stands for a transferqueue imported before the switch."""
    code = (
        "import sys, types; sys.modules['transfer_queue'] = types.ModuleType('transfer_queue')\n"
        "from tqstream.compat import switch; switch.install()\n"
        "print([type(f).__module__ for f in sys.meta_path])"
    )
    out = _ok(code, None)
    assert "tqstream.compat.switch" not in out.stdout
    assert f"{ENV} came too late for this process" in out.stderr
