"""``tqstream demo``: the reference loop on the embedded default, with a live view, a plot and a
summary.

Rollout worker processes (the pure-torch engine over a tiny Qwen2) generate answers to addition
problems and put them, one group per prompt, into an embedded tqstream; the trainer reads fresh
groups through a staleness window, runs decoupled PPO, and pushes its weights back over gloo.
``--max-staleness 0`` is the synchronous baseline: only rows of the current version are trained on.
Writes ``summary.json`` and ``progress.png`` (reward and version lag per step) into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from tqstream.reference.pipeline import PipelineConfig

    d = PipelineConfig()
    p = argparse.ArgumentParser(prog="tqstream demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers,
                   help="rollout worker processes (default: %(default)s)")  # fmt: skip
    p.add_argument("--max-staleness", type=int, default=d.max_staleness,
                   help="versions a trajectory may lag; 0: synchronous (%(default)s)")  # fmt: skip
    p.add_argument("--engine", choices=["torch", "vllm"], default=d.engine,
                   help="rollout engine; vllm needs vLLM (default: %(default)s)")  # fmt: skip
    p.add_argument("--sync-interval", type=int, default=d.sync_interval,
                   help="steps between weight syncs (default: %(default)s)")  # fmt: skip
    p.add_argument("--update-mode", choices=["keep", "abort"], default=d.update_mode,
                   help="generations in flight at a weight update (%(default)s)")  # fmt: skip
    p.add_argument("--proximal", choices=["recompute", "loglinear"], default=d.proximal,
                   help="proximal logprobs of decoupled PPO (default: %(default)s)")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("tqstream-demo"),
                   help="where summary.json and progress.png go (%(default)s)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no live view")
    return p


def _plot(summary: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step for h in summary.history]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [h.reward_mean for h in summary.history], label="reward (batch mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    lag = ax.twinx()
    lag.plot(steps, [h.max_lag for h in summary.history], color="tab:orange", alpha=0.6,
             label="max version lag")  # fmt: skip
    lag.set_ylabel("max version lag")
    lines = ax.get_legend_handles_labels(), lag.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="upper left")
    ax.set_title("tqstream demo: decoupled PPO on a tiny Qwen2, addition")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from tqstream.reference.pipeline import PipelineConfig, StepStats, run

    config = PipelineConfig(
        steps=args.steps, workers=args.workers, max_staleness=args.max_staleness,
        update_mode=args.update_mode, proximal=args.proximal, lr=args.lr, seed=args.seed,
        engine=args.engine, sync_interval=args.sync_interval,
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    live: Any = None
    if not args.quiet:
        from rich.live import Live
        from rich.table import Table

        def view(row: StepStats | None) -> Table:
            t = Table(title=f"tqstream demo — {config.workers} {config.engine} rollout workers, "
                            f"max_staleness {config.max_staleness}")  # fmt: skip
            for col in ("step", "version", "reward", "loss", "lag", "rows/s", "sync", "workers"):
                t.add_column(col, justify="right")
            if row is not None:
                t.add_row(f"{row.step + 1}/{config.steps}", str(row.version),
                          f"{row.reward_mean:.3f}", f"{row.loss:+.4f}", f"{row.max_lag:.0f}",
                          f"{row.rows_per_s:,.0f}", f"{row.sync_s * 1e3:.1f} ms",
                          str(row.workers))  # fmt: skip
            return t

        live = Live(view(None), refresh_per_second=4)
        live.start()

    def on_step(row: StepStats) -> None:
        if live is not None:
            live.update(view(row))

    try:
        summary = run(config, on_step=on_step)
    finally:
        if live is not None:
            live.stop()
    out = {k: v for k, v in dataclasses.asdict(summary).items() if k != "history"}
    out["config"] = dataclasses.asdict(config)
    out["history"] = [dataclasses.asdict(h) for h in summary.history]
    (args.out / "summary.json").write_text(json.dumps(out, indent=1))
    _plot(summary, args.out / "progress.png")
    print(
        f"{summary.steps} steps in {summary.seconds:.0f}s: reward {summary.reward_first:.3f} -> "
        f"{summary.reward_last:.3f}; produced {summary.produced}, trained {summary.trained}, "
        f"dropped as stale {summary.dropped}, left {summary.left}; max lag {summary.max_lag:.0f}; "
        f"workers replaced {summary.restarts}; "
        f"wrote {args.out / 'summary.json'} and {args.out / 'progress.png'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
