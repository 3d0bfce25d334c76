"""The reference loop: rollout worker processes and a trainer joined by tqstream and a weight sync.

::

    rollout worker k (process)                        trainer (this process)
      takes a group's admission slots per prompt,       format warm start (before any rollout)
      up to prompts_per_rollout prompts at a time       ExperienceDataset reads whole groups
      the engine (torch or vLLM) generates them in      through the staleness window (head
      one batch, per-token versions                     measure, stale rows dropped and counted)
      ExperienceWriter puts the groups, ends the slots -> PPOTrainer.step, ack, version + 1,
      a thread waits for the hub's announcement and     admission.on_version
      has the engine take part in the sync          <-- every sync_interval steps: WeightHub.send
                                                      every eval_every steps: greedy exact-match
                                                      on the held-out problems
                                                      a supervisor thread: a worker that died
                                                      gets its slots released and is replaced

Every trajectory is accounted for at the end: ``produced = trained + dropped + left`` (rows still
in the partition when the trainer stopped). The admission (AReaL's capacity rule, one slot per
row) keeps rollouts from running more than ``max_staleness + 1`` batches ahead of the trainer, so
the window rarely has anything to drop; a worker that dies gives its slots back and a new one
takes its place (it joins the weight hub as a new member; the dead one is dropped at the next
sync).

The loop drives a :class:`Learner`: :class:`TorchLearner` (above) or, with ``trainer="jax"``,
``tqstream.reference.jax.JaxLearner``: the flax twin of the model, converted from the same torch
weights, reading through the JAX adapter (a reader thread leases the next batch while this thread
pushes the weights), pushing ``torch_state_dict(params)`` through the same hub to the same
workers. Its rollouts are held by a per_version admission instead (JAX-vLLM's rule: at most a
weight update's rows start under each version, see :func:`admission_settings`), and a worker
whose slots were granted at a version it has not loaded yet waits for those weights first, so
the rows counted under a version are generated under it.

The task (``task.py``) is the nines' complement of 5-digit numbers. Before any rollout the trainer
is warm-started on the answer's *format* only (five random digits, then the end of sequence), so
that what the policy learns about the digits it learns from the reward, through tqstream; the
held-out exact-match is measured before and after the warm start and every ``eval_every`` steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tqstream.reference.config import FIELDS, POLL, PipelineConfig, PipelineError
from tqstream.reference.task import HeldOut, score

__all__ = [
    "HeldOut", "Learner", "PipelineConfig", "PipelineError", "StepStats", "Summary", "TorchLearner",
    "admission_settings", "evaluate", "group_rows", "rollout_rows", "run", "warm_start",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StepStats:
    step: int
    version: int
    reward_mean: float
    loss: float
    max_lag: float
    rows_per_s: float
    sync_s: float  # 0 on steps without a sync
    workers: int  # weight-hub members the last sync reached
    seconds: float = 0.0  # since the run started (model, warm start and workers included)
    eval: float | None = None  # held-out exact-match after this step, on evaluated steps
    eval_digits: float | None = None  # held-out digits right (greedy), on evaluated steps
    lag_counts: dict[int, int] = dataclasses.field(default_factory=dict)  # trajectories by lag
    grad_norm: float = 0.0  # the largest gradient norm of the step's epochs, before clipping


@dataclasses.dataclass(frozen=True)
class Summary:
    steps: int
    reward_first: float
    reward_last: float
    max_lag: float
    produced: int
    trained: int
    dropped: int
    left: int
    restarts: int  # rollout workers that died and were replaced
    seconds: float
    history: list[StepStats]
    eval_untrained: float = 0.0  # held-out exact-match of the random model
    eval_first: float = 0.0  # after the format warm start: where RL starts
    eval_last: float = 0.0  # after the last step
    warm_start_seconds: float = 0.0
    rl_start_seconds: float = 0.0  # since the run started: the first weight sync to the workers
    tokens_masked: int = 0  # generated tokens of trained trajectories outside the window (token)
    seconds_to_eval_0_8: float | None = None  # first evaluation at >= 0.8 (None: never)
    # the held-out answers' digits right (greedy): ~0.1 by chance, smoother than exact-match
    # (which is about its fifth power)
    eval_digits_first: float = 0.0
    eval_digits_last: float = 0.0


def rollout_rows(
    prompts: list[list[int]], outs: list[Any], rewards: list[float]
) -> dict[str, list[Any]]:
    """Completions (``Completion``), each of its own prompt, as the rows a worker puts."""
    return {
        "prompt_ids": [torch.tensor(p) for p in prompts],
        "response_ids": [torch.tensor(o.tokens) for o in outs],
        "logprobs": [torch.tensor(o.logprobs) for o in outs],
        "versions": [torch.tensor(o.versions, dtype=torch.int32) for o in outs],
        "rewards": list(rewards),
    }


def group_rows(prompt: list[int], outs: list[Any], rewards: list[float]) -> dict[str, list[Any]]:
    """One prompt's completions (``Completion``) as the rows a worker puts, field by field."""
    return rollout_rows([prompt] * len(outs), outs, rewards)


def _per_rollout(config: PipelineConfig) -> int:
    """Prompts a worker takes at most per rollout (so that a batch always fills)."""
    return min(config.prompts_per_rollout, config.batch_groups)


def admission_settings(config: PipelineConfig) -> tuple[str, dict[str, int]]:
    """The rollout admission's style and settings, in rows (one slot per trajectory: a worker takes
    a group's ``group_size`` slots at a time and its put ends one per row).

    - torch trainer, ``capacity`` (AReaL's rule): at most ``max_staleness + admission_slack + 1``
      batches beyond those trained on exist or are in flight, so rollouts run up to the window
      ahead of the trainer;
    - jax trainer, ``per_version`` (the JAX-vLLM rule): at most ``max_per_version`` rows start
      under each weight version, where ``update_interval`` (rows the trainer consumes between two
      weight pushes, ``batch_groups * group_size * sync_interval``) times ``1 + admission_slack``;
      ``MAX_STALENESS >= UPDATE_INTERVAL`` holds by construction. With no slack the rollouts make
      exactly the batches the trainer takes before its next push, under the newest weights."""
    rows = config.batch_groups * config.group_size
    if config.trainer == "jax":
        interval = rows * config.sync_interval
        return "per_version", {"max_per_version": interval * (1 + config.admission_slack),
                               "update_interval": interval}  # fmt: skip
    running = config.workers * config.group_size * _per_rollout(config)
    return "capacity", {"max_concurrent": running,
                        "max_staleness": config.max_staleness + config.admission_slack,
                        "consumer_batch_size": rows}  # fmt: skip


def _make_engine(config: PipelineConfig, model_dir: str, rank: int, tok: Any) -> Any:
    if config.engine == "vllm":
        from tqstream.reference.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir, eos_id=tok.eos_token_id, temperature=config.temperature,
            update_mode=config.update_mode, seed=config.seed * 1000 + rank,
        )  # fmt: skip
    from transformers import AutoModelForCausalLM

    from tqstream.reference.engine import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return TorchEngine(
        model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=config.temperature,
        update_mode=config.update_mode, seed=config.seed * 1000 + rank,
    )  # fmt: skip


def _worker(
    address: str, hub_port: int, rank: int, config: PipelineConfig, model_dir: str, stop: Any,
    slots: Any,
) -> None:  # fmt: skip
    import tqstream
    from tqstream.adapters.torch import ExperienceWriter
    from tqstream.reference.task import problems, reward
    from tqstream.reference.weightsync import WeightMeta, WeightSubscription

    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging

    logging.disable_progress_bar()

    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    engine = _make_engine(config, model_dir, rank, tok)
    try:
        with torch.device("meta"):  # what the trainer must send: its model's checkpoint names
            expected = WeightMeta.of(
                AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).state_dict()
            )
        sub = WeightSubscription("127.0.0.1", hub_port, timeout=config.timeout)
        kwargs: dict[str, Any] = {"timeout": config.timeout, "backend": config.backend}
        if config.engine == "vllm":
            kwargs["expected"] = expected
        engine.connect_weights("127.0.0.1", hub_port, sub.member, **kwargs)
        first = sub.next(stop)  # the trainer's current weights before the first rollout
        if first is None:
            return
        engine.sync_weights(first)

        def receive_forever() -> None:
            while (version := sub.next(stop)) is not None:
                engine.sync_weights(version)

        threading.Thread(target=receive_forever, name="tqstream-weights", daemon=True).start()
        client = tqstream.connect(address)
        style, settings = admission_settings(config)
        admission = client.admission(style, name="rollout", **settings)
        g = config.group_size
        per = g * _per_rollout(config)
        row = slice(rank * per, (rank + 1) * per)
        rng = random.Random(config.seed * 7919 + rank)
        # no close(): the trainer, not the producers, says when the stream ends
        writer = ExperienceWriter(client, partition=config.partition, admission=admission)
        k = 0
        while not stop.is_set():
            ids = _take_slots(admission, engine, g, per, stop, slots, row)
            if stop.is_set():
                break
            if style == "per_version":
                # slots granted at a version this engine has not loaded yet (the trainer publishes
                # it once its push is through, and a parked acquire is granted at it): wait for
                # those weights, so that the rows counted under a version are generated under it
                newest = int(admission.state()["version"])
                while engine.version < newest and not stop.is_set():
                    stop.wait(0.002)
            todo = problems(len(ids) // g, rng)
            prompts = [
                tok.encode(p.prompt, add_special_tokens=False) for p in todo for _ in range(g)
            ]
            outs = engine.rollout(prompts, config.max_new_tokens)
            rewards = [
                reward(todo[i // g], tok.decode([t for t in out.tokens if t != tok.eos_token_id]),
                       out.finish_reason == "stop")
                for i, out in enumerate(outs)
            ]  # fmt: skip
            groups = [f"w{rank}-{k}-{i // g}" for i in range(len(outs))]
            writer.put_experience(rollout_rows(prompts, outs, rewards),
                                  current_version=engine.version, groups=groups,
                                  slots=ids)  # fmt: skip
            slots[row] = [-1] * per
            k += 1
    finally:
        engine.close()


def _take_slots(
    admission: Any, engine: Any, g: int, most: int, stop: Any, slots: Any, row: slice
) -> list[int]:
    """Admission slots for whole groups of ``g`` rows: one group's as soon as the budget allows,
    then more groups' as far as it allows now, up to ``most`` rows. The budget grows by whole
    groups (capacity: by batches; per_version: by a weight update's rows per version) and every
    worker takes whole groups, so a group is never left half-held (two workers each holding half
    of the last group would wait on each other)."""
    import tqstream

    ids: list[int] = []

    def record() -> None:
        slots[row] = ids + [-1] * (most - len(ids))

    while (not ids or len(ids) % g) and not stop.is_set():
        with contextlib.suppress(tqstream.RequestTimeoutError):
            ids += admission.acquire(g - len(ids) % g, version=engine.version, timeout=0.5)
        record()
    while len(ids) < most and not stop.is_set():
        more = admission.try_acquire(g, version=engine.version)
        ids += more
        record()
        if len(more) < g:
            while len(ids) % g and not stop.is_set():  # finish the group begun
                with contextlib.suppress(tqstream.RequestTimeoutError):
                    ids += admission.acquire(g - len(ids) % g, version=engine.version, timeout=0.5)
                record()
            break
    return ids


class _Workers:
    """The rollout worker processes, and a supervisor thread that replaces a dead one (after
    releasing its admission slots: the capacity it held comes back)."""

    def __init__(self, config: PipelineConfig, address: str, hub_port: int, model_dir: str,
                 admission: Any) -> None:  # fmt: skip
        self.config, self.address, self.hub_port = config, address, hub_port
        self.model_dir = model_dir
        self.admission = admission
        self.ctx = multiprocessing.get_context("spawn")
        self.stop = self.ctx.Event()
        self.per = config.group_size * _per_rollout(config)  # slots a worker may hold
        slots = (config.workers + config.max_restarts) * self.per
        self.slots = self.ctx.Array("q", [-1] * slots, lock=False)
        self.procs: dict[int, Any] = {}
        self.restarts = 0
        self.error: str | None = None
        self._next = 0
        for _ in range(config.workers):
            self._start()
        self._watch = threading.Thread(target=self._supervise, name="tqstream-supervisor",
                                       daemon=True)  # fmt: skip
        self._watch.start()

    def _start(self) -> None:
        rank, self._next = self._next, self._next + 1
        args = (self.address, self.hub_port, rank, self.config, self.model_dir, self.stop,
                self.slots)  # fmt: skip
        p = self.ctx.Process(target=_worker, name=f"tqstream-rollout-{rank}", args=args)
        p.start()
        self.procs[rank] = p

    def _supervise(self) -> None:
        g = self.per
        while not self.stop.wait(0.2):
            for rank, p in list(self.procs.items()):
                if p.is_alive() or self.stop.is_set():
                    continue
                del self.procs[rank]
                held = [i for i in self.slots[rank * g : (rank + 1) * g] if i >= 0]
                if held:  # a second release of an id is a no-op: a put that ended them is fine
                    self.admission.release(held, "rejected")
                if self.restarts >= self.config.max_restarts:
                    self.error = (
                        f"rollout worker {rank} exited with code {p.exitcode}, and "
                        f"{self.restarts} were already replaced (max_restarts)"
                    )
                    continue
                self.restarts += 1
                self._start()

    def describe(self) -> str:
        """Which workers run, with the slots they hold (for an error message)."""
        held = {
            rank: sum(i >= 0 for i in self.slots[rank * self.per : (rank + 1) * self.per])
            for rank in self.procs
        }
        alive = ", ".join(
            f"{rank}: {'alive' if p.is_alive() else f'exit {p.exitcode}'}, {held[rank]} slots"
            for rank, p in sorted(self.procs.items())
        )
        return f"rollout workers {{{alive}}}, {self.restarts} replaced"

    def close(self) -> None:
        self.stop.set()
        self._watch.join(5)
        for p in self.procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _where_rows_are(client: Any, partition: str, admission: Any) -> str:
    """The partition's and the admission's counts (for an error message); never raises."""
    try:
        part = client.stats(partition).partitions[partition]
        task = part.tasks.get("actor")
        rows = (
            f"partition: {part.produced} produced, {part.stale_dropped} dropped as stale, "
            f"{part.pending_puts} puts pending"
        )
        if task is not None:
            rows += f", {task.available} available, {task.leased} leased, {task.consumed} trained"
        return f"{rows}; admission: {admission.state()}"
    except Exception as exc:  # the message must not hide the timeout behind another error
        return f"no stats: {type(exc).__name__}: {exc}"


def warm_start(trainer: Any, tok: Any, steps: int, rng: random.Random, batch: int = 128) -> None:
    """Supervised steps on the answer's *format* only: training prompts followed by random digits
    of the answer's length and the end of sequence. The policy learns to answer with five digits
    and stop, nothing about which digits (its exact-match stays near 10⁻⁵)."""
    from tqstream.reference.task import format_examples

    model = trainer.model
    model.train()
    for _ in range(steps):
        prompts, answers = format_examples(
            batch, rng, lambda text: tok.encode(text, add_special_tokens=False), tok.eos_token_id
        )
        logp, mask = trainer.logprobs([torch.tensor(p) for p in prompts],
                                      [torch.tensor(a) for a in answers])  # fmt: skip
        loss = -(torch.where(mask, logp, 0.0).sum() / mask.sum())
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        trainer.optimizer.step()
    model.eval()


@torch.no_grad()
def evaluate(model: Any, tok: Any, problems: list[Any], max_new_tokens: int) -> HeldOut:
    """Greedy answers to ``problems`` (all prompts of one length: one batch, KV cache), scored."""
    prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in problems]
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("evaluate needs prompts of one length (the demo's task has them)")
    ids = torch.tensor(prompts)
    out = torch.empty((len(prompts), 0), dtype=torch.long)
    past, step = None, ids
    for _ in range(max_new_tokens):
        res = model(input_ids=step, past_key_values=past, use_cache=True)
        past = res.past_key_values
        step = res.logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, step], dim=1)
    return score(problems, out.tolist(), tok.eos_token_id, tok.decode)


class Learner(Protocol):
    """What the loop drives: a trainer with its reads, its evaluation and its weights. The torch
    one is :class:`TorchLearner`; the JAX one ``tqstream.reference.jax.JaxLearner``."""

    @property
    def version(self) -> int: ...
    def evaluate(self, problems: list[Any]) -> HeldOut: ...
    def warm_start(self, rng: random.Random) -> None: ...
    def weights(self) -> dict[str, torch.Tensor]:
        """The weights to push, as the rollout workers' torch model names them."""
        ...

    def start(self, client: Any) -> None:
        """Open the reads (after the warm start and the first weight push)."""
        ...

    def next_batch(self) -> Any:
        """The next batch; ``RequestTimeoutError`` after ``POLL`` seconds without one (asking
        again goes on waiting)."""
        ...

    def train(self, batch: Any) -> tuple[dict[str, Any], Any]:
        """One step on ``batch``, acked: the step's statistics and the batch's ``BatchMeta``."""
        ...

    def close(self) -> None: ...


class TorchLearner:
    """``PPOTrainer`` on the Hugging Face model, reading through ``ExperienceDataset``."""

    def __init__(self, config: PipelineConfig, model: Any, tok: Any) -> None:
        from tqstream.reference.trainer import PPOTrainer

        self.config, self.model, self.tok = config, model, tok
        self.trainer = PPOTrainer(
            model, pad_id=tok.pad_token_id, lr=config.lr, temperature=config.temperature,
            proximal=config.proximal, epochs=config.epochs, entropy_coef=config.entropy_coef,
            max_grad_norm=config.max_grad_norm,
        )  # fmt: skip
        self._schedule: Any = None
        self._data: Any = None
        self._batches: Any = None

    @property
    def version(self) -> int:
        return self.trainer.version

    def evaluate(self, problems: list[Any]) -> HeldOut:
        return evaluate(self.model, self.tok, problems, self.config.max_new_tokens)

    def warm_start(self, rng: random.Random) -> None:
        warm_start(self.trainer, self.tok, self.config.warmup_steps, rng)
        # the learning rate decays to 0 over the run (cosine): a solved policy is not shaken
        # apart late by the few groups that still tell samples apart (Adam's normalised steps)
        self._schedule = (
            torch.optim.lr_scheduler.CosineAnnealingLR(self.trainer.optimizer, self.config.steps)
            if self.config.lr_schedule == "cosine"
            else torch.optim.lr_scheduler.ConstantLR(self.trainer.optimizer, factor=1.0)
        )

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def start(self, client: Any) -> None:
        from tqstream import StalenessPolicy
        from tqstream.adapters.torch import ExperienceDataset

        c = self.config
        self._data = ExperienceDataset(
            client, FIELDS, c.batch_groups * c.group_size,
            partition=c.partition, task="actor", whole_groups=True, ack="manual",
            staleness=StalenessPolicy(max_staleness=c.max_staleness, measure=c.measure,
                                      on_stale="drop"),
            version_fn=lambda: self.trainer.version, timeout=POLL,
        )  # fmt: skip
        self._batches = iter(self._data)

    def next_batch(self) -> Any:
        import tqstream

        try:
            return next(self._batches)
        except tqstream.RequestTimeoutError:
            self._batches = iter(self._data)
            raise

    def train(self, batch: Any) -> tuple[dict[str, Any], Any]:
        from tqstream.adapters.torch import meta_of

        meta = meta_of(batch)
        fresh = list(batch["fresh_mask"].unbind()) if self.config.measure == "token" else None
        stats = self.trainer.step(
            list(batch["prompt_ids"].unbind()), list(batch["response_ids"].unbind()),
            list(batch["logprobs"].unbind()), list(batch["versions"].unbind()),
            batch["rewards"], meta.groups, fresh=fresh,
        )  # fmt: skip
        self._schedule.step()
        self._data.ack(batch)
        return stats, meta

    def close(self) -> None:
        pass


def _learner(config: PipelineConfig, model: Any, tok: Any) -> Learner:
    if config.trainer == "jax":
        from tqstream.reference.jax import JaxLearner

        return JaxLearner(config, model, tok)
    return TorchLearner(config, model, tok)


def run(
    config: PipelineConfig,
    client: Any = None,
    on_step: Callable[[StepStats], None] | None = None,
) -> Summary:
    """Run the loop on ``client``'s cluster (default: an embedded one) and return its summary."""
    import tqstream
    from tqstream.reference.task import held_out
    from tqstream.reference.tiny import tiny_model, tiny_tokenizer
    from tqstream.reference.weightsync import WeightHub

    config.check()
    from transformers.utils import logging

    logging.disable_progress_bar()
    own = client is None
    client = tqstream.init() if own else client
    workers: _Workers | None = None
    hub: WeightHub | None = None
    learner: Learner | None = None
    model_dir = tempfile.mkdtemp(prefix="tqstream-model-")  # tokenizer and initial weights
    t0 = time.perf_counter()
    try:
        torch.manual_seed(config.seed)
        tok = tiny_tokenizer(model_dir)
        model = tiny_model(len(tok), seed=config.seed)
        model.save_pretrained(model_dir)
        learner = _learner(config, model, tok)  # the JAX one starts from these weights too
        hub = WeightHub(timeout=config.timeout, backend=config.backend)
        style, settings = admission_settings(config)
        admission = client.admission(style, name="rollout", **settings)
        client.create_partition(config.partition, FIELDS, tasks=["actor"], admission="rollout")
        workers = _Workers(config, client.address, hub.port, model_dir, admission)
        # while the workers start: the held-out score of the random model, the format warm start
        # (the workers get its weights with the first sync, before their first rollout)
        held = held_out(config.eval_problems)
        eval_untrained = learner.evaluate(held)
        warm = time.perf_counter()
        learner.warm_start(random.Random(config.seed))
        warm_seconds = time.perf_counter() - warm
        eval_first = learner.evaluate(held)
        hub.wait_members(config.workers)
        sync = hub.send(learner.weights(), learner.version)
        rl_start = time.perf_counter() - t0
        learner.start(client)
        history: list[StepStats] = []
        latest = eval_first  # the last evaluation
        trained = masked = 0
        last = time.perf_counter()
        for step in range(config.steps):
            deadline = time.monotonic() + config.timeout
            while True:  # in slices: a run whose workers are gone for good fails at once
                if workers.error is not None:
                    raise PipelineError(workers.error)
                try:
                    batch = learner.next_batch()
                    break
                except tqstream.RequestTimeoutError as exc:
                    if time.monotonic() > deadline:
                        raise tqstream.RequestTimeoutError(
                            f"the trainer got no batch within {config.timeout}s at version "
                            f"{learner.version} ({workers.describe()}; "
                            f"{_where_rows_are(client, config.partition, admission)}): {exc}"
                        ) from exc
            stats, meta = learner.train(batch)
            trained += len(meta.row_ids)
            masked += meta.tokens_masked
            sync_s = 0.0
            if (step + 1) % config.sync_interval == 0 or step + 1 == config.steps:
                # the reads go on meanwhile where the learner reads ahead (the JAX iterator's
                # prefetch thread leases the next batch while this thread pushes the weights)
                sync = hub.send(learner.weights(), learner.version)
                sync_s = sync.seconds
                # the budget moves with the weights the rollouts hold, not the trainer's
                # version: opened earlier, it would admit work done under the old weights
                admission.on_version(learner.version)
            due = config.eval_every and (step + 1) % config.eval_every == 0
            scored = learner.evaluate(held) if due or step + 1 == config.steps else None
            latest = scored or latest
            now = time.perf_counter()
            rate = len(meta.row_ids) / (now - last)
            row = StepStats(
                step, learner.version, stats["reward_mean"], stats["loss"], stats["max_lag"],
                rate, sync_s, sync.receivers, seconds=now - t0,
                eval=None if scored is None else scored.exact,
                eval_digits=None if scored is None else scored.digits,
                lag_counts=stats["lag_counts"], grad_norm=stats["grad_norm"],
            )  # fmt: skip
            last = now
            history.append(row)
            if on_step is not None:
                on_step(row)
        learner.close()  # batches read ahead go back to the partition: they count as left
        workers.close()
        part = client.stats(config.partition).partitions[config.partition]
        produced, dropped = part.produced, part.stale_dropped
        first = history[: max(1, len(history) // 5)]
        final = history[-max(1, len(history) // 5) :]
        return Summary(
            steps=config.steps,
            reward_first=sum(h.reward_mean for h in first) / len(first),
            reward_last=sum(h.reward_mean for h in final) / len(final),
            max_lag=max(h.max_lag for h in history),
            produced=produced,
            trained=trained,
            dropped=dropped,
            left=produced - trained - dropped,
            restarts=workers.restarts,
            seconds=time.perf_counter() - t0,
            history=history,
            eval_untrained=eval_untrained.exact,
            eval_first=eval_first.exact,
            eval_last=latest.exact,
            warm_start_seconds=warm_seconds,
            rl_start_seconds=rl_start,
            tokens_masked=masked,
            seconds_to_eval_0_8=next(
                (h.seconds for h in history if h.eval is not None and h.eval >= 0.8), None
            ),
            eval_digits_first=eval_first.digits,
            eval_digits_last=latest.digits,
        )
    finally:
        if learner is not None:
            learner.close()
        if workers is not None:
            workers.close()
        if hub is not None:
            hub.close()
        shutil.rmtree(model_dir, ignore_errors=True)
        if own:
            client.close()
