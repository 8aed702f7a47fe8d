"""``ackflow state show``: what a windows state store holds (windows and dedupes), read-only."""

from __future__ import annotations

import contextlib
import os
import pickle
import sqlite3
from typing import Any

from ackflow.core.errors import ConfigError
from ackflow.state.partials import show_us
from ackflow.state.store import STORE_FILE
from ackflow.state.winlog import folded


def _when(us: int | None) -> str | None:
    return None if us is None else show_us(us)


def _dedupes(db: sqlite3.Connection) -> list[tuple[str, int, int, int | None]]:
    """Per dedupe operator: its claims, those not committed yet, the newest claim's time
    (a store written before dedupe existed has no such table)."""
    try:
        return db.execute(
            "SELECT op, count(*), sum(done = 0), max(t) FROM dedupe GROUP BY op ORDER BY op"
        ).fetchall()
    except sqlite3.OperationalError:
        return []


def describe(where: str, window: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
    """Per window operator: its watermark, counters and its open windows (the first
    ``limit``, oldest end first); per dedupe operator: its claims. ``where``: a state
    directory or the store's file."""
    path = os.path.join(where, STORE_FILE) if os.path.isdir(where) else where
    if not os.path.isfile(path):
        raise ConfigError(
            f"no windows state store at {where!r} (expected a state directory or its {STORE_FILE})"
        )
    try:
        db = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True, isolation_level=None)
        db.execute("BEGIN")  # one snapshot for every read (a fold and a write may commit between two)
        ops = db.execute(
            "SELECT op, watermark, max_event, late, written, applied_rows FROM marks ORDER BY op"
        )
        marks = ops.fetchall()
    except sqlite3.DatabaseError as e:
        raise ConfigError(f"{path!r} is not a windows state store: {e}") from e
    out = []
    try:
        for op, w, top, late, done, applied_rows in marks:
            if window is not None and op != window:
                continue
            logged = folded(db, op)  # (the change log replayed over the table, if it holds any)
            if logged is None:
                n_open, refused = db.execute(
                    "SELECT count(*), count(error) FROM windows WHERE op = ?", (op,)
                ).fetchone()
            else:
                n_open, refused = len(logged), sum(1 for w in logged if w[6] is not None)
            remembered = db.execute("SELECT count(*) FROM applied WHERE op = ?", (op,)).fetchone()[0]
            with contextlib.suppress(sqlite3.OperationalError):  # (a store no newer version opened)
                runs = "SELECT coalesce(sum(hi - lo + 1), 0) FROM applied_runs WHERE op = ?"
                remembered += db.execute(runs, (op,)).fetchone()[0]
            if logged is None:
                rows = db.execute(
                    'SELECT start, "end", nrows, dirty, state, error FROM windows WHERE op = ? '
                    'ORDER BY error IS NULL, "end", gk LIMIT ?',
                    (op, limit),
                ).fetchall()
            else:
                logged.sort(key=lambda w: (w[6] is None, w[2], w[0]))
                rows = [w[1:] for w in logged[:limit]]
            out.append(
                {
                    "window": op,
                    "watermark": _when(w),
                    "max_event_time": _when(top),
                    "open_windows": n_open,
                    "refused_windows": refused,
                    "rows_applied": applied_rows,
                    "late_rows": late,
                    "windows_written": done,
                    "applied_keys_remembered": remembered,
                    "open": [
                        {
                            "keys": list(pickle.loads(state)[0]),
                            "start": start if start == end else _when(start),
                            "end": None if start == end else _when(end),
                            "rows": n,
                            "unwritten_changes": bool(dirty),
                            **({"refused": error} if error else {}),
                        }
                        for start, end, n, dirty, state, error in rows
                    ],
                }
            )
        for op, n, uncommitted, newest in _dedupes(db):
            if window is None or op == window:
                out.append(
                    {
                        "dedupe": op,
                        "claims": n,
                        "uncommitted_claims": uncommitted,
                        "newest_claim": _when(newest),
                    }
                )
    finally:
        db.close()
    if window is not None and not out:
        raise ConfigError(f"no window named {window!r} in {path!r}")
    return out
