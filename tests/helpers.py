"""Small helpers shared by the tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, every: float = 0.02) -> bool:
    """Wait on a condition with a deadline (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def bodies(rows: list[dict[str, Any]]) -> list[bytes]:
    return [json.dumps(r).encode() for r in rows]


FAST = {"batch_size": 50, "max_inflight": 200, "until_idle": 0.3, "batch_timeout_s": 0.2}


class Outage:
    """Stop ``postgres`` (a PostgresServer) for ``seconds`` once ``count_sql`` (a count
    query) reaches ``at_least``, in a thread: ``with Outage(...) as o: run()``; after,
    ``o.happened`` says whether it did, and the server is running again."""

    def __init__(
        self, postgres: Any, count_sql: str, at_least: int, seconds: float = 3.0, wait_s: float = 60.0
    ) -> None:
        import threading

        self.postgres, self.sql, self.at_least, self.seconds = postgres, count_sql, at_least, seconds
        self.happened, self.wait_s = False, wait_s
        self._thread = threading.Thread(target=self._away, daemon=True)

    def _reached(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.postgres.dsn, connect_timeout=2) as c:
                return bool(c.execute(self.sql).fetchone()[0] >= self.at_least)
        except psycopg.Error:
            return False

    def _away(self) -> None:
        if wait_until(self._reached, timeout=self.wait_s, every=0.02):
            self.postgres.stop()
            time.sleep(self.seconds)
            self.postgres.start()
            self.happened = True

    def __enter__(self) -> Outage:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=self.wait_s + self.seconds + 30)
        if not self.postgres.running:
            self.postgres.start()


def must_be_positive(row: dict[str, Any]) -> dict[str, Any]:
    """A step that fails the rows whose ``n`` is negative (poison messages)."""
    if row["n"] < 0:
        raise ValueError(f"negative: {row['n']}")
    return row


def run_local(flow: Any, **kw: Any) -> Any:
    """Run ``flow`` with the in-process executor until idle (small batches)."""
    from ackflow.engine.loop import Engine

    opts = {"executor": "local", "batch_size": 500, "max_inflight": 2000, "until_idle": 0.5, **kw}
    return Engine(flow, handle_signals=False, **opts).run()


class CountingPulls:
    """A source mixin: each pulled delivery's ``messages`` in the class's ``pulls``."""

    pulls: list[int] = []

    def pull(self, max_messages: int, timeout: float) -> Any:
        got = super().pull(max_messages, timeout)  # type: ignore[misc]
        type(self).pulls += [d.messages for d in got]
        return got
