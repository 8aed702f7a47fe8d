"""Property test of the ack algebra on Spark: random flows, random failures, compared
with a plain-Python model of what must happen to every message.

For every source message: acked if and only if every row derived from it was written
by every branch (filtered messages acked); otherwise dead-lettered with a failure from
a step where it really failed; settled exactly once; none left unsettled.

CI runs a few examples; a larger run:
    ACKFLOW_PROPERTY_EXAMPLES=1000 .venv/bin/python -m pytest tests/test_properties.py
"""

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ackflow
from ackflow.testing import FailingSink, ListSource

pytestmark = pytest.mark.spark

EXAMPLES = int(os.environ.get("ACKFLOW_PROPERTY_EXAMPLES", "8"))

step = st.one_of(
    st.tuples(st.just("map"), st.integers(2, 9)),  # fails rows with (n + c) % m == 0
    st.tuples(st.just("filter"), st.integers(2, 5)),  # drops rows with (n + c) % m == 0
    st.tuples(st.just("flat_map"), st.integers(0, 3)),  # k children, c = 0..k-1
    st.tuples(st.just("group"), st.just(0)),  # group by n, c = count(*)
    st.tuples(st.just("transform"), st.just(0)),  # identity through the DataFrame hatch
)
branch = st.tuples(st.integers(2, 7), st.integers(0, 6), st.booleans())  # mod, rest, raises?


def model(ns, steps, branches):
    """What must happen, in plain Python.

    Returns (must, may): message index -> the steps it surely failed in, and the
    branches it may fail in as collateral (a raising branch fails its whole Spark
    partition, and which rows share a partition is Spark's business).
    """
    rows = [(frozenset([i]), {"n": n, "c": 0}) for i, n in enumerate(ns)]
    failed = {i: set() for i in range(len(ns))}
    for k, (kind, arg) in enumerate(steps):
        name = f"s{k}"
        out = []
        if kind == "map":
            for mem, r in rows:
                if (r["n"] + r["c"]) % arg == 0:
                    for i in mem:
                        failed[i].add(name)
                else:
                    out.append((mem, {"n": r["n"], "c": r["c"] + 1}))
        elif kind == "filter":
            out = [(m, r) for m, r in rows if (r["n"] + r["c"]) % arg != 0]
        elif kind == "flat_map":
            out = [(m, {"n": r["n"], "c": j}) for m, r in rows for j in range(arg)]
        elif kind == "group":
            groups = {}
            for m, r in rows:
                mem, count = groups.get(r["n"], (frozenset(), 0))
                groups[r["n"]] = (mem | m, count + 1)
            out = [(mem, {"n": n, "c": c}) for n, (mem, c) in groups.items()]
        else:
            out = rows
        rows = out
    may = {i: set() for i in range(len(ns))}
    for b, (mod, rest, raises) in enumerate(branches):
        bad = [m for m, r in rows if r["n"] % mod == rest % mod]
        for m in bad:
            for i in m:
                failed[i].add(f"b{b}")
        if raises and bad:
            for m, _ in rows:
                for i in m:
                    may[i].add(f"b{b}")
    return failed, may


def build(src, steps, branches):
    flow = ackflow.Flow(src)
    for k, (kind, arg) in enumerate(steps):
        name = f"s{k}"
        if kind == "map":

            def fn(r, m=arg):
                if (r["n"] + r["c"]) % m == 0:
                    raise ValueError("poison row")
                return {"n": r["n"], "c": r["c"] + 1}

            flow = flow.map(fn, name=name, schema="n BIGINT, c BIGINT")
        elif kind == "filter":
            flow = flow.filter(lambda r, m=arg: (r["n"] + r["c"]) % m != 0, name=name)
        elif kind == "flat_map":
            flow = flow.flat_map(
                lambda r, k=arg: [{"n": r["n"], "c": j} for j in range(k)],
                name=name,
                schema="n BIGINT, c BIGINT",
            )
        elif kind == "group":
            flow = flow.group_by("n").agg("count(*) AS c", name=name)
        else:
            flow = flow.transform(lambda df: df.withColumn("c", df["c"] + 0), name=name)
    sinks = []
    for b, (mod, rest, raises) in enumerate(branches):

        def pred(r, m=mod, x=rest):
            return r["n"] % m == x % m

        sinks.append(FailingSink(name=f"b{b}", **({"raise_if": pred} if raises else {"fail_if": pred})))
    return flow.broadcast(*sinks)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 8,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ns=st.lists(st.integers(0, 20), min_size=1, max_size=25),
    steps=st.lists(step, max_size=4),
    branches=st.lists(branch, min_size=1, max_size=2),
)
def test_ack_iff_every_derived_row_was_written(spark, ns, steps, branches):
    src = ListSource([json.dumps({"n": n, "c": 0}) for n in ns])
    flow = build(src, steps, branches)
    # the poison here fails by value with one text, a raising branch fails its partition:
    # by construction not told from a systemic failure, so that rule is off here
    # (tests/test_systemic.py and the model test's down examples test it)
    ackflow.run(
        flow,
        spark=spark,
        batch_size=100,
        max_inflight=100,
        until_idle=0.2,
        batch_timeout_s=0.2,
        max_concurrent_batches=1,
        systemic_after=0,
    )
    must, may = model(ns, steps, branches)
    final = src.final()
    assert set(final) == {f"m{i}" for i in range(len(ns))}  # none left unsettled
    for i, reasons in must.items():
        key = f"m{i}"
        assert len(src.settled[key]) == 1, (key, src.settled[key])  # settled once
        if reasons:
            assert final[key] == "dead_lettered", (key, reasons, steps, branches)
            assert src.failures[key].step in reasons | may[i], (key, src.failures[key], reasons)
        elif final[key] != "acked":  # only as collateral of a branch that raised
            assert src.failures[key].step in may[i], (key, src.failures[key], steps, branches)
