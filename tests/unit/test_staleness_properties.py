"""Hypothesis: no row is ever served outside its staleness window, and every row is accounted for.

Random interleavings on the pure controller state: puts of rows with random versions (per-row
start/end/dispatch, sometimes no version, sometimes groups), gets by two tasks with random windows
(current_version only grows per task, as a trainer's does), drop or keep, acks and releases.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tqstream.controller.state import ControllerState
from tqstream.controller.window import version_of
from tqstream.protocol.messages import GetMeta, PreparePut
from tqstream.types import FieldSchema

X = FieldSchema("dense", "int64", ())
TASKS = ("actor", "critic")


class Windows(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = ControllerState(lease_timeout=1e9, put_timeout=1e9)
        self.s.add_unit("u")
        self.version = {t: 0 for t in TASKS}
        self.leases: list[tuple[str, int, list[int]]] = []
        self.consumed: dict[str, set[int]] = {t: set() for t in TASKS}
        self.lagged = {t: 0 for t in TASKS}  # acks of rows that have a version
        self.groups = 0

    @rule(
        versions=st.lists(
            st.tuples(st.integers(0, 8), st.integers(0, 2), st.none() | st.integers(0, 8)),
            min_size=1,
            max_size=6,
        ),
        grouped=st.booleans(),
        versionless=st.booleans(),
    )
    def put(self, versions: list[tuple[int, int, int | None]], grouped: bool,
            versionless: bool) -> None:  # fmt: skip
        n = len(versions)
        self.groups += 1
        req = PreparePut(
            rid=0,
            partition="p",
            n_rows=n,
            schemas={"x": X},
            nbytes=8 * n,
            groups=[f"g{self.groups}"] * n if grouped else None,
            version_start=None if versionless else [v for v, _, _ in versions],
            version_end=None if versionless else [v + d for v, d, _ in versions],
            dispatch_version=None if versionless else [d for _, _, d in versions],
        )
        plan = self.s.prepare_put(req, 0)
        assert plan is not None
        self.s.commit(plan.put_id, 0)

    @precondition(lambda self: "p" in self.s.partitions)
    @rule(
        task=st.sampled_from(TASKS),
        bump=st.integers(0, 3),
        k=st.integers(0, 3),
        size=st.integers(1, 4),
        measure=st.sampled_from(["head", "tail", "dispatch"]),
        drop=st.booleans(),
        whole=st.booleans(),
    )
    def get(self, task: str, bump: int, k: int, size: int, measure: str, drop: bool,
            whole: bool) -> None:  # fmt: skip
        self.version[task] += bump
        v = self.version[task]
        p = self.s.partitions["p"]
        before = {rid: version_of(r, measure) for rid, r in p.rows.items()}
        group = {rid: r.group for rid, r in p.rows.items()}

        def stale(rid: int) -> bool:
            return before[rid] is not None and v - before[rid] > k  # type: ignore[operator]

        req = GetMeta(
            rid=0,
            partition="p",
            fields=["x"],
            batch_size=size,
            task=task,
            whole_groups=whole,
            timeout=0.0,
            current_version=v,
            max_staleness=k,
            measure=measure,
            on_stale="drop" if drop else "keep",
        )
        handle = object()
        meta, effects = self.s.get_meta(req, handle, 0)
        if meta is None:  # not servable now: it fails through the effects
            [(to, error)] = effects.failed
            assert to is handle and type(error).__name__ == "RequestTimeoutError"
        gone = set(before) - set(p.rows)
        # the evicted rows' storage is ordered freed, served or not
        assert sorted(
            r for rows in effects.drop_rows.values() for r in rows.get("p", [])
        ) == sorted(gone)
        for rid in gone:  # only stale rows (or members of a stale group) are evicted, with drop
            mates = [m for m in before if group[m] is not None and group[m] == group[rid]]
            assert drop and (stale(rid) or (whole and any(stale(m) for m in mates)))
        if meta is None:
            return
        for rid in meta.row_ids:
            ver = version_of(p.rows[rid], measure)
            assert ver is None or v - ver <= k, f"row {rid} v{ver} served at {v} with k={k}"
            assert rid not in self.consumed[task]
        assert meta.stale_dropped == len(gone)
        self.leases.append((task, meta.lease_id, meta.row_ids))  # type: ignore[arg-type]

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100), ack=st.booleans())
    def finish(self, i: int, ack: bool) -> None:
        task, lease_id, rows = self.leases.pop(i % len(self.leases))
        if ack:
            p = self.s.partitions["p"]
            t = p.tasks[task]
            still = [r for r in rows if r in p.rows and t.leased.get(r) == lease_id]
            self.lagged[task] += sum(1 for r in still if version_of(p.rows[r], "head") is not None)
            self.s.ack("p", task, lease_id, rows)
            self.consumed[task].update(still)
        else:
            self.s.release("p", task, lease_id, rows, 0)

    @invariant()
    def accounted(self) -> None:
        """produced = live rows + stale-dropped (nothing else removes rows here)."""
        p = self.s.partitions.get("p")
        if p is None:
            return
        assert p.produced == len(p.rows) + p.stale_dropped
        assert p.stale_dropped == sum(t.stale_dropped for t in p.tasks.values())
        for name, t in p.tasks.items():
            assert sum(t.lag.values()) == self.lagged[name]
            assert all(lag <= 3 for lag in t.lag), (name, t.lag)  # k <= 3 at every get


TestWindows = Windows.TestCase
TestWindows.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
