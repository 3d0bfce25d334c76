"""The pooled StalenessManager budget (``controller/budget.py``), without sockets: members' shares
and counts add up, late reports change nothing, a member that leaves takes its share with it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tqstream.controller.budget import Budgets
from tqstream.errors import AdmissionError


def areal_capacity(mc: int, bs: int, staleness: int, version: int, acc: int, run: int) -> int:
    """AReaL's get_capacity, transcribed."""
    return min(max(1, mc) - run, (staleness + version + 1) * max(1, bs) - (acc + run))


def test_shares_and_counts_add_up() -> None:
    b = Budgets()
    b.report("job", 1, "rank0", (4, 2, 1), 1, (1, 3, 5, 0), 0)
    budget = b.report("job", 2, "rank1", (4, 2, 1), 1, (0, 1, 2, 1), 0)
    assert budget is not None
    assert budget.capacity(3) == areal_capacity(8, 4, 1, 3, 7, 4)
    state = budget.state()
    assert (state["members"], state["running"], state["accepted"], state["rejected"]) == (
        2,
        4,
        7,
        1,
    )


def test_a_late_report_changes_nothing() -> None:
    b = Budgets()
    b.report("job", 1, None, (4, 2, 1), 2, (0, 2, 0, 0), 0)
    budget = b.report("job", 1, None, (4, 2, 1), 1, (0, 1, 0, 0), 0)  # overtaken
    assert budget is not None and budget.state()["running"] == 2


def test_a_member_that_leaves_takes_its_share() -> None:
    b = Budgets()
    b.report("job", 1, "rank0", (4, 2, 1), 1, (0, 3, 1, 0), 0)
    b.report("job", 2, "rank1", (4, 2, 1), 1, (0, 1, 0, 0), 0)
    b.drop_peer("rank0")
    budget = b.by_name["job"]
    assert budget.capacity(0) == areal_capacity(4, 2, 1, 0, 0, 1)
    state = budget.state()
    assert (state["members"], state["left"], state["returned"]) == (1, 1, 3)
    b.report("job", 2, "rank1", (4, 2, 1), 2, (0, 0, 0, 0), 0, leave=True)
    assert "job" not in b  # the last member ended it


def test_refusals_change_nothing() -> None:
    b = Budgets()
    with pytest.raises(AdmissionError, match=r"max_staleness must be >= 0 \(got -1\)"):
        b.report("job", 1, None, (4, 2, -1), 1, (0, 0, 0, 0), 0)
    assert "job" not in b
    b.report("job", 1, "a", (4, 2, 1), 1, (0, 0, 0, 0), 0)
    with pytest.raises(AdmissionError, match=r"a manager with max_staleness=0 cannot share it"):
        b.report("job", 2, "b", (4, 2, 0), 1, (0, 0, 0, 0), 0)
    with pytest.raises(AdmissionError, match=r"member 1 of budget 'job' belongs to another client"):
        b.report("job", 1, "b", (4, 2, 1), 2, (0, 5, 0, 0), 0)
    state = b.by_name["job"].state()
    assert (state["members"], state["running"]) == (1, 0)


@given(
    shares=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=4),
    counts=st.lists(st.tuples(st.integers(-2, 5), st.integers(0, 9)), min_size=4, max_size=4),
    staleness=st.integers(0, 3),
    version=st.integers(0, 5),
)
def test_members_together_are_one_areal_manager(
    shares: list[tuple[int, int]], counts: list[tuple[int, int]], staleness: int, version: int
) -> None:
    b = Budgets()
    for key, ((mc, bs), (run, acc)) in enumerate(zip(shares, counts, strict=False)):
        budget = b.report("job", key + 1, key, (mc, bs, staleness), 1, (0, run, acc, 0), 0)
    assert budget is not None
    n = len(shares)
    mc = sum(max(1, s[0]) for s in shares)
    bs = sum(max(1, s[1]) for s in shares)
    run, acc = sum(c[0] for c in counts[:n]), sum(c[1] for c in counts[:n])
    assert budget.capacity(version) == areal_capacity(mc, bs, staleness, version, acc, run)
