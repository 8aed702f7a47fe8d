"""The window's fold in Arrow (state/fold.py) gives what the row-by-row fold gives:
the same partials, key texts, row keys, late and failed rows, for any rows it takes."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ackflow.flow import Flow
from ackflow.state.fold import fold
from ackflow.state.partials import contribute
from ackflow.state.spec import window_flow
from ackflow.testing import ListSource
from ackflow.windows import avg, count, hopping, max_, min_, sum_, tumbling

S = 1_000_000
KINDS = [tumbling("10s"), tumbling("1 minute"), hopping("10s", every="5s"), hopping("10s", every="3s")]
AGGS = [
    [count()],
    [count(), sum_("v").alias("total")],
    [count("v").alias("n"), min_("v").alias("lo"), max_("v").alias("hi"), avg("v").alias("mean")],
    [sum_("v").alias("a"), avg("v").alias("b"), count().alias("c")],
]
TEXT_KEYS = st.one_of(
    st.sampled_from(["a", "b", "k00017", 'q"uote', "back\\slash", "é", "日本", "", "tab\t"]),
    st.text(max_size=4),
)


def spec(kind, aggs, by=("k",)):
    return window_flow(Flow(ListSource([])), kind, aggs=aggs, by=list(by), time="t", name="w").spec


@st.composite
def tables(draw):
    n = draw(st.integers(1, 40))
    time_kind = draw(st.sampled_from(["float", "int", "timestamp"]))
    if time_kind == "float":
        t = st.one_of(
            st.none(), st.floats(-1e6, 1e6, allow_nan=False), st.sampled_from([0.5, 2.5, -0.5, 1.0000005])
        )
        ttype = pa.float64()
    elif time_kind == "int":
        t = st.one_of(st.none(), st.integers(-100_000, 100_000))
        ttype = pa.int64()
    else:
        t = st.one_of(st.none(), st.datetimes(dt.datetime(1960, 1, 1), dt.datetime(2100, 1, 1)))
        ttype = pa.timestamp("us", tz=draw(st.sampled_from([None, "UTC"])))
    int_values = draw(st.booleans())
    plain = st.floats(-1e9, 1e9, allow_nan=False).map(lambda x: x + 0.0)  # (-0.0 goes row by row)
    v = st.one_of(st.none(), st.integers(-(2**40), 2**40)) if int_values else st.one_of(st.none(), plain)
    int_keys = draw(st.booleans())
    k = st.one_of(st.none(), st.integers(-5, 5)) if int_keys else st.one_of(st.none(), TEXT_KEYS)
    cols = {
        "t": pa.array([draw(t) for _ in range(n)], ttype),
        "k": pa.array([draw(k) for _ in range(n)], pa.int64() if int_keys else pa.string()),
        "j": pa.array([draw(st.sampled_from(["x", "y"])) for _ in range(n)], pa.string()),
        "v": pa.array([draw(v) for _ in range(n)], pa.int64() if int_values else pa.float64()),
    }
    keys = [f"f@i:{i}" for i in range(n)]
    cols["__af_key"] = pa.array(keys, pa.string())
    return pa.table(cols), keys


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tables(),
    st.sampled_from(KINDS),
    st.sampled_from(AGGS),
    st.sampled_from([("k",), ("k", "j")]),
    st.one_of(st.none(), st.integers(-(10**12), 10**12)),
    st.data(),
)
def test_the_arrow_fold_is_the_row_fold(table_keys, kind, aggs, by, watermark, data):
    table, keys = table_keys
    applied = set(data.draw(st.lists(st.sampled_from(keys), max_size=5)))
    sp = spec(kind, aggs, by)
    quick = fold(sp, table, keys, watermark, applied)
    assert quick is not None  # every table drawn here is one it takes
    slow = contribute(sp, table, keys, watermark, applied, arrow=False)
    (qp, qf, ql), (sp_, sf, sl) = quick, slow
    assert exact(qp.as_parts()[0]) == exact(sp_.as_parts()[0])  # (every bit: -0.0 is not 0.0 here)
    assert qp.as_parts()[1] == sp_.as_parts()[1]
    assert (qp.keys, qp.max_t, qp.late, qp.applied) == (sp_.keys, sp_.max_t, sp_.late, sp_.applied)
    assert (qf, ql) == (sf, sl)


def exact(value):
    """``value`` with every float as its hex text, so that == sees each bit."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {exact(k): exact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(exact(v) for v in value)
    return value


def test_a_hopping_windows_sum_adds_its_rows_in_row_order():
    # rows out of time order: window [0, 10) holds all three, and 0.1 + 0.2 + 0.3 is not
    # 0.2 + 0.3 + 0.1 in floats
    for kind in (hopping("10s", every="5s"), hopping("10s", every="3s")):
        sp = spec(kind, [sum_("v"), avg("v")])
        table = pa.table(
            {"t": [6.0, 1.0, 2.0], "k": ["a"] * 3, "v": [0.1, 0.2, 0.3], "__af_key": ["x", "y", "z"]}
        )
        quick = fold(sp, table, ["x", "y", "z"], None, set())
        assert quick is not None
        slow = contribute(sp, table, ["x", "y", "z"], None, set(), arrow=False)
        assert exact(quick[0].as_parts()[0]) == exact(slow[0].as_parts()[0])


def test_what_the_arrow_fold_leaves_to_the_row_fold():
    keys = ["a", "b"]
    base = {"k": ["x", "y"], "v": [1, 2], "__af_key": keys}
    sp = spec(tumbling("10s"), [count(), sum_("v")])

    def table(**cols):
        return pa.table({**base, **cols})

    assert fold(sp, table(t=[1.0, 2.0]), keys, None, set()) is not None
    # a NaN time, a time past the year 9999, text times: each row reads its own way
    assert fold(sp, table(t=[float("nan"), 2.0]), keys, None, set()) is None
    assert fold(sp, table(t=[1e12, 2.0]), keys, None, set()) is None
    assert fold(sp, table(t=["2026-01-01T00:00:00Z", "x"]), keys, None, set()) is None
    # an integer sum that could pass 2**63, a float key, a text value to sum
    assert fold(sp, table(t=[1.0, 2.0], v=[2**62, 2**62]), keys, None, set()) is None
    assert fold(sp, table(t=[1.0, 2.0], k=[0.0, -0.0]), keys, None, set()) is None
    assert fold(sp, table(t=[1.0, 2.0], v=["1", "2"]), keys, None, set()) is None
    # a -0.0 (Arrow sums from 0.0), a timestamp before the year 1 (no datetime holds it)
    assert fold(sp, table(t=[1.0, 2.0], v=[-0.0, 1.5]), keys, None, set()) is None
    early = pa.array([-(10**17), 0], pa.timestamp("us"))
    assert fold(sp, table(t=early), keys, None, set()) is None
    # and what it leaves, the row fold does
    part, _, _ = contribute(sp, table(t=[1.0, 2.0], v=[2**62, 2**62], k=["x", "x"]), keys, None, set())
    assert [acc[1] for _, acc in part.as_parts()[0].values()] == [2**63]
    _, failed, _ = contribute(sp, table(t=[float("nan"), 2.0]), keys, None, set())
    assert "not a time" in failed[0]
