"""tqstream demo: the reference loop on the embedded default, with a live view, a plot and a
summary.

Rollout worker processes (a pure-torch engine over a tiny Qwen2, or vLLM) answer problems of a
verifiable task (the nines' complement of 5-digit numbers: 31415= -> 68584) and put their
answers, one group per prompt, into an embedded tqstream; the trainer reads fresh groups through
a staleness window, runs decoupled PPO, pushes its weights back over gloo, and every few steps
measures greedy exact-match on problems it never trains on. Before any rollout it is warm-started
on the answer's format only (five random digits, then stop): the digits it learns from the
reward. --max-staleness 0 is the synchronous baseline; --compare runs it and then the
asynchronous run, and plots both against wall-clock time.

Writes summary.json and progress.png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]

_NEEDS = ("transformers", "tokenizers", "matplotlib", "rich")
PROGRESS_EVERY = 10
"""Steps between two progress lines when the output is not a terminal (no live view there)."""
_NEEDS_JAX = ("jax", "flax", "optax")


def _count(least: int) -> Any:
    """An argparse type: an int >= ``least`` (else argparse's usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tqstream demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--steps",
        type=_count(1),
        default=300,
        help="trainer steps, one weight version each (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=_count(1),
        default=2,
        help="rollout worker processes (default: %(default)s)",
    )
    p.add_argument(
        "--max-staleness",
        type=_count(0),
        default=2,
        help="versions a trajectory may lag behind the trainer; 0 is the synchronous "
        "baseline (default: %(default)s)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="run the synchronous baseline (--max-staleness 0), then this run, and plot "
        "both against wall-clock time",
    )
    p.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default="torch",
        help="rollout engine; vllm needs vLLM (default: %(default)s)",
    )
    p.add_argument(
        "--trainer",
        choices=["torch", "jax"],
        default="torch",
        help="the trainer: PPO in torch, or its JAX twin (flax, optax; reads through the JAX "
        "adapter, rollouts held by a per-version admission); jax needs the jax extra "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--sync-interval",
        type=_count(1),
        default=1,
        help="steps between weight syncs (default: %(default)s)",
    )
    p.add_argument(
        "--update-mode",
        choices=["keep", "abort"],
        default="keep",
        help="what a weight update does to generations in flight: keep them going "
        "under the new weights, or abort and resubmit them (default: %(default)s)",
    )
    p.add_argument(
        "--measure",
        choices=["head", "token"],
        default="head",
        help="how the window measures a trajectory: by its oldest token (a stale trajectory is "
        "dropped whole), or token by token (the stale tokens of a trajectory that spans weight "
        "updates are masked out of the loss) (default: %(default)s)",
    )
    p.add_argument(
        "--admission-slack",
        type=_count(0),
        default=0,
        help="versions beyond --max-staleness the admission lets rollouts run ahead: more "
        "overlap of generation and training, and more for the window to drop or mask "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--proximal",
        choices=["recompute", "loglinear"],
        default="recompute",
        help="proximal logprobs of decoupled PPO: a forward pass, or AReaL's log-linear "
        "approximation (default: %(default)s)",
    )
    p.add_argument(
        "--lr", type=_positive_float, default=3e-4, help="learning rate (default: %(default)s)"
    )
    p.add_argument(
        "--max-grad-norm",
        type=_positive_float,
        default=None,
        help="clip each optimizer step's gradient to this global norm (default: no clipping)",
    )
    p.add_argument(
        "--seed",
        type=_count(0),
        default=0,
        help="seed of the model, the problems and the sampling (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("tqstream-demo"),
        help="directory for summary.json and progress.png (default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no live view")
    return p  # fmt: skip


def _missing(names: tuple[str, ...] = _NEEDS) -> list[str]:
    """The packages of ``names`` (default: the reference extra) that cannot be imported."""

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    return [name for name in names if not found(name)]


def _config(args: argparse.Namespace, max_staleness: int, slack: int) -> Any:
    from tqstream.reference.pipeline import PipelineConfig

    return PipelineConfig(
        steps=args.steps, workers=args.workers, max_staleness=max_staleness,
        update_mode=args.update_mode, proximal=args.proximal, lr=args.lr, seed=args.seed,
        engine=args.engine, trainer=args.trainer, sync_interval=args.sync_interval,
        measure=args.measure,
        admission_slack=slack, max_grad_norm=args.max_grad_norm,
    )  # fmt: skip


def _run(config: Any, quiet: bool, title: str) -> Any:
    """One run with its live view (unless ``quiet``)."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from tqstream.reference.pipeline import StepStats, run

    console = Console()
    live: Any = None
    last_eval: list[float | None] = [None]

    def view(row: StepStats | None) -> Table:
        t = Table(title=title)
        for col in ("step", "version", "reward", "held-out", "loss", "lag", "rows/s", "sync",
                    "workers"):  # fmt: skip
            t.add_column(col, justify="right")
        if row is not None:
            score = last_eval[0]
            t.add_row(
                f"{row.step + 1}/{config.steps}", str(row.version), f"{row.reward_mean:.3f}",
                "-" if score is None else f"{score:.2f}", f"{row.loss:+.4f}",
                f"{row.max_lag:.0f}", f"{row.rows_per_s:,.0f}", f"{row.sync_s * 1e3:.1f} ms",
                str(row.workers),
            )  # fmt: skip
        return t

    if not quiet and console.is_terminal:
        live = Live(view(None), console=console, refresh_per_second=4)
        live.start()

    def on_step(row: StepStats) -> None:
        if row.eval is not None:
            last_eval[0] = row.eval
        if live is not None:
            live.update(view(row))
        elif not quiet and (row.eval is not None or (row.step + 1) % PROGRESS_EVERY == 0
                            or row.step + 1 == config.steps):  # fmt: skip
            # not a terminal (a log file, CI): a line now and then instead of the live view
            score = last_eval[0]
            print(
                f"step {row.step + 1}/{config.steps}  version {row.version}  "
                f"reward {row.reward_mean:.3f}  held-out {'-' if score is None else f'{score:.2f}'}"
                f"  loss {row.loss:+.4f}  lag {row.max_lag:.0f}  {row.rows_per_s:,.0f} rows/s  "
                f"{row.seconds:.0f} s",
                flush=True,
            )

    try:
        return run(config, on_step=on_step)
    finally:
        if live is not None:
            live.stop()
            if not console.is_terminal:
                print()  # the last frame has no line break of its own there


def _doc(summary: Any, config: Any) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(summary).items() if k != "history"}
    out["seconds_to_eval_0.8"] = out.pop("seconds_to_eval_0_8")
    out["config"] = dataclasses.asdict(config)
    out["history"] = [dataclasses.asdict(h) for h in summary.history]
    return out


def _line(name: str, s: Any) -> str:
    to = s.seconds_to_eval_0_8
    reached = f"0.8 after {to:.0f}s" if to is not None else "0.8 not reached"
    return (
        f"{name}{s.steps} steps in {s.seconds:.0f}s: held-out exact-match {s.eval_untrained:.2f} "
        f"untrained, {s.eval_first:.2f} after the format warm start ({s.warm_start_seconds:.0f}s), "
        f"{s.eval_last:.2f} at the end ({reached}); held-out digits right "
        f"{s.eval_digits_first:.2f} -> {s.eval_digits_last:.2f}; reward {s.reward_first:.3f} -> "
        f"{s.reward_last:.3f}; produced {s.produced}, trained {s.trained}, dropped as stale "
        f"{s.dropped}, left {s.left}; tokens masked {s.tokens_masked}; max lag "
        f"{s.max_lag:.0f}; workers replaced {s.restarts}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    missing = _missing()
    if missing:
        print(
            f"tqstream demo: needs {', '.join(missing)} (the reference extra): "
            f"pip install 'tqstream[reference]'",
            file=sys.stderr,
        )
        return 1
    missing = _missing(_NEEDS_JAX) if args.trainer == "jax" else []
    if missing:
        print(
            f"tqstream demo --trainer jax: needs {', '.join(missing)} (the jax extra): "
            f'pip install "tqstream[jax]"',
            file=sys.stderr,
        )
        return 1
    from tqstream.reference.plot import plot

    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, Any, Any]] = []
    if args.compare:
        base = _config(args, 0, 0)  # synchronous: nothing runs ahead
        runs.append(("synchronous", base, _run(base, args.quiet, _title(args, base, "1/2 "))))
    config = _config(args, args.max_staleness, args.admission_slack)
    label = "asynchronous" if config.max_staleness else "synchronous"
    title = _title(args, config, "2/2 " if args.compare else "")
    runs.append((label, config, _run(config, args.quiet, title)))
    doc = _doc(runs[-1][2], config)
    if args.compare:
        (_, base, base_summary), (_, _, summary) = runs
        doc["compare"] = {"baseline": _doc(base_summary, base)}
        a, b = summary.seconds_to_eval_0_8, base_summary.seconds_to_eval_0_8
        doc["compare"]["speedup_to_eval_0.8"] = b / a if a and b else None
    (args.out / "summary.json").write_text(json.dumps(doc, indent=1))
    plot([(f"{name}, max_staleness {c.max_staleness}", s) for name, c, s in runs],
         args.out / "progress.png")  # fmt: skip
    for name, _, s in runs:
        print(_line(f"{name}: " if args.compare else "", s))
    if args.compare:
        speedup = doc["compare"]["speedup_to_eval_0.8"]
        print(
            "time to held-out exact-match 0.8, synchronous / asynchronous: "
            + ("-" if speedup is None else f"{speedup:.2f}x")
        )
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'progress.png'}")
    return 0


def _title(args: argparse.Namespace, config: Any, prefix: str) -> str:
    return (
        f"{prefix}tqstream demo — {config.workers} {config.engine} rollout workers, "
        f"{config.trainer} trainer, max_staleness {config.max_staleness}"
    )


if __name__ == "__main__":
    sys.exit(main())
