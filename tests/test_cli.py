"""The ackflow command: argument errors, queue inspection, running a user's flow file."""

import json
import subprocess
import sys
import textwrap

import pytest

from ackflow.cli import main
from ackflow.embedded import EmbeddedQueue


def ackflow_cmd(*args, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "ackflow.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["demo", "--messages", "0"], "must be at least 1"),
        (["demo", "--poison-rate", "2"], "must be between 0 and 1"),
        (["run", "flow.py:flow", "--batch-size", "ten"], "expected a whole number"),
        (["queue", "stats", "--db", "x.db"], "--queue"),
    ],
)
def test_bad_arguments_say_what_to_fix(args, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert expected in capsys.readouterr().err


def test_missing_files_are_clear_errors(tmp_path, capsys):
    assert main(["queue", "stats", "--db", str(tmp_path / "none.db"), "--queue", "q"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["demo", "--resume", "--workdir", str(tmp_path)]) == 2
    assert "run 'ackflow demo' first" in capsys.readouterr().err


def test_queue_stats_peek_dead_letters_replay(tmp_path, capsys):
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("orders", [b'{"a": 1}', b'{"a": 2}'], msg_ids=["o1", "o2"])
    (m, _) = q.lease("orders", 2, visibility_timeout=60)
    q.dead_letter("orders", [(m.row_id, m.deliveries, "validate", "ValueError: bad")])
    q.close()

    assert main(["queue", "stats", "--db", db, "--queue", "orders", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert {k: stats[k] for k in ("ready", "leased", "dead_lettered", "delivered_total")} == {
        "ready": 0,
        "leased": 1,
        "dead_lettered": 1,
        "delivered_total": 2,
    }

    assert main(["queue", "dead-letters", "--db", db, "--queue", "orders"]) == 0
    text = capsys.readouterr().out
    assert "o1" in text and "step 'validate': ValueError: bad" in text

    assert main(["queue", "peek", "--db", db, "--queue", "orders", "--json"]) == 0
    assert [m["msg_id"] for m in json.loads(capsys.readouterr().out)] == ["o2"]

    assert main(["queue", "replay", "--db", db, "--queue", "orders", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"replayed": 1, "kept": []}
    assert EmbeddedQueue(db).stats("orders")["ready"] == 1


def test_replay_never_destroys_a_dead_letter_whose_msg_id_is_queued(tmp_path, capsys):
    """Issue 27 #3: a dead letter whose msg_id is queued again (the producer published it
    again) stays a dead letter, body and error intact, and the command says why."""
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("orders", [b'{"v": "old"}'], msg_ids=["o1"])
    (m,) = q.lease("orders", 1, visibility_timeout=60)
    q.dead_letter("orders", [(m.row_id, m.deliveries, "validate", "ValueError: bad")])
    q.publish("orders", [b'{"v": "new"}'], msg_ids=["o1"])  # queued again under o1
    q.close()

    assert main(["queue", "replay", "--db", db, "--queue", "orders"]) == 0
    text = capsys.readouterr().out
    assert "moved 0 dead letters" in text and "'o1' is queued" in text
    q = EmbeddedQueue(db)
    (dl,) = q.dead_letters("orders")
    assert (dl.msg_id, dl.body, dl.error) == ("o1", b'{"v": "old"}', "ValueError: bad")
    assert [p["body"] for p in q.peek("orders")] == ['{"v": "new"}']
    (n,) = q.lease("orders", 1, visibility_timeout=60)
    q.ack("orders", [(n.row_id, n.deliveries)])  # once the queued o1 settled, replay works
    q.close()
    assert main(["queue", "replay", "--db", db, "--queue", "orders", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"replayed": 1, "kept": []}
    q = EmbeddedQueue(db)
    assert q.dead_letters("orders") == [] and [p["body"] for p in q.peek("orders")] == ['{"v": "old"}']
    q.close()


@pytest.mark.spark
def test_run_a_flow_file(tmp_path):
    db = tmp_path / "q.db"
    EmbeddedQueue(str(db)).publish("in", [json.dumps({"x": i}).encode() for i in range(50)])
    (tmp_path / "myflow.py").write_text(
        textwrap.dedent(f"""
        import ackflow
        from ackflow.sources import EmbeddedQueue
        from ackflow.sinks import Parquet
        from pyspark.sql import functions as F

        def double(r):  # a function of this file: shipped to the executors by value
            return {{"x": r["x"], "y": r["x"] * 2}}

        flow = (ackflow.Flow(EmbeddedQueue({str(db)!r}, "in"))
                .map(double, name="double")
                .with_columns(z=F.col("y") + 1)
                .to(Parquet({str(tmp_path / "out")!r})))
    """)
    )
    r = ackflow_cmd(
        "run", "myflow.py:flow", "--until-idle", "1", "--json", "--master", "local[2]", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["acked"] == 50 and report["rows_written"] == {"parquet": 50}
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "out")
    assert sorted(t.column("z").to_pylist()) == [2 * i + 1 for i in range(50)]


def test_run_rejects_a_target_that_is_not_a_flow(tmp_path):
    (tmp_path / "f.py").write_text("flow = 3\n")
    r = ackflow_cmd("run", "f.py:flow", "--master", "local[1]", cwd=tmp_path)
    assert r.returncode == 2 and "is a int, not an ackflow Flow" in r.stderr


def test_demo_through_a_real_rabbitmq_broker(tmp_path, rabbitmq):
    r = ackflow_cmd(
        "demo",
        "--source",
        "rabbitmq",
        "--amqp-url",
        rabbitmq.url,
        "--messages",
        "4000",
        "--workdir",
        str(tmp_path / "demo"),
        "--json",
        "--master",
        "local[2]",
        "--batch-size",
        "1000",
        "--max-inflight",
        "3000",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    check = summary["check"]
    assert check["ok"], check
    assert check["poison_dead_lettered"] == check["poison_expected"] > 0
    assert check["queue"]["ready"] == 0
    assert "guest:guest" not in r.stdout + r.stderr  # the URL's password never shows


@pytest.mark.spark
@pytest.mark.slow
def test_the_windowed_demo_checks_every_window(tmp_path):
    """ackflow demo --windows --json: orders per customer per minute on Spark, some late
    (kept in a Parquet dataset of their own), some poison; every window equals the
    recomputation, none twice, every message accounted for; the state is inspectable."""
    work = tmp_path / "demo"
    r = ackflow_cmd(
        "demo", "--windows", "--json", "--messages", "15000", "--workdir", str(work),
        "--master", "local[2]", "--batch-size", "2500", "--max-inflight", "7500",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    check = json.loads(r.stdout.strip().splitlines()[-1])["check"]
    assert check["ok"], check
    assert check["windows_written"] == check["windows_expected"] > 100 and check["windows_written_twice"] == 0
    assert check["late"] > 0 and check["dead_lettered"] == check["poison_expected"] > 0
    shown = ackflow_cmd("state", "show", str(work / "state"), "--json")
    (op,) = json.loads(shown.stdout)
    assert op["window"] == "per_minute" and op["open_windows"] == 0 and op["late_rows"] == check["late"]


def test_demo_source_rabbitmq_needs_a_url(capsys):
    assert main(["demo", "--source", "rabbitmq", "--messages", "1"]) != 0
    assert "--amqp-url" in capsys.readouterr().err


@pytest.mark.spark
def test_run_without_json_prints_a_summary(tmp_path):
    """A person's summary: acked, dead-lettered with the top reasons, rows written."""
    db = tmp_path / "q.db"
    EmbeddedQueue(str(db)).publish("in", [json.dumps({"x": i}).encode() for i in range(30)] + [b"not json"])
    (tmp_path / "f.py").write_text(
        textwrap.dedent(f"""
        import ackflow
        from ackflow.core.policy import RetryPolicy
        from ackflow.sources import EmbeddedQueue
        from ackflow.sinks import Parquet

        def check(r):
            if r["x"] % 10 == 3:
                raise ValueError("x ends in 3")
            return r

        flow = (ackflow.Flow(EmbeddedQueue({str(db)!r}, "in",
                                           policy=RetryPolicy(max_deliveries=1)))
                .map(check, name="check").to(Parquet({str(tmp_path / "out")!r}, name="out")))
    """)
    )
    r = ackflow_cmd("run", "f.py:flow", "--until-idle", "1", "--master", "local[2]", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("ackflow run: 31 messages settled in "), lines
    text = "\n".join(lines)
    assert "  acked              27" in text
    assert "  dead-lettered       4   check: 3, decode: 1" in text
    assert "    3 x check: ValueError: x ends in 3" in text
    assert "rows written       out: 27" in text
    assert not text.lstrip().startswith("{")
