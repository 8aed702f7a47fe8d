"""A directory of files as a source: each line a message, progress per file.

Files are picked up as they appear in the directory (write them elsewhere, or under
a name starting with ``.``, then rename them in: a rename is atomic, so a file is
complete when it is seen).

Identity: a name is not an identity (daily drops reuse names). Each file *instance*
gets an id when it is first seen, random and kept in the state store with the file's
fingerprint (device, inode, size, modification and change time in ns). Each line is a
message with the stable id ``<file>@<id>:<line>``: the same after a restart, different
for a later file of the same name, even with the same content. Progress is one committed
line per instance, computed by an :class:`~ackflow.core.offsets.OffsetTracker` (never
past a line still in flight) and kept in ``PATH/_ackflow/state.db`` (SQLite, one row per
instance, see :mod:`ackflow.sources.files_state`). A restart resumes each instance after
its committed line. An instance whose lines are all settled is moved to ``PATH/done/``
(``done="move"``; as ``<file>.<id>`` if ``done/<file>`` exists: nothing is overwritten)
or only marked done (``done="record"``: a later file of the same name is a new instance
and is read).

Scanning is incremental: a pass lists the folder once, then examines at most
``SCAN_CHUNK`` names per step (a pull call runs a step only while it has nothing to
return), and opens at most ``MAX_OPEN`` files at once. A pass that ends forgets the rows
of finished instances whose file is gone (retention); so a file that is deleted and
re-created (``cp -p``, ``rsync -a``, ``tar x``, even on the same inode with the same size
and mtime) is a new arrival. Between two passes, a re-created file is told apart by its
ctime, which those tools cannot set.
"""

from __future__ import annotations

import csv
import heapq
import io
import json
import logging
import math
import os
import sqlite3
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, cast

from ackflow.core.errors import ConfigError
from ackflow.core.ledger import Failure
from ackflow.core.offsets import OffsetTracker
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement
from ackflow.sources import files_blocks, files_done
from ackflow.sources.base import BlockSize, Source
from ackflow.sources.files_done import _fingerprint
from ackflow.sources.files_state import FileStates, Row, new_id

SCAN_CHUNK = 256  # names examined per scan step (one transaction, one fsync)
MAX_OPEN = 256  # files open at once; a pass waits for one to finish beyond that

log = logging.getLogger("ackflow.sources.files")

FORMATS = {"jsonl": "json", "jsonl_nan_as_null": "json_nan_as_null", "csv": "json", "text": "text"}


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
    blocks: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # first -> (end, bytes)
    block_lines: int = 0  # lines in those blocks
    key_prefix: str = ""  # a line's message key is this and the line's number (from 1)
    saved: tuple[int, int] = (-1, -1)  # (committed, dead) as last stored

    def __post_init__(self) -> None:
        self.key_prefix = f"{self.name}@{self.id}:"


class FilesSource(Source):
    """Read ``path``'s files line by line; ``format`` is ``"jsonl"`` (one JSON object
    per line), ``"jsonl_nan_as_null"`` (the same, with ``NaN``/``Infinity``/``-Infinity``
    read as null: see :class:`ackflow.sources.base.Source`), ``"csv"`` (the first line is
    the header; each row becomes an object of strings) or ``"text"`` (``{"body": line}``).
    Empty lines are skipped.

    Failed lines are retried after the policy's backoff (kept in memory: a restart
    reads them again from the file) and, once given up, dead-lettered: to the flow's
    error sink if it has one, otherwise appended (with file, line, step, error and
    delivery count) to ``_ackflow/dead/<file>.jsonl`` before they count as settled.
    A finished file with dead letters says so: its dead letters are moved beside it
    (``done/<file>.dead.jsonl``) and the state store counts them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        format: str = "jsonl",
        *,
        policy: RetryPolicy | None = None,
        done: str = "move",
        scan_interval_s: float = 1.0,
        name: str | None = None,
    ) -> None:
        if format not in FORMATS:
            raise ConfigError(f"Files source: format must be one of {sorted(FORMATS)}, got {format!r}")
        if done not in ("move", "record"):
            raise ConfigError(f"Files source: done must be 'move' or 'record', got {done!r}")
        if not (
            isinstance(scan_interval_s, (int, float))
            and math.isfinite(scan_interval_s)
            and scan_interval_s >= 0
        ):  # nan would never scan again
            raise ConfigError(
                "Files source: scan_interval_s must be >= 0 seconds (a finite "
                f"number), got {scan_interval_s!r}"
            )
        super().__init__(format=FORMATS[format], name=name or f"files:{os.fspath(path)}")
        self.path = os.path.abspath(os.fspath(path))
        self.file_format = format
        self.policy = policy or RetryPolicy()
        self.done = done
        self.scan_interval_s = scan_interval_s
        self._files: dict[str, _File] = {}  # by instance id
        self._states: FileStates | None = None
        self._listing: list[str] | None = None  # the names of the pass in progress
        self._pos = 0
        self._retry: list[tuple[float, int, str, int, int]] = []  # due, seq, file id, line, count
        self._seq = 0
        self._last_scan = 0.0
        self._error_sink = False
        self._blocks = False  # runs of lines handed out as one delivery (files_blocks.py)
        self.block_size = BlockSize(files_blocks.BLOCK_LINES)
        self._window = 10_000
        self._move_tried: set[str] = set()  # instances whose move was tried in this run
        self._unmovable: tuple[int, list[str]] = (0, [])  # count, the first few "name: cause"

    # -- places ----------------------------------------------------------------------

    @property
    def meta(self) -> str:
        return os.path.join(self.path, "_ackflow")

    @property
    def state_path(self) -> str:
        return os.path.join(self.meta, "state.db")

    @property
    def states(self) -> FileStates:
        if self._states is None:
            raise RuntimeError(f"source {self.name!r} is not open")
        return self._states

    def _dead_path(self, file_id: str) -> str:
        return os.path.join(self.meta, "dead", file_id + ".jsonl")

    # -- lifecycle -----------------------------------------------------------------------

    def configure(self, *, max_inflight: int, error_sink: bool, keepalive_s: float = 30.0) -> None:
        self._error_sink = error_sink
        self._window = max_inflight

    def use_blocks(self, on: bool) -> bool:
        # CSV lines become JSON here, one by one; headers are made per delivery
        self._blocks = on and self.file_format != "csv" and self.headers_field is None
        return self._blocks

    def split(self, blocks: Sequence[Delivery]) -> None:
        files_blocks.split(self, blocks)

    def open(self) -> int:
        if not os.path.isdir(self.path):
            raise ConfigError(f"source {self.name!r}: {self.path!r} is not a directory")
        os.makedirs(os.path.join(self.meta, "dead"), exist_ok=True)
        if self.done == "move":
            os.makedirs(os.path.join(self.path, "done"), exist_ok=True)
        try:
            self._states = FileStates(self.state_path)
        except sqlite3.Error as e:
            raise ConfigError(
                f"source {self.name!r}: cannot open {self.state_path}: {e}; "
                "fix or remove it (then every file is read again)"
            ) from None
        old = os.path.join(self.meta, "state.json")
        if os.path.exists(old):  # written by an earlier version: taken over, rows kept
            try:
                n = self._states.migrate_json(old)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(
                    f"source {self.name!r}: cannot read {old}: {e}; "
                    "fix or remove it (then every file is read again)"
                ) from None
            log.info("source %r: %d file instances taken over from %s", self.name, n, old)
        self._count_unmovable()
        self._scan()
        return 0

    def _scan(self) -> None:
        """Run scan steps until the pass in progress (or a new one) ends, or waits for
        open files to finish."""
        self._scan_step()
        while self._listing is not None and self._scan_step():
            pass

    def _scan_step(self) -> bool:
        """Examine up to ``SCAN_CHUNK`` names of the pass in progress (listing the folder
        first if none is); True if it examined any. New instances are recorded (one
        transaction) before any of their lines is handed out."""
        states = self.states
        if self._listing is None:
            self._last_scan = time.monotonic()
            self._listing = sorted(
                n for n in os.listdir(self.path) if not n.startswith((".", "_")) and n != "done"
            )
            self._pos = 0
        listing = self._listing
        if self._pos < len(listing) and len(self._files) >= MAX_OPEN:
            return False  # the pass waits for an open file to finish
        to_open: list[Row] = []
        to_move: list[tuple[Row, str]] = []
        examined = 0
        with states.tx():
            seen: list[str] = []
            while (
                self._pos < len(listing)
                and examined < SCAN_CHUNK
                and len(self._files) + len(to_open) < MAX_OPEN
            ):
                name = listing[self._pos]
                self._pos += 1
                examined += 1
                try:
                    st = os.stat(os.path.join(self.path, name))
                except FileNotFoundError:  # gone meanwhile
                    continue
                except OSError:  # cannot tell: its rows are kept
                    seen.extend(r.id for r in states.by_name(name))
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                row = self._instance(name, st)
                if row is None:
                    continue
                seen.append(row.id)
                if row.status == "reading":
                    to_open.append(row)
                elif self.done == "move" and row.id not in self._move_tried:
                    # finished, then the process died before the move, or the move failed:
                    # tried once per run, never in a loop and never fatal
                    to_move.append((row, os.path.join(self.path, name)))
            states.saw(seen)
            states.commit_point()
        for row in to_open:
            self._open_instance(row)
        if to_move:
            self._move_done([(r.id, r.name, r.fingerprint, full) for r, full in to_move])
        if self._pos >= len(listing):
            self._end_pass()
        return examined > 0

    def _instance(self, name: str, st: os.stat_result) -> Row | None:
        """The row of the file now at ``name`` (inside the scan's transaction): the one
        recorded with this fingerprint, an old one without a fingerprint (state written
        before ids existed), or a new instance. None: open already (nothing to do)."""
        states = self.states
        fp, ctime = tuple(_fingerprint(st)), st.st_ctime_ns
        match = old = None
        for r in states.by_name(name):
            if r.fingerprint == fp:
                match = r
            elif r.fingerprint is None and old is None:
                old = r
        if match is None and old is not None:
            states.adopt(old.id, fp, ctime)
            match = old
            match.ctime_ns = ctime
        if match is not None:
            if match.id in self._files:  # being read (a chmod meanwhile is no new file)
                if match.ctime_ns != ctime:
                    states.adopt(match.id, fp, ctime)
                states.saw([match.id])
                return None
            if match.ctime_ns is None:  # taken over from state.json: no ctime yet
                states.adopt(match.id, fp, ctime)
                return match
            if match.ctime_ns == ctime or match.status == "unmovable":
                return match
            # Same inode, size and mtime, another ctime: re-created by cp -p, rsync -a or
            # tar x (which set the mtime, never the ctime), or its metadata changed (chmod,
            # chown, a hard link). They cannot be told apart: it is read again as a new
            # arrival (at-least-once), never skipped.
            log.warning(
                "source %r: %s has the inode, size and mtime of instance %s (%s, "
                "line %d committed) but another ctime: re-created, or its metadata "
                "changed; read again as a new instance (at-least-once)",
                self.name,
                name,
                match.id,
                match.status,
                match.committed,
            )
            states.delete([match.id])
        fid = new_id()
        states.insert(fid, name, fp, ctime)
        return Row(fid, name, fp, ctime, 0, 0, "reading", None)  # type: ignore[arg-type]

    def _end_pass(self) -> None:
        """The pass saw every name: rows of instances not open whose file is gone are
        forgotten (a later file there is a new arrival)."""
        states = self.states
        gone = [r for r in states.unseen() if r.id not in self._files]
        for r in gone:
            if r.status == "reading":
                log.warning(
                    "source %r: %s (%s) left the folder before it was finished: its "
                    "lines after line %d were never read",
                    self.name,
                    r.name,
                    r.id,
                    r.committed,
                )
        with states.tx():
            states.delete(r.id for r in gone)
            states.end_pass()
            states.commit_point()
        self._listing = None
        self._last_scan = time.monotonic()  # the interval runs between passes
        if any(r.status == "unmovable" for r in gone):
            self._count_unmovable()

    def _open_instance(self, row: Row) -> None:
        full = os.path.join(self.path, row.name)
        try:
            handle = open(full, "rb")
        except OSError as e:  # unreadable: look again at the next pass
            log.warning("source %r: cannot open %s: %s", self.name, row.name, e)
            return
        if tuple(_fingerprint(os.fstat(handle.fileno()))) != row.fingerprint:
            handle.close()  # replaced since the scan: the next pass sees the new one
            return
        committed = row.committed
        f = _File(
            row.id,
            row.name,
            list(row.fingerprint or ()),
            OffsetTracker(start=committed),
            handle=handle,
            dead_lettered=row.dead,
        )
        self._files[row.id] = f
        if self.file_format == "csv":  # line 0 is the header: read it, then skip to
            f.header = _csv_header(handle.readline())
            if f.header is None:
                log.error(
                    "source %r: the CSV header of %s is not valid UTF-8 CSV; every line of it fails",
                    self.name,
                    row.name,
                )
            f.next_line = 1
            f.tracker.gap(0, 1)
        while f.next_line < committed:  # resume after the committed line
            if not handle.readline():
                break
            f.next_line += 1
        if committed:
            log.info("source %r: resuming %s after line %d", self.name, row.name, committed)

    def close(self) -> None:
        for f in self._files.values():
            if f.handle is not None:
                f.handle.close()
        self._files.clear()
        self._listing = None
        if self._states is not None:
            self._states.close()
            self._states = None

    # -- pulling ---------------------------------------------------------------------------

    def _delivery(self, f: _File, line: int, body: bytes, count: int) -> Delivery:
        number = str(line + 1)
        return Delivery(
            0,
            f.key_prefix + number,
            body,
            {"file": f.name, "file_id": f.id, "line": number},
            count,
            handle=(f.id, line),
        )

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
            room = self._window - sum(len(f.bodies) + f.block_lines for f in self._files.values())
            for f in list(self._files.values()):
                if f.eof or f.handle is None:
                    continue
                take = min(max_messages - sum(d.messages for d in out), room)
                if take > 0:
                    read = files_blocks.read_blocks if self._blocks else FilesSource._read
                    room -= read(self, f, take, out)
            if out or now >= deadline:
                break
            # one bounded scan step at a time, only while there is nothing to return
            if (
                self._listing is not None or now - self._last_scan >= self.scan_interval_s
            ) and self._scan_step():
                continue
            time.sleep(min(0.02, max(0.0, deadline - now)))
        return out

    def _read(self, f: _File, take: int, out: list[Delivery]) -> int:
        """Read up to ``take`` lines of ``f`` into ``out``; how many it added. The lines
        read are tracked as ranges (the runs between empty lines), not one by one."""
        handle = f.handle
        assert handle is not None
        readline, bodies, tracker, delivery = handle.readline, f.bodies, f.tracker, self._delivery
        plain = self.file_format != "csv"
        line = first = f.next_line
        added = 0
        try:
            while added < take:
                raw = readline()
                if not raw:
                    f.eof = True
                    break
                if raw.isspace():  # an empty line is no message
                    tracker.pulled_range(first, line)
                    tracker.gap(line, line + 1)
                    line += 1
                    first = line
                    continue
                body = raw.rstrip(b"\r\n") if plain else self._body(f, raw)
                bodies[line] = body
                out.append(delivery(f, line, body, 1))
                line += 1
                added += 1
        finally:  # what was read is tracked, whatever stopped the reading
            tracker.pulled_range(first, line)
            f.next_line = line
        if f.eof and self._finished(f):
            self._finish([f])
        return added

    @property
    def retries_waiting(self) -> int:
        return len(self._retry)

    def status(self) -> dict[str, object]:
        files = list(self._files.values())
        out: dict[str, object] = {
            "kind": "files",
            "path": self.path,
            "files_open": len(files),
            "retries_waiting": len(self._retry),
        }
        for f in files[:5]:  # bounded: the first few instances
            out[f"committed line of {f.name}"] = f.tracker.committed
        count, first = self._unmovable
        if count:
            out["files_unmovable"] = count
            out["unmovable"] = "; ".join(first)
        return out

    # -- settling ----------------------------------------------------------------------------

    def _settled(self, deliveries: Sequence[Delivery]) -> None:
        lines: dict[str, list[int]] = {}
        fid: str
        line: int
        if self._blocks and any(d.messages > 1 for d in deliveries):
            blocks = [d for d in deliveries if d.messages > 1]
            deliveries = [d for d in deliveries if d.messages == 1]
            for fid in files_blocks.acked(self, blocks):
                lines.setdefault(fid, [])
        for d in deliveries:
            fid, line = d.handle  # type: ignore[misc]  # (file id, line): see _position
            got = lines.get(fid)
            if got is None:
                lines[fid] = [line]
            else:
                got.append(line)
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
            fid, line = _position(d)
            per.setdefault(fid, []).append(
                json.dumps(
                    {
                        "file": d.headers.get("file"),
                        "file_id": fid,
                        "line": line + 1,
                        "step": f.step,
                        "error": f.error,
                        "deliveries": d.delivery_count,
                        "body": d.body.decode("utf-8", "replace"),
                        "dead_at": time.time(),
                    }
                )
            )
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
            fid, line = _position(d)
            f = self._files.get(fid)
            if f is None:
                continue
            f.tracker.failed(line)
            self._seq += 1
            heapq.heappush(
                self._retry,
                (now + self.policy.delay_after(d.delivery_count), self._seq, fid, line, d.delivery_count + 1),
            )

    def release(self, deliveries: Sequence[Delivery]) -> None:
        if any(d.messages > 1 for d in deliveries):  # blocks: their lines come again
            files_blocks.split(self, [d for d in deliveries if d.messages > 1])
            deliveries = [d for d in deliveries if d.messages == 1]
        now = time.monotonic()
        for d in deliveries:
            fid, line = _position(d)
            self._seq += 1
            heapq.heappush(self._retry, (now, self._seq, fid, line, d.delivery_count))

    # -- progress ----------------------------------------------------------------------------

    def _save(self, touched: set[str]) -> None:
        """Store the progress of the instances that settled lines and finish those now
        done: one transaction whatever their number, one row per instance."""
        updates, finished = [], []
        for fid in touched:
            f = self._files.get(fid)
            if f is None:
                continue
            if self._finished(f):
                finished.append(f)
            elif (f.tracker.committed, f.dead_lettered) != f.saved:
                updates.append((fid, f.tracker.committed, f.dead_lettered))
        if finished:
            self._finish(finished, updates)
        elif updates:
            with self.states.tx():
                self.states.progress(updates)
                self.states.commit_point()
            for fid, committed, dead in updates:
                self._files[fid].saved = (committed, dead)

    def _count_unmovable(self) -> None:
        rows = self.states.with_status("unmovable", 5)
        self._unmovable = (
            self.states.count("unmovable") if rows else 0,
            [f"{r.name}: {r.cause}" for r in rows],
        )

    def _move_done(self, items: Sequence[tuple[str, str, tuple[int, ...] | None, str | None]]) -> None:
        files_done.move_done(self, items)

    @staticmethod
    def _finished(f: _File) -> bool:
        """Read to its end with every line settled."""
        return f.eof and f.tracker.committed >= f.next_line and not f.bodies and not f.blocks

    def _finish(self, files: Sequence[_File], updates: Sequence[tuple[str, int, int]] = ()) -> None:
        """Record ``files`` done (with other instances' progress ``updates``) in one
        transaction, first: a crash before the move is finished at start; then move them."""
        with self.states.tx():
            self.states.progress([*updates, *((f.id, f.tracker.committed, f.dead_lettered) for f in files)])
            for f in files:
                self.states.set_status(f.id, "done")
            self.states.commit_point()
        for fid, committed, dead in updates:
            self._files[fid].saved = (committed, dead)
        for f in files:
            if f.handle is not None:
                f.handle.close()
                f.handle = None
            del self._files[f.id]
            if f.dead_lettered:
                log.warning(
                    "source %r: %s (%s) done with %d dead-lettered lines",
                    self.name,
                    f.name,
                    f.id,
                    f.dead_lettered,
                )
            else:
                log.info("source %r: %s (%s) done", self.name, f.name, f.id)
        if self.done == "move":
            self._move_done(
                [(f.id, f.name, tuple(f.fingerprint), os.path.join(self.path, f.name)) for f in files]
            )


def _position(d: Delivery) -> tuple[str, int]:
    """Where a delivery was read: its file's id and line (set in ``_delivery``)."""
    return cast(tuple[str, int], d.handle)


def _csv_header(raw: bytes) -> list[str] | None:
    try:
        return next(csv.reader([raw.rstrip(b"\r\n").decode("utf-8")]), [])
    except (UnicodeDecodeError, csv.Error):
        return None
