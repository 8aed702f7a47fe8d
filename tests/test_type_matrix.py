"""Every Spark SQL type a flow can produce, through every sink, read back and compared.

One flow makes a column of each type (timestamp, timestamp_ntz, date, decimal, binary,
arrays, maps, structs with nested temporal and decimal fields, booleans, every integer
and floating width) from JSON messages, one of them all nulls, and writes it to each
sink; the test reads each sink back in its own way (pyarrow, deltalake, pyiceberg,
psycopg, the embedded queue, a RabbitMQ queue) and compares with values written here
by hand. JSON sinks are compared with the JSON form of ``ackflow.sinks.jsonrows``.

Then the same for error sinks: a dead letter's body, error and counts as each sink
keeps them.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from decimal import Decimal

import pyarrow as pa
import pytest

import ackflow
from ackflow.testing import ListSource
from helpers import FAST

pytestmark = pytest.mark.spark

UTC = dt.UTC
AT = dt.datetime(2024, 1, 2, 3, 4, 5, 678000)
MESSAGES = [
    {
        "id": 1,
        "ts": "2024-01-02 03:04:05.678",
        "d": "2024-01-02",
        "amt": "12.34",
        "b": base64.b64encode(b"\x00hello\xff").decode(),
        "arr": [1, 2],
    },
    {"id": 2, "ts": None, "d": None, "amt": None, "b": None, "arr": None},
]

FULL = {
    "id": 1,
    "t": AT.replace(tzinfo=UTC),
    "tntz": AT,
    "dt": dt.date(2024, 1, 2),
    "dec": Decimal("12.34"),
    "bin": b"\x00hello\xff",
    "arr": [1, 2],
    "mp": {"k": 1},
    "st": {"i": 1, "at": AT.replace(tzinfo=UTC), "amt": Decimal("12.34")},
    "arrst": [{"q": 1, "day": dt.date(2024, 1, 2)}],
    "bo": True,
    "fl": 1.5,
    "dbl": 0.25,
    "sh": 1,
    "by": 1,
    "i32": 1,
}
NULLS = {
    **dict.fromkeys(FULL),
    "id": 2,
    "mp": {"k": 2},
    "st": {"i": 2, "at": None, "amt": None},
    "arrst": [{"q": 1, "day": None}],
    "bo": True,
    "fl": 1.5,
    "dbl": 0.25,
    "sh": 2,
    "by": 2,
    "i32": 2,
}
EXPECTED = {1: FULL, 2: NULLS}


def columns():
    from pyspark.sql import functions as F

    ts = F.to_timestamp(F.col("ts"))
    dec = F.col("amt").cast("decimal(10,2)")
    return dict(
        t=ts,
        tntz=F.to_timestamp_ntz(F.col("ts")),
        dt=F.to_date(F.col("d")),
        dec=dec,
        bin=F.unbase64(F.col("b")),
        mp=F.create_map(F.lit("k"), F.col("id")),
        st=F.struct(F.col("id").alias("i"), ts.alias("at"), dec.alias("amt")),
        arrst=F.array(F.struct(F.lit(1).alias("q"), F.to_date(F.col("d")).alias("day"))),
        bo=F.lit(True),
        fl=F.lit(1.5).cast("float"),
        dbl=F.lit(0.25),
        sh=F.col("id").cast("short"),
        by=F.col("id").cast("byte"),
        i32=F.col("id").cast("int"),
    )


def run_flow(spark, sink, *, error_sink=None, messages=MESSAGES):
    src = ListSource([json.dumps(m).encode() for m in messages], policy=ackflow.RetryPolicy(max_deliveries=1))
    flow = ackflow.Flow(src).with_columns(**columns()).to(sink)
    if error_sink is not None:
        flow = flow.on_error(error_sink)
    return ackflow.run(flow, spark=spark, **FAST)


def canonical(v):
    """Arrow's map form (a list of pairs) as a dict, aware datetimes in UTC, and the same
    inside nested values."""
    if isinstance(v, dt.datetime) and v.tzinfo is not None:
        return v.astimezone(UTC)
    if isinstance(v, list) and v and all(isinstance(x, tuple) and len(x) == 2 for x in v):
        return {k: canonical(x) for k, x in v}
    if isinstance(v, list):
        return [canonical(x) for x in v]
    if isinstance(v, dict):
        return {k: canonical(x) for k, x in v.items()}
    return v


def json_form(v):
    """The JSON form ackflow's JSON sinks write (ackflow.sinks.jsonrows)."""
    if isinstance(v, dt.datetime | dt.date):
        return v.isoformat()
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, bytes):
        return base64.b64encode(v).decode()
    if isinstance(v, dict):
        return {k: json_form(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_form(x) for x in v]
    return v


def compare(rows, *, nested_json=False, all_json=False, drop=()):
    """``rows``: the sink's rows (dicts with at least the expected columns)."""
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == [1, 2], rows
    for i, want in EXPECTED.items():
        got = {k: canonical(v) for k, v in by_id[i].items() if k in want and k not in drop}
        want = {k: v for k, v in want.items() if k not in drop}
        if all_json:
            want = json_form(want)
        elif nested_json:
            want = {k: json_form(v) if isinstance(v, dict | list) else v for k, v in want.items()}
        assert got == want, f"row {i}: {sorted(k for k in want if got.get(k) != want[k])}"


def assert_all_acked(report):
    assert (report.acked, report.dead_lettered, report.nacked) == (2, 0, 0), report.failures


def test_parquet(spark, tmp_path):
    import pyarrow.parquet as pq

    from ackflow.sinks import Parquet

    assert_all_acked(run_flow(spark, Parquet(tmp_path / "out")))
    compare(pq.read_table(tmp_path / "out").to_pylist())


def test_delta(spark, tmp_path):
    from deltalake import DeltaTable

    from ackflow.sinks import Delta

    assert_all_acked(run_flow(spark, Delta(tmp_path / "out")))
    compare(DeltaTable(str(tmp_path / "out")).to_pyarrow_table().to_pylist())


def test_iceberg(spark, tmp_path):
    from ackflow.sinks import Iceberg

    sink = Iceberg(f"sqlite:///{tmp_path}/cat.db", "ns.types")
    assert_all_acked(run_flow(spark, sink))
    compare(sink._load().scan().to_arrow().to_pylist())


def test_postgres(spark, postgres, pg_table):
    import psycopg
    from psycopg import sql

    from ackflow.sinks import Postgres

    assert_all_acked(run_flow(spark, Postgres(postgres.dsn, pg_table, create=True)))
    with psycopg.connect(postgres.dsn) as c:
        cur = c.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(pg_table)))
        names = [d.name for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    # arrays, maps and structs are jsonb, in the JSON form of every JSON sink
    compare(rows, nested_json=True)


def test_embedded_queue(spark, tmp_path):
    from ackflow.embedded import EmbeddedQueue
    from ackflow.sinks import EmbeddedQueue as EmbeddedSink

    db = str(tmp_path / "q.db")
    assert_all_acked(run_flow(spark, EmbeddedSink(db, "out")))
    q = EmbeddedQueue(db)
    try:
        leased = q.lease("out", 10, visibility_timeout=30)
        rows = [json.loads(m.body) for m in leased]
    finally:
        q.close()
    compare(rows, all_json=True)
    # ackflow reads its own output back: the next stage decodes every body
    from ackflow.sinks import MemorySink
    from ackflow.sources import EmbeddedQueue as EmbeddedSource

    out = MemorySink()
    report = ackflow.run(ackflow.Flow(EmbeddedSource(db, "out")).to(out), spark=spark, **FAST)
    assert report.acked == 2 and report.dead_lettered == 0, report.failures


def test_rabbitmq_publish(spark, rabbitmq):
    from ackflow.sinks import RabbitMQ
    from amqp import drain, names, setup

    ex, q = names("types-x"), names("types-q")
    setup(rabbitmq.url, queue=names("unused"), out_exchange=ex, out_queue=q)
    assert_all_acked(run_flow(spark, RabbitMQ(rabbitmq.url, ex, routing_key=q)))
    compare([body for _, body, _ in drain(rabbitmq.url, q)], all_json=True)


def test_a_nan_fails_only_its_message_in_a_json_sink(spark, tmp_path):
    """JSON has no NaN: the row holding one fails alone, naming the field; never a NaN
    written for the next stage's strict decoder to refuse."""
    from pyspark.sql import functions as F

    from ackflow.embedded import EmbeddedQueue
    from ackflow.sinks import EmbeddedQueue as EmbeddedSink

    db = str(tmp_path / "q.db")
    src = ListSource(
        [json.dumps({"x": x}).encode() for x in (1.0, 0.0, 2.0)], policy=ackflow.RetryPolicy(max_deliveries=1)
    )
    flow = ackflow.Flow(src).with_columns(r=F.try_divide(F.col("x") - F.col("x"), F.col("x")))
    # try_divide(0, 0) is null in Spark; sqrt(-x) is NaN for the x = 2.0 message
    flow = flow.with_columns(r=F.when(F.col("x") == 2.0, F.sqrt(-F.col("x"))).otherwise(F.col("r")))
    report = ackflow.run(flow.to(EmbeddedSink(db, "out")), spark=spark, **FAST)
    assert report.acked == 2 and report.dead_lettered == 1, report.failures
    (failure,) = report.failures
    assert failure["message"] == "m2" and "field 'r'" in failure["error"], failure
    q = EmbeddedQueue(db)
    try:
        leased = q.lease("out", 10, visibility_timeout=30)
        assert sorted(json.loads(m.body)["x"] for m in leased) == [0.0, 1.0]
    finally:
        q.close()


# -- error sinks: a dead letter as each sink keeps it ----------------------------------

POISON = [
    {"id": 1, "ts": "2024-01-02 03:04:05", "d": "2024-01-02", "amt": "12.34", "b": "aGk=", "arr": [1]},
    {"id": 2, "ts": "not a time", "d": "2024-01-02", "amt": "12.34", "b": "aGk=", "arr": [1]},
]


def check_dead_letter(row, *, text=False):
    assert row["message"] == "m1"
    body = row["body"]
    body = bytes(body) if isinstance(body, memoryview) else body
    if text:  # PostgreSQL: body as text (it is UTF-8), failed_at a timestamptz
        assert row["body_bytes"] is None and isinstance(row["failed_at"], dt.datetime)
        assert row["failed_at"].tzinfo is not None
    elif isinstance(body, str):  # a JSON sink keeps the bytes as base64
        body = base64.b64decode(body)
    assert json.loads(body) == POISON[1]
    assert "not a time" in row["error"] or "CAST" in row["error"].upper(), row["error"]
    assert row["deliveries"] == 1
    assert isinstance(row["failed_at"], float | dt.datetime | str)


def run_poison(spark, tmp_path, error_sink):
    from ackflow.sinks import Parquet

    report = run_flow(spark, Parquet(tmp_path / "main"), error_sink=error_sink, messages=POISON)
    assert (report.acked, report.dead_lettered) == (1, 1), report.failures
    return report


def test_error_sinks_keep_the_dead_letter_in_every_store(spark, tmp_path, postgres, pg_table, rabbitmq):
    import psycopg
    import pyarrow.parquet as pq
    from deltalake import DeltaTable
    from psycopg import sql

    from ackflow.embedded import EmbeddedQueue
    from ackflow.sinks import Delta, Iceberg, Parquet, Postgres
    from ackflow.sinks import EmbeddedQueue as EmbeddedSink

    run_poison(spark, tmp_path, Parquet(tmp_path / "dlq-parquet", name="dlq"))
    (row,) = pq.read_table(tmp_path / "dlq-parquet").to_pylist()
    check_dead_letter(row)

    run_poison(spark, tmp_path, Delta(tmp_path / "dlq-delta", name="dlq"))
    (row,) = DeltaTable(str(tmp_path / "dlq-delta")).to_pyarrow_table().to_pylist()
    check_dead_letter(row)

    ice = Iceberg(f"sqlite:///{tmp_path}/cat.db", "ns.dlq", name="dlq")
    run_poison(spark, tmp_path, ice)
    (row,) = ice._load().scan().to_arrow().to_pylist()
    check_dead_letter(row)

    run_poison(spark, tmp_path, Postgres(postgres.dsn, pg_table, create=True, name="dlq"))
    with psycopg.connect(postgres.dsn) as c:
        cur = c.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(pg_table)))
        names = [d.name for d in cur.description]
        (row,) = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    check_dead_letter(row, text=True)

    from ackflow.sinks import RabbitMQ
    from amqp import drain, names, setup

    ex, q = names("dlq-x"), names("dlq-q")
    setup(rabbitmq.url, queue=names("unused"), out_exchange=ex, out_queue=q)
    run_poison(spark, tmp_path, RabbitMQ(rabbitmq.url, ex, routing_key=q, name="dlq"))
    ((_, row, _),) = drain(rabbitmq.url, q)
    check_dead_letter(row)

    db = str(tmp_path / "dlq.db")
    run_poison(spark, tmp_path, EmbeddedSink(db, "dlq", name="dlq"))
    q = EmbeddedQueue(db)
    try:
        (m,) = q.lease("dlq", 10, visibility_timeout=30)
        check_dead_letter(json.loads(m.body))
    finally:
        q.close()


def test_arrow_types_the_json_form_covers():
    """Unit check of the JSON form for types the flows above do not make."""
    from ackflow.sinks.jsonrows import json_records

    t = pa.table(
        {
            "dur": pa.array([dt.timedelta(days=1, seconds=3, microseconds=500000)], pa.duration("us")),
            "intmap": pa.array([[(1, "a")]], pa.map_(pa.int32(), pa.string())),
            "inf": pa.array([[1.0, float("inf")]], pa.list_(pa.float64())),
        }
    )
    (ok,) = json_records(t.drop_columns(["inf"]))
    assert json.loads(ok) == {"dur": "P1DT3.5S", "intmap": {"1": "a"}}
    exact = pa.table(
        {
            "dur": pa.array(
                [dt.timedelta(seconds=11045, microseconds=678901), dt.timedelta(seconds=-7)],
                pa.duration("us"),
            )
        }
    )
    assert [json.loads(b)["dur"] for b in json_records(exact)] == ["P0DT11045.678901S", "-P0DT7S"]
    (bad,) = json_records(t)
    assert isinstance(bad, str) and "'inf[1]'" in bad
