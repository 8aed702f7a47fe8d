"""Files read in blocks (issue 32): a run of lines is one delivery on the driver, one
input row per line on the executors. The rows and keys must be exactly those of the
line-by-line path, for any bytes; a failing line must fail alone, dead-lettered with its
own line number; a crash or a stop between two durable steps loses and doubles nothing."""

import json
import os

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ackflow
from ackflow import faults
from ackflow.core.policy import RetryPolicy
from ackflow.engine.blocks import blocks_allowed
from ackflow.engine.loop import Engine
from ackflow.sinks import Memory, Parquet, Postgres
from ackflow.sinks.base import ROW_KEY
from ackflow.sources import Files
from ackflow.sources.files_blocks import BLOCK_LINES
from ackflow.spark.blocks import block_rows
from ackflow.spark.columns import BODY, HDR, ID, SRC, row_key
from ackflow.spark.plan import INPUT_SCHEMA
from ackflow.testing import KeyedSink
from helpers import CountingPulls, must_be_positive
from helpers import run_local as run


def write(folder, name, data: bytes):
    tmp = os.path.join(folder, "." + name)
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, os.path.join(folder, name))


def read_all(folder, blocks, take=10_000):
    """Every delivery of ``folder``'s files, with blocks or without."""
    src = Files(folder, "jsonl", done="record", scan_interval_s=0)
    src.configure(max_inflight=10**6, error_sink=False)
    assert src.use_blocks(blocks) is blocks
    src.open()
    out = []
    for _ in range(100):
        got = src.pull(take, 0.01)
        if not got and all(f.eof for f in src._files.values()):
            break
        out += got
    src.close()
    return out


def rows_of(deliveries):
    """(lineage id, key, body) of each input row, as the job gets them."""
    for i, d in enumerate(deliveries, start=1):
        d.lineage_id = i
    lines = [d for d in deliveries if d.messages == 1]
    blocks = [d for d in deliveries if d.messages > 1]
    out = [(d.lineage_id, row_key(d.identity), d.body) for d in lines]
    if blocks:
        t = block_rows(blocks, INPUT_SCHEMA, (ID, ROW_KEY, BODY, SRC, HDR))
        out += zip(
            t.column(ID).to_pylist(), t.column(ROW_KEY).to_pylist(), t.column(BODY).to_pylist(), strict=True
        )
    return out


LINE = st.one_of(
    st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")),
    st.sampled_from(
        [b"", b" ", b"\t", b"\r", b"\x0b\x0c", b" \r", b"{}", b'{"a":1}\r', b"\xff\xfe", b"x\r\r"]
    ),
)


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(LINE, min_size=0, max_size=40), newline_at_end=st.booleans(), take=st.integers(1, 9))
def test_blocks_make_the_rows_and_keys_of_the_lines_for_any_bytes(
    tmp_path_factory, lines, newline_at_end, take
):
    """Hostile bytes (invalid UTF-8, lone \\r, white space only, no newline at the end): the
    same messages, keys and bodies with blocks as line by line, whatever the pull size."""
    folder = tmp_path_factory.mktemp("blocks")
    data = b"\n".join(lines) + (b"\n" if newline_at_end and lines else b"")
    write(folder, "f.jsonl", data)
    one = read_all(folder, blocks=False, take=take)
    # the same instance (same id): read the state again with blocks, from the start
    os.remove(folder / "_ackflow" / "state.db")
    fid = one[0].headers["file_id"] if one else None
    both = read_all(folder, blocks=True, take=take)
    if fid is not None:  # a new instance id was drawn: compare keys without it
        for d in both:
            d.key = d.key.replace(d.headers["file_id"], fid)
    plain = sorted((k, b) for _, k, b in rows_of(one))
    blocked = rows_of(both)
    assert sorted((k, b) for _, k, b in blocked) == plain
    assert sum(d.messages for d in both) == len(plain) == len(one)


def test_a_block_is_cut_at_the_pull_size_and_block_lines(tmp_path):
    write(tmp_path, "f.jsonl", b"".join(b'{"n":%d}\n' % i for i in range(BLOCK_LINES + 10)))
    src = Files(tmp_path, "jsonl", done="record")
    src.configure(max_inflight=10**6, error_sink=False)
    src.use_blocks(True)
    src.open()
    first = src.pull(7, 0.1)
    assert [d.messages for d in first] == [7]
    assert src.block_size.now == 64  # a run starts with small blocks
    got = src.pull(250, 0.1)
    assert [d.messages for d in got] == [64, 64, 64, 58]
    src.ack(first + got)  # 257 acked without a split (4 x 64): blocks of 128 from now on
    assert src.block_size.now == 128
    assert [d.messages for d in src.pull(300, 0.1)] == [128, 128, 44]
    src.block_size.now = BLOCK_LINES
    got = src.pull(10**6, 0.1)
    assert [d.messages for d in got] == [BLOCK_LINES - 557 + 10]
    src.close()


def lines_with_bad(n, bad):
    return [
        json.dumps({"n": i}) if i not in bad else ("{not json" if i % 2 else json.dumps({"n": -i}))
        for i in range(n)
    ]


class Counting(CountingPulls, Files):
    pulls: list = []


def test_a_bad_line_fails_alone_with_its_line_number_and_good_rows_are_written_once(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    bad = {5, 6, 999, 1500, 1501}
    lines = lines_with_bad(2000, bad)
    lines.insert(300, "   ")  # blank lines are no messages, in a block too
    lines.insert(301, "")
    write(folder, "a.jsonl", ("\n".join(lines) + "\n").encode())
    Counting.pulls = []
    sink = KeyedSink()
    src = Counting(folder, "jsonl", policy=RetryPolicy(max_deliveries=2, backoff_s=0.01))
    report = run(ackflow.Flow(src).map(must_be_positive, name="check").to(sink))
    assert max(Counting.pulls) > 1, "blocks were used"
    assert report.acked == 1995 and report.dead_lettered == 5 and report.nacked == 5
    # every message pulled is settled, or sent again by a split (a block's lines, each once)
    assert report.pulled == report.acked + report.nacked + report.dead_lettered + report.split
    assert report.split > 0 and report.released == 0
    # rows a split block wrote are written again, in place: counted once
    assert report.rows_written == {"keyed": 1995}
    assert not sink.conflicts
    values = sorted(r["n"] for r in sink.rows.values())
    assert values == [i for i in range(2000) if i not in bad]
    # each row under its line's own key (the line path's key), line numbers from 1
    fid = next(iter(sink.rows)).split("@")[1].split(":")[0]
    for key, row in sink.rows.items():
        n = row["n"]
        assert key == f"a.jsonl@{fid}:{n + 1 + (2 if n >= 300 else 0)}"
    dead = [json.loads(x) for x in (folder / "done" / "a.jsonl.dead.jsonl").read_text().splitlines()]
    assert sorted(d["line"] for d in dead) == sorted(i + 1 + (2 if i >= 300 else 0) for i in bad)
    assert {d["step"] for d in dead} == {"decode", "check"}


def test_blocks_are_used_only_where_a_row_written_again_is_no_second_row(tmp_path):
    src = Files(tmp_path, "jsonl")
    f = ackflow.Flow(src)
    assert blocks_allowed(f.to(Parquet(tmp_path / "o")))
    assert blocks_allowed(f.to(KeyedSink()))
    assert not blocks_allowed(f.to(Memory()))  # appends: a block's good lines again = twice
    assert not blocks_allowed(f.to(Parquet(tmp_path / "o", dedupe=False)))
    assert not blocks_allowed(f.to(Postgres("postgresql://x@127.0.0.1/db", "t", key=["k"])))
    assert blocks_allowed(f.to(Postgres("postgresql://x@127.0.0.1/db", "t", key=["k"], mode="insert")))
    assert not blocks_allowed(f.grouped_within(10, 1.0).to(KeyedSink()))
    # a transform may drop a row with no receipt: the block's other lines would prove it
    assert not blocks_allowed(f.transform(lambda df: df, name="t").to(KeyedSink()))
    assert not blocks_allowed(f.group_by("k").agg("count(*) AS n").to(KeyedSink()))
    from ackflow import windows as w

    assert not blocks_allowed(f.window(w.tumbling("1s"), by="k", time="t", aggs=[w.count()]).to(KeyedSink()))
    assert not blocks_allowed(f.dedupe("k", within="1h").to(KeyedSink()))
    assert not blocks_allowed(f.broadcast(KeyedSink("a"), Memory("b")))
    assert blocks_allowed(f.broadcast(KeyedSink("a"), KeyedSink("b")))


@pytest.mark.parametrize(
    "point", ["batch.after_commit", "engine.mid_ack", "engine.before_fail", "files.before_commit"]
)
def test_a_crash_between_two_durable_steps_loses_and_doubles_nothing(tmp_path, point):
    """Crash at a fault point in the middle of the run (an exception out of the engine,
    as a kill would leave it), then run again: every good line's row once, each bad line
    dead-lettered once, the file finished."""
    folder = tmp_path / "in"
    folder.mkdir()
    bad = {17, 1234}
    write(folder, "a.jsonl", ("\n".join(lines_with_bad(3000, bad)) + "\n").encode())
    write(folder, "b.jsonl", ("\n".join(lines_with_bad(1000, {3})) + "\n").encode())
    sink = KeyedSink()
    flow = ackflow.Flow(Files(folder, "jsonl", policy=RetryPolicy(max_deliveries=1))).map(
        must_be_positive, name="check"
    )
    faults.arm(point, "raise", nth=2)
    try:
        with pytest.raises(faults.InjectedFault):
            run(flow.to(sink))
    finally:
        faults.disarm()
    report = run(
        ackflow.Flow(Files(folder, "jsonl", policy=RetryPolicy(max_deliveries=1)))
        .map(must_be_positive, name="check")
        .to(sink)
    )
    assert not sink.conflicts
    got = sorted(r["n"] for r in sink.rows.values())
    assert got == sorted([i for i in range(3000) if i not in bad] + [i for i in range(1000) if i != 3])
    assert report.acked >= 1
    for name, n_bad in (("a.jsonl", 2), ("b.jsonl", 1)):
        assert (folder / "done" / name).exists()
        dead = (folder / "done" / f"{name}.dead.jsonl").read_text().splitlines()
        assert len({json.loads(x)["line"] for x in dead}) == n_bad


ENGINES: list = []


def stop_at_2000(row):
    """Ask the run to stop (the local executor: the engine's own process)."""
    if row["n"] == 2000:
        ENGINES[0].request_stop()
    return row


def test_a_stop_gives_blocks_back_and_the_next_run_writes_the_rest(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    write(folder, "a.jsonl", ("\n".join(json.dumps({"n": i}) for i in range(5000)) + "\n").encode())
    sink = KeyedSink()
    ENGINES.clear()
    engine = Engine(
        ackflow.Flow(Files(folder, "jsonl")).map(stop_at_2000, name="stop").to(sink),
        executor="local",
        batch_size=700,
        max_inflight=1400,
        handle_signals=False,
    )
    ENGINES.append(engine)
    first = engine.run()
    assert first.acked < 5000
    second = run(ackflow.Flow(Files(folder, "jsonl")).to(sink))
    assert first.acked + second.acked >= 5000
    assert sorted(r["n"] for r in sink.rows.values()) == list(range(5000))
    assert not sink.conflicts


def test_blocks_through_spark_write_parquet_rows_once_with_line_keys(tmp_path, spark):
    """The Spark executor (local[2]) and the Parquet sink's key manifest: a block with a bad
    line is split; the good lines' rows, written in the block's batch, are not written again."""
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    folder.mkdir()
    bad = {40, 41}
    write(folder, "a.jsonl", ("\n".join(lines_with_bad(600, bad)) + "\n").encode())
    out = tmp_path / "out"
    report = Engine(
        ackflow.Flow(Files(folder, "jsonl", policy=RetryPolicy(max_deliveries=1)))
        .map(must_be_positive, name="check")
        .to(Parquet(out)),
        spark=spark,
        batch_size=300,
        max_inflight=600,
        until_idle=0.5,
        handle_signals=False,
    ).run()
    assert report.acked == 598 and report.dead_lettered == 2
    files = [
        os.path.join(root, f)
        for root, _, fs in os.walk(out)
        if "/_" not in root[len(str(out)) :] and "/." not in root[len(str(out)) :]
        for f in fs
        if f.endswith(".parquet") and not f.startswith((".", "_"))
    ]
    table = pa.concat_tables([pq.read_table(f) for f in files])
    assert sorted(table.column("n").to_pylist()) == [i for i in range(600) if i not in bad]


def test_a_sink_down_for_a_while_gives_blocks_back_and_dead_letters_nothing(tmp_path):
    """The sink's commit fails as a whole for three batches (every message would fail so):
    the blocks are split (their lines come one by one, and the systemic judge sees each
    line's failure: given back, pulling paused), nothing is dead-lettered, and every row
    is written once when the sink works again."""
    folder = tmp_path / "in"
    folder.mkdir()
    write(folder, "a.jsonl", ("\n".join(json.dumps({"n": i}) for i in range(3000)) + "\n").encode())
    sink = KeyedSink(fail_commits={1: "before", 2: "before", 3: "before"})
    report = run(
        ackflow.Flow(Files(folder, "jsonl", policy=RetryPolicy(max_deliveries=1))).to(sink), until_idle=2.0
    )
    assert report.dead_lettered == 0 and report.nacked == 0
    assert report.acked == 3000 and report.split > 0
    assert report.pulled == report.acked + report.released + report.split
    assert sorted(r["n"] for r in sink.rows.values()) == list(range(3000))
    assert not sink.conflicts


def test_the_committed_line_never_passes_a_block_in_flight(tmp_path):
    """Blocks acked out of order: the committed line waits for the first; a split block's
    lines hold it line by line."""
    write(tmp_path, "f.jsonl", b"".join(b'{"n":%d}\n' % i for i in range(30)))
    src = Files(tmp_path, "jsonl", done="record")
    src.configure(max_inflight=10**6, error_sink=False)
    src.use_blocks(True)
    src.open()
    a, b, c = src.pull(10, 0.1) + src.pull(10, 0.1) + src.pull(10, 0.1)
    tracker = next(iter(src._files.values())).tracker
    src.ack([b])
    assert tracker.committed == 0
    src.split([a])  # its lines come again one by one
    lines = src.pull(100, 0.1)
    assert [d.messages for d in lines] == [1] * 10
    src.ack(lines[1:])
    assert tracker.committed == 0  # line 1 (index 0) still in flight
    src.ack(lines[:1])
    assert tracker.committed == 20
    src.ack([c])
    assert tracker.committed == 30 and not src._files  # finished: recorded done
    src.close()
