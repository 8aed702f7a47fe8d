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

What is done with a batch that came back (acks, dead letters, give-backs, the rows
held by grouped_within) is in :mod:`ackflow.engine.settle`.
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
from ackflow.core.errors import ConfigError, FlowError
from ackflow.core.groups import GroupBuffer
from ackflow.core.ledger import Failure
from ackflow.core.policy import DEAD_RETRY_S
from ackflow.core.schema import SchemaStore, check_mode
from ackflow.core.settlement import Delivery
from ackflow.core.systemic import SystemicDetector
from ackflow.core.window import InflightWindow
from ackflow.engine.batch import BatchResult, execute, execute_groups, group_key
from ackflow.engine.blocks import blocks_allowed
from ackflow.engine.collector import fewer_collections
from ackflow.engine.report import RunReport
from ackflow.engine.schemas import open_store, state_file
from ackflow.engine.settle import Settling, write_dead_letters  # noqa: F401 - write_dead_letters re-exported
from ackflow.flow import Flow, GroupedWithin
from ackflow.observe.metrics import Metrics
from ackflow.observe.status import EngineFacts, StatusBoard
from ackflow.sinks.collect import CollectSink

log = logging.getLogger("ackflow.engine")

Progress = Callable[[RunReport, InflightWindow], None]


def _check_seconds(name: str, value: Any, zero_ok: bool) -> None:
    """A duration option: a finite number of seconds, >= 0 (or > 0), never nan or inf
    (``until_idle=nan`` would never end, ``drain_timeout_s=nan`` never cancel)."""
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if zero_ok else value > 0)
    )
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name} must be {bound} seconds (a finite number), got {value!r}")


class Engine(Settling):
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
        for name, value in (
            ("batch_size", batch_size),
            ("max_inflight", max_inflight),
            ("max_concurrent_batches", max_concurrent_batches),
            ("max_bisect_jobs", max_bisect_jobs),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if batch_size > max_inflight:
            raise ConfigError(
                f"batch_size ({batch_size}) cannot exceed max_inflight ({max_inflight}): "
                "raise max_inflight or lower batch_size"
            )
        for name, seconds, zero_ok in (
            ("until_idle", until_idle, True),
            ("batch_timeout_s", batch_timeout_s, False),
            ("linger_s", linger_s, True),
            ("drain_timeout_s", drain_timeout_s, True),
            ("keepalive_s", keepalive_s, False),
        ):
            if seconds is None and name == "until_idle":
                continue
            _check_seconds(name, seconds, zero_ok)
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
            stop_after_s=systemic_stop_after_s,
            backoff_s=systemic_backoff_s,
            max_backoff_s=systemic_max_backoff_s,
        )
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
        self.parked: list[tuple[float, Delivery]] = []  # (due, delivery): waits (settle._park)
        self.dead_waiting: list[tuple[float, int, Delivery, Failure]] = []  # settle._hold_dead
        self._ending = False  # the last give-back: nothing is held any more
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
            self.board = StatusBoard(flow, self.report, replay_supported=flow.source.replays_dead_letters)
        self.ui: Any = None  # the StatusServer, while the run serves the page
        self._plans: list[Any] = []  # the compiled plans (their row counts feed the page)
        self._phases: dict[str, str] = {}  # running batch id -> "job" or "commit"
        self._pending = 0  # pulled, not yet in a job (for the status page)
        self.inflight: dict[int, Delivery] = {}
        self._live: dict[str, int] = {}  # identity -> lineage id of its delivery in flight
        self._dupes: dict[int, list[Delivery]] = {}  # that lineage id -> repeats held back
        self._back: dict[str, tuple[float, set[str]]] = {}  # windows hold for these (settle.py)
        self._back_now: list[str] | None = None
        self._next_id = 1
        self._blocks = False  # the source pulls blocks (engine/blocks.py)
        self._inbox: queue.Queue[tuple[Future[BatchResult], list[Delivery] | None]] = queue.Queue()
        self._running: dict[str, tuple[Future[BatchResult], list[Delivery]]] = {}
        self._stop = threading.Event()
        self._cancel = threading.Event()
        self._signals = 0
        self._dead_letter_failures = 0
        self._run_token = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self._seq = 0
        self._activity = time.monotonic()  # the loop's last message, completion or wait
        self._busy = True  # until the loop runs: nothing is quiet while the run starts

    def quiet_s(self) -> float:
        """Seconds the stream has been quiet: nothing pulled, batched, running or held
        (0 while busy). Read by other threads: a window's timer closes windows by it."""
        return 0.0 if self._busy else time.monotonic() - self._activity

    # -- signals ------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop pulling; finish (or, after the drain timeout, give back) what is in flight."""
        self._stop.set()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals += 1
        if self._signals > 1:
            log.error("second signal: exiting now; unsettled messages return to the source")
            os._exit(130)
        log.warning(
            "signal %d: stopping; draining in-flight batches (up to %.0f s)", signum, self.drain_timeout_s
        )
        self._stop.set()

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
        row_keys = [group_key(g.row_keys, g.values or g.key) for g in groups]
        self._launch(
            pool,
            suffix,
            "g",
            None,
            lambda bid: execute_groups(
                suffix,
                groups,
                step.keys,
                bid,
                row_keys,
                count=self._count_job,
                cancelled=self._cancel,
                step_name=step.name,
            ),
        )

    def _publish(self, state: str) -> None:
        """Hand the status page a snapshot (the engine's thread; a few times a second)."""
        if self.board is None:
            return
        self._schema_facts()
        w = self.window
        jobs = tuple(
            (self._count(batch), self._phases.get(bid, "job"))
            for bid, (_, batch) in list(self._running.items())
        )
        try:
            details = self.flow.source.status()
        except Exception as e:  # noqa: BLE001 - the page must never stop the run
            details = {"status": f"unavailable: {type(e).__name__}"}
        rows: dict[str, tuple[int, int, int]] = {}
        for plan in self._plans:
            rows.update(plan.row_counts())  # each step and sink is in one plan
        self.board.publish(
            EngineFacts(
                state=state,
                in_flight=w.in_flight,
                max_inflight=w.max_inflight,
                throttled=w.throttled,
                throttle_episodes=w.throttle_episodes,
                batching=self._pending,
                jobs=jobs,
                held=len(self.held),
                connected=self.flow.source.connected,
                source=details,
                rows=rows,
                windows={s.name: f for s in self.flow.sinks if hasattr(s, "facts") and (f := s.facts())},
            )
        )

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
            self.suffix = compile_(Flow(flow.source, flow.steps[i + 1 :], flow.sink), rows_input=True)
            self.groups = GroupBuffer(step.n, step.timeout_s)
        else:
            compiled = compile_(flow)
        with contextlib.ExitStack() as stack:  # every resource closed on every path
            for sink in flow.sinks:
                if hasattr(sink, "bind_state"):  # a window: its durable state's file
                    where = state_file(flow, self.state_dir, "windows.db")
                    if where is not None:
                        sink.bind_state(where)
                    sink.observe(self.metrics, self.quiet_s)  # type: ignore[attr-defined]
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

                ui = StatusServer(
                    self.board,
                    flow.source,
                    port=self.ui_port or 0,
                    host=self.ui_host,
                    allow_replay=self.ui_allow_replay,
                )
                ui.start()
                stack.callback(_quietly, "stop the status page", ui.close)
                self.ui = ui  # set once it serves
                log.info("status page at %s", ui.url)
                if ui.replay_url is not None:  # to the operator only, never to the log
                    print(
                        f"ackflow: to replay dead letters, open {ui.replay_url} (the link "
                        "holds this run's replay token: keep it private)",
                        file=sys.stderr,
                        flush=True,
                    )
            flow.source.configure(
                max_inflight=self.window.max_inflight,
                error_sink=flow.error_sink is not None,
                keepalive_s=self.keepalive_s,
            )
            self._blocks = flow.source.use_blocks(self.groups is None and blocks_allowed(flow))
            stack.callback(_quietly, "close the source", flow.source.close)
            self.report.recovered = flow.source.open()
            self.metrics.recovered.inc(self.report.recovered)
            if self.report.recovered:
                log.warning(
                    "%d messages a previous consumer had in flight were given back and "
                    "will be processed again (their rows may be written twice)",
                    self.report.recovered,
                )
            if self.handle_signals and threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    stack.callback(signal.signal, sig, signal.signal(sig, self._on_signal))
            stack.enter_context(fewer_collections())
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
        self.report.schema_changes = [
            {**c, "changes": c["changes"][:50]} for c in sorted(changes, key=lambda c: c["at"])
        ]

    def _finish_report(self, started: float) -> None:
        self._schema_facts()
        self.report.elapsed_s = time.monotonic() - started
        idle = self._idle_since
        self.report.active_s = max(idle - started, 0.0) if idle is not None else self.report.elapsed_s
        self.report.throttle_episodes = self.window.throttle_episodes
        if self.batch_seconds:
            ordered = sorted(self.batch_seconds)
            self.report.batch_p50_s = ordered[len(ordered) // 2]
            self.report.batch_p99_s = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

    def _submit(self, compiled: Any, pool: ThreadPoolExecutor, batch: list[Delivery]) -> None:
        def phase(bid: str) -> Callable[[str], None]:
            return lambda name: self._phases.__setitem__(bid, name)

        self._launch(
            pool,
            compiled,
            "",
            batch,
            lambda bid: execute(
                compiled,
                batch,
                bid,
                max_jobs=self.max_bisect_jobs,
                cancelled=self._cancel,
                phase=phase(bid),
                count=self._count_job,
                uniform_probes=self.systemic.after,
            ),
        )

    def _launch(
        self,
        pool: ThreadPoolExecutor,
        compiled: Any,
        suffix: str,
        batch: list[Delivery] | None,
        run: Callable[[str], BatchResult],
    ) -> None:
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
            if self.parked:
                again = self._unpark()  # waited: run again (still in flight, no delivery spent)
                if again:
                    if not pending:
                        batch_started = time.monotonic()
                    pending.extend(again)
                    last_message = time.monotonic()
            if self.dead_waiting:
                self._retry_dead_letters()
            self._drop_lost()
            if self._back:
                self._expire_back()
            now = time.monotonic()
            if self._stop.is_set():  # stop receiving now: what comes while draining
                self._release(pending, ending=True)  # would be given back (a spent delivery)
                self._forget(pending)
                return
            pulled = 0
            want = min(self.window.credits, self.batch_size - self._count(pending))
            if now < self._pause_until:  # a systemic failure's backoff: settle, don't pull
                want = 0
            if want > 0:
                timeout = 0.02 if (pending or self._running) else 0.2
                got = source.pull(want, timeout)
                pulled = self._count(got)
                if got:
                    self.window.take(pulled)
                    fresh = self._admit(got)
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
            if (
                not connected
                or self.systemic.episode is not None
                or now < self._pause_until
                or source.retries_waiting
            ):
                # reconnecting, a systemic (or suspect) failure gave messages back, or
                # failed messages wait for their retry at the source: not idle
                last_message = time.monotonic()
                if (
                    want > 0
                    and not pulled
                    and connected
                    and not source.retries_waiting
                    and not self._busy_inside(pending)
                ):
                    # the pause is over, the source gave nothing and nothing is in flight:
                    # no batch will settle to check the episode (its messages went elsewhere)
                    self._stop_if_overdue()
            now = time.monotonic()
            if (
                pending
                and len(self._running) < self.max_concurrent
                and (
                    self._count(pending) >= self.batch_size
                    or pulled == 0
                    or self.window.credits == 0
                    or now - batch_started >= self.batch_timeout_s
                    or (not self._running and now - batch_started >= self.linger_s)
                )
            ):
                self._submit(compiled, pool, pending)
                pending = []
            if self.groups is not None and len(self._running) < self.max_concurrent:
                self._submit_groups(pool)
            # how long the stream has been quiet, for windows (their idle rule)
            self._activity, self._busy = (
                last_message,
                bool(pending or self._running or self.held or self.parked or self.dead_waiting),
            )
            if (
                self.until_idle is not None
                and not self._busy_inside(pending)
                and now - last_message >= self.until_idle
            ):
                self._idle_since = last_message
                return
            if self.progress is not None and now - last_progress >= 0.5:
                last_progress = now
                self.progress(self.report, self.window)
            if self.board is not None and self.board.due():
                self._pending = self._count(pending)
                self._publish("stopping" if self._stop.is_set() else "running")
            # (a source of blocks may hold leases outside the window: a split's messages)
            if now - last_keepalive >= self.keepalive_s and (self.inflight or self._blocks):
                last_keepalive = now
                source.keepalive(list(self.inflight.values()))
            if want <= 0 or (pending and len(self._running) >= self.max_concurrent):
                if self._complete(0.05):  # nothing to pull for now: wait for a completion
                    last_message = time.monotonic()

    def _busy_inside(self, pending: list[Delivery]) -> bool:
        """Messages in the engine still to settle: batched, running, held for grouping,
        parked, or rows waiting in groups."""
        return bool(
            pending
            or self._running
            or self.held
            or self.parked
            or self.dead_waiting
            or (self.groups and len(self.groups))
        )

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
                    log.warning(
                        "drain timeout: cancelling %d running batches; their messages are given back",
                        len(self._running),
                    )
                    self._cancel.set()
                    self._cancel_jobs()
                try:
                    self._complete(max(min(left, 0.5), 0.05))
                except FlowError:
                    continue
        finally:
            pool.shutdown(wait=True)
        # dead letters held (by the engine for the error sink, by the source for its
        # dead-letter exchange): written again until the drain's deadline
        source, next_try = self.flow.source, 0.0
        while (self.dead_waiting or source.dead_letters_held) and time.monotonic() < deadline:
            if self.dead_waiting and time.monotonic() >= next_try:
                self._retry_dead_letters(now_all=True)
                next_try = time.monotonic() + DEAD_RETRY_S
            if source.dead_letters_held:
                source.keepalive([])  # the source writes its own again, at their backoff
            self._drop_lost()
            if self.dead_waiting or source.dead_letters_held:
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        self._ending = True
        self._give_up_held()
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
