"""The window operator as the job's sink: rows go into durable state, results out.

In a batch's Spark job each task folds its rows into partial aggregates
(:mod:`.partials`) and hands them to the driver as its token; :meth:`WindowSink.commit`
merges every token into the store in one transaction (:mod:`.store`). A row counts as
written when that commit returned, so its message is acked then, never held until its
window closes.

Results: after each commit and on a timer, the windows that are due (closed by the
watermark, full count windows, or with ``output="update"`` changed ones) are written
to the output sink on the driver, under a stable row key (operator, key values,
window), committed there, and only then deleted from the store. A crash between the
two writes the same rows under the same keys again: harmless for a keyed sink.

The watermark a window closes by never overtakes a running batch: a batch's tasks
accept rows at or above the watermark they read, so a window that such a batch may
still add to is not written until the batch committed (or failed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ackflow import faults
from ackflow.core.errors import FlowError, StoreAway, describe
from ackflow.sinks.base import ROW_KEY, PartitionResult, Sink
from ackflow.state.columns import results
from ackflow.state.held import DueTable
from ackflow.state.partials import Partials, contribute, show_us
from ackflow.state.spec import WindowSpec, check_columns
from ackflow.windows import Count

log = logging.getLogger("ackflow.window")
#: applied row keys older than ``remember`` are forgotten at most this often (each is a commit)
FORGET_EVERY_S = 10.0


class WindowSink(Sink):
    """Window ``spec``'s state; results go to ``output``; late rows to ``on_late``
    (else they fail their message as ``late``). Built by ``flow.window(...).to(output)``."""

    wants_keys = True

    def __init__(self, spec: WindowSpec, output: Sink, on_late: Sink | None = None) -> None:
        super().__init__(spec.name)
        self.spec = spec
        self.output = output
        self.on_late = on_late
        self.branches: tuple[Sink, ...] = (output,) if on_late is None else (output, on_late)
        self.key = spec.columns  # the columns it reads reach it even while all null
        self.path: str | None = None  # the store's file (bind_state)
        self._store: Any = None
        self._held_mark: int | None = None  # the watermark a batch's hold last read
        self._gate: Any = None  # the running batches and the watermark's order (gate.Gate)
        self._ticker: threading.Thread | None = None
        self._stopped = threading.Event()
        self._seq = 0
        self._active = 0.0
        self._forgot = -FORGET_EVERY_S  # (monotonic) when applied row keys were last forgotten
        self.emit_failures = 0
        self._prepared: pa.Schema | None = None
        self._metrics: Any = None
        self._quiet: Any = None
        self._facts: dict[str, Any] = {}

    def observe(self, metrics: Any, quiet: Any = None) -> None:
        """Driver side: the run's metrics (updated by the timer), and ``quiet()``: how
        long the engine has pulled nothing and had nothing in flight (seconds)."""
        self._metrics = metrics
        self._quiet = quiet

    def facts(self) -> dict[str, Any]:
        """The state as the timer last read it (for the status page)."""
        return dict(self._facts)

    def _refresh(self) -> None:
        from ackflow.state.partials import show_us

        mark = self._store.mark(self.name)
        stats = self._store.stats(self.name)
        w, top = mark["watermark"], mark["max_event"]
        self._facts = {
            "kind": type(self.spec.kind).__name__.lower(),
            "watermark": None if w is None else show_us(w),
            "max_event_time": None if top is None else show_us(top),
            "watermark_s": None if w is None else w / 1e6,
            "watermark_lag_s": None if w is None else round(time.time() - w / 1e6, 3),
            "open_windows": stats["open_windows"],
            "refused_windows": stats["refused_windows"],
            "rows_applied": mark["applied_rows"],
            "late_rows": mark["late"],
            "windows_written": mark["written"],
            "state_bytes": stats["bytes"],
            "output_failures": self.emit_failures,
        }
        if self._metrics is not None:
            self._metrics.windows(self.name, self._facts)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for k in ("_store", "_gate", "_ticker", "_stopped", "_metrics", "_quiet"):
            state[k] = None
        return state

    def bind_state(self, path: str) -> None:
        """Driver side, before open: the store's file (chosen by the engine)."""
        self.path = os.path.abspath(path)

    # -- driver: life cycle ----------------------------------------------------------

    def open(self) -> None:
        from ackflow.state.gate import Gate
        from ackflow.state.store import WindowStore

        if self.path is None and self.spec.state is None:
            raise FlowError(
                self.name,
                "a window keeps durable state and this flow has no place for it: give the run "
                "state_dir= (--state-dir)",
            )
        self.output.open()
        if self.on_late is not None:
            self.on_late.open()
        if self.spec.state is not None:
            from ackflow.state.pg import open_store

            self._store = open_store(self.spec.state, self.name)
        else:
            assert self.path is not None
            self._store = WindowStore(self.path)
        self._store.end(self.name)  # batches of a run that crashed
        self._store.retry_failed(self.spec)  # results refused last run: try them again
        self._gate = Gate()
        self._active = time.monotonic()  # when a batch last began (or the run did)
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name=f"window-{self.name}", daemon=True)
        self._ticker.start()

    def close(self) -> None:
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join(timeout=30)
        if self._store is not None:
            try:
                self.tick()  # windows that came due while stopping
            except Exception as e:  # noqa: BLE001 - logged; they are written next run
                log.warning("window %r: writing due windows at close failed: %s", self.name, describe(e))
            try:
                self._store.close()  # (the change log folded in first)
            except Exception as e:  # noqa: BLE001 - logged; the next start replays the log
                log.warning("window %r: closing its state store failed: %s", self.name, describe(e))
            self._store = None
        self.output.close()
        if self.on_late is not None:
            self.on_late.close()

    def prepare(self, schema: Any) -> None:
        check_columns(self.name, schema, self.spec.columns, self.spec.by, "group key")
        self._prepared = schema
        if self.on_late is not None:
            self.on_late.prepare(schema)

    def begin_job(self, batch_id: str) -> None:
        """Before a batch's job: remember the watermark its tasks will read at least."""
        store = self._store
        if store is not None:
            self._active = time.monotonic()
            with store.lock:  # registered before any emission can see the new watermark
                self._gate.begin(batch_id, store.begin(self.name, batch_id))

    def hold(self, batch_id: str) -> None:
        """A batch begins (the engine's, before any of its jobs): until :meth:`unhold`,
        batches that began after it cannot move the watermark, so the rows of its later
        jobs (the halves of a failed job, a retry after its columns evolved) are judged
        by where the watermark stood when it began."""
        store = self._store
        if store is not None:
            with store.lock:
                try:
                    self._held_mark = store.mark(self.name)["watermark"]
                except StoreAway:  # the batch will fail as a whole: hold its place anyway
                    pass  # (the last watermark read: never above the store's)
                self._gate.begin(f"hold:{batch_id}", self._held_mark)

    def unhold(self, batch_id: str) -> None:
        store = self._store
        if store is not None:
            with store.lock:
                store.move(self.spec, self._gate.end(f"hold:{batch_id}", None))

    def keep(self, batch_id: str) -> None:
        """Instead of :meth:`unhold`: the batch failed as a whole and its messages may be
        given back (a database away, a sink down). Its place holds the watermark (and
        the idle close) until :meth:`let_go`, so that they are not late when they come
        back for a failure that was not theirs."""
        store = self._store
        if store is not None:
            with store.lock:
                self._gate.rename(f"hold:{batch_id}", f"back:{batch_id}")

    def let_go(self, batch_id: str) -> None:
        """The messages :meth:`keep` waited for came back and settled (or were not given
        back, or waited too long): the watermark may move on."""
        store = self._store
        if store is not None:
            with store.lock:
                store.move(self.spec, self._gate.end(f"back:{batch_id}", None))

    # -- task side -------------------------------------------------------------------

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        from ackflow.state.store import read_view

        keys = rows.column(ROW_KEY).to_pylist()
        if self.spec.state is not None:
            from ackflow.state import pg

            watermark, applied = pg.read_view(self.spec.state, self.name, keys, batch_id)
        else:
            assert self.path is not None
            watermark, applied = read_view(self.path, self.name, keys, batch_id)
        parts, failed, late = contribute(self.spec, rows, keys, watermark, applied)
        out: dict[int, str | tuple[str, str]] = dict(failed)
        late_token = None
        if late:
            if self.on_late is None:
                times = rows.column(self.spec.time).to_pylist()
                for i in late:
                    out[i] = f"late: event time {times[i]} < watermark {show_us(watermark or 0)}"
            else:
                sub = rows.take(late)
                if not self.on_late.wants_keys:
                    sub = sub.drop_columns([ROW_KEY])
                res = self.on_late.write_partition(batch_id, partition, sub)
                late_token = res.token
                for j, e in res.failed.items():
                    out[late[j]] = e if isinstance(e, tuple) else (self.on_late.name, e)
        return PartitionResult(failed=out, token=pickle.dumps((parts, late_token)))

    # -- driver: commit --------------------------------------------------------------

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        got = [pickle.loads(t) for t in tokens]
        store = self._store
        if self.on_late is not None:
            try:
                self.on_late.commit(batch_id, [lt for _, lt in got if lt is not None])
            except BaseException:
                self._ended(batch_id)
                raise
        parts: list[Partials] = [p for p, _ in got]
        event_max = max((p.max_t for p in parts if p.max_t is not None), default=None)
        with store.lock:
            try:
                store.apply(self.spec, parts, event_max=self._gate.ready(batch_id, event_max))
            except BaseException:
                self._ended(batch_id)
                raise
            self._gate.end(batch_id, event_max)
            store.end(self.name, batch_id)
        try:
            self.emit()
        except FlowError:  # the output sink cannot take the results: stop the run
            raise
        except Exception as e:  # noqa: BLE001 - the batch is committed; results wait for the next try
            self._emit_failed(e)

    def _ended(self, batch_id: str) -> None:
        """``batch_id`` failed: it adds nothing; batches that waited for it may count."""
        store = self._store
        if store is None or self._gate is None:
            return
        with store.lock:
            store.move(self.spec, self._gate.end(batch_id, None))
            store.end(self.name, batch_id)

    def abort(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        self._ended(batch_id)
        if self.on_late is not None:
            lates = [pickle.loads(t)[1] for t in tokens]
            self.on_late.abort(batch_id, [lt for lt in lates if lt is not None])

    # -- driver: results -------------------------------------------------------------

    def bound(self) -> int | None:
        """The watermark windows close by: the store's, held back by running batches."""
        with self._store.lock:
            return self._gate.bound(self._store.mark(self.name)["watermark"])  # type: ignore[no-any-return]

    def emit(self) -> int:
        """Write every due window to the output sink; returns how many. A window whose
        row cannot be made or that the sink refuses is set aside in the store with the
        reason (:meth:`WindowStore.fail`): it never holds back the others."""
        store = self._store
        total = 0
        with store.lock:  # one writer of results at a time
            while True:
                due = store.due(self.spec, self.bound())
                if not due:
                    store.settle(self.spec)  # (the change log folded in, now and then)
                    return total
                table, due = self._table_or_refuse(due)
                if not due:
                    continue
                bid = f"{self.name}-out-{os.getpid()}-{time.monotonic_ns()}"
                if type(self.output).prepare is not Sink.prepare:
                    self.output.prepare(table.schema)
                try:
                    res = self.output.write_partition(
                        bid, 0, table if self.output.wants_keys else table.drop_columns([ROW_KEY])
                    )
                except Exception:
                    self.output.abort(bid, [])
                    raise
                tokens = [res.token] if res.token is not None else []
                try:  # (a refusal is kept in the store: a write there that fails drops what was staged)
                    for i, why in res.failed.items():
                        store.fail(
                            self.spec,
                            due[i],
                            f"{self.output.name}: {why[1] if isinstance(why, tuple) else why}",
                        )
                        log.error(
                            "window %r: %r refused a result (kept in the state store): %s",
                            self.name,
                            self.output.name,
                            why,
                        )
                except Exception:
                    self.output.abort(bid, tokens)
                    raise
                try:
                    self.output.commit(bid, tokens)
                except Exception:
                    self.output.abort(bid, tokens)  # what it staged; the windows stay, tried again
                    raise
                faults.point("state.after_output")
                store.done(
                    self.spec, [d for i, d in enumerate(due) if i not in res.failed] if res.failed else due
                )
                total += len(due) - len(res.failed)
                if time.monotonic() - self._forgot >= min(FORGET_EVERY_S, self.spec.remember_us / 2e6):
                    store.forget(self.spec)  # (each is a commit: not after every write)
                    self._forgot = time.monotonic()

    def _table_or_refuse(self, due: Sequence[Any]) -> tuple[pa.Table, Sequence[Any]]:
        """The rows of ``due``; if they cannot be made together, each alone, and those
        that cannot be made at all (a Python aggregator that raises, a sum too large
        for a column) are set aside with the reason."""
        if isinstance(due, DueTable):  # held in columns: made in Arrow
            made = self._columns_table(due)
            if made is not None:
                return made, due
        try:
            return self._table(due), due
        except Exception:  # noqa: BLE001 - find the windows at fault
            pass
        good = []
        for d in due:
            try:
                self._table([d])
                good.append(d)
            except Exception as e:  # noqa: BLE001 - this window's values
                self._store.fail(self.spec, d, f"its row cannot be made: {describe(e)}")
                log.error(
                    "window %r: a result cannot be made (kept in the state store): %s", self.name, describe(e)
                )
        if not good:
            return pa.table({}), []
        try:
            return self._table(good), good
        except Exception:  # noqa: BLE001 - each is fine alone, not together: one at a time
            return self._table(good[:1]), good[:1]

    def _table(self, due: Sequence[Any]) -> pa.Table:
        spec = self.spec
        cols: dict[str, list[Any]] = {k: [d.values[i] for d in due] for i, k in enumerate(spec.by)}
        if isinstance(spec.kind, Count):
            cols["window_index"] = [d.start for d in due]
        else:
            cols["window_start"] = [d.start for d in due]
            cols["window_end"] = [d.end for d in due]
        for j, a in enumerate(spec.aggs):
            cols[a.name] = [a.finish(d.accs[j]) for d in due]
        table = pa.table(cols)
        if not isinstance(spec.kind, Count):
            ts = pa.timestamp("us", tz="UTC")
            for c in ("window_start", "window_end"):
                table = table.set_column(table.schema.get_field_index(c), c, table.column(c).cast(ts))
        keys = _window_keys(self.name, [(d.gk, d.start) for d in due], self.spec.output == "final")
        return table.append_column(ROW_KEY, pa.array(keys, pa.string()))

    def _columns_table(self, due: DueTable) -> pa.Table | None:
        """:meth:`_table` of windows held in columns, from their Arrow table (the same
        rows); None where that cannot be sure of them (they are made in Python then)."""
        try:
            table = results(due.table, self.spec.by, [(a.name, a.fn) for a in self.spec.aggs])
        except Exception:  # noqa: BLE001 - the Python way makes them, or finds the one at fault
            return None
        if table is None:
            return None
        keys = _window_keys(self.name, due.slots(), self.spec.output == "final")
        return table.append_column(ROW_KEY, pa.array(keys, pa.string()))

    def _emit_failed(self, e: BaseException) -> None:
        self.emit_failures += 1
        log.error(
            "window %r: writing results to %r failed (they stay in the state store and are tried again): %s",
            self.name,
            self.output.name,
            describe(e),
        )

    def tick(self) -> None:
        """The timer's work: close every open window once the stream was quiet for
        ``idle`` (the engine pulled nothing and had nothing in flight; a restart's
        downtime and its start do not count, its backlog is no quiet stream), then
        write due windows."""
        if self._quiet is not None:
            quiet_s = self._quiet()
        else:  # not run by an engine: quiet since the last batch began
            quiet_s = 0.0 if self._gate.running else time.monotonic() - self._active
        if (
            quiet_s >= self.spec.idle_us / 1e6
            and not self._gate.running
            and not isinstance(self.spec.kind, Count)
        ):
            self._store.close_open(self.spec)
        try:
            self.emit()
        finally:
            self._refresh()

    def _tick_loop(self) -> None:
        every = max(0.05, min(1.0, self.spec.idle_us / 2e6))
        while not self._stopped.wait(every):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - logged, tried again on the next tick
                self._emit_failed(e)


def _window_keys(op: str, slots: Sequence[tuple[str, int]], by_start: bool = True) -> list[str]:
    """Each window's row key, the same in every run: the operator, the window's start
    (as 16 hex digits of start + 2**63, so that keys sort by start) and a digest of
    (operator, key text, start). Keys that sort by start go into a sink's key manifest
    (a B-tree) side by side, where random ones would touch every page of it on each
    write (measured: the Parquet sink's commit of results, half the CPU). Without
    ``by_start`` (``output="update"``, whose open windows have rows in the output under
    the keys of before 0.6.7, upserted again after an upgrade): ``w:<op>:<digest>``."""
    sha, head, nul = hashlib.sha256, f"{op}\x00", "\x00"
    digests = [sha(f"{head}{gk}{nul}{start}".encode()).hexdigest()[:32] for gk, start in slots]
    if not by_start:
        return [f"w:{op}:{d}" for d in digests]
    return [f"w:{op}:{start + 2**63:016x}:{d}" for (_, start), d in zip(slots, digests, strict=True)]
