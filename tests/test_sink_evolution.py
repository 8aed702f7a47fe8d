"""Sinks evolve with the flow's schema (issue 30): ``prepare(v1)``, rows, ``prepare(v2)``
with a new column, a new struct field, a grown list-of-struct element and widened
types, rows, then everything read back: old rows with nulls in the new fields, new rows
with every field at every depth. ``evolve=False`` keeps refusing. A crash between the
table's evolution and the end of ``prepare`` (fault point ``<sink>.evolved``) leaves a
table the next ``prepare`` accepts.

The sinks are driven as the engine drives them (``prepare`` on the driver, then
``write_partition`` and ``commit``), with ``prepare_like_plan`` standing in for
``Plan.prepare_sink``'s handling of refused and retyped columns.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from ackflow import faults
from ackflow.core.errors import ColumnsRefused
from ackflow.sinks import Delta, Iceberg, Parquet, Postgres
from ackflow.sinks.base import ROW_KEY

S1 = pa.struct([("x", pa.string())])
S2 = pa.struct([("x", pa.string()), ("z", pa.bool_())])
L1 = pa.list_(pa.struct([("y", pa.int64())]))
L2 = pa.list_(pa.struct([("y", pa.int64()), ("w", pa.string())]))
V1 = pa.schema([("id", pa.int64()), ("a", pa.int32()), ("f", pa.int64()), ("s", S1), ("l", L1)])
V2 = pa.schema(
    [("id", pa.int64()), ("a", pa.int64()), ("f", pa.float64()), ("s", S2), ("l", L2), ("n", pa.string())]
)
KINDS = ["postgres", "parquet", "delta", "iceberg"]
#: which widenings each sink makes: a (int32 -> int64), f (int64 -> float64)
WIDENS = {"postgres": {"a", "f"}, "parquet": {"a"}, "iceberg": {"a"}, "delta": set()}
POINT = {
    "postgres": "postgres.evolved",
    "parquet": "parquet.evolved",
    "delta": "delta.evolved",
    "iceberg": "iceberg.evolved",
}

ROW1 = {"id": 1, "a": 1, "f": 5, "s": {"x": "u"}, "l": [{"y": 1}]}


def row2(kind):
    return {
        "id": 2,
        "a": 2**40 if "a" in WIDENS[kind] else 7,
        "f": 6.5 if "f" in WIDENS[kind] else 6.0,
        "s": {"x": "v", "z": True},
        "l": [{"y": 2, "w": "q"}, {"y": 3, "w": None}],
        "n": "new",
    }


def make(kind, tmp_path, postgres=None, table=None, **options):
    if kind == "postgres":
        sink = Postgres(postgres.dsn, table, create=True, **options)
    elif kind == "parquet":
        sink = Parquet(tmp_path / "p", **options)
    elif kind == "delta":
        sink = Delta(tmp_path / "d", **options)
    else:
        sink = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t", **options)
    sink.open()
    return sink


@pytest.fixture
def sink_of(request, tmp_path):
    """``sink_of(kind, **options)``: a sink on a fresh table; the PostgreSQL server only
    for kind ``postgres``."""
    made = []

    def build(kind, **options):
        pg = table = None
        if kind == "postgres":
            pg = request.getfixturevalue("postgres")
            table = request.getfixturevalue("pg_table")
        sink = make(kind, tmp_path, pg, table, **options)
        made.append(sink)
        return sink

    yield build
    for sink in made:
        sink.close()


def prepare_like_plan(sink, schema):
    """``Plan.prepare_sink``: columns refused leave the schema, retyped ones take the
    table's type, until ``prepare`` accepts. Returns (refused, retyped)."""
    refused, retyped = {}, {}
    while True:
        use = pa.schema(
            [
                f.with_type(retyped[f.name]) if f.name in retyped else f
                for f in schema
                if f.name not in refused
            ]
        )
        try:
            sink.prepare(use)
            return refused, retyped
        except ColumnsRefused as e:
            names = set(e.columns) | set(e.retype)
            assert names and not names & {*refused, *retyped}, e
            retyped = {**retyped, **e.retype}
            refused = {**refused, **{c: w for c, w in e.columns.items() if c not in e.retype}}


def rows(schema, records, refused=()):
    schema = pa.schema([f for f in schema if f.name not in refused])
    table = pa.Table.from_pylist(
        [{k: v for k, v in r.items() if k not in refused} for r in records], schema=schema
    )
    return table.append_column(ROW_KEY, pa.array([f"m{r['id']}" for r in records]))


def write(sink, batch, table):
    result = sink.write_partition(batch, 0, table)
    sink.commit(batch, [result.token] if result.token else [])
    return dict(result.failed)


def read_back(kind, sink):
    """Rows sorted by id, with the nested values as Python values."""
    if kind == "postgres":
        import psycopg
        from psycopg import sql

        with psycopg.connect(sink.dsn) as conn:
            cur = conn.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(sink._ident()))
            names = [d.name for d in cur.description]
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    if kind == "parquet":
        table = parquet_by_pyarrow(sink.path)
    elif kind == "delta":
        from deltalake import DeltaTable

        table = DeltaTable(sink.path).to_pyarrow_table()
    else:
        table = sink._load().scan().to_arrow()
    return sorted(table.to_pylist(), key=lambda r: r["id"])


def parquet_by_pyarrow(path):
    """The recipe of docs/sinks/parquet.md: the dataset's schema from ``_common_metadata``."""
    schema = pq.read_schema(f"{path}/_common_metadata")
    return ds.dataset(path, schema=schema, format="parquet").to_table()


def parquet_by_polars(path):
    import polars as pl

    schema = pl.read_parquet_schema(f"{path}/_common_metadata")
    cast = pl.ScanCastOptions(
        integer_cast=["upcast", "allow-float"], float_cast="upcast", missing_struct_fields="insert"
    )
    return (
        pl.scan_parquet(
            f"{path}/**/*.parquet",
            schema=schema,
            missing_columns="insert",
            cast_options=cast,
            hive_partitioning=False,
        )
        .collect()
        .to_dicts()
    )


def same(got, want):
    """``got`` holds ``want``: equal at every depth, a missing or null field equal to a
    null one (a jsonb object has no key for a field added later)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), (got, want)
        for k in set(got) | set(want):
            same(got.get(k), want.get(k))
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            same(g, w)
    else:
        assert got == want, (got, want)


def table_types(kind, sink):
    """Column -> type name as the table keeps it."""
    if kind == "postgres":
        import psycopg

        with psycopg.connect(sink.dsn) as conn:
            return dict(
                conn.execute(
                    "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
                    "attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
                    [sink.table],
                ).fetchall()
            )
    if kind == "parquet":
        schema = sink.stored_schema()
    else:
        schema = sink.table_schema()[0]
    return {f.name: str(f.type) for f in schema}


def evolve_and_check(kind, sink):
    assert prepare_like_plan(sink, V1) == ({}, {})
    assert write(sink, "b1", rows(V1, [ROW1])) == {}
    refused, retyped = prepare_like_plan(sink, V2)
    assert refused == {}
    # what the format cannot widen keeps the table's type, written value by value
    assert set(retyped) == {"f"} - WIDENS[kind]
    v2 = pa.schema([f.with_type(retyped.get(f.name, f.type)) for f in V2])
    batch = [row2(kind)]
    if "f" not in WIDENS[kind]:  # a double that is not a whole number fails alone
        batch.append({**row2(kind), "id": 3, "f": 6.5})
    failed = write(sink, "b2", rows(V2, batch))
    if "f" in WIDENS[kind]:
        assert failed == {}
    else:
        assert list(failed) == [1] and "6.5" in failed[1], failed
    got = read_back(kind, sink)
    assert [r["id"] for r in got] == [1, 2]
    same({k: got[0][k] for k in V2.names}, {**ROW1, "n": None})
    same({k: got[1][k] for k in V2.names}, row2(kind))
    if kind != "postgres":  # the nulls of the old row are there, at every depth
        assert got[0]["s"] == {"x": "u", "z": None} and got[0]["n"] is None
        assert got[0]["l"] == [{"y": 1, "w": None}]
    types = table_types(kind, sink)
    if kind == "postgres":
        assert types["a"] == "bigint" and types["f"] == "double precision"
        assert types["s"] == types["l"] == "jsonb" and types["n"] == "text"
    else:
        assert types["a"] == ("int64" if "a" in WIDENS[kind] else "int32")
        assert types["f"] == "int64" and "z" in types["s"] and "w" in types["l"]
    return v2


@pytest.mark.parametrize("kind", KINDS)
def test_a_sink_evolves_with_new_columns_nested_fields_and_widening(kind, sink_of):
    sink = sink_of(kind)
    v2 = evolve_and_check(kind, sink)
    before = table_types(kind, sink)
    # idempotent: preparing v2 (and v1) again changes nothing, on a new sink object too
    sink.close()  # (Parquet: one writer per path)
    again = sink_of(kind)
    again.prepare(v2)
    prepare_like_plan(again, V1)
    assert table_types(kind, sink) == before
    if kind == "parquet":  # polars reads the dataset as one table too
        got = sorted(parquet_by_polars(sink.path), key=lambda r: r["id"])
        same(got[0], {**ROW1, "n": None})
        same(got[1], row2(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_evolve_false_keeps_refusing_and_the_table_unchanged(kind, sink_of):
    sink = sink_of(kind, evolve=False)
    prepare_like_plan(sink, V1)
    write(sink, "b1", rows(V1, [ROW1]))
    before = table_types(kind, sink)
    refused, retyped = prepare_like_plan(sink, V2)
    assert "n" in refused and ("table" in refused["n"] or "dataset" in refused["n"])
    assert table_types(kind, sink) == before
    if kind == "postgres":  # jsonb takes any struct; bigint takes a whole double
        assert set(refused) == {"n"} and retyped == {}
        return
    assert set(retyped) == {"f", "s", "l"}
    # a nested field the table lacks fails the rows holding a value in it (never dropped
    # by the cast to the table's struct); a row without one is written
    old_shape = {"id": 4, "a": 4, "f": 4.0, "s": {"x": "w", "z": None}, "l": [{"y": 4}]}
    failed = write(sink, "b2", rows(V2, [row2(kind) | {"a": 7, "f": 6.0}, old_shape], refused))
    assert list(failed) == [0] and "'s.z'" in failed[0], failed
    assert [r["id"] for r in read_back(kind, sink)] == [1, 4]


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_struct_field_the_table_lacks_fails_its_row_and_is_never_dropped(kind, sink_of):
    """A table that keeps its struct (``evolve`` off): a row with a value in a field the
    table's struct lacks fails alone, naming the field. It used to be written without
    the field (Arrow's cast to the narrower struct dropped it) and its message acked."""
    sink = sink_of(kind)
    sink.evolve = False  # (set after construction: the same test runs on older code)
    sink.prepare(pa.schema([("id", pa.int64()), ("s", S1)]))
    sink.prepare(pa.schema([("id", pa.int64()), ("s", S1)]))
    table = pa.Table.from_pylist(
        [{"id": 1, "s": {"x": "a", "z": True}}, {"id": 2, "s": {"x": "b", "z": None}}],
        schema=pa.schema([("id", pa.int64()), ("s", S2)]),
    )
    failed = write(sink, "b1", table.append_column(ROW_KEY, pa.array(["m1", "m2"])))
    assert list(failed) == [0] and "'s.z'" in failed[0], failed
    assert [(r["id"], r["s"]) for r in read_back(kind, sink)] == [(2, {"x": "b"})]


@pytest.mark.parametrize("kind", KINDS)
def test_a_crash_after_the_table_evolved_is_completed_by_the_next_prepare(kind, sink_of):
    sink = sink_of(kind)
    prepare_like_plan(sink, V1)
    write(sink, "b1", rows(V1, [ROW1]))
    faults.arm(POINT[kind], "raise")
    try:
        with pytest.raises(faults.InjectedFault):
            sink.prepare(V2)
    finally:
        faults.disarm()
    assert "n" in table_types(kind, sink)  # evolved before the crash
    sink.close()
    restarted = sink_of(kind)  # the restart's sink: a new object, the live table
    refused, _ = prepare_like_plan(restarted, V2)
    assert refused == {}
    batch = [row2(kind)]
    assert write(restarted, "b2", rows(V2, batch)) == {}
    got = read_back(kind, restarted)
    same({k: got[1][k] for k in V2.names}, row2(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_two_threads_and_another_writer_evolving_at_once_agree(kind, sink_of):
    """Two sink objects (two processes' worth; Parquet: one, a path has one writer)
    prepare v2 from several threads at once: every prepare is accepted."""
    one = sink_of(kind)
    two = one if kind == "parquet" else sink_of(kind)
    prepare_like_plan(one, V1)
    write(one, "b1", rows(V1, [ROW1]))
    errors = []

    def go(sink):
        try:
            prepare_like_plan(sink, V2)
        except Exception as e:  # noqa: BLE001 - collected, asserted below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(s,)) for s in (one, two, one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert write(two, "b2", rows(V2, [row2(kind)])) == {}
    got = read_back(kind, one)
    assert [r["id"] for r in got] == [1, 2]
    same({k: got[1][k] for k in V2.names}, row2(kind))  # every field, at every depth


@pytest.mark.spark
def test_spark_reads_an_evolved_parquet_dataset_as_one_table(spark, sink_of):
    """Spark takes the dataset's schema from ``_common_metadata`` (without mergeSchema:
    that fails on INT32 beside INT64, measured) and reads older files in it."""
    sink = sink_of("parquet")
    evolve_and_check("parquet", sink)
    got = sorted(
        (r.asDict(recursive=True) for r in spark.read.parquet(sink.path).collect()), key=lambda r: r["id"]
    )
    same({k: got[0][k] for k in V2.names}, {**ROW1, "n": None})
    same({k: got[1][k] for k in V2.names}, row2("parquet"))
    assert got[0]["s"] == {"x": "u", "z": None}
    assert dict(spark.read.parquet(sink.path).dtypes)["a"] == "bigint"


@pytest.mark.parametrize("kind", KINDS)
def test_an_error_sinks_table_keeps_its_columns(kind, sink_of):
    """The dead letters' columns are fixed: the engine's writer prepares an evolving sink
    (the default) with the same columns each time, so its table never changes."""
    from ackflow.core.ledger import Failure
    from ackflow.core.settlement import Delivery
    from ackflow.engine.loop import write_dead_letters

    sink = sink_of(kind)
    write_dead_letters(sink, "d1", [(Delivery(1, "m1", b"x"), Failure("parse", "bad"))])
    before = table_types(kind, sink)
    for i in range(2, 4):
        write_dead_letters(
            sink, f"d{i}", [(Delivery(i, f"m{i}", b"{}", {"h": "v"}), Failure("parse", "bad"))]
        )
    assert table_types(kind, sink) == before
    assert len(read_back_any(kind, sink)) == 3


def read_back_any(kind, sink):
    if kind == "postgres":
        import psycopg
        from psycopg import sql

        with psycopg.connect(sink.dsn) as conn:
            return conn.execute(sql.SQL("SELECT * FROM {}").format(sink._ident())).fetchall()
    if kind == "parquet":
        return parquet_by_pyarrow(sink.path).to_pylist()
    if kind == "delta":
        from deltalake import DeltaTable

        return DeltaTable(sink.path).to_pyarrow_table().to_pylist()
    return sink._load().scan().to_arrow().to_pylist()


def test_a_postgres_table_the_sink_may_not_alter_refuses_the_columns(postgres, pg_table):
    """A table another role owns (the sink's role may write, not ALTER): the evolution is
    refused by the server, logged, and the table left as it is; the new column is
    refused (its rows fail alone), the rest is written."""
    import psycopg
    from psycopg import sql

    role = f"w_{pg_table}"[:60]
    with psycopg.connect(postgres.dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
        c.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        c.execute(
            sql.SQL("CREATE TABLE {} (ackflow_key text PRIMARY KEY, id bigint, a integer)").format(
                sql.Identifier(pg_table)
            )
        )
        c.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE ON {} TO {}").format(
                sql.Identifier(pg_table), sql.Identifier(role)
            )
        )
    try:
        sink = Postgres(postgres.dsn.replace("postgres@", f"{role}@", 1), pg_table)
        sink.open()
        refused, _ = prepare_like_plan(
            sink, pa.schema([("id", pa.int64()), ("a", pa.int64()), ("n", pa.string())])
        )
        assert set(refused) == {"n"}
        assert (
            write(sink, "b1", rows(pa.schema([("id", pa.int64()), ("a", pa.int64())]), [{"id": 1, "a": 5}]))
            == {}
        )
        assert table_types("postgres", sink) == {"ackflow_key": "text", "id": "bigint", "a": "integer"}
    finally:
        with psycopg.connect(postgres.dsn, autocommit=True) as c:
            c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(pg_table)))
            c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_a_parquet_field_that_held_only_nulls_takes_the_later_type(sink_of):
    """An empty list and a field null in every row of the first batch have Arrow's null
    type; a later batch's values give them their type (they are not refused)."""
    sink = sink_of("parquet")
    first = pa.schema([("id", pa.int64()), ("t", pa.list_(pa.null())), ("s", pa.struct([("x", pa.null())]))])
    later = pa.schema(
        [("id", pa.int64()), ("t", pa.list_(pa.string())), ("s", pa.struct([("x", pa.int64())]))]
    )
    prepare_like_plan(sink, first)
    write(sink, "b1", rows(first, [{"id": 1, "t": [], "s": {"x": None}}]))
    assert prepare_like_plan(sink, later) == ({}, {})
    assert write(sink, "b2", rows(later, [{"id": 2, "t": ["a"], "s": {"x": 5}}])) == {}
    got = sorted(parquet_by_pyarrow(sink.path).to_pylist(), key=lambda r: r["id"])
    assert got == [{"id": 1, "t": [], "s": {"x": None}}, {"id": 2, "t": ["a"], "s": {"x": 5}}]


@pytest.mark.parametrize("kind", ["parquet", "delta", "iceberg"])
def test_a_batch_written_before_the_evolution_commits_after_it(kind, sink_of):
    """Two batches in flight: the first one's files are written in v1, then the second
    batch evolves the table, then the first commits: both read back."""
    sink = sink_of(kind)
    prepare_like_plan(sink, V1)
    early = sink.write_partition("b1", 0, rows(V1, [ROW1]))
    prepare_like_plan(sink, V2)
    late = sink.write_partition("b2", 0, rows(V2, [row2(kind)]))
    sink.commit("b1", [early.token])
    sink.commit("b2", [late.token])
    got = read_back(kind, sink)
    same({k: got[0][k] for k in V2.names}, {**ROW1, "n": None})
    same({k: got[1][k] for k in V2.names}, row2(kind))


@pytest.mark.spark
def test_two_runs_with_a_grown_schema_land_every_field_through_the_engine(spark, sink_of):
    """The engine's own path (``Plan.prepare_sink`` then the Spark tasks): run 1 with
    ``schema=`` v1, run 2 with v2 (a new column, a struct field, an element field, int
    -> bigint) into the same Parquet dataset, Delta and PostgreSQL tables; every row
    lands with every field, every message acked."""
    import ackflow
    from ackflow.sinks import Broadcast
    from ackflow.testing import ListSource
    from helpers import FAST, bodies

    v1 = "id BIGINT, a INT, s STRUCT<x: STRING>, l ARRAY<STRUCT<y: BIGINT>>"
    v2 = (
        "id BIGINT, a BIGINT, s STRUCT<x: STRING, z: BOOLEAN>, "
        "l ARRAY<STRUCT<y: BIGINT, w: STRING>>, n STRING"
    )
    one = {"id": 1, "a": 1, "s": {"x": "u"}, "l": [{"y": 1}]}
    two = {
        "id": 2,
        "a": 7,
        "s": {"x": "v", "z": True},
        "l": [{"y": 2, "w": "q"}],
        "n": "new",
    }  # (a fits Delta's int: Delta does not widen)
    kinds = ["parquet", "delta", "postgres"]
    for schema, body in [(v1, one), (v2, two)]:
        sinks = [sink_of(k) for k in kinds]
        for s in sinks:
            s.close()  # (opened again by the run)
        key = f"m{body['id']}"
        src = ListSource(bodies([body]), keys=[key])
        report = ackflow.run(
            ackflow.Flow(src).map(lambda r: r, name="shape", schema=schema).to(Broadcast(*sinks)),
            spark=spark,
            **FAST,
        )
        assert src.final() == {key: "acked"}, (src.failures, report)
    # the runs' last sinks read the tables back
    for kind, sink in zip(kinds, sinks, strict=True):
        got = read_back(kind, sink)
        assert [r["id"] for r in got] == [1, 2], kind
        same({k: got[1][k] for k in ("s", "l", "n")}, {k: two[k] for k in ("s", "l", "n")})
        same(got[0]["s"], one["s"])
    assert table_types("postgres", sinks[2])["a"] == "bigint"
    assert table_types("parquet", sinks[0])["a"] == "int64"
