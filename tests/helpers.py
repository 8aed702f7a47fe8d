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
