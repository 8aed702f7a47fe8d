"""The PostgreSQL sink against a real server: keyed writes, bad rows isolated, clear
errors, and the same rows (not twice as many) when messages are delivered again."""

import psycopg
import pytest
from psycopg import sql

import ackflow
from ackflow.core.errors import ConfigError, FlowError
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Postgres
from ackflow.testing import ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def rows_of(dsn, table, order="ackflow_key"):
    with psycopg.connect(dsn) as c:
        cur = c.execute(
            sql.SQL("SELECT * FROM {} ORDER BY {}").format(sql.Identifier(table), sql.Identifier(order))
        )
        names = [d.name for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def execute(dsn, statement):
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(statement)


def orders(n):
    return bodies(
        [
            {"order": i, "items": [{"sku": f"s{i}-{j}", "qty": j + 1} for j in range(i % 3 + 1)]}
            for i in range(n)
        ]
    )


def explode(o):
    for item in o["items"]:
        yield {"order": o["order"], "sku": item["sku"], "qty": item["qty"]}


def test_creates_the_table_and_writes_each_row_under_its_message_key(spark, postgres, pg_table):
    src = ListSource(orders(60))
    sink = Postgres(postgres.dsn, pg_table, create=True)
    report = ackflow.run(ackflow.Flow(src).flat_map(explode).to(sink), spark=spark, **FAST)
    assert report.acked == 60
    rows = rows_of(postgres.dsn, pg_table)
    assert len(rows) == sum(i % 3 + 1 for i in range(60))
    by_key = {r["ackflow_key"]: r for r in rows}
    assert by_key["m4#1"]["sku"] == "s4-1" and by_key["m4#1"]["qty"] == 2
    assert report.rows_written[sink.name] == len(rows)


def test_redelivered_messages_are_written_in_place_not_twice(spark, postgres, pg_table):
    sink = Postgres(postgres.dsn, pg_table, create=True)
    flow = ackflow.Flow(ListSource(orders(40))).flat_map(explode).to(sink)
    ackflow.run(flow, spark=spark, **FAST)
    first = rows_of(postgres.dsn, pg_table)
    # the same messages again (as after a crash before the acks): same keys, same rows
    again = ackflow.run(ackflow.Flow(ListSource(orders(40))).flat_map(explode).to(sink), spark=spark, **FAST)
    assert again.acked == 40
    assert rows_of(postgres.dsn, pg_table) == first


def test_user_key_upsert_keeps_the_last_write_and_insert_the_first(spark, postgres, pg_table):
    execute(
        postgres.dsn,
        sql.SQL("CREATE TABLE {} (sku text PRIMARY KEY, qty int)").format(sql.Identifier(pg_table)),
    )
    first = bodies([{"sku": "a", "qty": 1}, {"sku": "b", "qty": 1}])
    second = bodies([{"sku": "a", "qty": 2}, {"sku": "c", "qty": 2}])
    upsert = Postgres(postgres.dsn, pg_table, key=["sku"])
    keep = Postgres(postgres.dsn, pg_table, key=["sku"], mode="insert")
    ackflow.run(ackflow.Flow(ListSource(first)).to(upsert), spark=spark, **FAST)
    ackflow.run(ackflow.Flow(ListSource(second)).to(keep), spark=spark, **FAST)
    assert {r["sku"]: r["qty"] for r in rows_of(postgres.dsn, pg_table, "sku")} == {"a": 1, "b": 1, "c": 2}
    ackflow.run(ackflow.Flow(ListSource(second)).to(upsert), spark=spark, **FAST)
    assert {r["sku"]: r["qty"] for r in rows_of(postgres.dsn, pg_table, "sku")} == {"a": 2, "b": 1, "c": 2}


@pytest.mark.parametrize("constraint", ["UNIQUE", "PRIMARY KEY"])
def test_a_null_key_fails_its_message_alone_never_acked_unwritten(spark, postgres, pg_table, constraint):
    """Issue 27 #6: two null-key rows in one piece were one for DISTINCT ON (the other
    message acked without its row), and ON CONFLICT never matches NULL (a redelivery
    writes it again). A null key fails its own message, naming the key column."""
    execute(
        postgres.dsn,
        sql.SQL("CREATE TABLE {} (sku text {}, qty int)").format(
            sql.Identifier(pg_table), sql.SQL(constraint)
        ),
    )
    msgs = bodies(
        [{"sku": "a", "qty": 1}, {"sku": None, "qty": 2}, {"sku": None, "qty": 3}, {"sku": "b", "qty": 4}]
    )
    sink = Postgres(postgres.dsn, pg_table, key=["sku"], name="pg")
    for _ in range(2):  # the second run is a redelivery of every message
        src = ListSource(msgs)
        report = ackflow.run(ackflow.Flow(src).to(sink), spark=spark, **{**FAST, "batch_size": 4})
        assert report.acked == 2 and set(src.dead_letters) == {"m1", "m2"}
        for m in ("m1", "m2"):
            assert src.failures[m].step == "pg" and "'sku' has no value" in src.failures[m].error
        assert [(r["sku"], r["qty"]) for r in rows_of(postgres.dsn, pg_table, "qty")] == [("a", 1), ("b", 4)]


def test_constraint_violations_fail_only_their_messages(spark, postgres, pg_table):
    execute(
        postgres.dsn,
        sql.SQL(
            "CREATE TABLE {} (ackflow_key text PRIMARY KEY, n int NOT NULL CHECK (n >= 0), label varchar(5))"
        ).format(sql.Identifier(pg_table)),
    )
    msgs = []
    for i in range(200):
        if i in (17, 101):
            msgs.append({"n": -i, "label": "x"})  # violates the CHECK
        elif i == 150:
            msgs.append({"n": i, "label": "far too long"})  # value too long for varchar(5)
        else:
            msgs.append({"n": i, "label": "ok"})
    src = ListSource(bodies(msgs))
    sink = Postgres(postgres.dsn, pg_table, name="pg")
    report = ackflow.run(
        ackflow.Flow(src).to(sink), spark=spark, **{**FAST, "batch_size": 200, "max_inflight": 200}
    )
    assert report.acked == 197 and report.dead_lettered == 3
    assert set(src.dead_letters) == {"m17", "m101", "m150"}
    assert src.failures["m17"].step == "pg"
    assert "check constraint" in src.failures["m17"].error
    assert "too long" in src.failures["m150"].error
    got = sorted(r["n"] for r in rows_of(postgres.dsn, pg_table))
    assert got == sorted(m["n"] for i, m in enumerate(msgs) if i not in (17, 101, 150))


def test_a_value_past_the_index_row_limit_fails_only_its_message(spark, postgres, pg_table):
    """SQLSTATE 54000 (program_limit_exceeded: an index row larger than a B-tree page
    holds) is a row's own error, but psycopg raises it as an OperationalError, which the
    sink took for a lost connection: the whole partition failed (found by review)."""
    import random

    execute(
        postgres.dsn,
        sql.SQL("CREATE TABLE {} (ackflow_key text PRIMARY KEY, n int, tag text UNIQUE)").format(
            sql.Identifier(pg_table)
        ),
    )
    rnd = random.Random(7)
    huge = "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(20_000))
    msgs = [{"n": i, "tag": huge if i == 9 else f"t{i}"} for i in range(30)]
    src = ListSource(bodies(msgs))
    report = ackflow.run(
        ackflow.Flow(src).to(Postgres(postgres.dsn, pg_table, name="pg")),
        spark=spark,
        **{**FAST, "batch_size": 30, "max_inflight": 30},
    )
    assert report.acked == 29 and report.dead_lettered == 1
    assert set(src.dead_letters) == {"m9"}
    assert "index row" in src.failures["m9"].error
    assert sorted(r["n"] for r in rows_of(postgres.dsn, pg_table)) == [i for i in range(30) if i != 9]


def test_a_missing_column_the_flow_makes_stops_the_run_and_names_it(spark, postgres, pg_table):
    execute(
        postgres.dsn,
        sql.SQL("CREATE TABLE {} (ackflow_key text PRIMARY KEY, n int)").format(sql.Identifier(pg_table)),
    )
    src = ListSource(bodies([{"n": 1}]))
    with pytest.raises(FlowError) as e:
        ackflow.run(
            ackflow.Flow(src).with_columns(city="'Oslo'").to(Postgres(postgres.dsn, pg_table, evolve=False)),
            spark=spark,
            **FAST,
        )
    assert "city" in str(e.value) and pg_table in str(e.value)
    assert src.final() == {"m0": "released"}  # given back, not failed


def test_a_missing_column_from_the_data_fails_only_the_messages_holding_it(spark, postgres, pg_table):
    """Before, the columns inferred from a first batch holding one message with a field
    the table lacks stopped the run, and a restart met that message first again: a crash
    loop on one bad message. Now that message fails, naming the column; the rest flow."""
    execute(
        postgres.dsn,
        sql.SQL("CREATE TABLE {} (ackflow_key text PRIMARY KEY, n int)").format(sql.Identifier(pg_table)),
    )
    # m3 also tries to write over m1's row through the sink's own key column
    src = ListSource(
        bodies([{"n": 1, "city": "Oslo"}, {"n": 2}, {"n": 3, "city": None}, {"n": 4, "ackflow_key": "m1"}]),
        policy=RetryPolicy(max_deliveries=1),
    )
    report = ackflow.run(
        ackflow.Flow(src).to(Postgres(postgres.dsn, pg_table, evolve=False)), spark=spark, **FAST
    )  # (evolution: tests/test_sink_evolution.py)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked", "m2": "acked", "m3": "dead_lettered"}
    f = src.failures["m0"]
    assert f.step.startswith("postgres") and "column 'city'" in f.error
    assert "own key column" in src.failures["m3"].error
    assert [r["n"] for r in rows_of(postgres.dsn, pg_table)] == [2, 3] and report.acked == 2


def test_field_names_longer_than_postgres_allows_fail_their_rows(spark, postgres, pg_table):
    """PostgreSQL cuts names at 63 bytes: two data fields sharing their first 63 bytes made
    CREATE TABLE fail, and every job with it (every message dead-lettered as poison)."""
    long_a, long_b = "x" * 63 + "a", "x" * 63 + "b"
    src = ListSource(
        bodies([{"n": 1}, {"n": 2, long_a: 1}, {"n": 3, long_b: 2}]), policy=RetryPolicy(max_deliveries=1)
    )
    ackflow.run(ackflow.Flow(src).to(Postgres(postgres.dsn, pg_table, create=True)), spark=spark, **FAST)
    assert src.final() == {"m0": "acked", "m1": "dead_lettered", "m2": "dead_lettered"}
    assert "longer than PostgreSQL's 63 bytes" in src.failures["m1"].error
    assert [r["n"] for r in rows_of(postgres.dsn, pg_table)] == [1]


def test_a_key_without_a_unique_index_is_a_clear_error(spark, postgres, pg_table):
    execute(postgres.dsn, sql.SQL("CREATE TABLE {} (sku text, qty int)").format(sql.Identifier(pg_table)))
    src = ListSource(bodies([{"sku": "a", "qty": 1}]))
    with pytest.raises(FlowError, match="UNIQUE"):
        ackflow.run(ackflow.Flow(src).to(Postgres(postgres.dsn, pg_table, key=["sku"])), spark=spark, **FAST)


def test_missing_table_and_unreachable_server_fail_at_start_without_the_password(postgres):
    with pytest.raises(ConfigError, match="does not exist"):
        Postgres(postgres.dsn, "no_such_table").open()
    dsn = "postgresql://app:hunter2secret@127.0.0.1:1/db"
    with pytest.raises(ConfigError) as e:
        Postgres(dsn, "t", connect_timeout=2).open()
    assert "hunter2secret" not in str(e.value) and "cannot connect" in str(e.value)
    with pytest.raises(ConfigError, match="mode"):
        Postgres(postgres.dsn, "t", mode="merge")


def test_an_unreachable_database_never_acks_never_dead_letters_and_hides_the_password(spark):
    """A database gone after the start fails every message the same way: a systemic
    failure (tests/test_systemic.py). Nothing acked, nothing dead-lettered, every message
    given back, and the run stops with an error that names the sink, not the password."""
    from ackflow.core.errors import SystemicFailure
    from ackflow.engine.loop import Engine

    class Unreachable(Postgres):  # as if the server went away after the start
        def open(self):
            pass

        def prepare(self, schema):
            pass

    src = ListSource(
        bodies([{"n": i} for i in range(30)]), policy=RetryPolicy(max_deliveries=2, backoff_s=0.05)
    )
    sink = Unreachable("postgresql://app:hunter2secret@127.0.0.1:1/db", "t", name="pg", connect_timeout=1)
    engine = Engine(
        ackflow.Flow(src).to(sink),
        spark=spark,
        handle_signals=False,
        systemic_stop_after_s=2,
        systemic_backoff_s=0.1,
        **FAST,
    )
    with pytest.raises(SystemicFailure) as e:
        engine.run()
    assert e.value.step == "pg" and "cannot connect to PostgreSQL" in str(e.value)
    assert "hunter2secret" not in str(e.value) + e.value.detail
    assert engine.report.acked == 0 and engine.report.dead_lettered == 0
    assert not src.dead_letters and set(src.settled["m0"]) == {"released"}


def test_join_matches_and_groups_get_stable_keys_so_a_rerun_changes_nothing(spark, postgres, pg_table):
    stock = spark.createDataFrame(
        [("a", "north"), ("a", "south"), ("b", "north")], "sku string, warehouse string"
    )
    msgs = bodies([{"sku": "a" if i % 2 else "b", "n": i} for i in range(20)])

    def flow():
        return (
            ackflow.Flow(ListSource(msgs))
            .join(stock, on="sku")
            .to(Postgres(postgres.dsn, pg_table, create=True))
        )

    ackflow.run(flow(), spark=spark, **FAST)
    first = rows_of(postgres.dsn, pg_table)
    assert len(first) == 10 * 2 + 10  # "a" matches two warehouses, "b" one
    assert {r["ackflow_key"] for r in first if r["n"] == 1} == {"m1", "m1~1"}
    ackflow.run(flow(), spark=spark, **FAST)  # delivered again: same keys, same rows
    assert rows_of(postgres.dsn, pg_table) == first
    # a message named like m1's second match had that row's key: one upsert replaced the
    # other, and both messages were acked
    named = ackflow.Flow(ListSource(bodies([{"sku": "b", "n": 100}]), keys=["m1~1"]))
    ackflow.run(named.join(stock, on="sku").to(Postgres(postgres.dsn, pg_table)), spark=spark, **FAST)
    after = rows_of(postgres.dsn, pg_table)
    assert len(after) == len(first) + 1
    assert {r["n"] for r in after if r["ackflow_key"].startswith("m1~1")} == {1, 100}
    groups = pg_table + "_g"
    execute(postgres.dsn, sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(groups)))
    grouped = (
        ackflow.Flow(ListSource(msgs))
        .group_by("sku")
        .agg("count(*) AS n")
        .to(Postgres(postgres.dsn, groups, create=True))
    )
    ackflow.run(grouped, spark=spark, **{**FAST, "batch_size": 20, "max_inflight": 20})
    g1 = rows_of(postgres.dsn, groups)
    assert sorted((r["sku"], r["n"]) for r in g1) == [("a", 10), ("b", 10)]
    assert all(r["ackflow_key"].startswith("g:") for r in g1)


def test_an_error_sink_in_postgres_creates_its_table_and_holds_the_dead_letters(spark, postgres, pg_table):
    """The error sink is a sink: prepared like a main sink. Before, the engine never called
    prepare() on it, every dead letter failed "relation does not exist" and was nacked
    forever."""

    def check(r):
        if r["n"] % 3 == 0:
            raise ValueError(f"bad {r['n']}")
        return r

    src = ListSource([f'{{"n": {i}}}' for i in range(9)], policy=RetryPolicy(max_deliveries=1))
    flow = (
        ackflow.Flow(src)
        .map(check, name="check")
        .to(ackflow.sinks.MemorySink())
        .on_error(Postgres(postgres.dsn, pg_table, create=True, name="dead"))
    )
    report = ackflow.run(flow, spark=spark, **FAST)
    assert report.dead_lettered == 3 and report.acked == 6
    with psycopg.connect(postgres.dsn) as c:
        got = c.execute(
            sql.SQL("SELECT message, step, error FROM {} ORDER BY message").format(sql.Identifier(pg_table))
        ).fetchall()
    assert [(m, s) for m, s, _ in got] == [("m0", "check"), ("m3", "check"), ("m6", "check")]
    assert "bad 3" in got[1][2]


def test_processes_creating_one_table_at_once_all_succeed(postgres, pg_table):
    """Several sinks (processes of one pipeline) prepare the same new table at once:
    "IF NOT EXISTS" alone collides on PostgreSQL's catalog (a unique violation on
    pg_type); each must find the table made, none fail."""
    import threading

    import pyarrow as pa

    schema = pa.schema([("order", pa.int64()), ("sku", pa.string())])
    for round_ in range(5):
        name = f"{pg_table[:40]}_{round_}"
        execute(postgres.dsn, sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))
        # the same table named with and without its schema
        sinks = [Postgres(postgres.dsn, name if i % 2 else f"public.{name}", create=True) for i in range(6)]
        for s in sinks:
            s.open()
        errors: list[BaseException] = []
        gate = threading.Barrier(len(sinks))

        def prepare(sink, gate=gate, errors=errors):
            gate.wait()
            try:
                sink.prepare(schema)
            except BaseException as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

        threads = [threading.Thread(target=prepare, args=(s,)) for s in sinks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in sinks:
            s.close()
        assert not errors, errors
