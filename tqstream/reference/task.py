"""The demo's verifiable task: the nines' complement of a 5-digit number, ``"31415="`` ->
``"68584"`` (every digit ``d`` becomes ``9 - d``), rewarded by the digits it gets right.

An untrained policy writes the exact answer about once in 10⁵ tries, and a policy warm-started
only on the answer's *format* (five digits, then stop) about as rarely: what it learns beyond
that, it learns from the reward. Problems are drawn from the 10⁵ numbers less a fixed held-out
set, on which the trainer measures greedy exact-match: problems never trained on.

The reward: 0 unless the completion is five digits and then the end of sequence; else the
fraction of the five digits that are right (1.0 for the exact answer).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

__all__ = [
    "DIGITS", "HeldOut", "Problem", "exact", "format_answer", "format_examples", "held_out",
    "problems", "reward", "score",
]  # fmt: skip

DIGITS = 5
"""Digits of a problem's number and of its answer."""
_HELD_OUT_SEED = 20_261_127


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def _problem(x: int) -> Problem:
    digits = f"{x:0{DIGITS}d}"
    return Problem(f"{digits}=", "".join(str(9 - int(d)) for d in digits))


@cache
def _held_out_numbers(n: int) -> tuple[int, ...]:
    return tuple(random.Random(_HELD_OUT_SEED).sample(range(10**DIGITS), n))


def held_out(n: int = 256) -> list[Problem]:
    """The held-out problems (the same for every run): never drawn by :func:`problems`."""
    return [_problem(x) for x in _held_out_numbers(n)]


def problems(n: int, rng: random.Random, held: int = 256) -> list[Problem]:
    """``n`` training problems: numbers drawn uniformly from those not held out."""
    skip = set(_held_out_numbers(held))
    out: list[Problem] = []
    while len(out) < n:
        x = rng.randrange(10**DIGITS)
        if x not in skip:
            out.append(_problem(x))
    return out


def format_answer(rng: random.Random) -> str:
    """An answer of the right shape and random digits: what the format warm start teaches."""
    return "".join(str(rng.randrange(10)) for _ in range(DIGITS))


def format_examples(
    n: int, rng: random.Random, encode: Callable[[str], list[int]], eos_id: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The format warm start's examples: ``n`` training prompts and as many answers of the right
    shape with random digits, then the end of sequence (token ids)."""
    todo = problems(n, rng)
    answers = [[*encode(format_answer(rng)), eos_id] for _ in todo]
    return [encode(p.prompt) for p in todo], answers


def reward(problem: Problem, completion: str, stopped: bool) -> float:
    """The fraction of the answer's digits that are right, for a completion of exactly
    ``DIGITS`` digits followed by the end of sequence; 0 otherwise."""
    if not stopped or len(completion) != DIGITS or completion.strip("0123456789"):
        return 0.0
    return sum(a == b for a, b in zip(completion, problem.answer, strict=True)) / DIGITS


def exact(problem: Problem, completion: str, stopped: bool) -> bool:
    """The exact answer, then the end of sequence."""
    return stopped and completion == problem.answer


@dataclass(frozen=True)
class HeldOut:
    """A greedy evaluation on held-out problems."""

    exact: float
    """Exact-match: the answer, then the end of sequence."""
    digits: float
    """The digits right (the task's reward, averaged): 0.1 by chance for an answer of the right
    shape; less noisy than ``exact``, about whose fifth root it is."""


def score(
    todo: Sequence[Problem], completions: Sequence[Sequence[int]], eos_id: int,
    decode: Callable[[list[int]], str],
) -> HeldOut:  # fmt: skip
    """The evaluation of one completion (token ids, cut at the first ``eos_id``) per problem."""
    hits = digits = 0.0
    for problem, row in zip(todo, completions, strict=True):
        tokens = list(row)
        stopped = eos_id in tokens
        text = decode(tokens[: tokens.index(eos_id)] if stopped else tokens)
        hits += exact(problem, text, stopped)
        digits += reward(problem, text, stopped)
    return HeldOut(hits / len(todo), digits / len(todo))
