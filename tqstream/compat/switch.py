"""``TQSTREAM_TRANSFER_QUEUE=1``: ``import transfer_queue`` loads tqstream's compatibility layer.

With the variable on, ``transfer_queue`` and every ``transfer_queue.<name>`` resolve to
``tqstream.compat.transfer_queue[.<name>]`` — the same module objects, so classes and isinstance
checks agree whichever name imported them — in every Python process that sees the variable and has
tqstream installed, even where the ``transferqueue`` distribution is installed too::

    TQSTREAM_TRANSFER_QUEUE=1 python train.py
    ray.init(runtime_env={"env_vars": {"TQSTREAM_TRANSFER_QUEUE": "1"}})

Processes started later inherit it through their environment: Ray workers get the environment of
the raylet of their node (the driver's, for the node ``ray.init()`` starts) plus the runtime_env's
``env_vars``, which is how the variable reaches workers on other nodes or on a cluster started
before the driver.

It acts at interpreter start because tqstream installs ``tqstream-compat.pth`` into site-packages
(written by setup.py, for ``pip install`` and ``pip install -e`` alike). The .pth imports this
module only when the variable holds something other than an "off" value, so a process without it
pays one environment lookup. ``python -S`` reads no .pth; there, call :func:`install` before
anything imports transfer_queue.

On: ``1 true yes on``; off: unset, empty, ``0 false no off`` (any case). Anything else logs a
warning and leaves it off. The variable is read here (and in the .pth) rather than in
``tqstream.config`` because it has to act before any tqstream configuration exists.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import logging
    from collections.abc import Sequence
    from types import ModuleType

__all__ = ["ENV", "install", "maybe_install"]

ENV = "TQSTREAM_TRANSFER_QUEUE"
NAME = "transfer_queue"
TARGET = "tqstream.compat.transfer_queue"
# the .pth repeats _OFF so that a process where the switch is off never imports tqstream
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
_warned = False


def _log() -> logging.Logger:
    """logging loads only when there is something to say: the switch runs in every process."""
    import logging

    return logging.getLogger("tqstream.compat")


class _Redirect(MetaPathFinder, Loader):
    """Answers for ``transfer_queue[.x]`` ahead of every other finder.

    The loader lets importlib build a throwaway module, then puts the compat module in its
    ``sys.modules`` slot: importlib returns whatever that slot holds once ``exec_module`` is done,
    and the compat module keeps its own ``__spec__`` and ``__name__`` (pickles name it, not the
    alias).
    """

    def __init__(self) -> None:
        self._announced = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != NAME and not fullname.startswith(NAME + "."):
            return None
        alias = TARGET + fullname[len(NAME) :]
        spec = importlib.util.find_spec(alias)
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: {ENV} is on, so transfer_queue is tqstream's "
                f"TransferQueue compatibility layer, which has no module {alias!r}; unset {ENV} "
                f"(or set it to 0) to import the transferqueue package instead",
                name=fullname,
            )
        is_package = spec.submodule_search_locations is not None
        return ModuleSpec(fullname, self, origin=spec.origin, is_package=is_package)

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        name = module.__name__
        sys.modules[name] = importlib.import_module(TARGET + name[len(NAME) :])
        if name == NAME and not self._announced:
            self._announced = True
            real = PathFinder.find_spec(NAME)
            bypassed = ""
            if real is not None and real.origin:
                bypassed = f"; the transferqueue package at {real.origin} is not used"
            _log().info(
                "import transfer_queue resolved to tqstream's TransferQueue compatibility layer "
                "(%s), because %s=%s%s",
                TARGET,
                ENV,
                os.environ.get(ENV, ""),
                bypassed,
            )


def install() -> None:
    """Redirect ``transfer_queue`` imports in this process from now on; a second call does nothing.

    A process that has already imported the real transfer_queue keeps it (a warning says so):
    redirecting its submodules would mix two implementations.
    """
    if any(isinstance(finder, _Redirect) for finder in sys.meta_path):
        return
    loaded = sys.modules.get(NAME)
    if loaded is not None and loaded.__name__ != TARGET:
        _log().warning(
            "%s came too late for this process: transfer_queue was already imported from %s, so "
            "it stays that package here; set %s=1 in the environment the process starts with "
            "(tqstream-compat.pth then installs the switch at interpreter start)",
            ENV,
            getattr(loaded, "__file__", None) or loaded,
            ENV,
        )
        return
    sys.meta_path.insert(0, _Redirect())


def maybe_install() -> None:
    """Install the switch if ``TQSTREAM_TRANSFER_QUEUE`` is on; tqstream-compat.pth calls this.

    It may run twice in one process (``site`` reads a venv's site-packages twice on some Python
    versions), so it warns about a bad value once.
    """
    global _warned
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        install()
    elif value not in _OFF and not _warned:
        _warned = True
        _log().warning(
            "%s=%r is not a recognised value, so the switch stays off (transfer_queue is not "
            "redirected); on: %s; off: %s or unset",
            ENV,
            os.environ[ENV],
            ", ".join(_ON),
            ", ".join(v for v in _OFF if v),
        )
