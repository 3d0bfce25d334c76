"""Installs ``tqstream-compat.pth`` at the top of site-packages; the rest is in pyproject.toml.

The .pth is what lets ``TQSTREAM_TRANSFER_QUEUE=1`` act in every interpreter, Ray workers included
(tqstream/compat/switch.py). pyproject.toml cannot place a file outside a package, hence this
build sub-command, which ``pip install .`` and ``pip install -e .`` both run.
"""

from __future__ import annotations

import os
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build import build

PTH_NAME = "tqstream-compat.pth"
# Only lines starting with "import" run; the off values are switch._OFF, repeated here so that a
# process where the switch is off never imports tqstream. Sorting after "__editable__.*.pth"
# matters: an editable install makes tqstream importable from that file.
PTH = (
    "# TQSTREAM_TRANSFER_QUEUE=1: `import transfer_queue` loads tqstream.compat.transfer_queue "
    "(tqstream/compat/switch.py)\n"
    "import os; os.environ.get('TQSTREAM_TRANSFER_QUEUE', '').strip().lower() not in "
    "('', '0', 'false', 'no', 'off') and "
    "__import__('tqstream.compat.switch').compat.switch.maybe_install()\n"
)


class build_pth(Command):
    """Writes the .pth where the installer will copy it to the root of site-packages."""

    description = f"write {PTH_NAME}"
    user_options: ClassVar[list[tuple[str, str | None, str]]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        # A wheel holds build_lib. An editable wheel drops build_lib (the code stays in the
        # checkout) and is zipped from the tree that setuptools names as install's install_lib.
        root = self.build_lib
        if self.editable_mode:
            root = self.get_finalized_command("install").install_lib
        assert root is not None
        self.mkpath(root)
        with open(os.path.join(root, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(PTH)

    def get_outputs(self) -> list[str]:
        # in editable mode nothing lands in build_lib for setuptools to link or copy
        return [] if self.editable_mode else [os.path.join(self.build_lib or "", PTH_NAME)]

    def get_source_files(self) -> list[str]:
        return []


class build_with_pth(build):
    sub_commands: ClassVar = [*build.sub_commands, ("build_pth", None)]


setup(cmdclass={"build": build_with_pth, "build_pth": build_pth})
