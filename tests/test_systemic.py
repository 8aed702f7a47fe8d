"""Poison or systemic: a failure every message meets the same way never dead-letters them.

A sink that raises for every message, a Column expression that fails every row the same
way, a commit that always fails: the messages are given back (no delivery spent), the
episode shows in the report, the metrics and the status page within one batch, and the
run stops with SystemicFailure after ``systemic_stop_after_s``. A step that works again
ends the episode; real poison is still isolated and dead-lettered.
"""

from __future__ import annotations

import json
import threading

import pytest

import ackflow
from ackflow.core.errors import ConfigError, SystemicFailure
from ackflow.core.systemic import ANY_STEP, SystemicDetector
from ackflow.engine.loop import Engine
from ackflow.sinks import MemorySink
from ackflow.testing import FailingSink, ListSource
from helpers import FAST, bodies

# -- the detector, without Spark -----------------------------------------------------------


def test_a_streak_across_batches_becomes_systemic_and_evidence_ends_it():
    t = [0.0]
    d = SystemicDetector(sinks={"pg"}, after=3, stop_after_s=10, clock=lambda: t[0])
    assert d.judge([(1, "pg", "down")], working=set()) == set()
    assert d.judge([(2, "pg", "down")], working=set()) == set()
    assert d.judge([(3, "pg", "down"), (4, "pg", "down")], working=set()) == {3, 4}
    assert d.episode is not None and d.episode.step == "pg" and d.episodes == 1
    assert d.backoff_s() == 1.0
    assert d.judge([(5, "pg", "down")], working=set()) == {5}
    assert d.backoff_s() == 2.0
    t[0] = 10.0
    assert d.overdue()
    # another sink writing rows is no proof for "pg"; an acked message is none either
    assert d.judge([(6, "pg", "down")], working={"other", ANY_STEP}) == {6}
    # "pg" wrote rows: it works; the same error now is the message's own
    assert d.judge([(7, "pg", "down")], working={"pg"}) == set()
    assert d.episode is None and not d.overdue()


def test_one_message_failing_again_and_again_is_poison_not_systemic():
    d = SystemicDetector(after=3)
    for _ in range(10):  # the same message, redelivered: one distinct key
        assert d.judge([("m1", "parse", "ValueError: bad")], working=set()) == set()
    assert d.episode is None


def test_different_errors_are_different_signatures():
    d = SystemicDetector(after=3)
    fails = [(i, "parse", f"ValueError: bad value {chr(97 + i)!r}") for i in range(10)]
    assert d.judge(fails, working=set()) == set()


def test_what_varies_between_writes_failing_alike_is_one_signature():
    """A staging folder per batch, a file per partition, a row number in a detail."""
    d = SystemicDetector(sinks={"pq"}, after=3)
    fails = [
        (
            i,
            "pq",
            f"write failed: PermissionError: [Errno 13] Permission denied: "
            f"'/data/out/_staging/20261125T0900-{i:06d}/part-{i}-5f0c1e2a.parquet'",
        )
        for i in range(3)
    ]
    assert d.judge(fails, working=set()) == {0, 1, 2}


def test_a_step_that_is_not_a_sink_works_when_a_message_is_acked():
    d = SystemicDetector(sinks={"pg"}, after=2)
    assert d.judge([(1, "parse", "KeyError: 'x'")], working={ANY_STEP}) == set()
    assert d.judge([(2, "parse", "KeyError: 'x'")], working={ANY_STEP}) == set()
    assert d.episode is None


GONE = "write failed: ConnectionError: lost the connection to PostgreSQL at 0x7f3a2b1c9d90 (at pg.py:1 in w)"


def test_a_sink_that_wrote_then_went_away_makes_suspects_only_of_stable_keys():
    """A write that failed as a whole with an error that is not a row's data, while its
    sink wrote other rows: given back (no delivery spent), however often, while the
    partial outage lasts (an object's address in the text changes nothing); a row's
    data is the message's own. A key that changes at each delivery (a RabbitMQ message
    without an id) would be a new suspect each time (found by review): it fails."""
    t = [0.0]
    d = SystemicDetector(sinks={"pg"}, after=3, stop_after_s=60, clock=lambda: t[0])
    row = "write failed: [a row's data] ValueError: qty must be positive (at pg.py:1 in w)"
    stable = lambda k: not k.startswith("delivery:")  # noqa: E731
    for n in range(5):  # more than a suspect's two give-backs
        t[0] += 1
        gone = GONE.replace("9d90", f"9d9{n}")
        assert not d.judge([("m1", "pg", gone), ("m2", "pg", row)], working={"pg"}, stable=stable)
        assert d.suspects == {"m1"} and d.partial == {"pg"}  # m2: a row's data: its own
    for n in range(5):
        d.judge([(f"delivery:{n}", "pg", GONE)], working={"pg"}, stable=stable)
        assert d.suspects == set()
    assert d.episode is None


def test_a_partial_outage_that_lasts_stops_the_run_and_a_good_batch_ends_it():
    """One executor cannot reach the database: each batch, some partitions fail with a
    connection error while the sink writes the others. Found by two reviews, each case:
    - its messages are given back until it has lasted ``stop_after_s``, also in a batch
      where the sink wrote nothing (a batch of one partition), however slow the batches;
    - a batch in which the sink wrote everything ends it: sporadic failures with good
      batches between never add up to a stop;
    - once it has lasted ``stop_after_s`` over ``after`` messages, it is systemic and
      the episode is overdue (the run stops), counting every delivery given back;
    - one message alone failing so for that long (a row that breaks the connection) is
      failed as its own, not given back forever."""
    t = [0.0]
    d = SystemicDetector(sinks={"pg"}, after=3, stop_after_s=60, max_backoff_s=10, clock=lambda: t[0])
    for i in range(10):  # sporadic: one failure, then a good batch, for 500 s
        assert not d.judge([(f"s{i}", "pg", GONE)], working={"pg"})
        assert d.suspects == {f"s{i}"}
        t[0] += 25
        assert not d.judge([], working={"pg"})
        t[0] += 25
    assert d.episode is None
    for i in range(2):  # batches 40 s apart (connect timeouts), every one failing so
        works = set() if i == 1 else {"pg"}  # (a batch whose only partition failed)
        assert not d.judge([(f"n{i}", "pg", GONE), (f"o{i}", "pg", GONE)], working=works)
        assert d.suspects == {f"n{i}", f"o{i}"} and d.partial == {"pg"}
        t[0] += 40
    judged = d.judge([("n3", "pg", GONE)], working={"pg"})  # 80 s on
    assert judged == {"n3"} and d.episode is not None and d.overdue() and d.episode.partial
    assert d.episode.step == "pg" and "lost the connection" in d.episode.error
    assert d.episode.messages == 5  # every delivery given back in it, and this one

    t[0] += 1000
    lone = SystemicDetector(sinks={"pg"}, after=3, stop_after_s=60, clock=lambda: t[0])
    for i in range(4):  # a row that breaks the connection, with good partitions beside it
        judged = lone.judge([("poison", "pg", GONE)], working={"pg"})
        assert not judged and lone.suspects == ({"poison"} if i < 3 else set())
        t[0] += 25
    assert lone.episode is None


def test_a_full_outage_during_a_partial_one_is_an_episode_with_its_backoff():
    """Found by review: the sink goes down entirely while a partial outage is on. Three
    messages failing so in batches where it wrote nothing make the usual episode (shown,
    backing off), not a partial outage that retries every second."""
    t = [0.0]
    d = SystemicDetector(sinks={"pg"}, after=3, stop_after_s=300, clock=lambda: t[0])
    d.judge([("a", "pg", GONE)], working={"pg"})  # partial
    t[0] += 1
    assert not d.judge([("b", "pg", GONE), ("c", "pg", GONE)], working=set())
    assert d.suspects == {"b", "c"} and d.episode is None
    t[0] += 1
    assert d.judge([("d", "pg", GONE)], working=set()) == {"d"}
    assert d.episode is not None and not d.episode.partial and d.backoff_s() == 1.0


def test_systemic_after_zero_turns_the_rule_off():
    d = SystemicDetector(after=0)
    assert d.judge([(i, "s", "down") for i in range(10)], working=set()) == set()
    assert d.suspects == set() and d.episode is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"after": 1},
        {"after": 2.5},
        {"stop_after_s": float("nan")},
        {"stop_after_s": -1},
        {"max_backoff_s": float("inf")},
    ],
)
def test_bad_settings_fail_at_start(kwargs):
    with pytest.raises(ConfigError):
        SystemicDetector(**kwargs)


# -- end to end, on Spark ------------------------------------------------------------------


def engine_for(flow, spark, **options):
    opts = {
        **FAST,
        "until_idle": 0.5,
        "systemic_stop_after_s": 3.0,
        "systemic_backoff_s": 0.1,
        "systemic_max_backoff_s": 0.2,
        **options,
    }
    return Engine(flow, spark=spark, handle_signals=False, **opts)


def only_released(src):
    """Every settlement of every message was a give-back: none nacked, none dead."""
    return all(set(v) == {"released"} for v in src.settled.values()) and not src.dead_letters


@pytest.mark.spark
def test_a_sink_that_raises_for_every_message_never_makes_a_dead_letter(spark):
    src = ListSource(bodies([{"n": i} for i in range(30)]), policy=ackflow.RetryPolicy(max_deliveries=1))
    sink = FailingSink(raise_if=lambda r: True, name="broken")
    engine = engine_for(ackflow.Flow(src).to(sink), spark, ui_port=0)
    seen: dict[str, object] = {}

    def watch():  # the page and the metrics show it while the run goes on
        from helpers import wait_until

        def shown():
            page = engine.board.current()[1] if engine.board is not None else None
            if page and page.get("systemic"):
                seen["page"] = page["systemic"]
                seen["metric"] = engine.metrics.systemic.labels(step="broken")._value.get()
                return True
            return False

        wait_until(shown, timeout=60)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with pytest.raises(SystemicFailure) as info:
        engine.run()
    watcher.join(5)
    e = info.value
    assert e.step == "broken" and "sink exploded mid-write" in str(e), str(e)
    assert only_released(src), src.settled
    report = engine.report
    assert report.dead_lettered == 0 and report.nacked == 0 and report.acked == 0
    assert report.given_back_systemic >= 30 and report.systemic_episodes == 1
    assert report.systemic is not None and report.systemic["step"] == "broken"
    assert seen.get("metric") == 1.0 and seen["page"]["step"] == "broken", seen
    # no delivery was spent: every message can still be delivered max_deliveries times
    assert all(n <= 1 for n in src.deliveries.values()), src.deliveries


def test_an_episode_whose_messages_never_come_back_still_stops_the_run_when_it_lasts():
    """The messages given back for a systemic failure are taken by another consumer:
    nothing is in flight and nothing settles, yet the episode (not idle) ends the run
    with SystemicFailure after systemic_stop_after_s instead of keeping it for ever."""

    class TakenElsewhere(ListSource):
        def release(self, deliveries):
            for d in deliveries:
                self._record(d, "released")

    src = TakenElsewhere(bodies([{"n": i} for i in range(6)]))
    flow = ackflow.Flow(src).to(FailingSink(raise_if=lambda r: True, name="broken"))
    engine = Engine(
        flow, executor="local", handle_signals=False, systemic_stop_after_s=1.0, batch_size=6, until_idle=0.3
    )
    outcome: dict[str, object] = {}

    def go():
        try:
            engine.run()
        except BaseException as e:  # noqa: BLE001 (checked below)
            outcome["error"] = e

    runner = threading.Thread(target=go, daemon=True)
    runner.start()
    runner.join(30)
    if runner.is_alive():
        engine.request_stop()
        runner.join(10)
        pytest.fail("the run never ended: the open episode kept it from being idle")
    assert isinstance(outcome.get("error"), SystemicFailure), outcome
    assert only_released(src) and engine.report.given_back_systemic == 6


@pytest.mark.spark
def test_a_column_that_fails_every_row_is_probed_not_bisected_to_the_end(spark):
    """``cast('x' as int)`` fails every job with one error: after one split and three
    messages tried alone, the rest gets the failure untested and all are given back."""
    from pyspark.sql import functions as F

    src = ListSource(bodies([{"n": i} for i in range(64)]), policy=ackflow.RetryPolicy(max_deliveries=1))
    flow = ackflow.Flow(src).with_columns(bad=F.lit("x").cast("int")).to(MemorySink())
    engine = engine_for(flow, spark, batch_size=64, max_inflight=64)
    with pytest.raises(SystemicFailure) as info:
        engine.run()
    assert "CAST_INVALID_INPUT" in str(info.value)
    assert only_released(src), src.settled
    r = engine.report
    assert r.dead_lettered == 0 and r.given_back_systemic >= 64
    # per batch: the whole, two halves, three probes (never 2 x 64 bisection jobs)
    batches = -(-r.pulled // 64)
    assert r.jobs <= 6 * batches, (r.jobs, r.pulled)


@pytest.mark.spark
def test_two_poison_messages_with_one_error_in_both_halves_are_still_isolated(spark):
    """Both halves fail with the same error (the same bad value in each): the probes
    pass, bisection resumes, the two are dead-lettered and the rest acked."""
    from pyspark.sql import functions as F

    rows = [{"v": "1"} for _ in range(16)]
    rows[2] = rows[13] = {"v": "abc"}
    src = ListSource(bodies(rows), policy=ackflow.RetryPolicy(max_deliveries=1))
    flow = ackflow.Flow(src).with_columns(n=F.col("v").cast("int")).to(MemorySink())
    report = ackflow.run(flow, spark=spark, **{**FAST, "batch_size": 16})
    assert report.acked == 14 and report.dead_lettered == 2, report.failures
    assert sorted(src.dead_letters) == ["m13", "m2"]
    assert report.given_back_systemic == 0


@pytest.mark.spark
def test_a_sink_that_comes_back_ends_the_episode_and_every_message_lands(spark, tmp_path):
    heal = tmp_path / "up"
    sink = MemorySink(name="flaky")
    real = sink.write_partition

    def write(batch_id, partition, rows, _path=str(heal), _real=real):
        import os

        if not os.path.exists(_path):
            raise ConnectionError("connection refused")
        return _real(batch_id, partition, rows)

    sink.write_partition = write  # pickled with the sink: the tasks see the file
    src = ListSource(bodies([{"n": i} for i in range(20)]), policy=ackflow.RetryPolicy(max_deliveries=1))
    engine = engine_for(ackflow.Flow(src).to(sink), spark, systemic_stop_after_s=120)

    def heal_later():
        from helpers import wait_until

        wait_until(lambda: engine.report.given_back_systemic >= 20, timeout=60)
        heal.write_text("1")

    threading.Thread(target=heal_later, daemon=True).start()
    report = engine.run()
    assert report.acked == 20 and report.dead_lettered == 0, report.failures
    assert report.given_back_systemic >= 20 and report.systemic is None
    assert sorted(json.loads(json.dumps(r["n"])) for r in sink.rows) == list(range(20))


@pytest.mark.spark
def test_a_commit_that_always_fails_is_systemic(spark):
    class NoCommit(MemorySink):
        def commit(self, batch_id, tokens):
            raise PermissionError("permission denied for table orders")

    src = ListSource(bodies([{"n": i} for i in range(10)]), policy=ackflow.RetryPolicy(max_deliveries=1))
    engine = engine_for(ackflow.Flow(src).to(NoCommit(name="orders")), spark)
    with pytest.raises(SystemicFailure) as info:
        engine.run()
    assert info.value.step == "orders" and "permission denied" in str(info.value)
    assert only_released(src) and engine.report.dead_lettered == 0


@pytest.mark.spark
def test_postgres_refusing_every_write_for_privilege_is_systemic_not_poison(spark, postgres, pg_table):
    """The table refuses every insert with SQLSTATE 42501 (insufficient privilege, raised
    by a trigger: the start-up check passes, the writes do not). A SQLSTATE no row's
    values cause fails the write as a whole: given back, never dead-lettered. A
    constraint violation (class 23) stays the row's own (tests/test_postgres.py)."""
    import psycopg
    from psycopg import sql

    from ackflow.sinks import Postgres

    table = sql.Identifier(pg_table)
    with psycopg.connect(postgres.dsn, autocommit=True) as c:
        c.execute(sql.SQL("CREATE TABLE {} (ackflow_key text PRIMARY KEY, n bigint)").format(table))
        c.execute(
            "CREATE OR REPLACE FUNCTION af_deny() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'permission denied for table orders' "
            "USING ERRCODE = '42501'; END $$"
        )
        c.execute(
            sql.SQL("CREATE TRIGGER deny BEFORE INSERT ON {} FOR EACH ROW EXECUTE FUNCTION af_deny()").format(
                table
            )
        )
    src = ListSource(bodies([{"n": i} for i in range(12)]), policy=ackflow.RetryPolicy(max_deliveries=1))
    engine = engine_for(ackflow.Flow(src).to(Postgres(postgres.dsn, pg_table, name="orders")), spark)
    with pytest.raises(SystemicFailure) as info:
        engine.run()
    assert info.value.step == "orders" and "permission denied" in str(info.value)
    assert only_released(src) and engine.report.dead_lettered == 0


@pytest.mark.spark
def test_one_message_whose_write_always_raises_is_poison_not_systemic(spark):
    """Its deliveries are one message however often it comes: below the three distinct
    messages a systemic failure needs, so it is retried and dead-lettered as before."""
    src = ListSource(bodies([{"n": 1}]), policy=ackflow.RetryPolicy(max_deliveries=3, backoff_s=0.01))
    report = ackflow.run(ackflow.Flow(src).to(FailingSink(raise_if=lambda r: True)), spark=spark, **FAST)
    assert report.dead_lettered == 1 and report.given_back_systemic == 0
    # given back twice as a suspect (no delivery spent), then failed as usual
    assert src.settled["m0"] == ["released", "released", "nacked", "nacked", "dead_lettered"]


class HeadSource(ListSource):
    """Gives back to the head of the queue, keeping the order (as a RabbitMQ requeue)."""

    def release(self, deliveries):
        for d in reversed(list(deliveries)):
            self._record(d, "released")
            self.deliveries[d.key] -= 1
            self._ready.insert(0, int(d.handle))


@pytest.mark.spark
def test_poison_at_the_head_of_an_ordered_queue_does_not_stand_for_the_rest(spark):
    """Four messages with one bad value (one error text) and four good ones, the bad
    first: the probes are spread (first, middle, last), a good one passes, bisection
    resumes, the bad are dead-lettered and the good written."""
    from pyspark.sql import functions as F

    rows = [{"v": v} for v in ("N/A", "N/A", "N/A", "1", "2", "3", "N/A", "4")]
    src = HeadSource(bodies(rows), policy=ackflow.RetryPolicy(max_deliveries=1))
    out = MemorySink()
    flow = ackflow.Flow(src).with_columns(n=F.col("v").cast("int")).to(out)
    report = ackflow.run(flow, spark=spark, **{**FAST, "batch_size": 8})
    assert report.acked == 4 and report.dead_lettered == 4, report.failures
    assert sorted(r["n"] for r in out.rows) == [1, 2, 3, 4]


@pytest.mark.spark
def test_a_message_acked_because_it_was_filtered_out_proves_nothing(spark):
    """Orders pass a filter, then a lookup that fails every row alike: the filtered-out
    messages are acked, the orders given back (not dead-lettered), the run stopped."""
    from pyspark.sql import functions as F

    rows = [{"kind": "order" if i % 2 else "ping", "n": i} for i in range(12)]
    src = ListSource(bodies(rows), policy=ackflow.RetryPolicy(max_deliveries=1))
    flow = (
        ackflow.Flow(src)
        .filter(F.col("kind") == "order")
        .with_columns(x=F.raise_error(F.lit("lookup service unavailable")))
        .to(MemorySink())
    )
    engine = engine_for(flow, spark, batch_size=12)
    with pytest.raises(SystemicFailure, match="lookup service unavailable"):
        engine.run()
    orders = {f"m{i}" for i in range(1, 12, 2)}
    assert not set(src.dead_letters) & orders, src.dead_letters
    assert {k for k, v in src.final().items() if v == "acked"} <= {f"m{i}" for i in range(0, 12, 2)}


@pytest.mark.spark
def test_a_write_failing_for_a_few_messages_gives_them_back_before_it_is_judged(spark):
    """Batches of one: the first two messages a down sink fails are suspects, given back
    (no delivery spent) until the third shows the failure is systemic: none is
    dead-lettered even with max_deliveries=1."""
    src = ListSource(bodies([{"n": i} for i in range(6)]), policy=ackflow.RetryPolicy(max_deliveries=1))
    engine = engine_for(
        ackflow.Flow(src).to(FailingSink(raise_if=lambda r: True)),
        spark,
        batch_size=1,
        max_inflight=1,
        max_concurrent_batches=1,
    )
    with pytest.raises(SystemicFailure):
        engine.run()
    assert only_released(src), src.settled


@pytest.mark.spark
def test_a_not_null_column_the_flow_never_writes_stops_at_start(spark, postgres, pg_table):
    import psycopg
    from psycopg import sql

    from ackflow.core.errors import FlowError
    from ackflow.sinks import Postgres

    with psycopg.connect(postgres.dsn, autocommit=True) as c:
        c.execute(
            sql.SQL("CREATE TABLE {} (ackflow_key text PRIMARY KEY, n bigint, region text NOT NULL)").format(
                sql.Identifier(pg_table)
            )
        )
    src = ListSource(bodies([{"n": i} for i in range(5)]))
    with pytest.raises(FlowError, match=r"NOT NULL column.*region"):
        ackflow.run(ackflow.Flow(src).to(Postgres(postgres.dsn, pg_table)), spark=spark, **FAST)
    assert not src.dead_letters and set(src.final().values()) == {"released"}


def test_a_broadcast_whose_commit_failed_once_ends_the_episode_when_it_writes_again(tmp_path):
    """A composite sink (broadcast; dedupe is another) counts its rows by branch: a
    commit failure names the composite, and the rows its branches write next prove it
    works. Before, the episode never ended: the run never went idle and stopped with
    SystemicFailure after ``systemic_stop_after_s``."""
    from ackflow.sinks import Broadcast
    from ackflow.testing import KeyedSink

    src = ListSource(bodies([{"i": i} for i in range(6)]))
    a, b = KeyedSink("a", fail_commits={1: "after"}), KeyedSink("b")
    report = ackflow.run(
        ackflow.Flow(src).to(Broadcast(a, b, name="both")),
        executor="local",
        batch_size=2,
        max_concurrent_batches=1,
        until_idle=0.5,
        systemic_after=2,
        systemic_stop_after_s=20,
    )
    assert report.acked == 6 and report.systemic is None and report.systemic_episodes == 1
    assert len(a.rows) == len(b.rows) == 6


def test_a_write_is_a_row_s_data_by_its_class_and_through_a_broadcast_only_if_every_branch_says_so():
    """Found by review: infrastructure errors that also derive from ValueError (an SSL
    certificate's, a closed stream's) or are named like a row's (psycopg's
    ProtocolViolation, an OperationalError) are not a row's data; and a primary that
    refuses the row's data with a fallback that is down is not the row's fault either."""
    import io
    import ssl

    import psycopg.errors as pg
    import pyarrow as pa

    from ackflow.core.errors import of_row_data, whole_write
    from ackflow.sinks.base import PartitionResult, Sink
    from ackflow.sinks.broadcast import Broadcast

    class BadRecord(ValueError):
        pass

    for exc, mine in [
        (BadRecord("n < 0"), True),
        (pg.StringDataRightTruncation("too long"), True),
        (pg.ProtocolViolation("x"), False),
        (ssl.SSLCertVerificationError("x"), False),
        (io.UnsupportedOperation("x"), False),
        (ConnectionResetError("x"), False),
    ]:
        assert of_row_data(whole_write(exc)) is mine, exc

    class Raises(Sink):
        def __init__(self, name, exc):
            super().__init__(name)
            self.exc = exc

        def write_partition(self, batch_id, partition, rows):
            raise self.exc

        def commit(self, batch_id, tokens):
            pass

    rows = pa.table({"n": [1, 2]})
    for fallback, mine in [(BadRecord("no"), True), (ConnectionResetError("down"), False)]:
        b = Broadcast(Raises("pg", ValueError("bad n")), mode="primary", fallback=[Raises("spare", fallback)])
        result: PartitionResult = b.write_partition("b1", 0, rows)
        texts = {text for _, text in result.failed.values()}
        assert len(texts) == 1 and of_row_data(texts.pop()) is mine
