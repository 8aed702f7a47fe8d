"""A model-based test of windows (hypothesis): random rows, batches that overlap and
commit out of order, tasks of several partitions, crashes before and after the state
commit (the batch's messages delivered again), late rows and quiet streams, driven
through the real task code (:func:`contribute`) and the real store; then every row has
exactly one fate, no window is written twice, and every written window equals the
windows recomputed from the rows counted."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ackflow.flow import Flow
from ackflow.state import winlog
from ackflow.state.gate import Gate
from ackflow.state.partials import contribute
from ackflow.state.spec import window_flow
from ackflow.state.store import WindowStore, read_view
from ackflow.testing import ListSource
from ackflow.windows import count, hopping, max_, session, sum_, tumbling

S = 1_000_000
KINDS = {"tumbling": tumbling("10s"), "hopping": hopping("10s", every="5s"), "session": session("5s")}


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 40))
    rows = [
        (draw(st.sampled_from("abc")), draw(st.integers(0, 60)), draw(st.integers(-5, 9))) for _ in range(n)
    ]
    # in order: the rows come by event time and only process crashes happen (no failed
    # commits, no quiet spells): then no row may be late, whatever batches overlap
    ordered = draw(st.booleans())
    if ordered:
        rows.sort(key=lambda r: r[1])
    crashes = ["none", "none", "after_commit", "bisect"]
    if not ordered:
        crashes += ["before_commit", "none"]
    plan = []  # (batch size, partitions, crash, overlaps the next batch, a quiet spell after)
    left = n
    while left > 0:
        size = draw(st.integers(1, min(8, left)))
        crash = draw(st.sampled_from(crashes))
        quiet = draw(st.booleans()) and not ordered
        plan.append((size, draw(st.integers(1, 3)), crash, draw(st.booleans()), quiet))
        left -= size
    return {
        "ordered": ordered,
        "kind": draw(st.sampled_from(sorted(KINDS))),
        "lateness": draw(st.integers(0, 20)),
        "rows": rows,
        "plan": plan,
    }


class Run:
    """The engine's protocol around one window, with the sink's emission rule."""

    def __init__(self, spec, store, view):
        self.spec, self.view = spec, view
        self.opener = store  # opens a handle on the store (again after a crash)
        self.store = store()
        self.gate = Gate()  # the running batches, as the window sink keeps them
        self.written = {}  # (gk, start) -> accumulators written (count of writes too)
        self.writes = {}
        self.late = {}  # row id -> the watermark its batch began with
        self.counted = set()

    def begin(self, bid):
        self.gate.begin(bid, self.store.begin(self.spec.name, bid))

    def hold(self, bid):  # the engine's batch, around all of its jobs (WindowSink.hold)
        self.gate.begin(f"hold:{bid}", self.store.mark(self.spec.name)["watermark"])

    def unhold(self, bid):
        self.store.move(self.spec, self.gate.end(f"hold:{bid}", None))

    def restart(self):
        """The process died: running batches are gone, a new process starts with a
        handle of its own (the old one dropped without closing: its change log unfolded)."""
        self.gate = Gate()
        self.store.db.close()
        self.store.scratch.close()
        self.store = self.opener()
        self.store.end(self.spec.name)

    def tasks(self, bid, rows, ids, parts):
        out = []
        for p in range(parts):
            idx = list(range(p, len(rows), parts))
            if not idx:
                continue
            table = pa.Table.from_pylist(
                [{"k": rows[i][0], "t": float(rows[i][1]), "v": rows[i][2]} for i in idx]
            )
            keys = [ids[i] for i in idx]
            w, applied = self.view(keys, bid) or read_view(self.store.path, self.spec.name, keys, bid)
            partials, failed, late = contribute(self.spec, table, keys, w, applied)
            assert not failed
            out.append((partials, {keys[j]: w for j in late}))
        return out

    def commit(self, bid, results):
        parts = [p for p, _ in results]
        top = max((p.max_t for p in parts if p.max_t is not None), default=None)
        self.store.apply(self.spec, parts, event_max=self.gate.ready(bid, top))
        self.gate.end(bid, top)
        self.store.end(self.spec.name, bid)
        for p, late in results:
            self.counted.update(p.keys)
            self.late.update(late)
        self.emit()

    def fail(self, bid):
        self.store.move(self.spec, self.gate.end(bid, None))
        self.store.end(self.spec.name, bid)

    def emit(self):
        bound = self.gate.bound(self.store.mark(self.spec.name)["watermark"])
        due = self.store.due(self.spec, bound)
        for d in due:
            key = (d.gk, d.start)
            self.writes[key] = self.writes.get(key, 0) + 1
            self.written[key] = (d.end, [a.finish(x) for a, x in zip(self.spec.aggs, d.accs, strict=True)])
        self.store.done(self.spec, due)
        self.store.settle(self.spec)  # (the change log folded in every few batches)


def expected(spec, rows, counted_rows):
    """The windows of the counted rows, recomputed: (gk, start) -> (end, [count, sum, max])."""
    import json

    members = {}
    for i in counted_rows:
        k, t, v = rows[i]
        kind = spec.kind
        if hasattr(kind, "starts"):
            for s in kind.starts(t * S):
                members.setdefault((k, s, s + kind.size_us), []).append(v)
    if not hasattr(spec.kind, "starts"):  # sessions: a gap of 5 s or more splits
        per = {}
        for i in counted_rows:
            per.setdefault(rows[i][0], []).append((rows[i][1] * S, rows[i][2]))
        for k, items in per.items():
            items.sort()
            start, last, vals = items[0][0], items[0][0], []
            for t, v in items:
                if vals and t >= last + spec.kind.gap_us:
                    members[(k, start, last + spec.kind.gap_us)] = vals
                    start, vals = t, []
                last = t
                vals.append(v)
            members[(k, start, last + spec.kind.gap_us)] = vals
    return {
        (json.dumps([k], separators=(",", ":")), s): (e, [len(v), sum(v), max(v)])
        for (k, s, e), v in members.items()
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenarios())
def test_every_row_has_one_fate_and_every_window_is_written_once_and_right(tmp_path_factory, sc):
    path = str(tmp_path_factory.mktemp("w") / "windows.db")
    check(sc, lambda: WindowStore(path), lambda keys, w: None)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenarios())
def test_the_same_in_postgresql(postgres, sc):
    """The PostgreSQL store runs the SQLite store's statements (translated): the same
    model over a real server (a schema per example)."""
    import uuid

    from ackflow.state import pg

    state = pg.PostgresState(postgres.dsn, schema=f"w_{uuid.uuid4().hex[:10]}")
    check(sc, lambda: pg.open_store(state, "w"), lambda keys, bid: pg.read_view(state, "w", keys, bid))


def check(sc, store, view):
    """Run scenario ``sc`` against the store ``store()`` opens; ``view(keys, batch)``: the
    tasks' read (None: the SQLite file's). The change log is folded every two rows."""
    every, winlog.COMPACT_EVERY = winlog.COMPACT_EVERY, 2
    try:
        _check(sc, store, view)
    finally:
        winlog.COMPACT_EVERY = every


def _check(sc, opener, view):
    flow = Flow(ListSource([]))
    spec = window_flow(
        flow,
        KINDS[sc["kind"]],
        by="k",
        time="t",
        lateness=sc["lateness"],
        aggs=[count(), sum_("v"), max_("v")],
        name="w",
    ).spec
    run = Run(spec, opener, view)
    rows = sc["rows"]
    ids = [f"r{i}" for i in range(len(rows))]
    queue = list(range(len(rows)))  # row indexes in arrival order
    held = []  # a begun batch waiting to commit after the next one (out of order)
    step = 0
    plan = list(sc["plan"])

    def requeue(batch, at_front):  # a crash gives back in place; a failure retries later
        return sorted(set(batch) | set(queue)) if at_front else queue + batch

    while queue or held:
        size, parts, crash, overlap, quiet = plan[step % len(plan)]
        step += 1
        if step > 200:
            crash = "none"  # the run must end: crashes stop after a while
        batch, queue = queue[:size], queue[size:]
        bid = f"b{step}"
        if batch:
            run.hold(bid)
            if crash == "bisect":  # the job fails as a whole; its halves run as jobs of their own
                run.begin(bid)
                run.tasks(bid, [rows[i] for i in batch], [ids[i] for i in batch], parts)
                run.fail(bid)
                if queue:  # meanwhile a younger batch runs and commits
                    young, queue = queue[:size], queue[size:]
                    yb = f"{bid}y"
                    run.hold(yb)
                    run.begin(yb)
                    run.commit(yb, run.tasks(yb, [rows[i] for i in young], [ids[i] for i in young], parts))
                    run.unhold(yb)
                half = max(1, len(batch) // 2)
                for k, h in enumerate(h for h in (batch[:half], batch[half:]) if h):
                    hb = f"{bid}{'ab'[k]}"
                    run.begin(hb)
                    run.commit(hb, run.tasks(hb, [rows[i] for i in h], [ids[i] for i in h], parts))
                run.unhold(bid)
                continue
            run.begin(bid)
            results = run.tasks(bid, [rows[i] for i in batch], [ids[i] for i in batch], parts)
            if crash == "before_commit":  # the transaction failed: nacked, retried later
                run.fail(bid)
                run.unhold(bid)
                queue = requeue(batch, at_front=False)
            elif overlap and queue and crash == "none":
                held.append((bid, results, batch))
                continue
            else:
                run.commit(bid, results)
                if crash == "after_commit":  # the process died before the ack
                    lost = [i for _, _, b in held for i in b]
                    held = []
                    run.restart()
                    queue = requeue(batch + lost, at_front=True)
                else:
                    run.unhold(bid)
        for hbid, hres, _ in held:  # the earlier batch commits after this one
            run.commit(hbid, hres)
            run.unhold(hbid)
        held = []
        if quiet:
            run.store.close_open(spec)
            run.emit()
    run.store.close_open(spec)
    run.emit()
    run.store.close()
    everyone = set(ids)
    final_late = {r for r in run.late if r not in run.counted}
    assert run.counted | final_late == everyone
    if sc["ordered"]:
        assert not final_late, f"rows in order made late by a crash: {sorted(final_late)}"
    assert not run.counted & final_late
    for r, w in run.late.items():  # judged late against its batch's starting watermark
        assert w is not None and rows[int(r[1:])][1] * S < w
    assert max(run.writes.values(), default=1) == 1, "a window written twice"
    want = expected(spec, rows, sorted(int(r[1:]) for r in run.counted))
    assert run.written == want
