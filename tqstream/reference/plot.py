"""``progress.png`` of ``tqstream demo``: what a run learned, how fast in wall-clock time, and how
stale its training data was.

Three panels: the batch reward and the held-out exact-match against steps (the exact-match of the
random model and after the format warm start drawn apart, at step 0); the held-out exact-match
against wall-clock seconds since the run started, for each run (``--compare``: the synchronous
baseline beside the asynchronous run), with the start-up and the format warm start shaded; the
distribution of the trained trajectories' version lag (by their oldest token), per run.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["plot"]

_COLORS = ("tab:blue", "tab:orange", "tab:green")


def plot(runs: list[tuple[str, Any]], path: Path) -> None:
    """Draw ``runs`` (name, ``Summary``) into ``path``; the last run is the main one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (by_step, by_time, lags) = plt.subplots(1, 3, figsize=(15, 4.6))
    name, main = runs[-1]
    steps = [h.step + 1 for h in main.history]
    by_step.plot(steps, [h.reward_mean for h in main.history], color="tab:gray", lw=1,
                 label="reward (batch mean)")  # fmt: skip
    evals = [(h.step + 1, h.eval) for h in main.history if h.eval is not None]
    by_step.plot([0] + [s for s, _ in evals], [main.eval_first] + [e for _, e in evals],
                 color="tab:blue", marker="o", ms=3, label="held-out exact-match")  # fmt: skip
    by_step.scatter([0], [main.eval_untrained], marker="x", color="tab:red", zorder=3,
                    label=f"random model: {main.eval_untrained:.2f}")  # fmt: skip
    by_step.annotate(f"after the format\nwarm start: {main.eval_first:.2f}", (0, main.eval_first),
                     xytext=(12, 70), textcoords="offset points", fontsize=8,
                     arrowprops={"arrowstyle": "->", "lw": 0.6})  # fmt: skip
    by_step.set(xlabel="trainer step", ylabel="reward / exact-match", ylim=(-0.02, 1.02),
                title=f"learning ({name})")  # fmt: skip
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_step.legend(loc="lower right", fontsize=8)
    by_step.grid(alpha=0.3)

    for (label, s), color in zip(runs, _COLORS, strict=False):
        points = [(s.rl_start_seconds, s.eval_first)]
        points += [(h.seconds, h.eval) for h in s.history if h.eval is not None]
        by_time.plot(*zip(*points, strict=True), color=color, marker="o", ms=3, label=label)
        by_time.axvspan(0, s.rl_start_seconds, color=color, alpha=0.08)
        if s.seconds_to_eval_0_8 is not None:
            by_time.axvline(s.seconds_to_eval_0_8, color=color, ls=":", lw=1)
    by_time.axhline(0.8, color="black", lw=0.6, ls="--")
    by_time.set(xlabel="wall-clock seconds since the run started", ylabel="held-out exact-match",
                ylim=(-0.02, 1.02), title="exact-match against time")  # fmt: skip
    by_time.legend(loc="lower right", fontsize=8)
    by_time.grid(alpha=0.3)
    by_time.text(0.01, 0.98, "shaded: start-up and\nformat warm start", transform=by_time.transAxes,
                 fontsize=7, va="top")  # fmt: skip

    width = 0.8 / len(runs)
    for i, ((label, s), color) in enumerate(zip(runs, _COLORS, strict=False)):
        counts: Counter[int] = Counter()
        for h in s.history:
            counts.update({int(k): v for k, v in h.lag_counts.items()})
        total = sum(counts.values()) or 1
        xs = sorted(counts)
        offset = (i - (len(runs) - 1) / 2) * width
        shares = [counts[x] / total for x in xs]
        lags.bar([x + offset for x in xs], shares, width=width, color=color, label=label)
    lags.set(xlabel="version lag of a trained trajectory (oldest token)",
             ylabel="share of trajectories", title="staleness of the training data")  # fmt: skip
    lags.xaxis.set_major_locator(MaxNLocator(integer=True))
    lags.set_ylim(0, 1.3)  # room above the bars for the legend
    lags.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    lags.legend(loc="upper center", fontsize=8)
    lags.grid(alpha=0.3, axis="y")
    fig.suptitle("tqstream demo: decoupled PPO on a tiny Qwen2, the nines' complement of 5-digit "
                 "numbers")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
