"""A directory of files as a source: each line a message, progress per file.

Files are picked up as they appear in the directory (write them elsewhere, or under
a name starting with ``.``, then rename them in: a rename is atomic, so a file is
complete when it is seen).

Identity: a name is not an identity (daily drops reuse names). Each file *instance*
gets an id when it is first seen, random and kept in the state file with the file's
fingerprint (device, inode, size, modification time in ns). Each line is a message
with the stable id ``<file>@<id>:<line>``: the same after a restart, different for a
later file of the same name, even with the same content. Progress is one committed line
per instance, computed by an :class:`~ackflow.core.offsets.OffsetTracker` (never past
a line still in flight) and kept in ``PATH/_ackflow/state.json`` (written atomically).
A restart resumes each instance after its committed line. An instance whose lines are
all settled is moved to ``PATH/done/`` (``done="move"``; as ``<file>.<id>`` if
``done/<file>`` exists: nothing is overwritten) or only marked done in the state file
(``done="record"``: a later file of the same name is a new instance and is read).
"""

from __future__ import annotations

import csv
import heapq
import io
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ackflow import faults
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
    id: str  # unique to this instance of the file (names are reused)
    name: str
    fingerprint: list[int]
    tracker: OffsetTracker
    handle: BinaryIO | None = None
    next_line: int = 0
    eof: bool = False
    header: list[str] | None = None
    dead_lettered: int = 0
    bodies: dict[int, bytes] = field(default_factory=dict)  # in flight: line -> body
    key_prefix: str = ""  # a line's message key is this and the line's number (from 1)

    def __post_init__(self) -> None:
        self.key_prefix = f"{self.name}@{self.id}:"


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
        self._files: dict[str, _File] = {}  # by instance id
        self._state: dict[str, dict[str, Any]] = {}  # by instance id
        self._retry: list[tuple[float, int, str, int, int]] = []  # due, seq, file id, line, count
        self._seq = 0
        self._last_scan = 0.0
        self._error_sink = False
        self._window = 10_000
        self._move_tried: set[str] = set()  # instances whose move was tried in this run
        self._unmovable: dict[str, str] = {}  # instance id -> "name: cause" (this run)

    # -- places ----------------------------------------------------------------------

    @property
    def meta(self) -> str:
        return os.path.join(self.path, "_ackflow")

    @property
    def state_path(self) -> str:
        return os.path.join(self.meta, "state.json")

    def _dead_path(self, file_id: str) -> str:
        return os.path.join(self.meta, "dead", file_id + ".jsonl")

    # -- lifecycle -----------------------------------------------------------------------

    def configure(self, *, max_inflight: int, error_sink: bool,
                  keepalive_s: float = 30.0) -> None:
        self._error_sink = error_sink
        self._window = max_inflight

    def open(self) -> int:
        if not os.path.isdir(self.path):
            raise ConfigError(f"source {self.name!r}: {self.path!r} is not a directory")
        os.makedirs(os.path.join(self.meta, "dead"), exist_ok=True)
        if self.done == "move":
            os.makedirs(os.path.join(self.path, "done"), exist_ok=True)
        if os.path.exists(self.state_path):
            try:
                with open(self.state_path) as f:
                    self._state = _migrate(json.load(f)["files"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"source {self.name!r}: cannot read {self.state_path}: {e}; "
                                  "fix or remove it (then every file is read again)") from None
        self._scan()
        return 0

    def _instance(self, name: str, fingerprint: list[int],
                  known: dict[tuple[Any, ...], str]) -> tuple[str, dict[str, Any]]:
        """The state entry of the file now at ``name``: the one recorded with this
        fingerprint, an old entry without one (state written before ids existed), or a
        new instance."""
        fid = known.get((name, *fingerprint)) or known.pop((name,), None)
        if fid is not None:
            self._state[fid]["fingerprint"] = fingerprint
            return fid, self._state[fid]
        fid = uuid.uuid4().hex[:16]
        self._state[fid] = {"name": name, "fingerprint": fingerprint, "committed": 0, "dead": 0}
        self._write_state()  # the id is durable before any line of it is handed out
        return fid, self._state[fid]

    def _scan(self) -> None:
        self._last_scan = time.monotonic()
        reading = {tuple(f.fingerprint) for f in self._files.values()}
        known = {(e["name"], *e.get("fingerprint", ())): fid for fid, e in self._state.items()}
        for name in sorted(os.listdir(self.path)):
            if name.startswith((".", "_")) or name == "done":
                continue
            full = os.path.join(self.path, name)
            try:
                st = os.stat(full)
            except OSError:  # gone meanwhile
                continue
            fingerprint = _fingerprint(st)
            if not os.path.isfile(full) or tuple(fingerprint) in reading:
                continue
            fid, entry = self._instance(name, fingerprint, known)
            if entry.get("done"):
                # finished, then the process died before the move, or the move failed:
                # tried once per run, never in a loop and never fatal
                if self.done == "move" and fid not in self._move_tried:
                    self._move_done(fid, full)
                continue
            try:
                handle = open(full, "rb")
            except OSError as e:  # unreadable: look again at the next scan
                log.warning("source %r: cannot open %s: %s", self.name, name, e)
                continue
            committed = int(entry.get("committed", 0))
            f = _File(fid, name, fingerprint, OffsetTracker(start=committed),
                      handle=handle, dead_lettered=int(entry.get("dead", 0)))
            self._files[fid] = f
            if self.file_format == "csv":  # line 0 is the header: read it, then skip to
                f.header = _csv_header(handle.readline())
                if f.header is None:
                    log.error("source %r: the CSV header of %s is not valid UTF-8 CSV; every "
                              "line of it fails", self.name, name)
                f.next_line = 1
                f.tracker.gap(0, 1)
            while f.next_line < committed:  # resume after the committed line
                if not handle.readline():
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
        number = str(line + 1)
        return Delivery(0, f.key_prefix + number, body,
                        {"file": f.name, "file_id": f.id, "line": number},
                        count, handle=(f.id, line))

    def _body(self, f: _File, raw: bytes) -> bytes:
        text = raw.rstrip(b"\r\n")
        if self.file_format == "csv":
            # A line that does not fit (bad bytes, bad header, another number of fields)
            # is passed on undecodable, so that it fails as its own message ("decode").
            try:
                row = next(csv.reader(io.StringIO(text.decode("utf-8"))), [])
            except (UnicodeDecodeError, csv.Error):
                return b"\xff" + text
            header = f.header
            if header is None or len(row) != len(header):
                return b"\xff" + text
            return json.dumps(dict(zip(header, row, strict=True))).encode()
        return text

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        out: list[Delivery] = []
        while True:
            now = time.monotonic()
            while self._retry and self._retry[0][0] <= now and len(out) < max_messages:
                _, _, fid, line, count = heapq.heappop(self._retry)
                f = self._files.get(fid)
                if f is not None and line in f.bodies:
                    f.tracker.pulled(line)
                    out.append(self._delivery(f, line, f.bodies[line], count))
            # Bounded memory: lines waiting for a retry keep their bodies; new lines are read
            # only while in-flight and waiting lines together stay within the window.
            room = self._window - sum(len(f.bodies) for f in self._files.values())
            for f in list(self._files.values()):
                if f.eof or f.handle is None:
                    continue
                readline, pulled, bodies = f.handle.readline, f.tracker.pulled, f.bodies
                take = min(max_messages - len(out), room)
                while take > 0:
                    raw = readline()
                    if not raw:
                        f.eof = True
                        self._maybe_finish(f)
                        break
                    line = f.next_line
                    f.next_line += 1
                    if raw.isspace():
                        f.tracker.gap(line, line + 1)  # an empty line is no message
                        continue
                    body = self._body(f, raw)
                    pulled(line)
                    bodies[line] = body
                    room -= 1
                    take -= 1
                    out.append(self._delivery(f, line, body, 1))
            if out or now >= deadline:
                break
            if now - self._last_scan >= self.scan_interval_s:
                self._scan()
                continue
            time.sleep(min(0.02, max(0.0, deadline - now)))
        return out

    def status(self) -> dict[str, object]:
        files = list(self._files.values())
        out: dict[str, object] = {"kind": "files", "path": self.path, "files_open": len(files),
                                  "retries_waiting": len(self._retry)}
        for f in files[:5]:  # bounded: the first few instances
            out[f"committed line of {f.name}"] = f.tracker.committed
        if self._unmovable:
            out["files_unmovable"] = len(self._unmovable)
            out["unmovable"] = "; ".join(list(self._unmovable.values())[:5])
        return out

    # -- settling ----------------------------------------------------------------------------

    def _settled(self, deliveries: Sequence[Delivery]) -> None:
        lines: dict[str, list[int]] = {}
        for d in deliveries:
            fid, line = d.handle  # type: ignore[misc]
            lines.setdefault(fid, []).append(line)
        touched = set()
        for fid, settled in lines.items():
            f = self._files.get(fid)
            if f is None:
                continue
            for line in settled:
                f.bodies.pop(line, None)
            f.tracker.settled_many(settled)
            touched.add(fid)
        self._save(touched)
        for fid in touched:
            f = self._files.get(fid)
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
            fid, line = d.handle  # type: ignore[misc]
            per.setdefault(fid, []).append(json.dumps({
                "file": d.headers.get("file"), "file_id": fid, "line": line + 1,
                "step": f.step, "error": f.error, "deliveries": d.delivery_count,
                "body": d.body.decode("utf-8", "replace"), "dead_at": time.time()}))
            if fid in self._files:
                self._files[fid].dead_lettered += 1
        for fid, lines in per.items():
            with open(self._dead_path(fid), "a") as out:
                out.write("\n".join(lines) + "\n")
                out.flush()
                os.fsync(out.fileno())

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        now = time.monotonic()
        for d, _ in failures:
            fid, line = d.handle  # type: ignore[misc]
            f = self._files.get(fid)
            if f is None:
                continue
            f.tracker.failed(line)
            self._seq += 1
            heapq.heappush(self._retry, (now + self.policy.delay_after(d.delivery_count),
                                         self._seq, fid, line, d.delivery_count + 1))

    def release(self, deliveries: Sequence[Delivery]) -> None:
        now = time.monotonic()
        for d in deliveries:
            fid, line = d.handle  # type: ignore[misc]
            self._seq += 1
            heapq.heappush(self._retry, (now, self._seq, fid, line, d.delivery_count))

    # -- progress ----------------------------------------------------------------------------

    def _save(self, touched: set[str]) -> None:
        changed = False
        for fid in touched:
            f = self._files.get(fid)
            if f is None:
                continue
            entry = self._state[fid]
            if entry.get("committed") != f.tracker.committed or entry.get("dead") != f.dead_lettered:
                entry["committed"] = f.tracker.committed
                entry["dead"] = f.dead_lettered
                changed = True
        if changed:
            self._write_state()

    def _write_state(self) -> None:
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as out:
            json.dump({"version": 2, "files": self._state}, out)
            out.flush()
            os.fsync(out.fileno())
        faults.point("files.before_commit")
        os.replace(tmp, self.state_path)

    def _move_done(self, fid: str, full: str | None) -> None:
        """Move a finished instance (if ``full`` is still that file) and its dead letters
        to ``done/``, never over an earlier file; then forget it."""
        self._move_tried.add(fid)
        entry = self._state[fid]
        name = entry["name"]
        target = _free(os.path.join(self.path, "done", name), fid)
        try:
            if full is not None:
                try:
                    same = _fingerprint(os.stat(full)) == entry.get("fingerprint")
                except FileNotFoundError:
                    same = False
                if same:
                    os.replace(full, target)
            if os.path.exists(self._dead_path(fid)):
                os.replace(self._dead_path(fid), _free(target, fid, ".dead.jsonl"))
        except OSError as e:
            # e.g. EXDEV (done/ on another file system), EPERM (a sticky drop folder):
            # the file is finished; it stays where it is, marked, and is not read again
            cause = f"{type(e).__name__}: {e}"
            if entry.get("unmovable") != cause:
                entry["unmovable"] = cause
                self._write_state()
            self._unmovable[fid] = f"{name}: {cause}"
            log.error("source %r: %s (%s) is done but cannot be moved to done/ (%s); it is "
                      "left in place and not read again; move or delete it by hand",
                      self.name, name, fid, cause)
            return
        self._unmovable.pop(fid, None)
        self._state.pop(fid, None)
        self._write_state()

    def _maybe_finish(self, f: _File) -> None:
        """A file read to its end with every line settled is done."""
        if not f.eof or f.tracker.committed < f.next_line or f.bodies:
            return
        entry = self._state[f.id]
        entry.update(committed=f.tracker.committed, dead=f.dead_lettered, done=True)
        if f.handle is not None:
            f.handle.close()
            f.handle = None
        self._write_state()  # recorded first: a crash before the move is finished at start
        del self._files[f.id]
        if self.done == "move":
            self._move_done(f.id, os.path.join(self.path, f.name))
        if f.dead_lettered:
            log.warning("source %r: %s (%s) done with %d dead-lettered lines", self.name,
                        f.name, f.id, f.dead_lettered)
        else:
            log.info("source %r: %s (%s) done", self.name, f.name, f.id)


def _fingerprint(st: os.stat_result) -> list[int]:
    """What tells two files of one name apart: device, inode, size, mtime (ns). A file is
    complete when it is renamed in, so these do not change while it is read."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _free(path: str, fid: str, suffix: str = "") -> str:
    """``path + suffix`` if nothing is there, else ``path.<fid> + suffix`` (``done/``
    never overwrites)."""
    return path + suffix if not os.path.exists(path + suffix) else f"{path}.{fid}{suffix}"


def _csv_header(raw: bytes) -> list[str] | None:
    try:
        return next(csv.reader([raw.rstrip(b"\r\n").decode("utf-8")]), [])
    except (UnicodeDecodeError, csv.Error):
        return None


def _migrate(files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """State files written before instance ids were keyed by file name."""
    out = {}
    for key, entry in files.items():
        if "name" in entry:
            out[key] = entry
        else:  # old: the key is the name; the fingerprint is taken when it is next seen
            out[uuid.uuid4().hex[:16]] = {**entry, "name": key}
    return out
