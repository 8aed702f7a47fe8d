"""A progress line for long runs: a live bar on a terminal, periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ackflow.core.window import InflightWindow
from ackflow.engine.report import RunReport


class ProgressBar:
    """Call it with the run's report and window (the engine does, twice a second).

    On a terminal it redraws one line; elsewhere it writes a line every
    ``every_s`` seconds, so logs of a batch job stay readable.
    """

    def __init__(self, total: int | None = None, stream: TextIO | None = None, every_s: float = 5.0) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._t0 = time.monotonic()
        self._last_line = 0.0
        self._last = (self._t0, 0)
        self._rate = 0.0

    def __call__(self, report: RunReport, window: InflightWindow) -> None:
        now = time.monotonic()
        finished = report.acked + report.dead_lettered  # nacked ones come back
        t_prev, n_prev = self._last
        if now - t_prev >= 1.0:
            self._rate = (finished - n_prev) / (now - t_prev)
            self._last = (now, finished)
        done = f"{finished:,}" + (f"/{self.total:,}" if self.total else "")
        bar = ""
        if self.total and self.tty:
            filled = int(20 * min(finished / self.total, 1.0))
            bar = "[" + "#" * filled + "." * (20 - filled) + "] "
        line = (
            f"{bar}done {done} | {self._rate:,.0f} settled/s | in flight "
            f"{window.in_flight:,}/{window.max_inflight:,}"
            f"{' THROTTLED' if window.throttled else ''} | acked {report.acked:,} | "
            f"dead-lettered {report.dead_lettered:,} | nacked {report.nacked:,}"
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
        elif now - self._last_line >= self.every_s:
            self._last_line = now
            self.stream.write(f"[{now - self._t0:7.1f}s] {line}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
