"""Schema as a durable, evolving contract (issue 30): nested fields are never dropped,
the columns are stored and reused after a restart, and each mode (evolve, rescue,
freeze) handles rows that do not fit without losing a field."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

import ackflow
from ackflow import Flow
from ackflow.core.errors import ConfigError
from ackflow.core.schema import SchemaStore, empty, merge_schemas, open_readonly
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST
from model import unrescued
from realdata import same

LOCAL = {**FAST, "executor": "local", "until_idle": 0.2}


def run(bodies, state, sink=None, mode="evolve", build=None, **kw):
    src = ListSource([json.dumps(b) if not isinstance(b, str) else b for b in bodies])
    sink = sink if sink is not None else MemorySink()
    flow = (build or (lambda f: f.map(lambda r: r, name="ident")))(Flow(src))
    report = ackflow.run(flow.to(sink), **{**LOCAL, "schema_mode": mode, "state_dir": state, **kw})
    return src, sink, report


def history(state):
    store = open_readonly(str(state))
    try:
        return store.history()
    finally:
        store.close()


def test_a_nested_field_new_in_a_later_batch_is_never_dropped(tmp_path):
    """The issue's case: a first batch of {"customer": {"name": "a"}} and a later
    {"customer": {"name": "b", "vip": true}} wrote {"customer": {"name": "b"}} and acked
    (law 10). Lists of structs the same. Now the field lands (evolve), fails its message
    naming it (freeze), or is kept in _rescued (rescue)."""
    first = [{"id": 1, "customer": {"name": "a"}, "lines": [{"sku": "x"}]}]
    later = [
        {"id": 2, "customer": {"name": "b", "vip": True}, "lines": [{"sku": "y"}]},
        {"id": 3, "customer": {"name": "c"}, "lines": [{"sku": "z", "qty": 2}]},
    ]
    out = {}
    for mode in ("evolve", "freeze", "rescue"):
        state = tmp_path / mode
        sink = MemorySink()
        run(first, state, sink, mode)
        src, sink, _ = run(later, state, sink, mode)
        out[mode] = (
            src.final(),
            {k: str(v) for k, v in src.failures.items()},
            sorted(sink.rows, key=lambda r: r["id"]),
        )
    final, failures, rows = out["evolve"]
    assert final == {"m0": "acked", "m1": "acked"}
    assert rows[1] == {"id": 2, "customer": {"name": "b", "vip": True}, "lines": [{"sku": "y", "qty": None}]}
    assert rows[2] == {"id": 3, "customer": {"name": "c", "vip": None}, "lines": [{"sku": "z", "qty": 2}]}
    final, failures, rows = out["freeze"]
    assert final == {"m0": "dead_lettered", "m1": "dead_lettered"}
    assert "'customer.vip'" in failures["m0"] and "freeze" in failures["m0"]
    assert "'lines[].qty'" in failures["m1"]
    assert [r["id"] for r in rows] == [1]
    final, failures, rows = out["rescue"]
    assert final == {"m0": "acked", "m1": "acked"}
    assert rows[1]["customer"] == {"name": "b"}
    assert json.loads(rows[1]["_rescued"]) == {"customer": {"vip": True}}
    assert json.loads(rows[2]["_rescued"]) == {"lines": [{"sku": "z", "qty": 2}]}


def test_a_restart_reuses_the_stored_columns_and_widens_them_once(tmp_path):
    """Run 2 used to infer its columns again from its own first batch: a long became a
    double, a column vanished. Now run 2 starts from version 1; a fraction widens the
    column to double once (version 2, naming the message), and a column absent from
    run 2's data is still there."""
    state = tmp_path / "state"
    run([{"n": i, "tag": "t"} for i in range(3)], state)
    src, sink, report = run([{"n": 1.5}, {"n": 4}], state)
    assert src.final() == {"m0": "acked", "m1": "acked"}
    assert sorted(r["n"] for r in sink.rows) == [1.5, 4.0]
    assert all(set(r) == {"n", "tag"} for r in sink.rows)
    versions = history(state)
    assert [(v["version"], v["changes"]) for v in versions] == [
        (1, ["+n: int64", "+tag: string"]),
        (2, ["n: int64 -> double"]),
    ]
    assert versions[1]["brought_by"] == "m0"
    assert report.schema_versions == {"0:ident": 2}
    assert [c["version"] for c in report.schema_changes] == [2]
    # a third run changes nothing
    _, _, report = run([{"n": 2}], state)
    assert len(history(state)) == 2 and report.schema_changes == []


def test_a_value_that_cannot_widen_fails_its_message_naming_field_and_types(tmp_path):
    state = tmp_path / "s"
    run([{"n": 1, "c": {"a": 1}}], state)
    src, _sink, _ = run([{"n": "one"}, {"n": 2, "c": {"a": "x"}}, {"n": 3}], state)
    assert src.final() == {"m0": "dead_lettered", "m1": "dead_lettered", "m2": "acked"}
    assert (
        "field 'n'" in str(src.failures["m0"])
        and "string" in str(src.failures["m0"])
        and "int64" in str(src.failures["m0"])
    )
    assert "field 'c.a'" in str(src.failures["m1"])
    assert len(history(state)) == 1  # nothing evolved for values that cannot widen


def test_fractions_are_never_cut_by_an_integer_column(tmp_path):
    """pyarrow writes 7.5 into an int64 column as 7, silently. A fraction now widens the
    column (evolve), goes to _rescued (rescue), or fails its message (freeze, and with
    schema= given)."""
    for mode, expect in (("evolve", 7.5), ("rescue", None), ("freeze", "failed")):
        state = tmp_path / mode
        run([{"n": 1}], state, mode=mode)
        src, sink, _ = run([{"n": 7.5}, {"n": 7.0}], state, mode=mode)
        rows = {r["n"]: r for r in sink.rows}
        if expect == "failed":
            assert src.final()["m0"] == "dead_lettered"
            assert "fraction" in str(src.failures["m0"])
        elif expect is None:
            assert json.loads(sink.rows[0]["_rescued"]) == {"n": 7.5}
        else:
            assert expect in rows
        assert src.final()["m1"] == "acked"  # 7.0 is an integer: nothing is cut
    src = ListSource(['{"n": 7.5}'])
    sink = MemorySink()
    given = pa.schema([("n", pa.int64())])
    ackflow.run(Flow(src).map(lambda r: r, name="given", schema=given).to(sink), **LOCAL)
    assert src.final() == {"m0": "dead_lettered"} and sink.rows == []


def test_a_field_in_one_row_of_a_big_first_batch_takes_part(tmp_path):
    """No sampling luck: the first columns come from every good row of the first batch
    (the issue measured 21 valid records dead-lettered with a 200-row sample)."""
    bodies = [{"n": i} for i in range(999)] + [{"n": 999, "rare": {"deep": [1, 2]}}]
    src, _sink, report = run(bodies, tmp_path / "s", batch_size=1000, max_inflight=1000, mode="freeze")
    assert set(src.final().values()) == {"acked"}
    assert report.jobs == 1  # no evolution needed, no second job
    assert [v["columns"] for v in history(tmp_path / "s")] == [
        ["n: int64", "rare: struct<deep: list<element: int64>>"]
    ]


def test_null_only_fields_are_null_columns_until_a_value_arrives(tmp_path):
    """A field null (or empty) in every row is a column of the null type: the steps see
    it, a sink does not (it would have to guess a type); its first value evolves it."""
    state = tmp_path / "s"
    _src, sink, _ = run([{"n": 1, "later": None, "empty": []}], state)
    assert history(state)[0]["columns"] == ["n: int64", "later: null", "empty: null"]
    assert sink.rows == [{"n": 1}]
    _src, sink, _ = run([{"n": 2, "later": 5}], state)
    assert sink.rows == [{"n": 2, "later": 5}]
    assert history(state)[-1]["changes"] == ["later: int64"]


def test_bad_names_still_fail_their_message_in_every_mode(tmp_path):
    for mode in ("evolve", "rescue", "freeze"):
        state = tmp_path / mode
        run([{"n": 1}], state, mode=mode)
        src, _sink, _ = run(
            [{"n": 2, "a.b": 1}, {"n": 3, "N": 1}, {"n": 4, "__af_x": 1}, {"n": 5}], state, mode=mode
        )
        final = src.final()
        assert [final[f"m{i}"] for i in range(4)] == ["dead_lettered"] * 3 + ["acked"], mode
        assert "rename the field" in str(src.failures["m0"])
        assert "only in case" in str(src.failures["m1"])
        assert "reserved" in str(src.failures["m2"])


def test_flat_map_rows_and_a_second_segment_evolve_too(tmp_path):
    """A flat_map child with a new field makes its message run again after the columns
    evolved; every child is written once, and the other message is not run again."""

    def build(f):
        return f.flat_map(
            lambda r: [{"k": r["k"], "i": i, **r.get("extra", {})} for i in range(2)], name="split"
        )

    state = tmp_path / "s"
    run([{"k": "a"}], state, build=build)
    src, sink, report = run([{"k": "b", "extra": {"x": 1}}, {"k": "c"}], state, build=build)
    assert src.final() == {"m0": "acked", "m1": "acked"}
    assert sorted((r["k"], r["i"], r.get("x")) for r in sink.rows) == [
        ("b", 0, 1),
        ("b", 1, 1),
        ("c", 0, None),
        ("c", 1, None),
    ]
    assert report.schema_versions == {"0:split": 2}


def test_schema_mode_is_checked_at_start():
    with pytest.raises(ConfigError, match="schema_mode"):
        ackflow.run(Flow(ListSource([])).map(lambda r: r).to(MemorySink()), schema_mode="merge", **LOCAL)
    with pytest.raises(ConfigError, match="schema_mode"):
        Flow(ListSource([])).map(lambda r: r, schema_mode="x")
    with pytest.raises(ConfigError, match="schema="):
        Flow(ListSource([])).map(lambda r: r, schema="n BIGINT", schema_mode="freeze")


def test_a_step_overrides_the_run_mode(tmp_path):
    state = tmp_path / "s"

    def build(f):
        return f.map(lambda r: r, name="ident", schema_mode="freeze")

    run([{"n": 1}], state, build=build)
    src, _, _ = run([{"n": 2, "x": 1}], state, build=build, mode="evolve")
    assert src.final() == {"m0": "dead_lettered"}


def test_a_crash_after_the_version_is_recorded_completes_on_restart(tmp_path):
    """Law 11: the new version is recorded, then the sinks evolve, then the rows are
    written and acked. Killed right after the record (fault point schema.recorded), the
    restart finds the version stored, writes every message with its new field, and the
    history holds the addition once."""
    state = tmp_path / "state"
    out = tmp_path / "rows.jsonl"
    script = tmp_path / "flow.py"
    script.write_text(f"""
import json, sys, ackflow
from ackflow import Flow
from ackflow.sinks import MemorySink
from ackflow.embedded import EmbeddedQueue
from ackflow.sources import EmbeddedQueueSource
sink = MemorySink()
report = ackflow.run(Flow(EmbeddedQueueSource({str(tmp_path / "q.db")!r}, "q"))
                     .map(lambda r: r, name="ident").to(sink), executor="local",
                     until_idle=0.3, batch_size=10, state_dir={str(state)!r})
with open({str(out)!r}, "a") as f:
    for r in sink.rows:
        f.write(json.dumps(r, sort_keys=True) + "\\n")
""")
    from ackflow.embedded import EmbeddedQueue

    q = EmbeddedQueue(tmp_path / "q.db")
    q.publish("q", [json.dumps({"n": i}).encode() for i in range(5)])
    first = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    q.publish("q", [json.dumps({"n": i, "new": {"x": i}}).encode() for i in range(5, 10)])
    env = {**os.environ, "ACKFLOW_FAULTS": "schema.recorded=exit@1"}
    crashed = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    assert [v["version"] for v in history(state)] == [1, 2]  # recorded before the crash
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    later = sorted((r for r in rows if r["n"] >= 5), key=lambda r: r["n"])
    assert [r["new"] for r in later] == [{"x": i} for i in range(5, 10)]
    assert q.stats("q")["ready"] == 0 and q.stats("q")["dead_lettered"] == 0
    assert [v["changes"] for v in history(state)][1] == ["+new: struct<x: int64>"]
    q.close()


def test_the_store_keeps_versions_and_refuses_foreign_files(tmp_path):
    store = SchemaStore(tmp_path / "schemas.db")
    s1 = pa.schema([("a", pa.int64())])
    assert store.record("0:x", s1, ["+a: int64"], None) == 1
    assert store.record("0:x", s1, [], None) == 1  # the same columns: no new version
    s2, changes, _ = merge_schemas(s1, pa.schema([("b", pa.string())]))
    assert store.record("0:x", s2, changes, "m7") == 2
    store.close()
    again = SchemaStore(tmp_path / "schemas.db")
    assert again.current("0:x") == (2, s2)
    again.close()
    foreign = tmp_path / "other.db"
    import sqlite3

    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE t (x)")
    with pytest.raises(ConfigError, match="not an ackflow schema store"):
        open_readonly(str(foreign))


def test_cli_schema_show_and_history(tmp_path):
    state = tmp_path / "s"
    run([{"n": 1}], state)
    run([{"n": 2, "m": "x"}], state)
    cli = [sys.executable, "-m", "ackflow.cli", "schema"]
    shown = subprocess.run([*cli, "show", str(state)], capture_output=True, text=True)
    assert shown.returncode == 0 and "0:ident  version 2" in shown.stdout
    assert "n: int64" in shown.stdout and "m: string" in shown.stdout
    hist = subprocess.run([*cli, "history", str(state), "--json"], capture_output=True, text=True)
    versions = json.loads(hist.stdout)
    assert [v["changes"] for v in versions] == [["+n: int64"], ["+m: string"]]
    assert versions[1]["brought_by"] == "m0"
    missing = subprocess.run([*cli, "show", str(tmp_path / "none")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1


# -- a property: evolving shapes, in every mode, lose no field -------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEYS = st.sampled_from(["a", "b", "c", "d"])
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.text("xyz", max_size=3),
)
VALUE = st.recursive(
    LEAF,
    lambda inner: st.one_of(st.dictionaries(KEYS, inner, max_size=3), st.lists(inner, max_size=3)),
    max_leaves=6,
)
RECORDS = st.lists(st.dictionaries(KEYS, VALUE, min_size=1, max_size=4), min_size=1, max_size=25)


def kind(v):
    if empty(v):  # None, [] or {}, or only such: holds nothing
        return "empty"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    return type(v).__name__


def kinds(v, path, out):
    """Every (path, kind) of a value; list elements share the path ``p[]``."""
    k = kind(v)
    if k == "empty":
        return
    out.setdefault(path, set()).add(k)
    if isinstance(v, dict):
        for key, x in v.items():
            kinds(x, f"{path}.{key}", out)
    elif isinstance(v, list):
        for x in v:
            kinds(x, f"{path}[]", out)


@settings(
    max_examples=int(os.environ.get("AF_SHAPES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(records=RECORDS, batch=st.integers(1, 8), mode=st.sampled_from(["evolve", "rescue", "freeze"]))
def test_evolving_shapes_lose_no_field_in_any_mode(tmp_path_factory, records, batch, mode):
    """Random records whose fields appear, nest, widen and conflict, in random batches:
    - every message is settled; a message is dead-lettered only for a field whose kinds
      disagree across the records (``evolve``), or for a field outside the columns or a
      kind of another record (``freeze``); never in ``rescue``;
    - every acked message's row holds every field it had, at every depth (with the
      ``_rescued`` JSON put back in ``rescue``)."""
    state = tmp_path_factory.mktemp("s")
    src, sink, _ = run(records, state, mode=mode, batch_size=batch, max_inflight=2 * batch)
    final = src.final()
    assert set(final.values()) <= {"acked", "dead_lettered"}
    paths = {}
    for r in records:
        kinds(r, "", paths)
    torn = {p for p, ks in paths.items() if len(ks) > 1}  # kinds disagree across records
    rows = iter(sink.rows)
    by_n = {}
    for i, r in enumerate(records):
        if final[f"m{i}"] == "acked":
            by_n[i] = r
    assert len(sink.rows) == len(by_n)
    written = [unrescued(x) if mode == "rescue" else x for x in rows]
    for r in by_n.values():  # each acked record has a row that keeps all of it
        assert any(same(r, w) for w in written), (mode, r, written)
    for i, r in enumerate(records):
        if final[f"m{i}"] != "dead_lettered":
            continue
        assert mode != "rescue", (r, src.failures[f"m{i}"])
        mine = {}
        kinds(r, "", mine)
        if mode == "evolve":
            assert set(mine) & torn, (r, str(src.failures[f"m{i}"]), torn)


def test_the_store_sits_beside_the_flows_durable_state(tmp_path):
    """No state_dir: the columns are kept in a Parquet dataset's _ackflow folder (and
    survive a restart there); a flow with no local state keeps them in memory."""
    from ackflow.engine.schemas import default_location
    from ackflow.sinks import Parquet
    from ackflow.sources import EmbeddedQueueSource, Files

    out = tmp_path / "out"
    for bodies in ([{"n": 1}], [{"n": 2.5}]):
        src = ListSource([json.dumps(b) for b in bodies])
        ackflow.run(Flow(src).map(lambda r: r, name="ident").to(Parquet(out)), **LOCAL)
    assert [v["version"] for v in history(out / "_ackflow")] == [1, 2]
    assert default_location(Flow(ListSource([])).to(MemorySink())) is None
    (tmp_path / "in").mkdir()
    assert default_location(Flow(Files(tmp_path / "in")).to(MemorySink())) == str(
        tmp_path / "in" / "_ackflow" / "schemas.db"
    )
    q = str(tmp_path / "q.db")
    assert default_location(Flow(EmbeddedQueueSource(q, "q")).to(MemorySink())) == q + ".schemas.db"


# -- found by an adversarial review (each failed before its fix) -----------------------------


def test_rescue_over_columns_stored_by_an_evolve_run_keeps_every_field(tmp_path):
    """The stored columns had no _rescued column: rescue mode then dropped new fields and
    acked. Now the column is added as a new version."""
    state = tmp_path / "s"
    run([{"id": 1, "a": "x"}], state, mode="evolve")
    src, sink, _ = run([{"id": 2, "a": "y", "new": 42, "c": {"deep": 1}}], state, mode="rescue")
    assert src.final() == {"m0": "acked"}
    assert json.loads(sink.rows[0]["_rescued"]) == {"new": 42, "c": {"deep": 1}}
    assert history(state)[-1]["changes"] == ["+_rescued: string"]


def test_a_data_field_named_rescued_is_kept_inside_the_rescued_column(tmp_path):
    src, sink, _ = run(
        [{"id": 1, "_rescued": 7}, {"id": 2, "_rescued": "x", "z": 1}], tmp_path / "s", mode="rescue"
    )
    assert set(src.final().values()) == {"acked"}
    kept = [json.loads(r["_rescued"]) for r in sink.rows]
    assert {"_rescued": 7} in kept and {"_rescued": "x"} in kept
    assert [r["z"] for r in sink.rows if r["id"] == 2] == [1]  # z: a column of version 1


def test_a_value_arrow_cannot_hold_never_makes_a_column(tmp_path):
    """A new field first seen as 2**64 made the column a string, recorded for good, and
    every later integer was dead-lettered. Now that message fails alone, naming the
    field, and the next integer makes the column bigint."""
    state = tmp_path / "s"
    run([{"id": 1}], state)
    src, _, _ = run([{"id": 2, "n": 2**64}, {"id": 3, "n": 5}], state, batch_size=1, max_inflight=1)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked"}
    assert "'n'" in str(src.failures["m0"])
    assert history(state)[-1]["columns"] == ["id: int64", "n: int64"]


def test_evolution_runs_outside_the_bisection_budget(tmp_path):
    """max_bisect_jobs=1 and a new field: the run used to stop with an IndexError."""
    state = tmp_path / "s"
    run([{"id": 1}], state)
    src, sink, _ = run([{"id": 2, "new": 1}], state, max_bisect_jobs=1)
    assert src.final() == {"m0": "acked"} and sink.rows == [{"id": 2, "new": 1}]


def test_decimals_datetimes_and_map_values_are_never_cut(tmp_path):
    import datetime as dt
    from decimal import Decimal

    given = pa.schema([("price", pa.int64()), ("day", pa.date32()), ("m", pa.map_(pa.string(), pa.int64()))])
    values = [
        {"price": Decimal("1.99")},
        {"day": dt.datetime(2020, 1, 1, 23, 59)},
        {"m": {"k": 1.7}},
        {"price": Decimal("2"), "day": dt.datetime(2020, 1, 2), "m": {"k": 3.0}},
    ]
    sink = MemorySink()
    src = ListSource([json.dumps({"i": i}) for i in range(len(values))])
    ackflow.run(Flow(src).map(lambda r, v=tuple(values): v[r["i"]], name="m", schema=given).to(sink), **LOCAL)
    final = src.final()
    assert [final[f"m{i}"] for i in range(4)] == ["dead_lettered"] * 3 + ["acked"]
    assert "fraction" in str(src.failures["m0"]) and "time of day" in str(src.failures["m1"])
    assert "['k']" in str(src.failures["m2"])
    assert sink.rows == [{"price": 2, "day": dt.date(2020, 1, 2), "m": [("k", 3)]}]


def test_a_damaged_store_is_refused_at_start_naming_it(tmp_path):
    import sqlite3

    state = tmp_path / "s"
    run([{"id": 1}], state)
    with sqlite3.connect(state / "schemas.db") as c:
        c.execute("UPDATE schema_versions SET schema = 'bm90IGEgc2NoZW1h'")
    with pytest.raises(ConfigError, match=r"schemas\.db.*cannot be read"):
        run([{"id": 2}], state)


def test_two_writers_of_one_store_never_lose_a_column(tmp_path):
    a, b = SchemaStore(tmp_path / "s.db"), SchemaStore(tmp_path / "s.db")
    base = pa.schema([("id", pa.int64())])
    a.record("0:x", base, ["+id"], None)
    a.record("0:x", base.append(pa.field("p", pa.string())), ["+p"], "m1")
    b.record("0:x", base.append(pa.field("q", pa.string())), ["+q"], "m2")  # from v1
    assert a.current("0:x")[1].names == ["id", "p", "q"]
    a.close()
    b.close()


def test_a_headers_field_of_strings_is_a_map_not_a_struct_that_grows(tmp_path):
    """Header keys are whatever producers send: as struct fields they made a new version
    per key (and, in CI's hostile fuzz, a struct Spark read with two fields of one name).
    A headers field whose values are strings is a map of strings."""
    from ackflow.embedded import EmbeddedQueue
    from ackflow.sources import EmbeddedQueueSource

    db = str(tmp_path / "q.db")
    EmbeddedQueue(db).publish(
        "in", [b"a", b"b", b"c"], headers=[{"x": "1"}, {"y": "2", "\n": "3"}, {"X": "4"}]
    )
    src = EmbeddedQueueSource(db, "in", format="text")
    src.headers_field = "meta"
    sink = MemorySink()
    report = ackflow.run(
        Flow(src).map(lambda r: r, name="same").to(sink), **{**LOCAL, "batch_size": 1, "max_inflight": 1}
    )
    assert report.acked == 3 and [c["version"] for c in report.schema_changes] == [1]
    assert sorted(sorted(r["meta"]) for r in sink.rows) == sorted(
        [[("X", "4")], [("\n", "3"), ("y", "2")], [("x", "1")]]
    )


TYPES = [
    pa.int8(), pa.int64(), pa.uint8(), pa.uint64(), pa.float16(), pa.float32(), pa.float64(),
    pa.null(), pa.date32(), pa.timestamp("us"), pa.time64("us"), pa.string(), pa.bool_(),
    pa.struct([("a", pa.int64())]), pa.list_(pa.int64()), pa.map_(pa.string(), pa.int64()),
    pa.int16(), pa.int32(), pa.uint32(), pa.date64(), pa.time32("s"), pa.timestamp("ms", "UTC"),
    pa.duration("s"), pa.large_list(pa.float32()), pa.decimal128(10, 2), pa.binary(),
    pa.dictionary(pa.int32(), pa.string()),
]  # fmt: skip


def test_the_plain_types_skipped_by_conform_are_always_passed_by_outside():
    """``conform`` skips ``outside`` for a value of a plain type (``plain_types``): that
    is only right if ``outside`` would pass every such value. Checked over every type a
    column may have and values at the edges (huge and negative ints, NaN, infinities,
    float32's limits, booleans, which are not plain)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ackflow.core.schema import outside, plain_types

    values = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.5, 1e-46, 3.5e38, -0.0, 2.0**64]),
    )

    @settings(max_examples=2000, deadline=None, derandomize=True)
    @given(value=values, t=st.sampled_from(TYPES))
    def check(value, t):
        if type(value) in plain_types(t):
            assert outside(value, t, "x") is None, (value, t)

    check()
    assert bool not in plain_types(pa.int64()) and float not in plain_types(pa.float32())
