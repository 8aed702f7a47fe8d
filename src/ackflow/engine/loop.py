"""The driver loop (DESIGN.md, "How a batch flows").

One thread owns the source: it pulls while the in-flight window has credits,
cuts batches by size or time, hands them to up to ``max_concurrent_batches``
worker threads (one Spark job each), and settles each message when its batch
comes back. Completions are read even when the window is full (law 3).

Batch cutting adapts to the rate: a batch is cut when it is full (``batch_size``), when
the source has nothing more right now, when the window is full, when it is
``batch_timeout_s`` old, or as soon as no job is running and it is ``linger_s`` old. At
a low rate Spark is idle most of the time, so messages go in small batches without
waiting for the timeout; at a high rate jobs are always running, and batches grow
with the time a job takes, up to ``batch_size``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ackflow import faults
from ackflow.core.errors import ConfigError, FlowError, SystemicFailure
from ackflow.core.groups import GroupBuffer
from ackflow.core.ledger import Failure
from ackflow.core.schema import SchemaStore, check_mode
from ackflow.core.secrets import redact
from ackflow.core.settlement import Delivery, Settlement
from ackflow.core.systemic import ANY_STEP, SystemicDetector
from ackflow.core.window import InflightWindow
from ackflow.engine.batch import BatchResult, execute, execute_groups, group_key
from ackflow.engine.report import RunReport
from ackflow.engine.schemas import open_store
from ackflow.flow import Flow, GroupedWithin
from ackflow.observe.metrics import Metrics
from ackflow.observe.status import EngineFacts, StatusBoard
from ackflow.sinks.base import ROW_KEY
from ackflow.sinks.collect import CollectSink

log = logging.getLogger("ackflow.engine")

Progress = Callable[[RunReport, InflightWindow], None]


def _check_seconds(name: str, value: Any, zero_ok: bool) -> None:
    """A duration option: a finite number of seconds, >= 0 (or > 0), never nan or inf
    (``until_idle=nan`` would never end, ``drain_timeout_s=nan`` never cancel)."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (value >= 0 if zero_ok else value > 0))
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name} must be {bound} seconds (a finite number), got {value!r}")


class Engine:
    def __init__(
        self,
        flow: Flow,
        *,
        batch_size: int = 2000,
        max_inflight: int = 10000,
        max_concurrent_batches: int = 2,
        batch_timeout_s: float = 1.0,
        linger_s: float = 0.05,
        until_idle: float | None = None,
        drain_timeout_s: float = 60.0,
        max_bisect_jobs: int = 64,
        keepalive_s: float = 30.0,
        spark: Any = None,
        master: str | None = None,
        progress: Progress | None = None,
        handle_signals: bool = True,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        executor: str = "spark",
        ui_port: int | None = None,
        ui_host: str = "127.0.0.1",
        ui_allow_replay: bool = False,
        systemic_after: int = 3,
        systemic_stop_after_s: float = 300.0,
        systemic_backoff_s: float = 1.0,
        systemic_max_backoff_s: float = 30.0,
        schema_mode: str = "evolve",
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("max_inflight", max_inflight),
                            ("max_concurrent_batches", max_concurrent_batches),
                            ("max_bisect_jobs", max_bisect_jobs)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if batch_size > max_inflight:
            raise ConfigError(
                f"batch_size ({batch_size}) cannot exceed max_inflight ({max_inflight}): "
                "raise max_inflight or lower batch_size"
            )
        for name, value, zero_ok in (("until_idle", until_idle, True),
                                     ("batch_timeout_s", batch_timeout_s, False),
                                     ("linger_s", linger_s, True),
                                     ("drain_timeout_s", drain_timeout_s, True),
                                     ("keepalive_s", keepalive_s, False)):
            if value is None and name == "until_idle":
                continue
            _check_seconds(name, value, zero_ok)
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port (0-65535), got {metrics_port}")
        if executor not in ("spark", "local"):
            raise ConfigError(f"executor must be 'spark' or 'local', got {executor!r}")
        if ui_port is not None and not 0 <= ui_port <= 65535:
            raise ConfigError(f"ui_port must be a TCP port (0-65535), got {ui_port}")
        if ui_allow_replay and ui_port is None:
            raise ConfigError("ui_allow_replay needs the status page (ui_port)")
        flow.validate()
        self.schema_mode = check_mode(schema_mode)
        self.state_dir = None if state_dir is None else os.fspath(state_dir)
        self.schema_store: SchemaStore | None = None  # opened by run()
        # poison or systemic (ackflow/core/systemic.py): a failure every message meets the
        # same way gives the messages back, never dead-letters them
        self.systemic = SystemicDetector(
            sinks=[s.name for s in flow.sinks]
            + [b.name for s in flow.sinks for b in getattr(s, "branches", ())],
            after=systemic_after,
            stop_after_s=systemic_stop_after_s, backoff_s=systemic_backoff_s,
            max_backoff_s=systemic_max_backoff_s)
        self._idle_since: float | None = None  # when the closing until_idle wait began
        self._pause_until = 0.0  # no pulling before this (a systemic failure's backoff)
        self._connected_seen = True  # the source_connected gauge as last set
        self._counts_lock = threading.Lock()
        self.flow = flow
        self.executor = executor
        self.batch_size = batch_size
        self.window = InflightWindow(max_inflight)
        self.max_concurrent = max_concurrent_batches
        self.batch_timeout_s = batch_timeout_s
        self.linger_s = min(linger_s, batch_timeout_s)
        self.until_idle = until_idle
        self.drain_timeout_s = drain_timeout_s
        self.max_bisect_jobs = max_bisect_jobs
        self.keepalive_s = keepalive_s
        self.spark = spark
        self.master = master
        self.progress = progress
        self.handle_signals = handle_signals

        self.report = RunReport()
        self.groups: GroupBuffer | None = None  # grouped_within's buffer, if the flow has one
        self.held: dict[int, int] = {}  # lineage id -> group memberships still unwritten
        self.suffix: Any = None
        self._gw_index = -1
        self.metrics = Metrics(max_inflight)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.batch_seconds: deque[float] = deque(maxlen=10_000)  # bounded, for p50/p99
        # the status page: a board the engine feeds, served by a thread of its own
        self.ui_port, self.ui_host, self.ui_allow_replay = ui_port, ui_host, ui_allow_replay
        self.board: StatusBoard | None = None
        if ui_port is not None:
            self.board = StatusBoard(flow, self.report,
                                     replay_supported=flow.source.replays_dead_letters)
        self.ui: Any = None  # the StatusServer, while the run serves the page
        self._plans: list[Any] = []  # the compiled plans (their row counts feed the page)
        self._phases: dict[str, str] = {}  # running batch id -> "job" or "commit"
        self._pending = 0  # pulled, not yet in a job (for the status page)
        self.inflight: dict[int, Delivery] = {}
        self._live: dict[str, int] = {}  # identity -> lineage id of its delivery in flight
        self._dupes: dict[int, list[Delivery]] = {}  # that lineage id -> repeats held back
        self._next_id = 1
        self._inbox: queue.Queue[tuple[Future[BatchResult], list[Delivery] | None]] = queue.Queue()
        self._running: dict[str, tuple[Future[BatchResult], list[Delivery]]] = {}
        self._stop = threading.Event()
        self._cancel = threading.Event()
        self._signals = 0
        self._dead_letter_failures = 0
        self._run_token = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self._seq = 0

    # -- signals ------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop pulling; finish (or, after the drain timeout, give back) what is in flight."""
        self._stop.set()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals += 1
        if self._signals > 1:
            log.error("second signal: exiting now; unsettled messages return to the source")
            os._exit(130)
        log.warning("signal %d: stopping; draining in-flight batches (up to %.0f s)",
                    signum, self.drain_timeout_s)
        self._stop.set()

    # -- settling -----------------------------------------------------------------------

    def _ack(self, deliveries: list[Delivery]) -> None:
        """Settle first (a second settle raises here, before the broker hears of it), then
        ack at the source; what it refuses (a stale receipt) becomes released."""
        if not deliveries:
            return
        for d in deliveries:
            d.settle(Settlement.ACKED)
        if faults.active() and len(deliveries) > 1:  # a middle, for the fault point
            half = len(deliveries) // 2
            stale = {id(d) for d in self.flow.source.ack(deliveries[:half]) or ()}
            faults.point("engine.mid_ack")
            stale |= {id(d) for d in self.flow.source.ack(deliveries[half:]) or ()}
        else:
            stale = {id(d) for d in self.flow.source.ack(deliveries) or ()}
        for d in deliveries:
            if id(d) in stale:
                d.revise(Settlement.RELEASED)
        self._count_redelivered(len(stale))
        self.report.acked += len(deliveries) - len(stale)
        self.metrics.acked.inc(len(deliveries) - len(stale))
        if self.board is not None:
            self.board.acked([d for d in deliveries if id(d) not in stale] if stale
                             else deliveries)

    def _count_redelivered(self, n: int) -> None:
        if n:
            log.warning("%d deliveries could not be settled (their channel or lease is gone); "
                        "the source delivers them again", n)
            self.report.redelivered += n
            self.metrics.redelivered.inc(n)

    def _drop_lost(self) -> None:
        """Stop tracking deliveries the source lost (it delivers them again)."""
        lost = [d for d in self.flow.source.take_lost()
                if not d.settled and d.lineage_id in self.inflight]
        for d in lost:
            d.settle(Settlement.RELEASED)
        self._count_redelivered(len(lost))
        self._forget(lost)
        # acks the engine counted that never reached the broker: no acks, they come again
        unsent = [d for d in self.flow.source.take_unsent_acks()
                  if d.state is Settlement.ACKED and not d.revised]
        for d in unsent:
            d.revise(Settlement.RELEASED)
        if unsent:
            self.report.acked -= len(unsent)
            self._count_redelivered(len(unsent))

    def _fail(self, batch_id: str, failures: list[tuple[Delivery, Failure]]) -> None:
        if failures and self.flow.error_sink is not None:
            failures = self._dead_letter_to_sink(batch_id, failures)
        if not failures:
            return
        source = self.flow.source
        for d, _ in failures:  # settled first; the source may answer otherwise (below)
            d.settle(Settlement.DEAD_LETTERED if source.exhausted(d) else Settlement.NACKED)
        faults.point("engine.before_fail")
        states = source.fail(failures)
        for (d, f), state in zip(failures, states, strict=True):
            if state is Settlement.NACKED and d.state is Settlement.DEAD_LETTERED:
                # given up, but the dead-letter route refused it (a full dead-letter
                # queue, say): nacked, retried later; counted as a dead-letter failure
                self._dead_letter_failures += 1
                self.metrics.dead_letter_write_failures.inc()
            if state is not d.state:
                d.revise(state)
            if state is Settlement.RELEASED:
                self._count_redelivered(1)
            else:
                self._record_failure(d, f, state)

    def _forget(self, deliveries: list[Delivery]) -> None:
        """Drop settled deliveries from the window (their credits return). A message that
        still had rows waiting in grouped_within groups (it failed, or its source lost it)
        takes them out: those groups are written without it, and it comes again."""
        done = [d for d in deliveries if d.settled and d.lineage_id in self.inflight]
        waiting = set()
        followers = []
        for d in done:
            del self.inflight[d.lineage_id]
            if self.held.pop(d.lineage_id, 0) > 0:
                waiting.add(d.lineage_id)
            if self._live.get(d.identity) == d.lineage_id:
                del self._live[d.identity]
            dupes = self._dupes.pop(d.lineage_id, None)
            if dupes:
                followers.append((d, dupes))
        if self.groups is not None:
            self.groups.discard(waiting)
        self.window.give_back(len(done))
        for first, dupes in followers:
            self._settle_duplicates(first, dupes)

    def _settle_duplicates(self, first: Delivery, dupes: list[Delivery]) -> None:
        """Law 12: deliveries of an identity that was in flight already (a producer's
        re-send, a redelivery racing a slow batch) contributed nothing; they settle as
        what the first became: acked with it (its rows, or its dead letter, stand for
        them), else given back to come again."""
        live = [d for d in dupes if not d.settled]
        if not live:
            return
        if first.state in (Settlement.ACKED, Settlement.DEAD_LETTERED):
            log.info("%d repeated deliveries of %s settled as the first (%s)", len(live),
                     first.identity, first.state.value)
            self._ack(live)
        else:
            self._give_back([(d, Failure("engine", "a repeat of a message in flight"))
                             for d in live])
        self._forget(live)

    def _settle(self, result: BatchResult, deliveries: list[Delivery]) -> None:
        # deliveries the source lost meanwhile are settled (released) already: skip them
        by_id = {d.lineage_id: d for d in deliveries if not d.settled}
        held = self._hold(result) if self.groups is not None else set()
        acked = [by_id[i] for i in result.outcomes.acked if i not in held and i in by_id]
        self._ack(acked)
        failures = [(by_id[i], f) for i, f in result.outcomes.failed.items() if i in by_id]
        failures = self._give_back_systemic(result, failures, acked=bool(acked))
        self._fail(result.batch_id, failures)
        self._release([by_id[i] for i in result.released if i in by_id])

        outcome_ids = set(result.outcomes.acked) | set(result.outcomes.failed) | set(result.released)
        missing = [d for d in by_id.values() if d.lineage_id not in outcome_ids]
        if missing:  # cannot happen by construction; never ack what has no outcome
            log.error("batch %s: %d messages got no outcome; failing them", result.batch_id,
                      len(missing))
            lost = Failure("engine", "no outcome for this message; not acked", whole=True)
            self._fail(result.batch_id, [(d, lost) for d in missing])

        self._forget(deliveries)
        self.report.batches += 1
        self._account(result)
        log.debug("batch %s: %d messages, %d acked, %d failed, %d held, %d jobs, %.3f s",
                  result.batch_id, result.size, len(acked), len(failures), len(held),
                  result.jobs, result.seconds)

    def _account(self, result: BatchResult) -> None:  # jobs and bisections: _count_job
        for name, n in result.outcomes.rows_written.items():
            if self.groups is not None and name == self.flow.steps[self._gw_index].name:
                continue  # rows handed to grouped_within are not written anywhere yet
            self.report.rows_written[name] = self.report.rows_written.get(name, 0) + n
            self.metrics.rows_written.labels(sink=name).inc(n)
        self.batch_seconds.append(result.seconds)
        if self.board is not None:
            self.board.batch(result.seconds)
        self.metrics.batch_seconds.observe(result.seconds)
        self.metrics.batch_size.observe(result.size)
        self._window_metrics()

    # -- grouped_within ------------------------------------------------------------------

    def _hold(self, result: BatchResult) -> set[int]:
        """Put the rows a batch handed to grouped_within into the buffer; return the ids
        of messages that now wait for their groups (not failed in this batch)."""
        assert self.groups is not None
        step = self.flow.steps[self._gw_index]
        assert isinstance(step, GroupedWithin)
        now = time.monotonic()
        held: set[int] = set()
        for table in result.collected:
            lineage = "__af_ids" if "__af_ids" in table.column_names else "__af_id"
            ids = table.column(lineage).to_pylist()
            keys = table.column(ROW_KEY).to_pylist()
            rows = table.drop_columns([lineage, ROW_KEY]).to_pylist()
            for row, mid, row_key in zip(rows, ids, keys, strict=True):
                members = mid if isinstance(mid, list) else [mid]
                # not a member: failed in this batch, or lost (and forgotten) meanwhile
                members = [m for m in members if m not in result.outcomes.failed
                           and m in self.inflight and not self.inflight[m].settled]
                if not members:
                    continue
                self.groups.add(tuple(row.get(k) for k in step.keys), row, members, now,
                                row_key)
                for m in members:
                    self.held[m] = self.held.get(m, 0) + 1
                    held.add(m)
        return held

    def _submit_groups(self, pool: ThreadPoolExecutor) -> None:
        assert self.groups is not None and self.suffix is not None
        groups = self.groups.due(time.monotonic())
        if not groups:
            return
        step = self.flow.steps[self._gw_index]
        assert isinstance(step, GroupedWithin)
        suffix = self.suffix
        # a group's row key: its rows' keys (unique to them: two groups of one message's
        # rows differ) and its values
        row_keys = [group_key(g.row_keys, g.key) for g in groups]
        self._launch(pool, suffix, "g", None,
                     lambda bid: execute_groups(suffix, groups, step.keys, bid, row_keys,
                                                count=self._count_job, cancelled=self._cancel))

    def _settle_groups(self, result: BatchResult) -> None:
        """A group job finished: fail members of failed groups, ack members whose
        every group is now written; a job cancelled at shutdown releases its members."""
        released = [d for d in (self.inflight.get(m) for m in result.released)
                    if d is not None and not d.settled]
        self._release(released)
        touched: list[Delivery] = released
        failures = []
        for mid, failure in result.outcomes.failed.items():
            d = self.inflight.get(mid)
            if d is not None and not d.settled:
                failures.append((d, failure))
                touched.append(d)
        failures = self._give_back_systemic(result, failures, acked=False)
        self._fail(result.batch_id, failures)
        done = []
        for mid, n in result.member_rows.items():
            d = self.inflight.get(mid)
            if d is None or d.settled:
                continue
            left = self.held.get(mid, 0) - n
            self.held[mid] = left
            if left <= 0:
                done.append(d)
        self._ack(done)
        self._forget(touched + done)
        self._account(result)

    def _give_back_systemic(self, result: BatchResult,
                            failures: list[tuple[Delivery, Failure]], *,
                            acked: bool) -> list[tuple[Delivery, Failure]]:
        """Give back (release) failures the detector judges systemic; return the rest,
        to be nacked or dead-lettered as usual. Raises :class:`SystemicFailure` once an
        episode has lasted ``systemic_stop_after_s``."""
        working = {name for name, n in result.outcomes.rows_written.items() if n > 0}
        if working:  # rows reached a sink: every step before it works
            working.add(ANY_STEP)
        detector = self.systemic
        was = detector.episode
        # only failures of a write or job as a whole; a message counts once however often
        # it is delivered (its identity), a delivery is given back by its lineage id
        whole = [(d, f) for d, f in failures if f.whole]
        judged = detector.judge(
            [(d.identity, f.step, f.error) for d, f in whole], working=working,
            detail=lambda step, error: result.details.get((step, error)) or error)
        systemic = {d.lineage_id for d, _ in whole if d.identity in judged}
        suspects = {d.lineage_id for d, _ in whole if d.identity in detector.suspects}
        if was is not None and detector.episode is None:
            log.warning("step %r works again: the systemic failure is over (%d deliveries "
                        "were given back)", was.step, was.messages)
            self.metrics.systemic.labels(step=was.step).set(0)
        self.report.systemic = (detector.episode.as_json()
                                if detector.episode is not None else None)
        self.report.systemic_episodes = detector.episodes
        rest = [(d, f) for d, f in failures if d.lineage_id not in systemic]
        untested = [d for d, _ in rest if d.lineage_id in result.untested]
        if untested:  # never dead-letter (nor spend a delivery) on an inferred failure
            log.warning("batch %s: %d messages whose failure was inferred, not seen alone, "
                        "are given back", result.batch_id, len(untested))
            self._give_back([(d, f) for d, f in rest if d.lineage_id in result.untested])
            rest = [(d, f) for d, f in rest if d.lineage_id not in result.untested]
        if suspects:  # a whole failure not yet shown by enough messages: give back, pause
            back = [d for d, _ in rest if d.lineage_id in suspects]
            log.warning("batch %s: %d messages failed a write or job as a whole (%s); given "
                        "back while it is unknown whether every message fails so",
                        result.batch_id, len(back), redact(whole[0][1].error))
            self._give_back([(d, f) for d, f in rest if d.lineage_id in suspects])
            self._pause_until = max(self._pause_until, time.monotonic() + detector.backoff_s(1))
            rest = [(d, f) for d, f in rest if d.lineage_id not in suspects]
        if not systemic:
            return rest
        episode = detector.episode
        assert episode is not None
        back = [d for d, _ in failures if d.lineage_id in systemic]
        self._give_back([(d, f) for d, f in failures if d.lineage_id in systemic])
        self.report.given_back_systemic += len(back)
        self.metrics.given_back_systemic.inc(len(back))
        self.metrics.systemic.labels(step=episode.step).set(1)
        pause = detector.backoff_s(detector.strikes)
        self._pause_until = time.monotonic() + pause
        left = detector.stop_after_s - (time.monotonic() - episode.since)
        log.error("batch %s: systemic failure at step %r: %d messages failed the same way "
                  "(%s); given back, not dead-lettered; pulling paused %.1f s; the run stops "
                  "in %.0f s if it persists", result.batch_id, episode.step, len(back),
                  episode.error, pause, max(left, 0))
        if detector.overdue():
            if episode.detail:
                log.error("the systemic failure in full:\n%s", episode.detail)
            raise SystemicFailure(episode.step, episode.error, messages=episode.messages,
                                  seconds=detector.stop_after_s, detail=episode.detail)
        return rest

    def _count_job(self, bisection: bool) -> None:
        """A Spark job started (a worker thread calls this): live counts for the page."""
        with self._counts_lock:
            if bisection:
                self.report.bisections += 1
                self.metrics.bisections.inc()
            else:
                self.report.jobs += 1
                self.metrics.jobs.inc()

    def _dead_letter_to_sink(self, batch_id: str,
                             failures: list[tuple[Delivery, Failure]]) -> list[tuple[Delivery, Failure]]:
        """Write given-up messages to the flow's error sink, then settle them; return the
        failures that are still to be retried by the source."""
        source, sink = self.flow.source, self.flow.error_sink
        assert sink is not None
        done = [(d, f) for d, f in failures if source.exhausted(d)]
        if not done:
            return failures
        rest = [(d, f) for d, f in failures if not source.exhausted(d)]
        try:
            write_dead_letters(sink, f"{batch_id}-dead", done)
        except Exception as e:  # noqa: BLE001 - not written: nack, never drop
            self._dead_letter_failures += len(done)
            self.metrics.dead_letter_write_failures.inc(len(done))
            log.error("batch %s: error sink %r failed to write %d dead letters (%s); nacking "
                      "them (%d dead-letter writes failed in this run)", batch_id, sink.name,
                      len(done), e, self._dead_letter_failures)
            for d, _ in done:
                d.settle(Settlement.NACKED)
            source.nack(done)
            for d, f in done:
                self._record_failure(d, f, Settlement.NACKED)
            return rest
        faults.point("engine.dead_letter_written")
        self.report.rows_written[sink.name] = self.report.rows_written.get(sink.name, 0) + len(done)
        self.metrics.rows_written.labels(sink=sink.name).inc(len(done))
        for d, _ in done:
            d.settle(Settlement.DEAD_LETTERED)
        stale = {id(d) for d in source.ack([d for d, _ in done]) or ()}
        for d, f in done:
            if id(d) in stale:  # written, but the source comes with it again: written again
                d.revise(Settlement.RELEASED)
                self._count_redelivered(1)
            else:
                self._record_failure(d, f, Settlement.DEAD_LETTERED, kept_by=sink.name)
        return rest

    def _record_failure(self, d: Delivery, f: Failure, state: Settlement, *,
                        kept_by: str = "source") -> None:
        if state is Settlement.DEAD_LETTERED:
            self.report.dead_lettered += 1
            self.report.dead_lettered_by_step[f.step] = (
                self.report.dead_lettered_by_step.get(f.step, 0) + 1
            )
            self.metrics.dead_lettered.labels(step=f.step).inc()
            log.info("message %s dead-lettered after %d deliveries: %s", d.key,
                     d.delivery_count, f)
            self.report.count_reason(f.step, f.error)
        else:
            self.report.nacked += 1
            self.metrics.nacked.inc()
            log.debug("message %s nacked (delivery %d): %s", d.key, d.delivery_count, f)
        if self.board is not None:
            ref = (self.flow.source.dead_letter_ref(d)
                   if kept_by == "source" and state is Settlement.DEAD_LETTERED else None)
            self.board.failed(d, f, state.value, kept_by=kept_by, ref=ref)
        self.report.failures_total += 1
        if len(self.report.failures) < 20:
            self.report.failures.append(
                {"message": d.key, "step": f.step, "error": f.error, "outcome": state.value}
            )

    def _release(self, deliveries: list[Delivery], *, ending: bool = False) -> None:
        """Give back what was not processed; deliveries settled meanwhile (lost with their
        channel, say) are the source's already and are skipped."""
        if not ending and not any(not d.settled for d in deliveries):
            return
        # a release means the run is ending: stop receiving first (a message given back
        # while consuming comes straight back), and settle what was received meanwhile
        extra = self.flow.source.stop_consuming()
        if extra:
            for d in extra:
                d.lineage_id = self._next_id
                d.pulled_at = time.monotonic()
                self._next_id += 1
            self.report.pulled += len(extra)
            self.metrics.pulled.inc(len(extra))
        deliveries = [d for d in [*deliveries, *extra] if not d.settled]
        if not deliveries:
            return
        last = {id(d) for d in self.flow.source.unreleasable(deliveries)}
        if last:  # a give-back would spend their last delivery: the broker drops them
            log.warning("%d unprocessed messages are at their last delivery (the broker "
                        "counts a give-back as one and would drop them): dead-lettering "
                        "them instead (step 'release')", len(last))
            why = Failure("release", "not processed before the stop, at its last delivery: "
                          "the broker counts a give-back as a delivery (x-delivery-limit) and "
                          "would drop it; dead-lettered instead")
            self._fail("release", [(d, why) for d in deliveries if id(d) in last])
            deliveries = [d for d in deliveries if id(d) not in last and not d.settled]
            if not deliveries:
                return
        for d in deliveries:
            d.settle(Settlement.RELEASED)
        self.flow.source.release(deliveries)
        self.report.released += len(deliveries)
        self.metrics.released.inc(len(deliveries))

    def _give_back(self, failures: list[tuple[Delivery, Failure]]) -> None:
        """Give failed messages back mid-run without failing them (a systemic or suspect
        failure, an untested one): released, the source goes on consuming. A message at
        its last delivery on a queue that counts a give-back as one (a quorum queue with
        a delivery limit) would be dropped by the broker: it is failed (dead-lettered
        with its failure, knowingly) instead."""
        failures = [(d, f) for d, f in failures if not d.settled]
        if not failures:
            return
        last = {id(d) for d in self.flow.source.unreleasable([d for d, _ in failures])}
        if last:
            log.warning("%d messages to give back are at their last delivery (the broker "
                        "counts a give-back as one and would drop them): dead-lettering them "
                        "with their failure instead", len(last))
            self._fail("give-back", [(d, f) for d, f in failures if id(d) in last])
        back = [d for d, _ in failures if id(d) not in last and not d.settled]
        if not back:
            return
        for d in back:
            d.settle(Settlement.RELEASED)
        self.flow.source.release(back)
        self.report.released += len(back)
        self.metrics.released.inc(len(back))

    def _window_metrics(self) -> None:
        w = self.window
        self.metrics.window(w.in_flight, w.throttled, w.throttle_episodes)

    def _publish(self, state: str) -> None:
        """Hand the status page a snapshot (the engine's thread; a few times a second)."""
        if self.board is None:
            return
        self._schema_facts()
        w = self.window
        jobs = tuple((len(batch), self._phases.get(bid, "job"))
                     for bid, (_, batch) in list(self._running.items()))
        try:
            details = self.flow.source.status()
        except Exception as e:  # noqa: BLE001 - the page must never stop the run
            details = {"status": f"unavailable: {type(e).__name__}"}
        rows: dict[str, tuple[int, int, int]] = {}
        for plan in self._plans:
            rows.update(plan.row_counts())  # each step and sink is in one plan
        self.board.publish(EngineFacts(
            state=state, in_flight=w.in_flight, max_inflight=w.max_inflight,
            throttled=w.throttled, throttle_episodes=w.throttle_episodes,
            batching=self._pending, jobs=jobs, held=len(self.held),
            connected=self.flow.source.connected, source=details, rows=rows))

    # -- the loop -----------------------------------------------------------------------

    def _compiler(self) -> Callable[..., Any]:
        """Flow -> its executable plan: on Spark, or in this process (``executor="local"``,
        for tests: the same task code, no JVM, Python steps only). With the status page
        on, the plan's tasks count rows per step."""
        count = self.board is not None
        if self.executor == "local":
            from ackflow.spark.local import LocalFlow

            return lambda f, **kw: self._plan(LocalFlow(f, count_rows=count, **kw))
        from ackflow.spark.compile import CompiledFlow
        from ackflow.spark.session import session

        spark = self.spark or session(self.master)
        return lambda f, **kw: self._plan(CompiledFlow(f, spark, count_rows=count, **kw))

    def _plan(self, plan: Any) -> Any:
        self._plans.append(plan)
        return plan

    def run(self) -> RunReport:
        flow = self.flow
        compile_ = self._compiler()
        gw = [i for i, s in enumerate(flow.steps) if isinstance(s, GroupedWithin)]
        if gw:
            i = self._gw_index = gw[0]
            step = flow.steps[i]
            assert isinstance(step, GroupedWithin)
            compiled = compile_(Flow(flow.source, flow.steps[:i], CollectSink(step.name)))
            self.suffix = compile_(Flow(flow.source, flow.steps[i + 1:], flow.sink),
                                   rows_input=True)
            self.groups = GroupBuffer(step.n, step.timeout_s)
        else:
            compiled = compile_(flow)
        with contextlib.ExitStack() as stack:  # every resource closed on every path
            for sink in flow.sinks:
                sink.open()
                stack.callback(_quietly, "close sink", sink.close)
            if flow.error_sink is not None:
                flow.error_sink.open()
                stack.callback(_quietly, "close the error sink", flow.error_sink.close)
            self.schema_store = open_store(flow, self.state_dir)
            stack.callback(_quietly, "close the schema store", self.schema_store.close)
            for plan in self._plans:
                plan.schema_store = self.schema_store
                plan.schema_mode = self.schema_mode
            if self.metrics_port is not None:
                self.metrics.serve(self.metrics_port, self.metrics_host)
                log.info("metrics at http://%s:%d/metrics", self.metrics_host, self.metrics.port)
            stack.callback(_quietly, "stop the metrics server", self.metrics.close)
            if self.board is not None:
                from ackflow.observe.ui import StatusServer

                ui = StatusServer(self.board, flow.source, port=self.ui_port or 0,
                                  host=self.ui_host, allow_replay=self.ui_allow_replay)
                ui.start()
                stack.callback(_quietly, "stop the status page", ui.close)
                self.ui = ui  # set once it serves
                log.info("status page at %s", ui.url)
                if ui.replay_url is not None:  # to the operator only, never to the log
                    print(f"ackflow: to replay dead letters, open {ui.replay_url} (the link "
                          "holds this run's replay token: keep it private)", file=sys.stderr,
                          flush=True)
            flow.source.configure(max_inflight=self.window.max_inflight,
                                  error_sink=flow.error_sink is not None,
                                  keepalive_s=self.keepalive_s)
            stack.callback(_quietly, "close the source", flow.source.close)
            self.report.recovered = flow.source.open()
            self.metrics.recovered.inc(self.report.recovered)
            if self.report.recovered:
                log.warning("%d messages a previous consumer had in flight were given back and "
                            "will be processed again (their rows may be written twice)",
                            self.report.recovered)
            if self.handle_signals and threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    stack.callback(signal.signal, sig, signal.signal(sig, self._on_signal))
            pool = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="ackflow-batch")
            started = time.monotonic()
            self._publish("running")
            try:
                self._loop(compiled, pool)
            finally:
                try:
                    self._shutdown(pool)
                finally:
                    self._finish_report(started)
                    self._pending = 0
                    self._publish("stopped")
        return self.report

    def _schema_facts(self) -> None:
        """Copy the plans' schema versions and this run's changes into the report."""
        versions: dict[str, int] = {}
        changes: list[dict[str, Any]] = []
        for plan in self._plans:  # no store access: this runs a few times a second
            changes += plan.schema_changes
            versions.update(plan.segment_versions())
        self.report.schema_versions = versions
        self.report.schema_changes = [{**c, "changes": c["changes"][:50]}
                                      for c in sorted(changes, key=lambda c: c["at"])]

    def _finish_report(self, started: float) -> None:
        self._schema_facts()
        self.report.elapsed_s = time.monotonic() - started
        idle = self._idle_since
        self.report.active_s = (max(idle - started, 0.0) if idle is not None
                                else self.report.elapsed_s)
        self.report.throttle_episodes = self.window.throttle_episodes
        if self.batch_seconds:
            ordered = sorted(self.batch_seconds)
            self.report.batch_p50_s = ordered[len(ordered) // 2]
            self.report.batch_p99_s = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

    def _submit(self, compiled: Any, pool: ThreadPoolExecutor, batch: list[Delivery]) -> None:
        def phase(bid: str) -> Callable[[str], None]:
            return lambda name: self._phases.__setitem__(bid, name)

        self._launch(pool, compiled, "", batch,
                     lambda bid: execute(compiled, batch, bid, max_jobs=self.max_bisect_jobs,
                                         cancelled=self._cancel, phase=phase(bid),
                                         count=self._count_job,
                                         uniform_probes=self.systemic.after))

    def _launch(self, pool: ThreadPoolExecutor, compiled: Any, suffix: str,
                batch: list[Delivery] | None, run: Callable[[str], BatchResult]) -> None:
        """Run ``run(batch_id)`` on a worker thread under its own Spark job group (so that
        shutdown can cancel it); its result comes back through the inbox with ``batch``
        (None for a grouped_within job)."""
        self._seq += 1
        batch_id = f"{self._run_token}-{self._seq:06d}{suffix}"

        def work() -> BatchResult:
            started = time.monotonic()
            self._phases[batch_id] = "job"
            compiled.bind_thread(batch_id)
            result = run(batch_id)
            result.seconds = time.monotonic() - started
            return result

        fut = pool.submit(work)
        self._running[batch_id] = (fut, batch or [])
        fut.add_done_callback(lambda f: self._inbox.put((f, batch)))

    def _complete(self, block_s: float) -> bool:
        """Settle finished batches; wait up to ``block_s`` for the first. True if any."""
        got = False
        timeout: float | None = block_s
        while True:
            try:
                fut, batch = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                return got
            timeout = None
            got = True
            for k in [k for k, v in self._running.items() if v[0] is fut]:
                del self._running[k]
                self._phases.pop(k, None)
            exc = fut.exception()
            if batch is None:  # a grouped_within job
                if exc is not None:
                    raise exc
                self._settle_groups(fut.result())
                continue
            if exc is not None:
                # A FlowError or a bug: nothing of this batch is proven; give it back.
                self._release([d for d in batch if not d.settled])
                self._forget(batch)
                raise exc
            self._settle(fut.result(), batch)

    def _loop(self, compiled: Any, pool: ThreadPoolExecutor) -> None:
        source = self.flow.source
        pending: list[Delivery] = []
        batch_started = 0.0
        last_message = time.monotonic()
        last_progress = last_keepalive = time.monotonic()
        while True:
            if self._complete(0):  # a settlement is activity: retries it started may come
                last_message = time.monotonic()
            self._drop_lost()
            now = time.monotonic()
            if self._stop.is_set():  # stop receiving now: what comes while draining
                self._release(pending, ending=True)  # would be given back (a spent delivery)
                self._forget(pending)
                return
            pulled = 0
            want = min(self.window.credits, self.batch_size - len(pending))
            if now < self._pause_until:  # a systemic failure's backoff: settle, don't pull
                want = 0
            if want > 0:
                timeout = 0.02 if (pending or self._running) else 0.2
                got = source.pull(want, timeout)
                pulled = len(got)
                if got:
                    self.window.take(pulled)
                    pulled_at = time.monotonic()
                    fresh = []
                    for d in got:
                        d.lineage_id = self._next_id
                        d.pulled_at = pulled_at
                        self._next_id += 1
                        self.inflight[d.lineage_id] = d
                        first = self._live.get(d.identity)
                        if first is None:
                            self._live[d.identity] = d.lineage_id
                            fresh.append(d)
                        else:  # one identity, one contribution: held until the first settles
                            self._dupes.setdefault(first, []).append(d)
                            self.report.duplicates += 1
                    if not pending and fresh:
                        batch_started = time.monotonic()
                    pending.extend(fresh)
                    self.report.pulled += pulled
                    self.metrics.pulled.inc(pulled)
                    self._window_metrics()
                    last_message = time.monotonic()
            connected = source.connected
            if connected != self._connected_seen:
                self._connected_seen = connected
                self.metrics.source_connected.set(1 if connected else 0)
            if (not connected or self.systemic.episode is not None
                    or now < self._pause_until or source.retries_waiting):
                # reconnecting, a systemic (or suspect) failure gave messages back, or
                # failed messages wait for their retry at the source: not idle
                last_message = time.monotonic()
            now = time.monotonic()
            if pending and len(self._running) < self.max_concurrent and (
                len(pending) >= self.batch_size
                or pulled == 0
                or self.window.credits == 0
                or now - batch_started >= self.batch_timeout_s
                or (not self._running and now - batch_started >= self.linger_s)
            ):
                self._submit(compiled, pool, pending)
                pending = []
            if self.groups is not None and len(self._running) < self.max_concurrent:
                self._submit_groups(pool)
            if (self.until_idle is not None and not pending and not self._running
                    and not self.held and not (self.groups and len(self.groups))
                    and now - last_message >= self.until_idle):
                self._idle_since = last_message
                return
            if self.progress is not None and now - last_progress >= 0.5:
                last_progress = now
                self.progress(self.report, self.window)
            if self.board is not None and self.board.due():
                self._pending = len(pending)
                self._publish("stopping" if self._stop.is_set() else "running")
            if now - last_keepalive >= self.keepalive_s and self.inflight:
                last_keepalive = now
                source.keepalive(list(self.inflight.values()))
            if want <= 0 or (pending and len(self._running) >= self.max_concurrent):
                if self._complete(0.05):  # nothing to pull for now: wait for a completion
                    last_message = time.monotonic()

    def _shutdown(self, pool: ThreadPoolExecutor) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        self._pending = 0  # the loop gave back what it had not batched
        try:
            while self._running:
                faults.point("engine.drain")
                if self.board is not None and self.board.due():
                    self._publish("draining")
                left = deadline - time.monotonic()
                if left <= 0 and not self._cancel.is_set():
                    log.warning("drain timeout: cancelling %d running batches; their messages "
                                "are given back", len(self._running))
                    self._cancel.set()
                    self._cancel_jobs()
                try:
                    self._complete(max(min(left, 0.5), 0.05))
                except FlowError:
                    continue
        finally:
            pool.shutdown(wait=True)
        leftover = [d for d in self.inflight.values() if not d.settled]
        self._release(leftover, ending=True)
        self.inflight.clear()
        if self.progress is not None:
            self.progress(self.report, self.window)

    def _cancel_jobs(self) -> None:
        try:
            from pyspark import SparkContext

            sc = SparkContext._active_spark_context
            if sc is not None:
                for batch_id in list(self._running):
                    sc.cancelJobGroup(batch_id)
        except Exception as e:  # noqa: BLE001
            log.error("could not cancel Spark jobs: %s", e)


def _quietly(what: str, fn: Callable[[], Any]) -> None:
    """Run a cleanup step; a failure is logged, and the other steps still run."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - cleanup must not hide the run's own outcome
        log.error("could not %s: %s", what, e)


def write_dead_letters(sink: Any, batch_id: str,
                       failures: list[tuple[Delivery, Failure]]) -> None:
    """Write failed messages with their provenance to ``sink`` and commit; raise if any
    row was not written."""
    import json

    import pyarrow as pa

    now = time.time()
    table = pa.Table.from_pylist(
        [{"message": d.identity, "body": d.body, "headers": json.dumps(d.headers),
          "step": f.step, "error": f.error, "deliveries": d.delivery_count, "failed_at": now}
         for d, f in failures],
        schema=pa.schema([("message", pa.string()), ("body", pa.binary()),
                          ("headers", pa.string()), ("step", pa.string()),
                          ("error", pa.string()), ("deliveries", pa.int64()),
                          ("failed_at", pa.float64())]))
    table = sink.dead_letter_rows(table)  # in the types its readers want (PostgreSQL: text)
    sink.prepare(table.schema)  # the error sink is a sink: check or create its table first
    if getattr(sink, "wants_keys", False):  # a dead letter written again is the same row
        table = table.append_column(ROW_KEY, pa.array([d.identity for d, _ in failures], pa.string()))
    result = sink.write_partition(batch_id, 0, table)
    if result.failed:
        sink.abort(batch_id, [result.token] if result.token else [])
        raise RuntimeError(f"{len(result.failed)} dead letters were refused: "
                           f"{next(iter(result.failed.values()))}")
    sink.commit(batch_id, [result.token] if result.token else [])


def run(flow: Flow, **options: Any) -> RunReport:
    """Run ``flow`` until idle (``until_idle=S``) or until SIGINT/SIGTERM.

    Options: ``batch_size`` (2000), ``max_inflight`` (10000), ``max_concurrent_batches``
    (2), ``batch_timeout_s`` (1.0), ``linger_s`` (0.05: an idle engine waits this long
    for more messages before it cuts a batch), ``until_idle`` (None: run until a signal),
    ``drain_timeout_s`` (60), ``max_bisect_jobs`` (64), ``spark`` (a SparkSession) or
    ``master`` (``local[*]`` by default), ``progress`` (a callback), ``metrics_port``
    and ``metrics_host`` (Prometheus), ``ui_port``, ``ui_host`` and ``ui_allow_replay``
    (the live status page, :mod:`ackflow.observe.ui`), ``executor`` (``"spark"``;
    ``"local"`` runs the same task code in this process without a JVM, for tests of
    flows with Python steps only: see :mod:`ackflow.spark.local`).

    Returns a :class:`RunReport`. A message is acked only when every row derived from
    it was written; every other message is nacked (retried by the source's policy),
    dead-lettered, or given back.
    """
    return Engine(flow, **options).run()
