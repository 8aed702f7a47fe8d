"""The windowed demo (``ackflow demo --windows``): orders per customer per minute.

Orders with event times (20 a second of event time, 100 customers) go through an
embedded queue into a one-minute tumbling window per customer (orders, revenue, largest
order) kept in the state store; a share of the orders is poison (dead-lettered by
``validate``) and a share arrives ten minutes late (below the watermark: written to a
``late`` dataset, never dropped). The check recomputes every window in plain Python
from what was published, leaving out the rows the run reported late, and compares.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

from ackflow import windows as w
from ackflow.core.policy import RetryPolicy
from ackflow.embedded import EmbeddedQueue, message_key
from ackflow.flow import Flow
from ackflow.sinks.parquet import ParquetSink
from ackflow.sources.embedded import EmbeddedQueueSource

QUEUE = "orders"
START = 1_795_000_000.0  # event time of the first order (epoch seconds, November 2026)
MINUTE = 60_000_000  # microseconds


def paths(workdir: str) -> dict[str, str]:
    return {
        "db": os.path.join(workdir, "queue.db"),
        "windows": os.path.join(workdir, "windows.parquet"),
        "late": os.path.join(workdir, "late.parquet"),
        "state": os.path.join(workdir, "state"),
        "manifest": os.path.join(workdir, "manifest.json"),
    }


def publish(
    workdir: str, messages: int, poison_rate: float, late_rate: float = 0.01, seed: int = 7
) -> dict[str, Any]:
    """Start afresh in ``workdir``: queue the orders; return the manifest (the valid
    orders' customer, event time and total, and the poison messages' ids)."""
    p = paths(workdir)
    for old in (p["db"], p["db"] + "-wal", p["db"] + "-shm", p["manifest"]):
        if os.path.exists(old):
            os.remove(old)
    for d in ("windows", "late", "state"):
        shutil.rmtree(p[d], ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    rng = random.Random(seed)
    bodies, ids, poison, valid = [], [], [], {}
    for i in range(messages):
        mid = f"order-{i:07d}"
        ts = START + i * 0.05
        if i > 12_000 and rng.random() < late_rate:
            ts -= 600  # ten minutes behind the stream: below the watermark
        order = {"order_id": mid, "customer": f"c-{rng.randrange(100):03d}", "ts": ts}
        order["total"] = round(rng.uniform(1, 500), 2)
        if rng.random() < poison_rate:
            poison.append(mid)
            body = json.dumps(order)[:-5] if rng.random() < 0.5 else json.dumps({**order, "total": -1})
        else:
            valid[mid] = (order["customer"], ts, order["total"])
            body = json.dumps(order)
        bodies.append(body.encode())
        ids.append(mid)
    q = EmbeddedQueue(p["db"])
    try:
        q.publish(QUEUE, bodies, msg_ids=ids)
    finally:
        q.close()
    manifest = {"messages": messages, "poison": poison, "valid": valid}
    with open(p["manifest"] + ".tmp", "w") as f:
        json.dump(manifest, f)
    os.replace(p["manifest"] + ".tmp", p["manifest"])
    return manifest


def validate(order: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(order.get("total"), (int, float)) or order["total"] <= 0:
        raise ValueError(f"order {order.get('order_id')} has total {order.get('total')!r}")
    return order


def build_flow(workdir: str) -> Flow:
    p = paths(workdir)
    source = EmbeddedQueueSource(p["db"], QUEUE, policy=RetryPolicy(max_deliveries=3, backoff_s=0.2))
    return (
        Flow(source)
        .map(validate, name="validate")
        .window(
            w.tumbling("1 minute"),
            by="customer",
            time="ts",
            lateness="30s",
            idle=1.0,
            on_late=ParquetSink(p["late"], name="late"),
            aggs=[
                w.count().alias("orders"),
                w.sum_("total").alias("revenue"),
                w.max_("total").alias("largest"),
            ],
            name="per_minute",
        )
        .to(ParquetSink(p["windows"], name="windows"))
    )


def _read(path: str, cols: list[str]) -> list[dict[str, Any]]:
    import pyarrow.dataset as ds

    if not os.path.isdir(path):
        return []
    return ds.dataset(path, partitioning="hive").to_table(columns=cols).to_pylist()


def verify(workdir: str) -> dict[str, Any]:
    """Recompute each window from the manifest (without the rows written as late) and
    compare with the windows written; count every message's fate."""
    p = paths(workdir)
    with open(p["manifest"]) as f:
        manifest = json.load(f)
    late = {r["order_id"] for r in _read(p["late"], ["order_id"])}
    want: dict[tuple[str, int], list[float]] = {}
    for mid, (customer, ts, total) in manifest["valid"].items():
        if mid in late:
            continue
        start = int(ts * 1_000_000) // MINUTE * MINUTE
        want.setdefault((customer, start), []).append(total)
    got: dict[tuple[str, int], dict[str, Any]] = {}
    twice = 0
    for r in _read(p["windows"], ["customer", "window_start", "orders", "revenue", "largest"]):
        key = (r["customer"], int(r["window_start"].timestamp() * 1_000_000))
        twice += key in got
        got[key] = r
    wrong = [
        k
        for k, totals in want.items()
        if k in got
        and (
            got[k]["orders"] != len(totals)
            or abs(got[k]["revenue"] - sum(totals)) > 1e-6 * max(1.0, sum(totals))
            or got[k]["largest"] != max(totals)
        )
    ]
    q = EmbeddedQueue(p["db"])
    try:
        stats = q.stats(QUEUE)
        dead = {message_key(d.row_id, d.msg_id) for d in q.dead_letters(QUEUE)}
    finally:
        q.close()
    poison = set(manifest["poison"])
    return {
        "windows_expected": len(want),
        "windows_written": len(got),
        "windows_missing": len(set(want) - set(got)),
        "windows_unexpected": len(set(got) - set(want)),
        "windows_wrong": len(wrong),
        "windows_written_twice": twice,
        "late": len(late),
        "late_not_valid": len(late - set(manifest["valid"])),
        "poison_expected": len(poison),
        "dead_lettered": len(dead),
        "dead_lettered_wrongly": len(dead - poison),
        "left_in_queue": stats["ready"] + stats["leased"] + stats["delayed"],
        "ok": (
            set(want) == set(got)
            and not wrong
            and not twice
            and not (late - set(manifest["valid"]))
            and dead == poison
            and stats["ready"] + stats["leased"] + stats["delayed"] == 0
        ),
    }


def text(summary: dict[str, Any], p: dict[str, str], state_dir: str) -> str:
    c = summary["check"]
    return "\n".join(
        [
            "",
            f"ackflow demo --windows — {summary['elapsed_s']:.1f} s, "
            f"{summary['messages_per_s']:,.0f} messages/s",
            f"  acked {summary['acked']:,}, dead-lettered {summary['dead_lettered']:,} "
            f"by step {summary['dead_lettered_by_step']}",
            f"  windows written {c['windows_written']:,} of {c['windows_expected']:,} recomputed "
            f"({c['windows_wrong']} wrong, {c['windows_written_twice']} twice, "
            f"{c['windows_missing']} missing)",
            f"  late orders (kept in {p['late']}): {c['late']:,}",
            f"  {'OK' if c['ok'] else 'MISMATCH'}: windows in {p['windows']}",
            f"  state: ackflow state show {state_dir}",
        ]
    )
