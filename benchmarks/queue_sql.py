"""What SQLite itself costs the embedded queue's lease and ack, without ackflow's Python
around it: ``.venv/bin/python -m benchmarks.queue_sql [--out X.json]``.

A table shaped as the embedded queue's ``messages`` (same columns and ready index), 200 000
100-byte messages; each statement over 25 000 of them, rolled back, wall time a message.
The lease moves a message in the ready index (its ``visible_at`` changes) and returns the
rows; the variants leave out one, then both, to show what each costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import tempfile
import time
from typing import Any

N, BATCH = 200_000, 25_000
BODY = b"x" * 100
READY = "SELECT id FROM messages WHERE queue = 'q' AND visible_at <= 1 ORDER BY visible_at, id LIMIT 25000"
STATEMENTS = {
    "lease (UPDATE ... RETURNING)": "UPDATE messages"
    " SET deliveries = deliveries + 1, leased = 1, visible_at = 99"
    f" WHERE id IN ({READY}) RETURNING id, msg_id, body, headers, deliveries, published_at",
    "lease, not moved in the index": "UPDATE messages SET deliveries = deliveries + 1, leased = 1"
    f" WHERE id IN ({READY}) RETURNING id, msg_id, body, headers, deliveries, published_at",
    "lease, not moved, nothing returned": "UPDATE messages SET deliveries = deliveries + 1, leased = 1"
    f" WHERE id IN ({READY})",
    "select the ready rows only": READY.replace("SELECT id", "SELECT id, msg_id, body, headers, deliveries"),
    "ack (DELETE by ids)": "DELETE FROM messages WHERE id IN (SELECT value FROM json_each(?))",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        db = sqlite3.connect(os.path.join(tmp, "q.db"), isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(
            "CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL, msg_id TEXT,"
            " body BLOB NOT NULL, headers TEXT, deliveries INTEGER NOT NULL DEFAULT 0,"
            " visible_at REAL NOT NULL, leased INTEGER NOT NULL DEFAULT 0, published_at REAL NOT NULL,"
            " last_error TEXT);"
            "CREATE INDEX messages_ready ON messages (queue, visible_at, id);"
        )
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO messages (queue, body, visible_at, published_at) VALUES ('q', ?, 0, 0)",
            [(BODY,)] * N,
        )
        db.execute("COMMIT")
        ids = json.dumps(list(range(1, BATCH + 1)))
        print(f"{'statement':<38} {'µs a message':>13}")
        for name, sql in STATEMENTS.items():
            best = float("inf")
            for _ in range(3):
                db.execute("BEGIN IMMEDIATE")
                t = time.perf_counter()
                db.execute(sql, (ids,) if "?" in sql else ()).fetchall()
                best = min(best, time.perf_counter() - t)
                db.execute("ROLLBACK")
            results[name] = best / BATCH * 1e6
            print(f"{name:<38} {results[name]:>13.2f}")
        db.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"messages": N, "batch": BATCH, "us_a_message": results}, f, indent=1)
    print(json.dumps({"messages": N, "batch": BATCH, "us_a_message": results}))


if __name__ == "__main__":
    main()
