"""A directory of files as a source: each line a message, progress per file.

Files are picked up as they appear in the directory (write them elsewhere, or under
a name starting with ``.``, then rename them in: a rename is atomic, so a file is
complete when it is seen). Each line is a message with the stable id
``<file>:<line>``. Progress is one committed line per file, computed by an
:class:`~ackflow.core.offsets.OffsetTracker` (never past a line still in flight)
and kept in ``PATH/_ackflow/state.json`` (written atomically). A restart resumes
each file after its committed line. A file whose lines are all settled is moved
to ``PATH/done/`` (``done="move"``) or only marked done in the state file
(``done="record"``).
"""

from __future__ import annotations

import csv
import heapq
import io
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ackflow.core.errors import ConfigError
from ackflow.core.ledger import Failure
from ackflow.core.offsets import OffsetTracker
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement
from ackflow.sources.base import Source

log = logging.getLogger("ackflow.sources.files")

FORMATS = {"jsonl": "json", "csv": "json", "text": "text"}


@dataclass
class _File:
    name: str
    tracker: OffsetTracker
    handle: BinaryIO | None = None
    next_line: int = 0
    eof: bool = False
    header: list[str] | None = None
    dead_lettered: int = 0
    bodies: dict[int, bytes] = field(default_factory=dict)  # in flight: line -> body


class FilesSource(Source):
    """Read ``path``'s files line by line; ``format`` is ``"jsonl"`` (one JSON object
    per line), ``"csv"`` (the first line is the header; each row becomes an object of
    strings) or ``"text"`` (``{"body": line}``). Empty lines are skipped.

    Failed lines are retried after the policy's backoff (kept in memory: a restart
    reads them again from the file) and, once given up, dead-lettered: to the flow's
    error sink if it has one, otherwise appended (with file, line, step, error and
    delivery count) to ``_ackflow/dead/<file>.jsonl`` before they count as settled.
    A finished file with dead letters says so: its dead letters are moved beside it
    (``done/<file>.dead.jsonl``) and the state file counts them.
    """

    def __init__(self, path: str | os.PathLike[str], format: str = "jsonl", *,
                 policy: RetryPolicy | None = None, done: str = "move",
                 scan_interval_s: float = 1.0, name: str | None = None) -> None:
        if format not in FORMATS:
            raise ConfigError(f"Files source: format must be one of {sorted(FORMATS)}, "
                              f"got {format!r}")
        if done not in ("move", "record"):
            raise ConfigError(f"Files source: done must be 'move' or 'record', got {done!r}")
        super().__init__(format=FORMATS[format], name=name or f"files:{os.fspath(path)}")
        self.path = os.path.abspath(os.fspath(path))
        self.file_format = format
        self.policy = policy or RetryPolicy()
        self.done = done
        self.scan_interval_s = scan_interval_s
        self._files: dict[str, _File] = {}
        self._state: dict[str, dict[str, Any]] = {}
        self._retry: list[tuple[float, int, str, int, int]] = []  # due, seq, file, line, count
        self._seq = 0
        self._last_scan = 0.0
        self._error_sink = False

    # -- places ----------------------------------------------------------------------

    @property
    def meta(self) -> str:
        return os.path.join(self.path, "_ackflow")

    @property
    def state_path(self) -> str:
        return os.path.join(self.meta, "state.json")

    def _dead_path(self, name: str) -> str:
        return os.path.join(self.meta, "dead", name + ".jsonl")

    # -- lifecycle -----------------------------------------------------------------------

    def configure(self, *, max_inflight: int, error_sink: bool) -> None:
        self._error_sink = error_sink

    def open(self) -> int:
        if not os.path.isdir(self.path):
            raise ConfigError(f"source {self.name!r}: {self.path!r} is not a directory")
        os.makedirs(os.path.join(self.meta, "dead"), exist_ok=True)
        if self.done == "move":
            os.makedirs(os.path.join(self.path, "done"), exist_ok=True)
        if os.path.exists(self.state_path):
            with open(self.state_path) as f:
                self._state = json.load(f)["files"]
        self._scan()
        return 0

    def _scan(self) -> None:
        self._last_scan = time.monotonic()
        for name in sorted(os.listdir(self.path)):
            if name in self._files or name.startswith((".", "_")) or name == "done":
                continue
            full = os.path.join(self.path, name)
            if not os.path.isfile(full):
                continue
            st = self._state.get(name, {})
            if st.get("done"):
                if self.done == "move":  # finished, then the process died before the move
                    self._move_done(name)
                continue
            committed = int(st.get("committed", 0))
            f = _File(name, OffsetTracker(start=committed), dead_lettered=int(st.get("dead", 0)))
            f.handle = open(full, "rb")
            self._files[name] = f
            if self.file_format == "csv":  # line 0 is the header: read it, then skip to
                f.header = next(csv.reader([f.handle.readline().decode("utf-8")]), [])
                f.next_line = 1
                f.tracker.gap(0, 1)
            while f.next_line < committed:  # resume after the committed line
                if not f.handle.readline():
                    break
                f.next_line += 1
            if committed:
                log.info("source %r: resuming %s after line %d", self.name, name, committed)

    def close(self) -> None:
        for f in self._files.values():
            if f.handle is not None:
                f.handle.close()
        self._files.clear()

    # -- pulling ---------------------------------------------------------------------------

    def _delivery(self, f: _File, line: int, body: bytes, count: int) -> Delivery:
        return Delivery(0, f"{f.name}:{line + 1}", body, {"file": f.name, "line": str(line + 1)},
                        count, handle=(f.name, line))

    def _body(self, f: _File, raw: bytes) -> bytes:
        text = raw.rstrip(b"\r\n")
        if self.file_format == "csv":
            row = next(csv.reader(io.StringIO(text.decode("utf-8"))), [])
            header = f.header or []
            if len(row) != len(header):
                # not a fit: pass it through undecodable, so that it fails as its own message
                return b"\xff" + text
            return json.dumps(dict(zip(header, row, strict=True))).encode()
        return text

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        out: list[Delivery] = []
        while True:
            now = time.monotonic()
            while self._retry and self._retry[0][0] <= now and len(out) < max_messages:
                _, _, name, line, count = heapq.heappop(self._retry)
                f = self._files.get(name)
                if f is not None and line in f.bodies:
                    f.tracker.pulled(line)
                    out.append(self._delivery(f, line, f.bodies[line], count))
            for f in list(self._files.values()):
                while len(out) < max_messages and not f.eof and f.handle is not None:
                    raw = f.handle.readline()
                    if not raw:
                        f.eof = True
                        self._maybe_finish(f)
                        break
                    line = f.next_line
                    f.next_line += 1
                    if not raw.strip():
                        f.tracker.gap(line, line + 1)  # an empty line is no message
                        continue
                    body = self._body(f, raw)
                    f.tracker.pulled(line)
                    f.bodies[line] = body
                    out.append(self._delivery(f, line, body, 1))
            if out or now >= deadline:
                break
            if now - self._last_scan >= self.scan_interval_s:
                self._scan()
                continue
            time.sleep(min(0.02, max(0.0, deadline - now)))
        return out

    # -- settling ----------------------------------------------------------------------------

    def _settled(self, deliveries: Sequence[Delivery]) -> None:
        touched = set()
        for d in deliveries:
            name, line = d.handle  # type: ignore[misc]
            f = self._files.get(name)
            if f is None:
                continue
            f.bodies.pop(line, None)
            f.tracker.settled(line)
            touched.add(name)
        self._save(touched)
        for name in touched:
            f = self._files.get(name)
            if f is not None:
                self._maybe_finish(f)

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        self._settled(deliveries)

    def fail(self, failures: Sequence[tuple[Delivery, Failure]]) -> list[Settlement]:
        out, retry, dead = self.by_policy(failures)
        self.nack(retry)
        if dead:
            self._write_dead_letters(dead)
            self._settled([d for d, _ in dead])
        return out

    def _write_dead_letters(self, dead: Sequence[tuple[Delivery, Failure]]) -> None:
        per: dict[str, list[str]] = {}
        for d, f in dead:
            name, line = d.handle  # type: ignore[misc]
            per.setdefault(name, []).append(json.dumps({
                "file": name, "line": line + 1, "step": f.step, "error": f.error,
                "deliveries": d.delivery_count, "body": d.body.decode("utf-8", "replace"),
                "dead_at": time.time()}))
            if name in self._files:
                self._files[name].dead_lettered += 1
        for name, lines in per.items():
            with open(self._dead_path(name), "a") as out:
                out.write("\n".join(lines) + "\n")
                out.flush()
                os.fsync(out.fileno())

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        now = time.monotonic()
        for d, _ in failures:
            name, line = d.handle  # type: ignore[misc]
            f = self._files.get(name)
            if f is None:
                continue
            f.tracker.failed(line)
            self._seq += 1
            heapq.heappush(self._retry, (now + self.policy.delay_after(d.delivery_count),
                                         self._seq, name, line, d.delivery_count + 1))

    def release(self, deliveries: Sequence[Delivery]) -> None:
        now = time.monotonic()
        for d in deliveries:
            name, line = d.handle  # type: ignore[misc]
            self._seq += 1
            heapq.heappush(self._retry, (now, self._seq, name, line, d.delivery_count))

    # -- progress ----------------------------------------------------------------------------

    def _save(self, touched: set[str]) -> None:
        changed = False
        for name in touched:
            f = self._files.get(name)
            if f is None:
                continue
            entry = self._state.setdefault(name, {})
            if entry.get("committed") != f.tracker.committed or entry.get("dead") != f.dead_lettered:
                entry["committed"] = f.tracker.committed
                entry["dead"] = f.dead_lettered
                changed = True
        if changed:
            self._write_state()

    def _write_state(self) -> None:
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as out:
            json.dump({"files": self._state}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.state_path)

    def _move_done(self, name: str) -> None:
        """Move a finished file (and its dead letters) to ``done/``; forget its state, so
        that a new file of the same name is read from its start."""
        os.replace(os.path.join(self.path, name), os.path.join(self.path, "done", name))
        if os.path.exists(self._dead_path(name)):
            os.replace(self._dead_path(name), os.path.join(self.path, "done", name + ".dead.jsonl"))
        self._state.pop(name, None)
        self._write_state()

    def _maybe_finish(self, f: _File) -> None:
        """A file read to its end with every line settled is done."""
        if not f.eof or f.tracker.committed < f.next_line or f.bodies:
            return
        entry = self._state.setdefault(f.name, {})
        entry.update(committed=f.tracker.committed, dead=f.dead_lettered, done=True)
        if f.handle is not None:
            f.handle.close()
            f.handle = None
        self._write_state()  # recorded first: a crash before the move is finished at start
        del self._files[f.name]
        if self.done == "move":
            self._move_done(f.name)
        if f.dead_lettered:
            log.warning("source %r: %s done with %d dead-lettered lines (see %s)", self.name,
                        f.name, f.dead_lettered,
                        f"done/{f.name}.dead.jsonl" if self.done == "move"
                        else self._dead_path(f.name))
        else:
            log.info("source %r: %s done", self.name, f.name)
