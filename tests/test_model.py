"""The model-based test of the whole engine (tests/model.py builds the examples and the
model): random flows, data that fails in chosen rows, sinks that refuse, raise or fail
their commits, fault points that crash the run, restarts from the durable state.

After every example, for every message: acked with all its rows in every keyed sink
(each once: one row per key, no key holding two different rows), or dead-lettered
with the reason of a step it really failed in; every copy of it (a re-send with the
same key) finally settled exactly once, every delivery at most once; none left
unsettled; the in-flight window never above its bound; no run crashed on data.

In-process executor (``executor="local"``, no JVM; see ackflow/spark/local.py for what
it does not cover), ``ACKFLOW_MODEL_EXAMPLES`` examples (1000 in CI); on Spark, with
Column steps too, ``ACKFLOW_MODEL_SPARK_EXAMPLES`` (50 in CI). A larger run:
    ACKFLOW_MODEL_EXAMPLES=10000 .venv/bin/python -m pytest tests/test_model.py -k local
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings

from ackflow.engine.loop import Engine
from model import (
    Branch,
    Example,
    build,
    down_examples,
    examples,
    model,
    norm,
    reasons,
    settle_all,
)

LOCAL_EXAMPLES = int(os.environ.get("ACKFLOW_MODEL_EXAMPLES", "1000"))
SPARK_EXAMPLES = int(os.environ.get("ACKFLOW_MODEL_SPARK_EXAMPLES", "50"))


@pytest.fixture(autouse=True)
def _quiet() -> None:
    """Failed jobs and crashes are the point here: keep the log to errors of the test."""
    logging.getLogger("ackflow").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("ackflow").setLevel(logging.NOTSET)


def run_example(ex: Example, **engine: object) -> None:
    flow, sources, sinks, dlq = build(ex, engine.get("spark"))
    fates = model(ex)

    def run() -> None:
        # The model's poison fails by value with one error text ("poison row", a sink that
        # raises for a partition holding a chosen row): by construction it cannot be told
        # from a systemic failure, so these examples run without that rule; the examples
        # of test_model_down_* below test it.
        Engine(
            flow,
            batch_size=ex.batch_size,
            max_inflight=ex.window,
            max_concurrent_batches=ex.concurrency,
            batch_timeout_s=0.01,
            until_idle=0.02,
            max_bisect_jobs=1000,
            handle_signals=False,
            systemic_after=0,
            **engine,
        ).run()

    # on Spark a failed job kills its tasks' Python workers, and the next job forks and
    # imports new ones: an example that bisects three batches took 65 s on 2 cores
    crashes, texts = settle_all(ex, sources, run, within_s=240 if engine.get("spark") else 60)
    assert crashes <= len(ex.engine_faults), f"crashed more often than faults were armed: {texts}"
    window = sources[0].window
    assert window[1] <= ex.window, f"{window[1]} messages in flight, window {ex.window}"
    for s in sources:
        twice = {k: n for k, n in s.per_delivery.items() if n != 1}
        assert not twice, f"deliveries settled more than once: {twice}"
    for b, sink in enumerate(sinks):
        assert not sink.conflicts, f"b{b}: one key held two different rows: {sink.conflicts}"
    keyed_rows = not ex.grouped and not any(k == "group" for k, _ in ex.steps)
    allowed = [{key: row for f in fates for key, row in f.rows.get(b, {}).items()} for b in range(len(sinks))]
    for fate in fates:
        src = sources[fate.source]
        finals = []
        for h in fate.handles:  # each copy (a re-send has the same key) settles once
            history = src.per_copy.get(h, [])
            assert history, f"{fate.key} (copy {h}) was never settled"
            assert history.count("acked") + history.count("dead_lettered") == 1, (
                f"{fate.key} (copy {h}): settled finally more than once: {history}"
            )
            finals.append(history[-1])
        if dlq is not None:
            dead = fate.key in dlq.rows
            assert set(finals) == {"acked"}, f"{fate.key}: {finals} (an error sink is set)"
            if dead:
                step = dlq.rows[fate.key]["step"]
        else:  # a copy held while the first was in flight is acked as the first settled
            dead = "dead_lettered" in finals
            if dead:
                step = src.dead_letters[fate.local_key].step
        must_fail = fate.crash is not None or bool(fate.must)
        if must_fail:
            assert dead, f"{fate.key} must fail ({fate.crash or fate.must}) but was acked"
        elif not fate.may:
            assert not dead, f"{fate.key} was dead-lettered in {step!r} but fails nowhere"
        if dead:
            assert step in reasons(ex, fate), (
                f"{fate.key}: dead letter names {step!r}, expected one of {reasons(ex, fate)}"
            )
            continue
        if not keyed_rows:
            continue
        for b in range(len(sinks)):  # acked: every row of it written, as the model says
            want = fate.rows.get(b, {}) if ex.mode == "all" else (fate.rows.get(0, {}) if b == 0 else {})
            for key, row in want.items():
                where = [sinks[b]] if ex.mode == "all" else sinks
                got = [s.rows[key] for s in where if key in s.rows]
                assert got, f"{fate.key} acked, but row {key} is missing in b{b}"
                assert all(norm(g) == norm(row) for g in got), f"row {key}: {got} != {row}"
    if keyed_rows:  # nothing fabricated: every row in a sink is one the model made
        for b, sink in enumerate(sinks):
            model_rows = allowed[b] if ex.mode == "all" else allowed[0]
            extra = {
                k: v for k, v in sink.rows.items() if k not in model_rows or norm(model_rows[k]) != norm(v)
            }
            assert not extra, f"b{b} holds rows the model never made: {extra}"
    if dlq is not None:
        known = {f.key for f in fates}
        assert set(dlq.rows) <= known, f"dead letters of unknown messages: {set(dlq.rows) - known}"


OK = (Branch("ok", 2, 0),)
# Found by this test (kept as regressions):
# two merged sources both have a message "m0"; both dead-lettered into a keyed error sink
# shared one row key, the sink refused the pair, and they were retried forever
MERGED_DEAD_LETTERS = Example((None, None), 2, (), False, "all", OK, True, (), (), 2, 2, 1)
# one message's six rows made two groups of the same key value: both got one row key
# (a digest of the members' keys), so a keyed sink kept one of them
TWO_GROUPS_ONE_MESSAGE = Example(
    (0,), 1, (("flat_map", 2), ("flat_map", 3)), True, "all", OK, False, (), (), 1, 1, 1
)

# Spark prunes a column nothing reads: a failing cast of ``c`` followed by a group (which
# replaces ``c``) never runs, so the message is acked; the model first said it must fail
CAST_UNREAD = Example((0,), 1, (("cast", 5), ("group", 0)), False, "all", OK, False, (), (), 1, 1, 1)
# the same cast read by a Python step before the group does run, and fails the message
CAST_READ = Example(
    (0, 1), 1, (("cast", 5), ("filter", 7), ("group", 0)), False, "all", OK, False, (), (), 2, 2, 1
)

# a column of every Spark SQL type (nulls too) through a refusing sink and an on_error sink
EVERY_TYPE = Example(
    (0, 1, 2, 3, 4, 5),
    1,
    (("filter", 5), ("types", 0)),
    False,
    "all",
    (Branch("ok", 2, 0), Branch("refuse", 3, 1)),
    True,
    (),
    (),
    3,
    6,
    1,
)


# Repeats (law 12) and null keys: a copy right after its original (held while the first
# is in flight, then settled as it: acked with it, or acked after its dead letter), one at
# the end (runs again after the first settled: the same rows), a poison message with a
# copy (map 4 fails n=3, c=1), and a null key read as 0
REPEATS = Example(
    (1, 2, 3),
    1,
    (("flat_map", 2), ("map", 4)),
    False,
    "all",
    OK,
    False,
    (),
    (),
    4,
    8,
    1,
    ((0, "next"), (2, "next"), (1, "end")),
    (1,),
)
# a null key at a sink: a column null in every row of a batch reaches the sink absent
# (Arrow's null type), so the sink's predicate must read it with .get (the model's did not)
NULL_KEY_AT_SINK = Example(
    (0,), 1, (), False, "all", (Branch("refuse", 2, 1),), False, (), (), 1, 1, 1, (), (0,)
)
# found on the unchanged model (a false alarm): after a crash the columns are inferred
# anew (no state_dir), so m0, first written with x0 as a column, is written again with x0
# in _rescued (schema mode "rescue"); the keyed sink called that two different rows
RESCUED_AFTER_RESTART = Example(
    (0, 1), 1, (("shape", 2),), False, "all", OK, False, (), (("batch.after_commit", 1),), 1, 1, 1
)
# a null key in a broadcast branch's step (found by 1000 examples): its batch holds only
# that row, the column is null in every row and the branch step got no "n" at all
BRANCH_NULL_KEY = Example(
    (0,),
    1,
    (),
    False,
    "all",
    (Branch("ok", 2, 0, (("bfilter", 2),)), Branch("ok", 2, 0)),
    False,
    (),
    (),
    1,
    1,
    1,
    (),
    (0,),
)
# the shape of issue 27 #10: copies of a message in one pull through flat_map and group_by
REPEAT_GROUPED = Example(
    (3, 3, 5),
    1,
    (("flat_map", 2), ("group", 0)),
    False,
    "all",
    OK,
    False,
    (),
    (),
    8,
    8,
    1,
    ((0, "next"), (0, "next")),
    (2,),
)
# found by CI: group_by("n") where the first batch's n is null in every row stopped the
# run ("cannot resolve n"): a field null in every row made no column
GROUP_NULL_ONLY = Example(
    (0,), 1, (("group", 0),), False, "all", (Branch("ok", 2, 0),), False, (), (), 1, 1, 1, (), (0,)
)


# found by CI: a grouped_within group written again (a commit of another branch failed
# before applying) listed its members' rows in their new arrival order: one key, two rows
GROUP_ORDER = Example(
    (None, 1, None, 0, 7, 18, 17, 17, None, None),
    1,
    (("shape", 2), ("shape", 2)),
    True,
    "all",
    (Branch("refuse", 4, 4), Branch("refuse", 2, 4), Branch("refuse", 3, 1)),
    True,
    ((1, 2, "before"),),
    (("engine.drain", 3), ("engine.before_fail", 3)),
    3,
    10,
    3,
    ((3, "next"), (3, "end"), (7, "next")),
    (),
)


@settings(
    max_examples=LOCAL_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(ex=examples())
@example(ex=MERGED_DEAD_LETTERS)
@example(ex=TWO_GROUPS_ONE_MESSAGE)
@example(ex=REPEATS)
@example(ex=NULL_KEY_AT_SINK)
@example(ex=RESCUED_AFTER_RESTART)
@example(ex=BRANCH_NULL_KEY)
@example(ex=GROUP_ORDER)
def test_model_local(ex: Example) -> None:
    run_example(ex, executor="local")


@pytest.mark.spark
@settings(
    max_examples=SPARK_EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
@given(ex=examples(spark=True, max_messages=16))
@example(ex=CAST_UNREAD)
@example(ex=CAST_READ)
@example(ex=EVERY_TYPE)
@example(ex=REPEAT_GROUPED)
@example(ex=GROUP_NULL_ONLY)
def test_model_spark(spark: object, ex: Example) -> None:
    run_example(ex, spark=spark)


def test_null_column_reaches_branch_step_as_none() -> None:
    """A Python step sees the same row for the same message whatever its batch mates: a
    field that is null reaches it as ``None``, also in a broadcast branch (after a
    segment boundary) when the field is null in every row of the batch (it was pruned
    once: the branch step got no key at all, and ``r["n"]`` failed the message in one
    batch and not in another)."""
    import ackflow
    from ackflow.sinks import MemorySink
    from ackflow.testing import ListSource

    def look(r: dict) -> dict:
        return {"has_n": "n" in r}

    seen = []
    for bodies in (['{"n": null, "c": 0}', '{"n": 1, "c": 0}'], ['{"n": null, "c": 0}']):
        src, out = ListSource(bodies), MemorySink("out")
        flow = ackflow.Flow(src).broadcast(
            ackflow.branch().map(look, name="look").to(out), MemorySink("plain")
        )
        Engine(
            flow,
            batch_size=10,
            max_inflight=10,
            batch_timeout_s=0.05,
            until_idle=0.1,
            handle_signals=False,
            executor="local",
        ).run()
        assert src.final() == {f"m{i}": "acked" for i in range(len(bodies))}
        seen.append(out.rows[0]["has_n"])
    assert seen == [True, True], f'"n" in the branch step\'s row, per batch: {seen}'


# -- a sink that fails for every message: systemic, never dead letters --------------------

# found by CI: two down sinks split the messages' failures between them (a message's
# failure names one sink), so each sink may dead-letter two before it is judged
TWO_DOWN = Example(
    (0, 0, 1),
    1,
    (),
    False,
    "all",
    (Branch("down", 2, 0, (("bfilter", 2),)), Branch("down", 2, 0)),
    False,
    (),
    (),
    1,
    1,
    1,
)


def run_down_example(ex: Example, **engine: object) -> None:
    """Every sink raises for every partition. Messages failing in a step before it are
    dead-lettered with that step as usual; of the messages reaching a sink, at most
    ``systemic_after - 1`` (2) per sink can be dead-lettered there (before three
    distinct ones have shown the failure), none is acked, and once three have reached a
    lone sink the run stops with SystemicFailure. Nothing is lost: every message is finally settled or
    still at its source, every delivery settled at most once."""
    from ackflow.core.errors import SystemicFailure

    flow, sources, _sinks, dlq = build(ex, engine.get("spark"))
    fates = model(ex)
    reaching = [
        f
        for f in fates
        if f.rows
        and f.crash is None
        and not [s for s in f.must if not (s.startswith("b") and "s" not in s[1:])]
    ]
    stopped = None
    try:
        Engine(
            flow,
            batch_size=ex.batch_size,
            max_inflight=ex.window,
            max_concurrent_batches=ex.concurrency,
            batch_timeout_s=0.01,
            until_idle=0.3,
            max_bisect_jobs=1000,
            handle_signals=False,
            systemic_stop_after_s=0.3,
            systemic_backoff_s=0.01,
            systemic_max_backoff_s=0.05,
            **engine,
        ).run()
    except SystemicFailure as e:
        stopped = e
    for s in sources:
        twice = {k: n for k, n in s.per_delivery.items() if n != 1}
        assert not twice, f"deliveries settled more than once: {twice}"
    at_sink: Counter[str] = Counter()  # dead letters per sink step
    for fate in fates:
        src = sources[fate.source]
        final = []
        for h in fate.handles:
            history = src.per_copy.get(h, [])
            mine = [x for x in history if x in ("acked", "dead_lettered")]
            assert len(mine) <= 1, f"{fate.key} (copy {h}): settled finally more than once: {history}"
            final += mine
        if dlq is not None:
            dead = fate.key in dlq.rows
            step = dlq.rows[fate.key]["step"] if dead else None
        else:
            dead = "dead_lettered" in final
            step = src.dead_letters[fate.local_key].step if dead else None
        if fate.rows and "acked" in final and not dead:
            raise AssertionError(f"{fate.key} acked, but its rows could not be written")
        if dead and step.startswith("b") and "s" not in step[1:]:
            at_sink[step] += 1
        if len(final) < len(fate.handles):  # a copy not settled: still at its source
            assert src.pending() > 0, f"{fate.key} is neither settled nor at its source"
    # before three distinct messages have shown one signature (a sink's failure), at most
    # two can have been failed as usual: per sink, since a message's failure names one
    over = {s: n for s, n in at_sink.items() if n > 2}
    assert not over, f"messages dead-lettered at a sink that fails every write: {over}"
    if len(ex.branches) == 1 and len(reaching) >= 3 and stopped is None:
        raise AssertionError(
            f"{len(reaching)} messages reach a sink that is down, and the run ended without SystemicFailure"
        )
    if stopped is not None:
        assert stopped.step.startswith("b"), str(stopped)


@settings(
    max_examples=max(LOCAL_EXAMPLES // 10, 20),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(ex=down_examples())
@example(ex=TWO_DOWN)
def test_model_down_local(ex: Example) -> None:
    run_down_example(ex, executor="local")


@pytest.mark.spark
@settings(
    max_examples=max(SPARK_EXAMPLES // 5, 5),
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
@given(ex=down_examples(spark=True))
def test_model_down_spark(spark: object, ex: Example) -> None:
    run_down_example(ex, spark=spark)
