"""AReaL's ``StalenessManager``, built the way AReaL builds it, with its budget at the controller.

AReaL's ``WorkflowExecutor`` gives each data-parallel rank a manager with a share of the job's
limits (``max_concurrent_rollouts // dp``, ``consumer_batch_size // dp``), and each counts its
own rollouts. This subclass takes the same arguments and counts the same way, but keeps its
counts in a budget at the tqstream controller (``controller/budget.py``) that managers can share:
the members of a budget together behave like one AReaL manager with the summed limits, so a rank
with rollouts to run uses the capacity another leaves idle, while the job's concurrency and
staleness stay AReaL's. A manager that shares with nobody behaves exactly like AReaL's.

The four ``on_rollout_*`` callbacks only count (they never wait for the controller: the counts
follow in the background, ``client/budget.py``); ``get_capacity`` and ``get_stats`` ask the
controller, sending the counts along, so they count every callback made before them.

:func:`install` makes AReaL's own code build this class wherever it builds its own.
"""

from __future__ import annotations

import itertools
import os
import secrets
import sys
from typing import Any

from areal.api.io_struct import RolloutStat
from areal.infra import staleness_manager as _areal_module
from areal.infra.staleness_manager import StalenessManager as _AReaLStalenessManager

from tqstream.client.budget import BudgetMember
from tqstream.client.client import Client
from tqstream.config import AREAL_BUDGET_ENV, environment
from tqstream.errors import AdmissionError, ClosedError, InvalidRequestError
from tqstream.staleness import is_version

__all__ = ["StalenessManager", "install"]

_unnamed = itertools.count()  # managers this process built without a name


def _check_int(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise AdmissionError(
            f"StalenessManager needs an int {what} (got {value!r} of type "
            f"{type(value).__name__}); pass a whole number of rollouts or versions",
            key=what,
        )
    return value


def _budget_name(name: str | None) -> str:
    """``name``; else, with ``TQSTREAM_AREAL_BUDGET=B`` set, ``B`` for the first manager this
    process builds without a name, ``B.1``, ``B.2``... for the next (every rank builds its
    training executor's first, then its evaluation executor's); else a budget of its own."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise AdmissionError(f"StalenessManager name must be a non-empty str, got {name!r}")
        return name
    shared = environment(AREAL_BUDGET_ENV)
    k = next(_unnamed)
    if shared:
        return shared if k == 0 else f"{shared}.{k}"
    return f"areal-{os.getpid()}-{k}-{secrets.token_hex(3)}"


class StalenessManager(_AReaLStalenessManager):  # type: ignore[misc]
    """A drop-in for ``areal.infra.staleness_manager.StalenessManager`` (same arguments, methods
    and ``RolloutStat`` counts) whose budget lives at the tqstream controller.

    ``version_provider`` and the three limits: AReaL's, as ``WorkflowExecutor`` passes them (this
    manager's share; AReaL clamps the first two to at least 1 and so does this one, counting it
    as ``clamped``). ``client``: the tqstream client; by default the process's
    (``TQSTREAM_ADDRESS``, else a cluster embedded in the process). ``name``: the budget to share;
    managers with the same name, in any processes, pool their limits and counts (they must agree
    on ``max_staleness``). Without a name, ``TQSTREAM_AREAL_BUDGET`` names it (see
    :func:`_budget_name`), else the manager has a budget of its own.

    ``get_stats()`` / ``rollout_stat``: the budget's counts (every member's). Thread-safe.
    ``close()`` leaves the budget (so does the end of the process or of its connection): the
    manager's share and counts stop counting.
    """

    def __init__(
        self, version_provider: Any, max_concurrent_rollouts: int, consumer_batch_size: int,
        max_staleness: int, *, client: Client | None = None, name: str | None = None,
    ) -> None:  # fmt: skip
        limits = (max_concurrent_rollouts, consumer_batch_size, max_staleness)
        for what, value in zip(
            ("max_concurrent_rollouts", "consumer_batch_size", "max_staleness"), limits, strict=True
        ):
            _check_int(what, value)
        # AReaL's attributes, set as its __init__ does (its rollout_stat is a property here)
        self.version_provider = version_provider
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        if client is None:
            from tqstream.launch.default import default_client

            client = default_client()
        self.name = _budget_name(name)
        self.budget = BudgetMember(client, self.name, *limits)
        self.lock = self.budget.lock

    @property
    def rollout_stat(self) -> RolloutStat:  # type: ignore[override]
        """The budget's counts now (AReaL's attribute, read-only: a snapshot, as ``get_stats``)."""
        return self.get_stats()

    @property
    def client(self) -> Client:
        return self.budget.client

    def _version(self) -> int:
        version = self.version_provider.get_version()
        if not is_version(version):
            raise InvalidRequestError(
                f"version_provider.get_version() returned {version!r}; the staleness bound needs "
                f"the current policy version (an int >= 0): set it with engine.set_version(v)"
            )
        return int(version)

    def _check_open(self) -> None:
        if self.budget._left:
            raise ClosedError(f"StalenessManager {self.name!r} is closed; build a new one")

    def get_capacity(self) -> int:
        """AReaL's capacity at the version provider's version, over the whole budget. Negative
        after submissions beyond it, as in AReaL."""
        self._check_open()
        return int(self.budget.report(self._version()).capacity)  # type: ignore[arg-type]

    async def async_get_capacity(self) -> int:
        self._check_open()
        return int((await self.budget.async_report(self._version())).capacity)  # type: ignore[arg-type]

    def get_stats(self) -> RolloutStat:
        self._check_open()
        state = self.budget.state()
        return RolloutStat(
            accepted=int(state["accepted"]),
            enqueued=int(state["enqueued"]),
            rejected=int(state["rejected"]),
            running=int(state["running"]),
        )

    def on_version_recovered(self, version: int) -> None:
        """Restarted from the checkpoint of ``version``: this manager's ``accepted`` becomes
        ``version * max(1, consumer_batch_size)``, as in AReaL; the budget's is every member's."""
        if not is_version(version):
            raise InvalidRequestError(
                f"on_version_recovered needs the recovered policy version (an int >= 0), got "
                f"{version!r}"
            )
        self._check_open()
        b = self.budget
        with b.lock:
            b.accepted = int(version) * max(1, self.consumer_batch_size)
        b.report()

    # --- AReaL's callbacks: counted here, reported in the background ---
    def on_rollout_enqueued(self) -> None:
        b = self.budget
        with b.lock:
            b.enqueued += 1
            b.changed()

    def on_rollout_submitted(self) -> None:
        b = self.budget
        with b.lock:
            if b.enqueued <= 0:
                b.unmatched += 1  # a submission with no enqueued input: AReaL goes below 0 too
            b.enqueued -= 1
            b.running += 1
            b.changed()

    def on_rollout_accepted(self) -> None:
        b = self.budget
        with b.lock:
            if b.running <= 0:
                b.unmatched += 1  # an outcome with no running rollout
            b.running -= 1
            b.accepted += 1
            b.changed()

    def on_rollout_rejected(self) -> None:
        b = self.budget
        with b.lock:
            if b.running <= 0:
                b.unmatched += 1
            b.running -= 1
            b.rejected += 1
            b.changed()

    def close(self) -> None:
        """Leave the budget. Idempotent; the process's default cluster stays up."""
        self.budget.leave()


def install() -> None:
    """Make AReaL build this class wherever it builds its own ``StalenessManager``
    (``WorkflowExecutor.initialize()``, the rollout controllers): rebinds the name in AReaL's
    module and in every module that already imported it. Idempotent."""
    for module in [_areal_module, *list(sys.modules.values())]:
        if (
            getattr(module, "__name__", "").startswith("areal")
            and getattr(module, "StalenessManager", None) is _AReaLStalenessManager
        ):
            module.StalenessManager = StalenessManager  # type: ignore[attr-defined]
