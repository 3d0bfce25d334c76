"""A ``RolloutWorkflow`` that stores what the workflow it wraps produces.

AReaL's executor keeps each episode's result in process memory until ``prepare_batch`` returns
it to the trainer in the same process. Wrapped, each accepted result is also put into tqstream
as one group of unpadded rows the moment the episode ends, so trainers anywhere read it through
the staleness window; the result is still returned, so the executor's own accounting is
unchanged.

Outcomes: a stored result is *accepted*; a ``None`` result, one ``should_accept_fn`` refuses, a
workflow that raises and a put that fails are *rejected* — nothing is stored and the rollout's
staleness budget comes back. Under AReaL's ``WorkflowExecutor`` the executor reports outcomes to
its staleness manager (a ``None`` return or an exception is a rejection there); run standalone,
give the wrapper the :class:`StalenessManager` and it reports them itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai.types import InteractionWithTokenLogpReward
from areal.infra import workflow_context
from areal.utils.data import concat_padded_tensors

from tqstream.adapters.areal.experience import ArealExperience
from tqstream.adapters.areal.staleness import StalenessManager
from tqstream.errors import InvalidRequestError, SchemaError
from tqstream.staleness import is_version

__all__ = ["ExperienceWorkflow"]


def _policy_version(engine: Any) -> int:
    get = getattr(engine, "get_version", None)
    version = get() if callable(get) else None
    if not is_version(version):
        raise InvalidRequestError(
            f"the inference engine passed to arun_episode gave policy version {version!r}; the "
            f"wrapper stores each trajectory under engine.get_version() (an int >= 0): call "
            f"engine.set_version(v) after each weight update"
        )
    return int(version)


def _as_tensors(traj: Any) -> Any:
    """Interaction dicts (OpenAI-style workflows) become the tensor dict AReaL's executor would
    build from them; string-only interactions cannot be trained on, so they cannot be stored."""
    if not isinstance(traj, dict) or not traj:
        return traj
    values = list(traj.values())
    if not all(isinstance(v, InteractionWithTokenLogpReward) for v in values):
        return traj
    if not all(v.has_tensor_data for v in values):
        raise SchemaError(
            "the workflow returned interactions without token data (an external API's "
            "strings); the AReaL adapter stores token trajectories only"
        )
    return concat_padded_tensors([v.to_tensor_dict() for v in values])


class ExperienceWorkflow(RolloutWorkflow):  # type: ignore[misc]
    """Wraps ``workflow``; each accepted ``arun_episode`` result is put into ``experience``.

    ``experience``: where results go (:class:`ArealExperience`). ``staleness_manager``: only when
    no ``WorkflowExecutor`` runs this workflow — the wrapper then reports each rollout's outcome
    itself (the caller calls ``on_rollout_submitted()`` before starting it, as the executor
    does). ``should_accept_fn``: AReaL's filter, applied *before* the put (pass it here, not to
    ``submit``/``prepare_batch``, whose filter runs after the rows are stored). ``group_id``: the
    group id from the episode's input (default: a fresh id per episode; ids must not repeat).
    ``timeout``: seconds a put may wait for room under storage quotas.

    ``stored`` / ``rejected`` / ``failed`` count episodes by outcome in this process.
    """

    def __init__(
        self, workflow: RolloutWorkflow, experience: ArealExperience, *,
        staleness_manager: StalenessManager | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_id: Callable[[dict[str, Any]], str] | None = None, timeout: float | None = None,
    ) -> None:  # fmt: skip
        if not isinstance(workflow, RolloutWorkflow):
            raise InvalidRequestError(
                f"ExperienceWorkflow wraps an AReaL RolloutWorkflow instance, got "
                f"{type(workflow).__name__}"
            )
        self.workflow, self.experience = workflow, experience
        self.staleness_manager, self.should_accept_fn = staleness_manager, should_accept_fn
        self.group_id, self.timeout = group_id, timeout
        self.stored = self.rejected = self.failed = 0

    def _check_owner(self) -> None:
        task = workflow_context.get().task_id
        if self.staleness_manager is not None and task is not None:
            raise InvalidRequestError(
                f"ExperienceWorkflow(staleness_manager=...) is running under a WorkflowExecutor "
                f"(task {task}), which reports rollout outcomes itself: each would count twice; "
                f"give the manager to WorkflowExecutor(staleness_manager=...) only"
            )

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        """Run the wrapped episode and store its result; returns it (None when rejected).

        The rows' version is ``engine.get_version()`` when the episode starts (the version the
        first token was generated with, unless per-token ``versions`` say otherwise), which is
        also their dispatch version. Exceptions propagate after the rollout is reported rejected.
        """
        self._check_owner()
        try:
            traj = await self._run(engine, data)
        except BaseException:
            self.failed += 1
            self._report(accepted=False)
            raise
        self._report(accepted=traj is not None)
        return traj

    async def _run(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        version = _policy_version(engine)
        traj = _as_tensors(await self.workflow.arun_episode(engine, data))
        if traj is None or (self.should_accept_fn is not None and not self.should_accept_fn(traj)):
            self.rejected += 1
            return None
        group = None if self.group_id is None else self.group_id(data)
        await self.experience.async_put_experience(
            traj, version, group=group, dispatch_version=version, timeout=self.timeout
        )
        self.stored += 1
        return traj

    def _report(self, accepted: bool) -> None:
        """End this rollout at the standalone manager (under an executor, the executor does)."""
        manager = self.staleness_manager
        if manager is None:
            return
        if accepted:  # counted here; it never waits for the controller
            manager.on_rollout_accepted()
        else:
            manager.on_rollout_rejected()
