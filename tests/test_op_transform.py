"""transform(fn): the DataFrame escape hatch must keep the lineage, or nothing is acked."""

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def test_a_transform_that_keeps_lineage_works(spark):
    from pyspark.sql import functions as F

    src = ListSource(bodies([{"a": i} for i in range(20)]))
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(src).transform(lambda df: df.withColumn("b", F.col("a") * 3), name="triple").to(sink),
        spark=spark,
        **FAST,
    )
    assert sorted(r["b"] for r in sink.rows) == [3 * i for i in range(20)]
    assert report.acked == 20


def test_a_transform_that_loses_lineage_fails_naming_the_step(spark):
    src = ListSource(bodies([{"a": 1}]))
    with pytest.raises(ackflow.FlowError, match=r"step 'narrow'.*lost ackflow's column"):
        ackflow.run(
            ackflow.Flow(src).transform(lambda df: df.select("a"), name="narrow").to(MemorySink()),
            spark=spark,
            **FAST,
        )
    assert src.final() == {"m0": "released"}


def test_fabricated_ids_fail_the_batch(spark):
    from pyspark.sql import functions as F

    src = ListSource(bodies([{"a": i} for i in range(5)]))
    report = ackflow.run(
        ackflow.Flow(src)
        .transform(lambda df: df.withColumn("__af_id", F.col("__af_id") + 1_000_000), name="forge")
        .to(MemorySink()),
        spark=spark,
        **FAST,
    )
    assert report.acked == 0
    assert all(f.step == "forge" and "fabricated" in f.error for f in src.failures.values())


def test_rows_removed_inside_a_transform_are_not_acked(spark):
    src = ListSource(bodies([{"a": i} for i in range(6)]))
    ackflow.run(
        ackflow.Flow(src).transform(lambda df: df.where("a < 3"), name="cut").to(MemorySink()),
        spark=spark,
        **FAST,
    )
    final = src.final()
    assert [final[f"m{i}"] for i in range(6)] == ["acked"] * 3 + ["dead_lettered"] * 3
    assert "lineage lost" in src.failures["m4"].error


def test_rows_a_transform_repeats_across_partitions_get_keys_unique_in_the_batch(
    spark, postgres, pg_table, tmp_path
):
    """Issue 27 #4: a repeat in another partition kept its original's key (repeats were
    numbered per writer partition): PostgreSQL overwrote it, the embedded queue ignored
    it, every message acked and the report counted rows that were not there."""
    import psycopg
    from psycopg import sql

    from ackflow.embedded import EmbeddedQueue
    from ackflow.sinks import EmbeddedQueueSink, Postgres

    def twice(df):
        return df.unionByName(df)  # the copy lands in other partitions

    n = 3
    src = ListSource(bodies([{"a": i} for i in range(n)]))
    pg = Postgres(postgres.dsn, pg_table, create=True, name="pg")
    report = ackflow.run(ackflow.Flow(src).transform(twice, name="twice").to(pg), spark=spark, **FAST)
    with psycopg.connect(postgres.dsn) as c:
        got = c.execute(sql.SQL("SELECT ackflow_key, a FROM {}").format(sql.Identifier(pg_table))).fetchall()
    assert report.acked == n and report.rows_written["pg"] == 2 * n
    assert sorted(a for _, a in got) == sorted(2 * list(range(n)))
    assert len({k for k, _ in got}) == 2 * n
    keys_pg = sorted(k for k, _ in got)

    db = str(tmp_path / "q.db")
    src = ListSource(bodies([{"a": i} for i in range(n)]))
    report = ackflow.run(
        ackflow.Flow(src).transform(twice, name="twice").to(EmbeddedQueueSink(db, "next", name="q")),
        spark=spark,
        **FAST,
    )
    q = EmbeddedQueue(db)
    queued = q.peek("next", 100)
    q.close()
    assert report.acked == n and report.rows_written["q"] == 2 * n
    assert len(queued) == 2 * n and sorted(m["msg_id"] for m in queued) == keys_pg

    # a second transform repeating the repeats again: still one key per row
    src = ListSource(bodies([{"a": i} for i in range(n)]))
    ackflow.run(
        ackflow.Flow(src)
        .transform(twice, name="t1")
        .transform(twice, name="t2")
        .to(EmbeddedQueueSink(db, "next2", name="q2")),
        spark=spark,
        **FAST,
    )
    q = EmbeddedQueue(db)
    queued = q.peek("next2", 100)
    q.close()
    assert len({m["msg_id"] for m in queued}) == len(queued) == 4 * n
