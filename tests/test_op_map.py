"""map: plain Python per row; a raising row fails only its own message."""

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def test_map_writes_every_row_and_acks_every_message(spark):
    src = ListSource(bodies([{"n": i} for i in range(120)]))
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(src).map(lambda r: {"n": r["n"], "sq": r["n"] ** 2}, name="square").to(sink),
        spark=spark,
        **FAST,
    )
    assert sorted((r["n"], r["sq"]) for r in sink.rows) == [(i, i * i) for i in range(120)]
    assert set(src.final().values()) == {"acked"} and len(src.final()) == 120
    assert report.acked == 120 and report.rows_written == {"memory": 120}
    assert all(len(v) == 1 for v in src.settled.values())  # settled exactly once


def test_a_raising_row_fails_only_its_message_with_step_id_and_cause(spark):
    def parse(r):
        if r["n"] % 17 == 0:
            raise ValueError(f"bad n {r['n']}")
        return r

    src = ListSource(bodies([{"n": i} for i in range(100)]))
    sink = MemorySink()
    report = ackflow.run(ackflow.Flow(src).map(parse, name="parse").to(sink), spark=spark, **FAST)
    bad = {f"m{i}" for i in range(100) if i % 17 == 0}
    assert {k for k, v in src.final().items() if v == "dead_lettered"} == bad
    assert report.acked == 100 - len(bad) and report.dead_lettered == len(bad)
    f = src.failures["m34"]
    assert (f.step, f.error) == ("parse", "ValueError: bad n 34")
    assert sorted(r["n"] for r in sink.rows) == [i for i in range(100) if i % 17]
    assert report.dead_lettered_by_step == {"parse": len(bad)}


@pytest.mark.parametrize("fuse", [True, False])
def test_a_not_null_column_holds_the_good_rows_and_fails_only_the_bad(spark, fuse):
    """schema= with NOT NULL, one pass or two (spark.ackflow.fuse): the failed and the
    filtered messages' rows hold nulls there, and they must not fail the others."""

    def parse(r):
        if r["n"] % 10 == 0:
            raise ValueError("poison")
        return r

    src = ListSource(bodies([{"n": i} for i in range(60)]))
    sink = MemorySink()
    spark.conf.set("spark.ackflow.fuse", str(fuse).lower())
    try:
        flow = (
            ackflow.Flow(src)
            .filter(lambda r: r["n"] % 7 != 0, name="keep")  # every seventh filtered
            .map(parse, name="parse", schema="n BIGINT NOT NULL")
            .to(sink)
        )
        report = ackflow.run(flow, spark=spark, **FAST)
    finally:
        spark.conf.unset("spark.ackflow.fuse")
    assert sorted(r["n"] for r in sink.rows) == [i for i in range(60) if i % 10 and i % 7]
    assert report.dead_lettered == 5 and set(report.dead_lettered_by_step) == {"parse"}  # 10..50


def test_failed_messages_are_retried_by_policy_before_dead_lettering(spark):
    calls = {"n": 0}

    def flaky(r):
        if r["n"] == 3:
            raise RuntimeError("always")
        return r

    src = ListSource(
        bodies([{"n": i} for i in range(5)]), policy=ackflow.RetryPolicy(max_deliveries=3, backoff_s=0.05)
    )
    report = ackflow.run(ackflow.Flow(src).map(flaky, name="flaky").to(MemorySink()), spark=spark, **FAST)
    assert src.settled["m3"] == ["nacked", "nacked", "dead_lettered"]
    assert report.nacked == 2 and report.dead_lettered == 1 and report.acked == 4
    assert calls["n"] == 0  # the function ran on executors, not here


def test_map_must_return_a_dict(spark):
    src = ListSource(bodies([{"n": 1}, {"n": 2}]))
    ackflow.run(
        ackflow.Flow(src).map(lambda r: r if r["n"] == 1 else None, name="m").to(MemorySink()),
        spark=spark,
        **FAST,
    )
    assert src.final() == {"m0": "acked", "m1": "dead_lettered"}
    assert "map must return a dict" in src.failures["m1"].error


def test_a_row_that_does_not_fit_the_inferred_columns_fails_alone(spark):
    rows = [{"n": i} for i in range(10)] + [{"n": "eleven"}]
    src = ListSource(bodies(rows))
    sink = MemorySink()
    # the schema is given, so "eleven" cannot be a BIGINT
    ackflow.run(
        ackflow.Flow(src).map(lambda r: r, name="ident", schema="n BIGINT").to(sink), spark=spark, **FAST
    )
    assert src.final()["m10"] == "dead_lettered"
    assert src.failures["m10"].step == "ident" and "does not fit" in src.failures["m10"].error
    assert len(sink.rows) == 10


def test_a_crashing_python_worker_is_bisected_to_its_message(spark):
    import os

    def crash(r):
        if r["n"] == 5:
            os._exit(3)  # kills the Python worker: the whole Spark job fails
        return r

    src = ListSource(bodies([{"n": i} for i in range(8)]))
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(src).map(crash, name="crash").to(sink),
        spark=spark,
        **{**FAST, "batch_size": 8, "until_idle": 0.5},
    )
    assert src.final()["m5"] == "dead_lettered"
    assert src.failures["m5"].step == "crash"  # located by re-running prefixes of the plan
    assert report.acked == 7 and report.bisections >= 1
    assert sorted(r["n"] for r in sink.rows) == [0, 1, 2, 3, 4, 6, 7]


def test_outside_data_never_stops_the_run_through_column_inference(spark):
    """The first batch has mixed types for one field, a field named like an internal column
    and a value Spark cannot type. Before, inference raised FlowError: the batch was given
    back, the run stopped, and a restart met the same batch first (a crash loop). Now only
    the messages that do not fit fail, each with a reason naming the step and the field."""
    src = ListSource(
        [
            '{"qty": 1}',
            '{"qty": 2}',
            '{"qty": "three"}',
            '{"qty": 4, "__af_id": 7}',
            '{"qty": 5, "tags": [null]}',
            '{"qty": 6}',
        ],
        policy=ackflow.RetryPolicy(max_deliveries=2, backoff_s=0.01),
    )
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(src).map(lambda r: r, name="same").to(sink), spark=spark, **{**FAST, "until_idle": 0.5}
    )
    final = src.final()
    assert final["m2"] == "dead_lettered" and final["m3"] == "dead_lettered"
    assert src.deliveries["m2"] == 2  # retried by the policy, then given up: no endless loop
    assert "qty" in src.failures["m2"].error and src.failures["m2"].step == "same"
    assert "'__af_id'" in src.failures["m3"].error and "reserved" in src.failures["m3"].error
    assert sorted(r["qty"] for r in sink.rows) == sorted([1, 2, 6] + ([5] if final["m4"] == "acked" else []))
    assert report.acked == len(sink.rows)


def test_field_names_spark_cannot_address_fail_their_messages_not_the_run(spark):
    """Regression (CI, test_hostile): a first batch with the JSON key "._-" made a column
    that PySpark's own mapInArrow could not look up, so every later message failed the
    job "on its own" and was dead-lettered. Now such a field (a dot, a backtick, empty,
    or the same name in another case) fails only the rows holding it, with the reason."""
    # Spark compares names like Java's equalsIgnoreCase: the dotless i twins "i", and an
    # upper-case "__AF_ID" twins ackflow's own "__af_id"
    bodies_ = [
        '{"._-": 1}',
        '{"a.b": 2}',
        '{"`x": 3}',
        '{"": 4}',
        '{"n": 5, "N": 6}',
        '{"n": 7}',
        '{"n": 8, "*": 9}',
        '{"n": 10, "id": 2, "\u0131d": 1}',
        '{"n": 11, "__AF_ID": 3}',
    ]
    src = ListSource(bodies_, policy=ackflow.RetryPolicy(max_deliveries=1))
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(src).map(lambda r: r, name="same").to(sink), spark=spark, **{**FAST, "until_idle": 0.5}
    )
    final = src.final()
    assert [final[f"m{i}"] for i in range(9)] == ["dead_lettered"] * 5 + ["acked"] + ["dead_lettered"] * 3
    assert sink.rows == [{"n": 7, "id": None}]
    assert "'a.b'" in src.failures["m1"].error and "rename the field" in src.failures["m1"].error
    assert "only in case" in src.failures["m4"].error and "only in case" in src.failures["m7"].error
    assert "reserved" in src.failures["m8"].error
    assert report.dead_lettered_by_step == {"same": 8}


def test_a_field_outside_the_inferred_columns_is_never_lost(spark, tmp_path):
    """Columns are inferred from the first batch; a later row with another field used to
    lose that field silently. By schema mode: ``evolve`` (the default) adds the column and
    the row lands with it; ``freeze`` fails the message naming the field; ``rescue``
    keeps it in ``_rescued``. With schema= given the user chose the columns, and other
    fields are left out. (Two runs, so that the first batch is the first: the columns
    are kept in ``state_dir`` between them.)"""
    first = [f'{{"n": {i}}}' for i in range(5)]
    later = ['{"n": 5, "extra": "kept?"}', '{"n": 6}']
    for schema, mode, expect in (
        (None, "evolve", "acked"),
        (None, "freeze", "dead_lettered"),
        (None, "rescue", "acked"),
        ("n BIGINT", "evolve", "acked"),
    ):
        sink = MemorySink()
        state = tmp_path / f"{mode}-{schema}"
        for batch in (first, ["{}"] * 5 + later):
            src = ListSource(batch, policy=ackflow.RetryPolicy(max_deliveries=1))
            ackflow.run(
                ackflow.Flow(src)
                .map(lambda r: r, name="same", schema=schema)
                .filter(lambda r: r != {})
                .to(sink),
                spark=spark,
                **{**FAST, "until_idle": 0.5, "schema_mode": mode, "state_dir": state},
            )
        assert src.final()["m5"] == expect and src.final()["m6"] == "acked"
        if expect == "dead_lettered":
            err = src.failures["m5"].error
            assert "'extra'" in err and "freeze" in err
        assert sorted(r["n"] for r in sink.rows) == [i for i in range(7) if i != 5 or expect == "acked"]
        five = [r for r in sink.rows if r["n"] == 5]
        if mode == "evolve" and schema is None:
            assert five == [{"n": 5, "extra": "kept?"}]
        if mode == "rescue":
            assert five == [{"n": 5, "_rescued": '{"extra": "kept?"}'}]


@pytest.mark.parametrize(
    "build",
    [
        lambda f: f.map(lambda r: r, name="shape", schema="`a.b` BIGINT"),
        lambda f: f.with_columns(**{"x.y": "1"}),
        lambda f: f.map(lambda r: r, name="shape", schema="n BIGINT, N STRING"),
    ],
)
def test_configured_column_names_spark_cannot_address_stop_at_start(spark, build):
    src = ListSource(['{"n": 1}'])
    with pytest.raises(ackflow.FlowError, match=r"cannot be a Spark column|only in case"):
        ackflow.run(build(ackflow.Flow(src)).to(MemorySink()), spark=spark, **FAST)
    assert src.final() == {"m0": "released"}  # given back, not acked nor dead-lettered


def test_a_step_the_local_workers_cannot_import_stops_at_start(spark, tmp_path, monkeypatch):
    """On a local master too: the driver imports a module its Python workers cannot (here,
    a folder only on the driver's sys.path). Before, every message failed its job alone
    and was dead-lettered as if it were poison; now the run stops at start, naming it."""
    (tmp_path / "driver_only_steps.py").write_text("def tag(r):\n    return {**r, 't': 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from driver_only_steps import tag

    src = ListSource(['{"n": 1}'])
    with pytest.raises(ackflow.FlowError, match="step 'tag': the executors cannot load it"):
        ackflow.run(ackflow.Flow(src).map(tag, name="tag").to(MemorySink()), spark=spark, **FAST)
    assert src.final() in ({}, {"m0": "released"})
