"""broadcast: several sinks from one stream; modes all and primary with fallback."""

import pytest

import ackflow
from ackflow.core import ConfigError
from ackflow.sinks import Broadcast, MemorySink, ParquetSink
from ackflow.testing import FailingSink, ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def test_mode_all_acks_only_when_every_branch_wrote(spark):
    src = ListSource(bodies([{"n": i} for i in range(12)]))
    a, b = MemorySink("a"), FailingSink(fail_if=lambda r: r["n"] == 4, name="b")
    report = ackflow.run(ackflow.Flow(src).broadcast(a, b), spark=spark, **FAST)
    assert src.final()["m4"] == "dead_lettered"
    assert src.failures["m4"].step == "b"  # the failing branch, by name
    assert src.failures["m4"].error.startswith("branch 'b': row refused")
    assert report.acked == 11
    assert sorted(r["n"] for r in a.rows) == list(range(12))  # a wrote m4's row; still nacked
    assert report.rows_written == {"a": 12, "b": 11}


def test_mode_primary_falls_back_and_acks(spark, tmp_path):
    src = ListSource(bodies([{"n": i} for i in range(10)]))
    primary = FailingSink(fail_if=lambda r: r["n"] % 3 == 0, name="primary")
    spare = ParquetSink(tmp_path / "spare", name="spare")
    report = ackflow.run(
        ackflow.Flow(src).broadcast(primary, mode="primary", fallback=[spare]), spark=spark, **FAST
    )
    assert report.acked == 10
    assert report.rows_written == {"primary": 6, "spare": 4}
    import pyarrow.parquet as pq

    assert sorted(pq.read_table(tmp_path / "spare").column("n").to_pylist()) == [0, 3, 6, 9]


def test_mode_primary_fails_when_every_fallback_failed(spark):
    src = ListSource(bodies([{"n": i} for i in range(4)]))
    primary = FailingSink(fail_if=lambda r: r["n"] == 2, name="primary")
    spare = FailingSink(raise_if=lambda r: True, name="spare")
    ackflow.run(ackflow.Flow(src).broadcast(primary, mode="primary", fallback=[spare]), spark=spark, **FAST)
    assert src.final()["m2"] == "dead_lettered"
    assert src.failures["m2"].step == "primary"
    err = src.failures["m2"].error
    assert "branch 'primary'" in err and "branch 'spare'" in err


def test_bad_broadcasts_are_refused():
    with pytest.raises(ConfigError, match="fallback= needs mode='primary'"):
        Broadcast(MemorySink("a"), fallback=[MemorySink("b")])
    with pytest.raises(ConfigError, match="unique"):
        Broadcast(MemorySink("a"), MemorySink("a"))


def test_sub_flow_branches_each_with_steps(spark):
    from ackflow import branch

    src = ListSource(bodies([{"n": i} for i in range(10)]))
    raw, odd = MemorySink("raw"), FailingSink(fail_if=lambda r: r["sq"] == 49, name="odd")
    flow = (
        ackflow.Flow(src)
        .map(lambda r: {"n": r["n"], "half": r["n"] // 2}, name="prep")
        .broadcast(
            raw,
            branch()
            .filter(lambda r: r["n"] % 2 == 1, name="odds")
            .map(lambda r: {"n": r["n"], "sq": r["n"] ** 2}, name="square")
            .to(odd),
        )
    )
    report = ackflow.run(flow, spark=spark, **FAST)
    assert sorted(r["n"] for r in raw.rows) == list(range(10))
    assert sorted(r["sq"] for r in odd.rows) == [1, 9, 25, 81]
    assert src.final()["m7"] == "dead_lettered" and src.failures["m7"].step == "odd"
    assert report.acked == 9  # even numbers: filtered in one branch, written in the other


def test_a_branch_that_loses_rows_cannot_ack(spark):
    from ackflow import branch

    src = ListSource(bodies([{"n": i} for i in range(4)]))
    flow = ackflow.Flow(src).broadcast(
        MemorySink("all"), branch().transform(lambda df: df.where("n < 2"), name="cut").to(MemorySink("some"))
    )
    ackflow.run(flow, spark=spark, **FAST)
    assert src.final() == {"m0": "acked", "m1": "acked", "m2": "dead_lettered", "m3": "dead_lettered"}
    assert "lineage lost" in src.failures["m2"].error


def test_sub_flows_need_mode_all():
    from ackflow import branch

    with pytest.raises(ConfigError, match="mode='all'"):
        ackflow.Flow(ListSource([])).broadcast(branch().to(MemorySink("a")), mode="primary")


@pytest.mark.parametrize("mode", ["all", "primary"])
def test_a_branch_key_null_in_every_row_fails_those_rows_not_the_run(spark, tmp_path, mode):
    """A keyed sink behind a broadcast: a batch whose key field is null or missing in
    every row once lost the key column on its way (the broadcast did not say which
    columns its branches key by), and the branch's prepare stopped the run; a lone
    sink fails such rows alone. Found by review."""
    from ackflow.sinks.delta import DeltaSink

    src = ListSource(['{"k": null, "v": 1}', '{"v": 2}'])
    keyed, plain = DeltaSink(str(tmp_path / "d"), key="k"), MemorySink("m")
    flow = ackflow.Flow(src)
    flow = (
        flow.broadcast(keyed, plain)
        if mode == "all"
        else flow.broadcast(keyed, mode="primary", fallback=[plain])
    )
    ackflow.run(flow, spark=spark, **{**FAST, "batch_size": 2})
    if mode == "all":  # every branch must take a row: each fails at the keyed one, alone
        assert src.final() == {"m0": "dead_lettered", "m1": "dead_lettered"}
        assert all("key column 'k' has no value" in str(f) for f in src.dead_letters.values())
    else:  # the fallback takes what the primary refused, without the primary's null key column
        assert src.final() == {"m0": "acked", "m1": "acked"}
        assert sorted(r["v"] for r in plain.rows) == [1, 2] and all("k" not in r for r in plain.rows)


def test_a_branch_is_prepared_without_another_branchs_null_key_column():
    """A keyed branch's key column null in every row is kept for it only: the other
    branches' prepare once got it too (a table made with a guessed text column there,
    for good). Found by review."""
    import pyarrow as pa

    seen = {}

    class Recording(MemorySink):
        def __init__(self, name, key=None):
            super().__init__(name)
            self.key = key

        def prepare(self, schema):
            seen[self.name] = schema.names

    b = Broadcast(Recording("keyed", key=["k"]), Recording("plain"))
    b.prepare(pa.schema([("k", pa.null()), ("v", pa.int64())]))
    assert seen == {"keyed": ["k", "v"], "plain": ["v"]}
    b.prepare(pa.schema([("k", pa.string()), ("v", pa.int64())]))  # a value: every branch has it
    assert seen == {"keyed": ["k", "v"], "plain": ["k", "v"]}
