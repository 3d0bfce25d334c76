"""The demo's verifiable task: addition, ``"a+b="`` -> ``"c"``, rewarded by exact match.

A randomly initialised model almost never writes the exact answer, so the reward has steps a
policy can climb from the start: 0.1 for answering with a digit, 0.4 more when the answer's digits
are right, 0.5 more when it then stops (the exact answer and the end of sequence: 1.0).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Problem", "problems", "reward"]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def problems(n: int, rng: random.Random, top: int = 10) -> list[Problem]:
    """``n`` problems ``a+b=`` with ``a + b < top``."""
    out = []
    for _ in range(n):
        a = rng.randrange(top)
        b = rng.randrange(top - a)
        out.append(Problem(f"{a}+{b}=", str(a + b)))
    return out


def reward(problem: Problem, completion: str, stopped: bool) -> float:
    """0.1 for a digit first, +0.4 for the right digits, +0.5 for stopping right after them."""
    if not completion[:1].isdigit():
        return 0.0
    r = 0.1
    if completion.startswith(problem.answer):
        r += 0.4
        if stopped and completion == problem.answer:
            r += 0.5
    return r
