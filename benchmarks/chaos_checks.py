"""The chaos soak's checks (``benchmarks.chaos``): what the broker, PostgreSQL, the
Parquet folder and the stream hold at the end, against what was published."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from benchmarks.chaos_publisher import (
    DEAD_TABLE,
    DLX_QUEUE,
    ID_RE,
    KAFKA_PARTITIONS,
    KAFKA_TOPIC,
    QUEUE,
    STREAM,
    TABLE,
    WINDOW,
    WINDOW_TABLE,
    Published,
)

if TYPE_CHECKING:
    from benchmarks.chaos import Soak


def queue_depth(url: str) -> int:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(QUEUE, passive=True).method.message_count)
    finally:
        conn.close()


def dlx_messages(url: str) -> tuple[Counter[str], Counter[str], int]:
    """What the broker dead-lettered: (message id -> copies, x-death reasons, messages
    without a message id). Read with ``basic_get`` and left in the queue (not acked)."""
    import pika

    ids: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    nameless = 0
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for _ in range(10**6):  # bounded: the queue holds far fewer
            method, props, _body = ch.basic_get(DLX_QUEUE, auto_ack=False)
            if method is None:
                break
            if props.message_id:
                ids[props.message_id] += 1
            else:
                nameless += 1
            for death in (props.headers or {}).get("x-death") or []:
                reason = death.get("reason")
                reasons[reason.decode() if isinstance(reason, bytes) else str(reason)] += 1
    finally:
        conn.close()
    return ids, reasons, nameless


def _as_py(v: Any) -> Any:
    """A value read back from a sink, comparable with the published JSON value."""
    if isinstance(v, str) and v[:1] in "[{":
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def value_mismatches(rows: list[dict[str, Any]], expect: dict[str, dict[str, Any]], sink: str) -> list[str]:
    """Rows whose values are not what was published (nulls, empty lists and nested
    values must land intact)."""
    bad = []
    for r in rows:
        want = expect.get(r["id"])
        if want is None:
            continue
        got = {k: _as_py(r.get(k)) for k in want}
        if got != want:
            bad.append(f"{sink} {r['id']}: {got} != {want}"[:300])
    return bad


def files_left(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".jsonl") and not n.startswith("."))


def kafka_committed(bootstrap: str) -> dict[int, int]:
    """The chaos group's committed offset of each partition of the topic."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "chaos"})
    try:
        tps = [TopicPartition(KAFKA_TOPIC, p) for p in range(KAFKA_PARTITIONS)]
        return {tp.partition: tp.offset for tp in c.committed(tps, 15)}
    finally:
        c.close()


def kafka_topic(bootstrap: str) -> tuple[dict[int, int], list[str]]:
    """The end of each partition (its last message's offset + 1) and the body of every
    message, read by assignment from offset 0 until nothing more comes for 2 s. (tansu
    0.6's high watermark can lag the partition's real end: 997 with messages up to
    offset 999 after idempotent produces; so the end is read, not asked for.)"""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "chaos-check", "enable.auto.commit": False})
    c.assign([TopicPartition(KAFKA_TOPIC, p, 0) for p in range(KAFKA_PARTITIONS)])
    ends = {p: 0 for p in range(KAFKA_PARTITIONS)}
    got: list[str] = []
    quiet = time.monotonic()
    deadline = quiet + 120
    try:
        while time.monotonic() - quiet < 2.0 and time.monotonic() < deadline:
            for m in c.consume(500, 0.5):
                if m.error() is None:
                    got.append((m.value() or b"").decode("utf-8", "replace"))
                    ends[m.partition()] = max(ends[m.partition()], m.offset() + 1)
                    quiet = time.monotonic()
    finally:
        c.close()
    return ends, got


def kafka_lag(bootstrap: str) -> int:
    """Messages of the topic past the group's commits."""
    committed = kafka_committed(bootstrap)
    ends, _ = kafka_topic(bootstrap)
    return sum(max(0, end - max(0, committed[p])) for p, end in ends.items())


def stream_committed(rmq: Any) -> int:
    from rstream import Consumer

    async def go() -> int:
        async with Consumer("127.0.0.1", rmq.stream_port, username="guest", password="guest") as c:
            return int(await c.query_offset(STREAM, "chaos"))

    try:
        return asyncio.run(go())
    except Exception:  # noqa: BLE001 - no stored offset (or no broker): reported as -1
        return -1


def stream_tail(rmq: Any, start: int) -> list[tuple[int, str]]:
    """(offset, body) of every stream message from ``start``."""
    from rstream import Consumer, ConsumerOffsetSpecification, OffsetType

    got: list[tuple[int, str]] = []

    async def on_message(body: Any, ctx: Any) -> None:
        text = bytes(body).decode("utf-8", "replace")
        got.append((int(ctx.offset), text))

    async def go() -> None:
        async with Consumer("127.0.0.1", rmq.stream_port, username="guest", password="guest") as c:
            await c.subscribe(
                STREAM,
                on_message,
                offset_specification=ConsumerOffsetSpecification(OffsetType.OFFSET, max(0, start)),
            )
            n = -1
            while n != len(got):  # until nothing more comes for a second
                n = len(got)
                await asyncio.sleep(1.0)

    try:
        asyncio.run(go())
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        got.append((-1, f"{type(e).__name__}: {e}"))
    return got


def window_counts(
    windows: list[tuple[Any, ...]], state_dir: str, pg_rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The count window's rows and totals (written to PostgreSQL, and still open in the
    state store) against the rows in PostgreSQL: each written row counted once."""
    import pickle
    import sqlite3

    open_rows = open_total = 0
    path = os.path.join(state_dir, "windows.db")
    if os.path.exists(path):
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            for n, state in db.execute(
                "SELECT nrows, state FROM windows WHERE op = ? AND filled = 0", (WINDOW,)
            ):
                open_rows += n
                open_total += pickle.loads(state)[1][1] or 0  # (key values, [count, sum])
        finally:
            db.close()
    per_id: dict[str, int] = {r["id"]: r["total"] for r in pg_rows}
    twice = sorted(i for i, c in Counter(i for i, _, _ in windows).items() if c > 1)
    rows = sum(n for _, n, _ in windows) + open_rows
    total = sum(t for _, _, t in windows) + open_total
    return {
        "written": len(windows),
        "rows": rows,
        "rows_off": rows - len(per_id),
        "total_off": total - sum(per_id.values()),
        "twice": twice[:20],
    }


def is_poison(text: str) -> bool:
    try:
        return int(json.loads(text)["qty"]) <= 0
    except (ValueError, KeyError, TypeError):
        return True


def verify(pub: Published, pg: Any, rmq: Any, soak: Soak) -> dict[str, Any]:
    import psycopg
    import pyarrow.parquet as pq

    cols = ["id", "total", "n_lines", "members", "opt", "tags", "note"]
    with psycopg.connect(pg.dsn) as conn:
        pg_rows = [
            dict(zip(cols, r, strict=True)) for r in conn.execute(f"SELECT {', '.join(cols)} FROM {TABLE}")
        ]
        dead_rows = conn.execute(  # the body: text, or its bytes where it is not text
            f"SELECT message, coalesce(convert_to(body, 'UTF8'), body_bytes) FROM {DEAD_TABLE}"
        ).fetchall()
        windows = conn.execute(f"SELECT window_index, n, total FROM {WINDOW_TABLE}").fetchall()
    pg_ids = Counter(r["id"] for r in pg_rows)
    pq_ids: Counter[str] = Counter()
    pq_rows: list[dict[str, Any]] = []
    for path in glob.glob(os.path.join(soak.parquet_dir, "batch=*", "**", "*.parquet"), recursive=True):
        rows = pq.read_table(path, columns=cols).to_pylist()
        pq_rows += rows
        pq_ids.update(r["id"] for r in rows)
    mismatched = value_mismatches(pg_rows, pub.expect, "postgres") + value_mismatches(
        pq_rows, pub.expect, "parquet"
    )
    dlx_ids, dlx_reasons, dlx_nameless = dlx_messages(rmq.url)
    dead_ids: Counter[str] = Counter()
    unknown_dead = 0
    for _, body in dead_rows:
        text = (
            body.decode("utf-8", "replace") if isinstance(body, bytes | bytearray | memoryview) else str(body)
        )
        if isinstance(body, memoryview):
            text = bytes(body).decode("utf-8", "replace")
        m = ID_RE.search(text)
        if m:
            dead_ids[m.group(1)] += 1
        else:
            unknown_dead += 1
    # what the stream really holds: a message whose publish raised (no confirm) may be
    # in the stream all the same; it is published then, and must be processed
    in_stream = stream_tail(rmq, 0)
    extra_stream = []
    for off, text in in_stream:
        mid = ID_RE.search(text)
        if mid and mid.group(1) not in pub.good and mid.group(1) not in pub.poison:
            extra_stream.append((off, text[:120]))
            (pub.poison if is_poison(text) else pub.good).add(mid.group(1))
    stream_end = max((off for off, _ in in_stream), default=-1)
    # the same for the Kafka topic: a message without a delivery report may be in it
    extra_kafka: list[str] = []
    committed_k: dict[int, int] = {}
    kafka_ends: dict[int, int] = {}
    if soak.kafka is not None:
        kafka_ends, bodies = kafka_topic(soak.kafka.bootstrap)
        for text in bodies:
            mid = ID_RE.search(text)
            if mid and mid.group(1) not in pub.good and mid.group(1) not in pub.poison:
                extra_kafka.append(text[:120])
                (pub.poison if is_poison(text) else pub.good).add(mid.group(1))
        committed_k = kafka_committed(soak.kafka.bootstrap)
    kafka_at_end = all(
        committed_k[p] == end or (end == 0 and committed_k[p] < 0) for p, end in kafka_ends.items()
    )
    good, poison = pub.good, pub.poison
    in_dlx = set(dlx_ids)  # the broker's dead letters: accounted there, and only there
    lost_pg = good - set(pg_ids) - in_dlx
    lost_pq = good - set(pq_ids) - in_dlx
    poison_missing = poison - set(dead_ids) - in_dlx
    dup_pg = {k for k, n in pg_ids.items() if n > 1}
    dup_pq = {k for k, n in pq_ids.items() if n > 1}
    dup_dead = {k for k, n in dead_ids.items() if n > 1}
    dup_dlx = {k for k, n in dlx_ids.items() if n > max(1, pub.copies[k])}
    # one message in two places (written or dead-lettered by ackflow, and dead-lettered
    # by the broker too): counted twice
    dlx_and_settled = in_dlx & (set(pg_ids) | set(pq_ids) | set(dead_ids))
    lost = lost_pg | lost_pq | poison_missing
    duplicated = dup_pg | dup_pq | dup_dead | dup_dlx | dlx_and_settled
    good_dead = good & set(dead_ids)
    poison_written = poison & (set(pg_ids) | set(pq_ids))
    unknown_rows = (set(pg_ids) | set(pq_ids)) - good - poison
    counted = window_counts(windows, soak.state_dir, pg_rows)
    depth = queue_depth(rmq.url)
    committed = stream_committed(rmq)
    left = files_left(soak.files_dir)
    checks = {
        "lost_in_postgres": sorted(lost_pg)[:20],
        "lost_in_parquet": sorted(lost_pq)[:20],
        "poison_not_dead_lettered": sorted(poison_missing)[:20],
        "duplicated_in_postgres": sorted(dup_pg)[:20],
        "duplicated_in_parquet": sorted(dup_pq)[:20],
        "dead_lettered_twice": sorted(dup_dead)[:20],
        "broker_dead_lettered_more_than_published": sorted(dup_dlx)[:20],
        "broker_dead_lettered_and_settled_by_ackflow": sorted(dlx_and_settled)[:20],
        "values_not_as_published": mismatched[:10],
        "broker_dead_letters_without_id": dlx_nameless,
        "good_dead_lettered": sorted(good_dead)[:20],
        "poison_written": sorted(poison_written)[:20],
        "rows_not_published": sorted(unknown_rows)[:20],
        "dead_letters_without_id": unknown_dead,
        "queue_depth": depth,
        "stream_stored_offset": committed,
        "stream_last_offset": stream_end,
        "files_left": left[:20],
        "window_rows_not_counted_once": counted["rows_off"],
        "window_total_off": counted["total_off"],
        "windows_written_twice": counted["twice"],
    }
    checks["stream_unconfirmed_in_stream"] = extra_stream
    checks["kafka_committed"] = committed_k
    checks["kafka_end"] = kafka_ends
    checks["kafka_unconfirmed_in_topic"] = extra_kafka[:20]
    # offsets the broker never delivers (seen after a restart): the source declares them gaps
    checks["stream_offsets_not_messages"] = stream_end + 1 - len(in_stream)
    ok = (
        not lost
        and not duplicated
        and not good_dead
        and not poison_written
        and not unknown_rows
        and unknown_dead == 0
        and depth == 0
        and committed == stream_end
        and kafka_at_end
        and not left
        and not mismatched
        and counted["rows_off"] == 0
        and counted["total_off"] == 0
        and not counted["twice"]
    )
    return {
        "lost": len(lost),
        "duplicated": len(duplicated),
        "dead_lettered": len(dead_rows),
        "broker_dead_lettered": sum(dlx_ids.values()) + dlx_nameless,
        "broker_dead_letter_reasons": dict(dlx_reasons),
        "values_checked": len(pg_rows) + len(pq_rows),
        "values_wrong": len(mismatched),
        "good_dead_lettered": len(good_dead),
        "rows_postgres": sum(pg_ids.values()),
        "rows_parquet": sum(pq_ids.values()),
        "windows_written": counted["written"],
        "window_rows_counted": counted["rows"],
        "ok": ok,
        "checks": checks,
    }
