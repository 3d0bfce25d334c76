"""The reference loop: rollout worker processes and a trainer joined by tqstream and a weight sync.

::

    rollout worker k (process)                       trainer (this process)
      TorchEngine generates group_size samples       ExperienceDataset reads whole groups
      per prompt, per-token versions                 through the staleness window (head
      ExperienceWriter puts one group per call  -->  measure, stale rows dropped and counted)
      a thread receives weights and hands them       PPOTrainer.step, ack, version + 1
      to the engine at a step boundary          <--  WeightSender broadcasts the weights

Every trajectory is accounted for at the end: ``produced = trained + dropped + left`` (rows still
in the partition when the trainer stopped).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PipelineConfig", "StepStats", "Summary", "run"]

FIELDS = ["prompt_ids", "response_ids", "logprobs", "versions", "rewards"]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    steps: int = 20
    """Optimizer steps (= weight versions published)."""
    workers: int = 2
    """Rollout worker processes."""
    batch_groups: int = 4
    """Groups (prompts) per training batch."""
    group_size: int = 8
    """Samples per prompt (the GRPO group)."""
    max_staleness: int = 2
    """A trajectory whose oldest token is more versions behind than this is dropped, not trained on;
    0 is the synchronous baseline."""
    max_new_tokens: int = 3
    temperature: float = 1.0
    lr: float = 3e-3
    seed: int = 0
    update_mode: str = "keep"
    """What a weight update does to generations in flight: "keep" or "abort" (see engine.py)."""
    proximal: str = "recompute"
    timeout: float = 120.0
    """Seconds a read, a weight sync or a worker's start may take before the run fails."""
    partition: str = "rollouts"


@dataclasses.dataclass(frozen=True)
class StepStats:
    step: int
    version: int
    reward_mean: float
    loss: float
    max_lag: float
    rows_per_s: float
    sync_s: float


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
    seconds: float
    history: list[StepStats]


def _worker(
    address: str, port: int, rank: int, config: PipelineConfig, tok_dir: str, stop: Any
) -> None:
    from transformers import PreTrainedTokenizerFast

    from tqstream.adapters.torch import ExperienceWriter
    from tqstream.reference.engine import TorchEngine
    from tqstream.reference.task import problems, reward
    from tqstream.reference.tiny import tiny_model
    from tqstream.reference.weightsync import TorchCollective, WeightMeta, WeightReceiver

    torch.set_num_threads(1)
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    model = tiny_model(len(tok), seed=config.seed)
    engine = TorchEngine(
        model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=config.temperature,
        update_mode=config.update_mode, seed=config.seed * 1000 + rank,
    )  # fmt: skip
    group = TorchCollective(rank, 1 + config.workers, port=port, timeout=config.timeout)
    receiver = WeightReceiver(group, WeightMeta.of(model.state_dict()))
    version, weights = receiver.receive()  # the trainer's initial weights: every worker alike
    engine.load_weights({k: v.clone() for k, v in weights.items()}, version)

    def receive_forever() -> None:
        while True:  # the receive buffer is reused: the engine gets copies
            v, w = receiver.receive()
            engine.load_weights({k: t.clone() for k, t in w.items()}, v)

    threading.Thread(target=receive_forever, name="tqstream-weights", daemon=True).start()
    rng = random.Random(config.seed * 7919 + rank)
    with ExperienceWriter(address, partition=config.partition) as writer:
        k = 0
        while not stop.is_set():
            problem = problems(1, rng)[0]
            prompt = tok.encode(problem.prompt, add_special_tokens=False)
            prompts = [prompt] * config.group_size
            if config.update_mode == "abort":
                outs = engine.generate_resumed(prompts, config.max_new_tokens)
            else:
                outs = engine.generate(prompts, config.max_new_tokens)
            rows: dict[str, list[Any]] = {f: [] for f in FIELDS}
            for out in outs:
                tokens = [t for t in out.tokens if t != tok.eos_token_id]
                text = tok.decode(tokens)
                rows["prompt_ids"].append(torch.tensor(prompt))
                rows["response_ids"].append(torch.tensor(out.tokens))
                rows["logprobs"].append(torch.tensor(out.logprobs))
                rows["versions"].append(torch.tensor(out.versions, dtype=torch.int32))
                rows["rewards"].append(reward(problem, text, out.finish_reason == "stop"))
            writer.put_experience(rows, current_version=engine.version, group=f"w{rank}-{k}")
            k += 1


def run(
    config: PipelineConfig,
    client: Any = None,
    on_step: Callable[[StepStats], None] | None = None,
) -> Summary:
    """Run the loop on ``client``'s cluster (default: an embedded one) and return its summary."""
    import tqstream
    from tqstream import StalenessPolicy
    from tqstream.adapters.torch import ExperienceDataset, meta_of
    from tqstream.reference.tiny import tiny_model, tiny_tokenizer
    from tqstream.reference.trainer import PPOTrainer
    from tqstream.reference.weightsync import TorchCollective, WeightSender

    if config.workers < 1 or config.steps < 1:
        raise ValueError("a run needs at least one worker and one step")
    own = client is None
    client = tqstream.init() if own else client
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs: list[Any] = []
    tok_dir = tempfile.mkdtemp(prefix="tqstream-tok-")  # the tokenizer, for the workers to load
    t0 = time.perf_counter()
    try:
        torch.manual_seed(config.seed)
        tok = tiny_tokenizer(tok_dir)
        model = tiny_model(len(tok), seed=config.seed)
        trainer = PPOTrainer(model, pad_id=tok.pad_token_id, lr=config.lr,
                             temperature=config.temperature, proximal=config.proximal)  # fmt: skip
        group = TorchCollective(0, 1 + config.workers, timeout=config.timeout)
        client.create_partition(config.partition, FIELDS, tasks=["actor"],
                                producers=config.workers)  # fmt: skip
        for rank in range(1, config.workers + 1):
            args = (client.address, group.port, rank, config, tok_dir, stop)
            p = ctx.Process(target=_worker, name=f"tqstream-rollout-{rank}", args=args)
            p.start()
            procs.append(p)
        sender = WeightSender(group)
        sender.send(model.state_dict(), trainer.version)
        data = ExperienceDataset(
            client, FIELDS, config.batch_groups * config.group_size,
            partition=config.partition, task="actor", whole_groups=True, ack="manual",
            staleness=StalenessPolicy(max_staleness=config.max_staleness, measure="head",
                                      on_stale="drop"),
            version_fn=lambda: trainer.version, timeout=config.timeout,
        )  # fmt: skip
        history: list[StepStats] = []
        trained = 0
        batches = iter(data)
        last = time.perf_counter()
        for step in range(config.steps):
            batch = next(batches)
            meta = meta_of(batch)
            stats = trainer.step(
                list(batch["prompt_ids"].unbind()), list(batch["response_ids"].unbind()),
                list(batch["logprobs"].unbind()), list(batch["versions"].unbind()),
                batch["rewards"], meta.groups,
            )  # fmt: skip
            data.ack(batch)
            trained += len(meta.row_ids)
            t_sync = time.perf_counter()
            sender.send(model.state_dict(), trainer.version)
            now = time.perf_counter()
            rate = len(meta.row_ids) / (now - last)
            row = StepStats(step, trainer.version, stats["reward_mean"], stats["loss"],
                            stats["max_lag"], rate, now - t_sync)  # fmt: skip
            last = now
            history.append(row)
            if on_step is not None:
                on_step(row)
        stop.set()
        for p in procs:
            p.join(config.timeout)
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
            seconds=time.perf_counter() - t0,
            history=history,
        )
    finally:
        stop.set()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tok_dir, ignore_errors=True)
        if own:
            client.close()
