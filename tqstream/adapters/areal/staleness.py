"""AReaL's ``StalenessManager`` with its counters kept at the tqstream controller.

AReaL's own manager counts rollouts in one process: every data-parallel rank gets a share of the
budget (``max_concurrent_rollouts // dp``), and a restarted trainer starts from zero. This
subclass has the same methods and ``RolloutStat`` counters, but its ``running`` and ``accepted``
counts live in a capacity admission at the controller: one budget shared by every rank and
producer process, evaluated with AReaL's formula

    min(max_concurrent - running, (max_staleness + version + 1) * consumer_batch_size
        - (accepted + running))

and kept across a trainer restart (``on_version_recovered``). Inject it where AReaL builds its
own: ``WorkflowExecutor(config, engine, staleness_manager=StalenessManager(client, engine, ...))``.

AReaL's callbacks carry no rollout identity (``on_rollout_accepted()`` takes no argument) while
the controller counts slots by id, so each manager keeps the ids of its own running rollouts in
submission order and ends the oldest one at each outcome: rollouts are interchangeable in the
formula, so which id ends does not change any count.
"""

from __future__ import annotations

import collections
from typing import Any

from areal.api.io_struct import RolloutStat
from areal.infra.staleness_manager import StalenessManager as _AReaLStalenessManager

from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Client
from tqstream.errors import AdmissionError, InvalidRequestError

__all__ = ["StalenessManager"]


class StalenessManager(_AReaLStalenessManager):  # type: ignore[misc]
    """A drop-in for ``areal.infra.staleness_manager.StalenessManager`` backed by the controller.

    ``client``: a tqstream client. ``version_provider``: what AReaL passes (the inference engine;
    anything with ``get_version() -> int``). The three limits are AReaL's, **global**: the whole
    job's concurrency and batch size, never divided by the data-parallel size. Every process that
    builds a manager with the same ``name`` and limits shares one budget; other limits under the
    same name raise ``AdmissionError``, as do limits the formula cannot serve
    (``max_concurrent_rollouts < 1``, ``consumer_batch_size < 1``, ``max_staleness < 0``).

    ``get_stats()``: ``accepted``, ``rejected`` and ``running`` are the controller's (all
    processes); ``enqueued`` is this process's inputs waiting for submission, as in AReaL.
    Thread-safe: AReaL calls it from its submit thread and its event loop.
    """

    def __init__(
        self, client: Client, version_provider: Any, max_concurrent_rollouts: int,
        consumer_batch_size: int, max_staleness: int, *, name: str = "areal",
    ) -> None:  # fmt: skip
        super().__init__(version_provider, max_concurrent_rollouts, consumer_batch_size,
                         max_staleness)  # fmt: skip
        self.admission: AdmissionHandle = client.admission(
            "capacity",
            name=name,
            max_concurrent=max_concurrent_rollouts,
            max_staleness=max_staleness,
            consumer_batch_size=consumer_batch_size,
        )
        # AReaL's self.lock guards _running and _enqueued; never held across an await
        self._running: collections.deque[int] = collections.deque()  # this process's slot ids
        self._enqueued = 0
        self._published = -1  # newest version reported to the controller

    @classmethod
    def from_config(
        cls, client: Client, config: Any, version_provider: Any, *, name: str = "areal"
    ) -> StalenessManager:
        """From AReaL's ``InferenceEngineConfig``, read the way ``WorkflowExecutor`` reads it
        (``max_concurrent_rollouts or consumer_batch_size``, ``max_head_offpolicyness``) but not
        divided by the data-parallel size: the controller's budget is already global."""
        return cls(
            client,
            version_provider,
            config.max_concurrent_rollouts or config.consumer_batch_size,
            config.consumer_batch_size,
            config.max_head_offpolicyness,
            name=name,
        )

    def _version(self) -> int:
        version = self.version_provider.get_version()
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidRequestError(
                f"version_provider.get_version() returned {version!r}; the staleness bound needs "
                f"the current policy version (an int >= 0): set it with engine.set_version(v)"
            )
        if version > self._published:  # so the controller's stats show capacity at it
            self.admission.on_version(version)
            self._published = version
        return version

    def get_capacity(self) -> int:
        """AReaL's capacity at the version provider's current version, over every process's
        rollouts. May be negative after submissions beyond it, as in AReaL."""
        return self.admission.get_capacity(self._version())

    async def async_get_capacity(self) -> int:
        return await self.admission.async_get_capacity(self._version())

    def on_version_recovered(self, version: int) -> None:
        """Restarted from the checkpoint of ``version``: ``accepted = version * batch size``.

        The controller voids every slot issued before (a restarted job's rollouts are gone);
        rollouts this manager still runs take fresh slots, so ``running`` stays what AReaL's
        manager would keep. Call it at start-up, before rollouts run, as AReaL does.
        """
        with self.lock:
            self.admission.on_version_recovered(version)
            self._published = version
            self._running = collections.deque(
                self.admission.on_rollout_submitted() for _ in range(len(self._running))
            )

    def on_rollout_enqueued(self) -> None:
        with self.lock:
            self._enqueued += 1
        self.admission.on_rollout_enqueued()

    def on_rollout_submitted(self) -> None:
        """One running rollout, granted regardless of capacity: AReaL's executor checks
        ``get_capacity()`` first."""
        with self.lock:
            self._enqueued -= 1
            self._running.append(self.admission.on_rollout_submitted())

    def _pop(self, outcome: str) -> int:
        with self.lock:
            if not self._running:
                raise AdmissionError(
                    f"on_rollout_{outcome}() with no running rollout in this StalenessManager: "
                    f"call on_rollout_submitted() when a rollout starts, once per rollout"
                )
            return self._running.popleft()

    def on_rollout_accepted(self) -> None:
        self.admission.on_rollout_accepted(self._pop("accepted"))

    def on_rollout_rejected(self) -> None:
        """The rollout was filtered out or failed: its staleness budget comes back."""
        self.admission.on_rollout_rejected(self._pop("rejected"))

    async def async_on_rollout_accepted(self) -> None:
        await self.admission.async_release([self._pop("accepted")], "accepted")

    async def async_on_rollout_rejected(self) -> None:
        await self.admission.async_release([self._pop("rejected")], "rejected")

    def get_stats(self) -> RolloutStat:
        state = self.admission.state()
        with self.lock:
            enqueued = self._enqueued
        return RolloutStat(
            accepted=int(state["accepted"]),
            enqueued=enqueued,
            rejected=int(state["rejected"]),
            running=int(state["running"]),
        )
