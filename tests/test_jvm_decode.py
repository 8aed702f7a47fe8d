"""JSON decoded in the JVM where it certainly reads as Python does (spark/jvm_decode.py):
which messages the JVM takes, and, for a flow of Column steps, the same rows and dead
letters message by message with the JVM's reader on and off, hostile inputs included."""

import json
import os
import re

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ackflow
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import MemorySink
from ackflow.sources import EmbeddedQueueSource
from ackflow.spark import jvm_decode
from ackflow.spark.plan import INPUT_SCHEMA
from ackflow.spark.rows import make_segment
from helpers import FAST
from test_hostile import KNOWN, nested

pytestmark = pytest.mark.spark

SCHEMA = pa.schema(
    [
        ("qty", pa.int64()),
        ("price", pa.float64()),
        ("sku", pa.string()),
        ("ok", pa.bool_()),
        ("m", pa.struct([("x", pa.int64())])),
    ]
)
#: body -> taken by the JVM
ROUTES = {
    b'{"qty": 1, "price": 2.5, "sku": "a", "ok": true}': True,
    b' {"qty":-3,"price":7,"sku":null,"ok":false}\r\n': True,
    b"{}": True,
    b'{"price": 9007199254740992.0, "sku": "\xc3\xa9\xf0\x9f\x98\x80"}': True,
    b'{"price": 1e5, "qty": -0}': True,
    b'{"price": -0}': True,
    b'{"price": -0.0, "sku": ""}': True,
    b'{"price": 123456789012345, "qty": 9223372036854775807}': True,
    b'{"price": 0.1e-400}': True,
    # left to Python (valid or not: it decides)
    b'{"qty": 1, "qty": 2}': False,  # a key twice
    b'{"price": 1e999}': False,  # not finite
    b'{"price": NaN}': False,
    b'{"price": -Infinity}': False,
    b'{"sku": 5}': False,  # a number where a string is
    b'{"qty": "5"}': False,
    b'{"qty": 1.0}': False,
    b'{"qty": 1e2}': False,
    b'{"qty": 99999999999999999999}': False,  # past a long
    b'{"price": 9007199254740993}': False,  # an integer a double cannot hold exactly
    b'{"ok": 1}': False,
    b'{"qty": 1}}': False,  # text after the object
    b'{"qty": 1} x': False,
    b'{"qty": 1}{"qty": 2}': False,
    b'{"qty": 1}\xe2\x80\xa8': False,  # a line separator after it (Java's $ matched there)
    b'{"qty": 1}\xe2\x80\xa9': False,
    b'{"qty": 1}\xc2\x85': False,
    b'{"qty": 1}\n\xe2\x80\xa8': False,
    b'{"sku": "\xff"}': False,  # invalid UTF-8
    b'{"sku": "\xed\xa0\x80"}': False,  # a surrogate in UTF-8
    b'{"sku": "\\ud800"}': False,  # an escape
    b'{"sku": "a\\"b"}': False,
    b'{"qty" :1}': False,  # white space before a colon
    b'{"other": 1}': False,  # a field outside the columns
    b'{"QTY": 1}': False,
    b'{"m": {"x": 1}}': False,  # a nested value
    b'{"m": null}': False,  # a column the JVM does not read
    b'{"qty": [1]}': False,
    b"{'qty': 1}": False,
    b'{"qty": 01}': False,
    b'{"qty": 1,}': False,
    b'{"sku": "a\x01b"}': False,
    b"\xef\xbb\xbf{}": False,
    b'{"_rescued": "x"}': False,
    b"[1]": False,
    b"null": False,
    b"": False,
}


def test_the_jvm_takes_only_what_it_reads_as_python_does(spark):
    bodies = list(ROUTES)
    n = len(bodies)
    table = pa.table(
        {
            "__af_id": pa.array(range(n), pa.int64()),
            "__af_key": [f"k{i}" for i in range(n)],
            "__af_body": pa.array(bodies, pa.binary()),
            "__af_src": pa.array([0] * n, pa.int32()),
            "__af_hdr": pa.nulls(n, pa.string()),
        },
        schema=INPUT_SCHEMA,
    )
    df = spark.createDataFrame(table)
    schema = pa.schema([*SCHEMA, ("_rescued", pa.string())])
    decoded, rest = jvm_decode.split(df, schema, ["json"])
    mine = decoded.toArrow().sort_by("__af_id")
    taken = {bodies[i] for i in mine.column("__af_id").to_pylist()}
    left = {bodies[i] for i in rest.toArrow().column("__af_id").to_pylist()}
    assert taken | left == set(bodies) and not taken & left
    assert {b for b, jvm in ROUTES.items() if jvm} == taken
    # what the JVM made is what the Python decoder makes of the same messages
    fn = make_segment((), ["json"], None, schema, _out(schema), fast_json=False)
    same = table.filter(pc.is_in(table["__af_id"], mine["__af_id"]))
    theirs = pa.Table.from_batches(list(fn(iter(same.to_batches()))))
    assert str(mine.to_pylist()) == str(theirs.sort_by("__af_id").to_pylist())  # -0.0 too
    # and a source of another format, or headers, leave every message to Python
    assert jvm_decode.split(df, schema, ["text"])[0].count() == 0
    headed = table.set_column(4, "__af_hdr", pa.array(['{"meta": {}}'] * n, pa.string()))
    assert jvm_decode.split(spark.createDataFrame(headed), schema, ["json"])[0].count() == 0


def _out(schema):
    from ackflow.spark.columns import internal_schema

    return pa.schema([*schema, *internal_schema()])


COLUMNS = re.compile(r"the columns \[[^\]]*\]")
SEED = [json.dumps({"qty": i, "price": i / 4, "sku": f"s{i}", "ok": i % 2 == 0}).encode() for i in range(50)]


def outcome(spark, tmp_path, bodies, on, monkeypatch):
    """(rows, dead letters) of a Column-only flow over ``bodies`` after 50 messages that
    make its columns known, with the JVM's reader on or off."""
    db = str(tmp_path / f"q-{on}.db")
    EmbeddedQueue(db).publish("in", [*SEED, *bodies])
    src = EmbeddedQueueSource(db, "in", policy=ackflow.RetryPolicy(max_deliveries=2, backoff_s=0.01))
    sink, dead = MemorySink(), MemorySink(name="dead")
    splits = []
    real = jvm_decode.split
    monkeypatch.setattr(jvm_decode, "split", lambda *a: splits.append(1) or real(*a))
    spark.conf.set("spark.ackflow.jvmjson", "true" if on else "false")
    try:
        ackflow.run(
            ackflow.Flow(src).with_columns(twice="qty * 2").to(sink).on_error(dead),
            spark=spark,
            **{**FAST, "max_inflight": 50, "until_idle": 0.5, "systemic_stop_after_s": 15},
        )
    finally:
        spark.conf.unset("spark.ackflow.jvmjson")
    assert bool(splits) == on  # the path under test was taken
    rows = sorted(json.dumps(r, sort_keys=True, default=str) for r in sink.rows)
    # a row that fits no type names the columns of that moment: which new fields evolved
    # first depends on which rows reached the Python decoder together (CI saw both)
    letters = sorted((r["body"], r["step"], COLUMNS.sub("the columns [...]", r["error"])) for r in dead.rows)
    assert len(sink.rows) + len(dead.rows) >= len(SEED)
    return rows, letters


@settings(
    max_examples=int(os.environ.get("ACKFLOW_HOSTILE_EXAMPLES", "5")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@example(bodies=[*KNOWN, *ROUTES])
@given(
    bodies=st.lists(
        st.one_of(
            st.sampled_from([*KNOWN, *ROUTES]),
            st.binary(max_size=32),
            st.dictionaries(st.sampled_from(["qty", "price", "sku", "ok", "new"]), nested, max_size=4).map(
                lambda d: json.dumps(d).encode()
            ),
            st.fixed_dictionaries(
                {"qty": st.integers(), "price": st.floats(allow_nan=False), "sku": st.text(max_size=5)}
            ).map(lambda d: json.dumps(d).encode()),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_a_column_only_flow_gives_each_message_the_same_outcome_with_the_jvm_reader_or_without(
    spark, tmp_path_factory, monkeypatch, bodies
):
    """Hostile bodies (the fuzz's known cases, the routing cases above, drawn bytes and
    objects whose fields drift in type and name, so the columns evolve): every row
    written and every dead letter (body, step, reason) are the same whether the JVM
    decoded what it could or Python decoded everything."""
    tmp = tmp_path_factory.mktemp("jvm")
    assert outcome(spark, tmp, bodies, True, monkeypatch) == outcome(spark, tmp, bodies, False, monkeypatch)


@pytest.mark.parametrize("on", ["jvm", "python", "jvm, its input files unwritable"])
def test_decode_counts_every_message_in_once_whoever_decodes_it(spark, on, monkeypatch):
    """The status page's rows per step: in, out and failed at decoding are the same
    whether the JVM decoded most messages (the driver counts them in) or Python all;
    the batch's input files go with its job, and where they cannot be written the
    messages reach the JVM through ``createDataFrame``."""
    from ackflow.core.settlement import Delivery
    from ackflow.spark.compile import CompiledFlow
    from ackflow.spark.feed import LOCK, Feeds
    from ackflow.testing import ListSource

    if on.endswith("unwritable"):

        def full(self, table, batch_id):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(Feeds, "write_parquet", full)
    bodies = [*SEED, b'{"qty": 1, "qty": 2}', b"[1]", b'{"sku": 5}', b"{bad", b'{"price": 1e999}']
    flow = ackflow.Flow(ListSource([])).with_columns(twice="qty * 2").to(MemorySink())
    spark.conf.set("spark.ackflow.jvmjson", "false" if on == "python" else "true")
    try:
        plan = CompiledFlow(flow, spark, count_rows=True)
        plan._schemas[(0,)] = SCHEMA  # the columns are known (a run before stored them)
        inputs = plan.input_table([Delivery(i, f"m{i}", b) for i, b in enumerate(bodies)])
        assert plan._jvm_decodes() == (on != "python")
        receipts = plan.job(inputs, "b1").toArrow()
        plan.release("b1")
    finally:
        spark.conf.unset("spark.ackflow.jvmjson")
    assert os.listdir(plan._feeds.dir) == [LOCK]
    assert sorted(set(receipts.column("id").drop_null().to_pylist())) == list(range(len(bodies)))
    # five fail at decoding: a key twice, [1], {bad, 1e999, and {"sku": 5} (a number in
    # a string column: a schema miss, the columns evolve and it runs again)
    assert plan.row_counts()["decode"] == (len(bodies), len(bodies) - 5, 5)


def test_a_failed_job_counts_no_message_into_decoding_from_the_driver(spark):
    """A job that fails as a whole (a Column step overflows) adds no decode counts from
    the driver: it counts the JVM's messages in only once the job has succeeded (review:
    they were added before the job ran, failures counted as decoded). What tasks of the
    Python decoder finished may have added, as they do without the JVM (CI saw a failed
    job's finished task counted: a failed job's counts are partial either way)."""
    from ackflow.core.settlement import Delivery
    from ackflow.spark.compile import CompiledFlow
    from ackflow.testing import ListSource

    bodies = [b'{"qty": 1}', b"{bad", b'{"qty": 5000000000000000000}']
    flow = ackflow.Flow(ListSource([])).with_columns(twice="qty * 2").to(MemorySink())
    spark.conf.set("spark.ackflow.jvmjson", "true")
    try:
        plan = CompiledFlow(flow, spark, count_rows=True)
        plan._schemas[(0,)] = SCHEMA
        inputs = plan.input_table([Delivery(i, f"m{i}", b) for i, b in enumerate(bodies)])
        assert plan._jvm_decodes()
        with pytest.raises(Exception, match="ARITHMETIC_OVERFLOW"):
            plan.job(inputs, "b1").toArrow()
        plan.release("b1")
    finally:
        spark.conf.unset("spark.ackflow.jvmjson")
    # messages in are counted by the driver alone on this path (the Python decoder adds
    # only its failures: {bad, if its task finished)
    assert plan.row_counts().get("decode", (0, 0, 0))[0] == 0
