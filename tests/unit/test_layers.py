"""Layering: a storage unit holds and ships columns and never loads the user-format conversion."""

from __future__ import annotations

import subprocess
import sys


def test_storage_unit_does_not_import_convert() -> None:
    """Importing the storage unit loads ``tqstream.protocol.columns`` and ``.wire`` but nothing of
    ``tqstream.convert`` (checked in a fresh interpreter: this one has imported everything)."""
    code = """
import sys
import tqstream.storage.service
assert "tqstream.protocol.columns" in sys.modules and "tqstream.protocol.wire" in sys.modules
print(sorted(m for m in sys.modules if m.split(".")[:2] == ["tqstream", "convert"]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
