"""``flow.dedupe(by, within=...)``: drop repeats of a business key inside a horizon.

The operator wraps the flow's sink. Its durable state is a claim per first of a key
value (table ``dedupe``, in the windows' store: the SQLite file beside the run's state,
or a :class:`~ackflow.state.pg.PostgresState`): which row was the first (its row key:
its message's identity and place), when (its event time; without ``time=`` the wall
clock, and from its commit on), the job that wrote it, and whether that job committed.

In a task, inside one claim transaction per partition (SQLite ``BEGIN IMMEDIATE``;
PostgreSQL a transaction-scoped advisory lock per operator, which commits and releases
take too), each row is, in the order of its time:

* **the owner again** (a claim's row key is its own: a redelivery, or a task run
  again): it goes to the sink again, under the same row key (a keyed sink writes it in
  place);
* **first**: no claim of its key is less than ``within`` from it (either side): it
  claims its time and goes to the sink;
* **a repeat**: such a claim is committed, or is of this very job and its row was
  written in this partition: it is dropped, and its message is acked as handled
  (counted by the metric ``ackflow_dedupe_dropped_total``);
* **waiting**: such a claim is another job's that has not settled (a batch beside this
  one, one a crash left behind), or another partition's of this job: the row says it
  waits (:data:`~ackflow.core.ledger.WAITS`); the engine keeps its message in flight
  for a second and runs it again, no delivery spent; by then the claim is committed (a
  repeat) or gone (a first).

On the driver, :meth:`DedupeSink.commit` commits the sink, then marks the job's claims
committed. A claim is deleted only when the sink refused its row; a job that failed
(:meth:`DedupeSink.abort`), or a crash, leaves its claims uncommitted but owned, since
a sink may have made rows durable inside the tasks (PostgreSQL does): the owner's
redelivery writes the same row again, under the same key, and its job commits the
claim. A claim never committed is abandoned after ``remember`` (wall clock; its owner
ended as a dead letter): a repeat may then claim the key. Committed claims go once they
are ``within`` behind the newest claimed time (or the wall clock) and ``remember`` old:
the state grows with the keys seen in one horizon (or in ``remember``), never with the
stream; a repeat that comes after both (a very late row) is written as a first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ackflow import faults
from ackflow.core.errors import ConfigError, FlowError
from ackflow.core.ledger import WAITS
from ackflow.sinks.base import ROW_KEY, PartitionResult, Sink, key_columns

log = logging.getLogger("ackflow.dedupe")

WALL_MIN_US = 10_000_000  # the shortest within by the wall clock


@dataclass(frozen=True)
class DedupeSpec:
    """What a dedupe operator compares: the key columns, the horizon (µs), and the time
    column (None: the wall clock when a row is claimed)."""

    name: str
    by: tuple[str, ...]
    within_us: int
    time: str | None = None
    state: Any = None  # a PostgresState, or None: the SQLite file beside the run's state
    remember_us: int = 3_600_000_000  # claims kept at least this long (wall clock)

    @property
    def columns(self) -> list[str]:
        """The input columns the dedupe reads."""
        return [*self.by, *([self.time] if self.time else [])]


@dataclass(frozen=True)
class DedupedFlow:
    """A flow whose rows pass a dedupe operator: end it with ``.to(sink)``."""

    flow: Any
    spec: DedupeSpec

    def to(self, sink: Sink) -> Any:
        if not isinstance(sink, Sink):
            raise ConfigError(
                f"dedupe {self.spec.name!r}: .to() needs an ackflow Sink, got {type(sink).__name__}"
            )
        return self.flow.to(DedupeSink(self.spec, sink))


def dedupe_flow(
    flow: Any,
    by: Any,
    *,
    within: Any,
    time: Any = None,
    remember: Any = 3600,
    state: Any = None,
    name: str | None = None,
) -> DedupedFlow:
    """Check :meth:`Flow.dedupe`'s arguments."""
    from ackflow.state.pg import PostgresState
    from ackflow.windows import _is_column, duration_us

    op = flow._name(name, "dedupe")
    by_t = (by,) if isinstance(by, str) else tuple(by)
    if not by_t or not all(isinstance(k, str) and k for k in by_t):
        raise ConfigError(f"dedupe {op!r}: by= takes one or more column names")
    within_us = duration_us(within, f"dedupe {op!r}: within")
    if within_us <= 0:
        raise ConfigError(f"dedupe {op!r}: within must be a positive duration")
    if time is None and within_us < WALL_MIN_US:
        raise ConfigError(
            f"dedupe {op!r}: without time= (the wall clock), within must be at least "
            f"{WALL_MIN_US // 1_000_000} s: a repeat that waits for its first is decided a few "
            "seconds after the first's commit, and would be a first again"
        )
    if state is not None and not isinstance(state, PostgresState):
        raise ConfigError(
            f"dedupe {op!r}: state= takes a PostgresState (or None: a file beside the run's state)"
        )
    if state is not None and name is None:
        raise ConfigError(
            f"dedupe {op!r}: with state= in PostgreSQL give name= (the claims are kept under it, "
            "and another flow's default name in the same schema would share them)"
        )
    if time is not None and not isinstance(time, str):
        if not _is_column(time):
            raise ConfigError(f"dedupe {op!r}: time= takes a column name or a Spark Column")
        flow = flow.with_columns({f"_{op}_time": time}, name=f"{op}.inputs")
        time = f"_{op}_time"
    remember_us = duration_us(remember, f"dedupe {op!r}: remember")
    if remember_us <= 0:
        raise ConfigError(
            f"dedupe {op!r}: remember must be a positive duration (longer than a batch runs: an "
            "unsettled first older than it is taken as abandoned)"
        )
    return DedupedFlow(flow, DedupeSpec(op, by_t, within_us, time, state, remember_us))


@dataclass
class _Claim:
    """One first of a key: its row key, job, time (µs), committed or not, and when it
    was claimed or last renewed by its owner (wall clock)."""

    owner: str
    job: str
    t: int
    done: int
    at: float


class DedupeSink(Sink):
    """Rows whose key is not a repeat go to ``inner``; see the module docstring."""

    wants_keys = True

    def __init__(self, spec: DedupeSpec, inner: Sink) -> None:
        super().__init__(spec.name)
        self.spec = spec
        self.inner = inner
        self.branches: tuple[Sink, ...] = (inner,)
        self.key = [*spec.columns, *key_columns(inner)]
        self.path: str | None = None
        self.dropped = 0  # repeats dropped (this run, committed jobs)
        self._metrics: Any = None

    # -- driver ----------------------------------------------------------------------

    def bind_state(self, path: str) -> None:
        """Driver side, before open: the store's file (chosen by the engine)."""
        self.path = os.path.abspath(path)
        if hasattr(self.inner, "bind_state"):
            self.inner.bind_state(path)

    def observe(self, metrics: Any, quiet: Any = None) -> None:
        self._metrics = metrics
        if hasattr(self.inner, "observe"):
            self.inner.observe(metrics, quiet)

    def open(self) -> None:
        if self.path is None and self.spec.state is None:
            raise FlowError(
                self.name,
                "dedupe keeps durable state and this flow has no place for it: give the run "
                "state_dir= (--state-dir)",
            )
        db = self._connect(create=True)  # the tables; fails at start if the store is unreachable
        db.close()
        self.inner.open()

    def close(self) -> None:
        if self.dropped:
            log.info("dedupe %r: %d repeats dropped this run", self.name, self.dropped)
        self.inner.close()

    def prepare(self, schema: Any) -> None:
        from ackflow.state.spec import check_columns

        check_columns(self.name, schema, self.spec.columns, self.spec.by, "dedupe key")
        if type(self.inner).prepare is not Sink.prepare:
            self.inner.prepare(schema)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_metrics": None}

    # a window inside: the engine's hooks reach it
    def begin_job(self, batch_id: str) -> None:
        if hasattr(self.inner, "begin_job"):
            self.inner.begin_job(batch_id)

    def hold(self, batch_id: str) -> None:
        if hasattr(self.inner, "hold"):
            self.inner.hold(batch_id)

    def unhold(self, batch_id: str) -> None:
        if hasattr(self.inner, "unhold"):
            self.inner.unhold(batch_id)

    def keep(self, batch_id: str) -> None:
        if hasattr(self.inner, "keep"):
            self.inner.keep(batch_id)
        else:
            self.unhold(batch_id)

    def let_go(self, batch_id: str) -> None:
        if hasattr(self.inner, "let_go"):
            self.inner.let_go(batch_id)

    def facts(self) -> dict[str, Any]:
        return dict(self.inner.facts()) if hasattr(self.inner, "facts") else {}

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        got = [pickle.loads(t) for t in tokens]
        self.inner.commit(batch_id, [t for t, _, _ in got if t is not None])
        faults.point("dedupe.after_output")
        claims = [(k, owner) for _, _, written in got for k, owner in written]
        # without time=, a first's span starts when it is committed: a repeat that waited
        # for the commit is inside it however long it waited
        now = int(time.time() * 1e6)
        with self._locked() as db:  # only the claims whose rows the sink took
            if self.spec.time is None:
                db.executemany(
                    "UPDATE dedupe SET done = 1, t = ? WHERE op = ? AND k = ? AND owner = ? AND done = 0",
                    [(now + j, self.name, k, owner) for j, (k, owner) in enumerate(claims)],  # one µs apart
                )
            else:
                db.executemany(
                    "UPDATE dedupe SET done = 1 WHERE op = ? AND k = ? AND owner = ? AND done = 0",
                    [(self.name, k, owner) for k, owner in claims],
                )
            self._forget(db)
        dropped = sum(n for _, n, _ in got)
        self.dropped += dropped
        if dropped and self._metrics is not None:
            self._metrics.dedupe_dropped(self.name, dropped)

    def abort(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        """The job failed: its claims stay, owned by their rows (a sink may have made
        rows durable inside the tasks, as PostgreSQL does): the owners come again and
        commit them; until then a repeat of theirs waits."""
        self.inner.abort(batch_id, [t for t, _, _ in (pickle.loads(x) for x in tokens) if t is not None])

    def _forget(self, db: Any) -> None:
        """Committed claims a horizon behind the newest (event time) or the wall clock,
        and claimed more than ``remember`` ago, go: a repeat that comes later than both
        (a retry, a late row) would find its claim gone and be written as a first. Claims
        never committed go after ``remember`` (their owner ended as a dead letter)."""
        now = time.time()
        if self.spec.time is None:
            horizon = int(now * 1e6) - self.spec.within_us
        else:
            top = db.execute("SELECT max(t) FROM dedupe WHERE op = ?", (self.name,)).fetchone()[0]
            if top is None:
                return
            # capped by the wall clock: one row dated in the far future forgets no claim
            horizon = min(int(top), int(now * 1e6)) - self.spec.within_us
        old = now - self.spec.remember_us / 1e6
        db.execute(
            "DELETE FROM dedupe WHERE op = ? AND ((done = 1 AND t < ? AND at < ?) OR (done = 0 AND at < ?))",
            (self.name, horizon, old, old),
        )

    # -- both sides ------------------------------------------------------------------

    def _connect(self, create: bool = False) -> Any:
        if self.spec.state is not None:
            from ackflow.state.pg import connect_store

            return connect_store(self.spec.state, create=create)
        from ackflow.state.store import connect

        assert self.path is not None
        return connect(self.path)

    # -- task side -------------------------------------------------------------------

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        from ackflow.state.partials import to_us
        from ackflow.state.store import gk_text

        n = rows.num_rows
        keys = rows.column(ROW_KEY).to_pylist()
        cols = [rows.column(k).to_pylist() for k in self.spec.by]
        failed: dict[int, str | tuple[str, str]] = {}
        now = int(time.time() * 1e6)
        todo: list[tuple[int, str, int, str]] = []  # (time, row key, index, key text)
        free: list[int] = []  # rows with a null key value: no key to compare, written
        times = rows.column(self.spec.time).to_pylist() if self.spec.time else None
        for i in range(n):
            t = now
            if times is not None:
                try:
                    if times[i] is None:
                        raise ValueError("it is null")
                    t = to_us(times[i])
                except ValueError as e:
                    failed[i] = f"time column {self.spec.time!r}: {e}"
                    continue
            values = [c[i] for c in cols]
            if any(v is None for v in values):
                free.append(i)
            else:
                todo.append((t, keys[i], i, gk_text(values)))
        todo.sort()
        claimed, repeats, dropped = self._claim(batch_id, todo, failed)
        faults.point("dedupe.after_claim")
        passed = sorted([*claimed, *free])
        res = PartitionResult()
        if passed:
            sub = rows.take(passed)
            if not self.inner.wants_keys:
                sub = sub.drop_columns([ROW_KEY])
            res = self.inner.write_partition(batch_id, partition, sub)  # raising: the claims stay (owned)
        refused = {passed[j] for j in res.failed}
        for j, why in res.failed.items():
            failed[passed[j]] = why if isinstance(why, tuple) else (self.inner.name, why)
        # a claim whose row the sink refused: it was not written (unless the sink writes
        # to several places, where a refusal may follow another branch's write)
        gone = [i for i in claimed if i in refused]
        if gone and not getattr(self.inner, "branches", None):
            self._release(batch_id, [(claimed[i][0], keys[i]) for i in gone])
        written = [(claimed[i][0], keys[i]) for i in claimed if i not in refused]
        # a repeat of a row of this partition is dropped once that row was written; a
        # repeat of another partition's row waits (that row may yet be refused)
        owners = {claimed[i]: i for i in claimed}
        for i, first in repeats:
            mine = owners.get(first)
            if mine is not None and mine not in refused:
                dropped += 1
            else:
                failed[i] = (
                    f"{WAITS}key {first[0][:200]} is held by a row of this batch that is not written yet"
                )
        counts = dict(res.counts) if res.counts is not None else {self.inner.name: len(passed) - len(refused)}
        return PartitionResult(
            failed=failed, token=pickle.dumps((res.token, dropped, written)), counts=counts
        )

    def _claim(
        self, job: str, todo: list[tuple[int, str, int, str]], failed: dict[int, str | tuple[str, str]]
    ) -> tuple[dict[int, tuple[str, int]], list[tuple[int, tuple[str, int]]], int]:
        """Decide each row in one claim transaction. A key may hold several claims: a row
        less than ``within`` from a claim of another row (either side) repeats it; a row
        near none is a first and claims its own time. Returns the rows to write
        (index -> the claim each owns: key text, time), the repeats of claims of this
        very job (index, claim), decided once the sink wrote, and how many repeats of
        committed claims were dropped."""
        within = self.spec.within_us
        claimed: dict[int, tuple[str, int]] = {}  # row -> the claim it owns (key text, time)
        repeats: list[tuple[int, tuple[str, int]]] = []
        dropped = 0
        with self._locked() as db:
            held = self._held(db, sorted({k for *_, k in todo}))
            writes: list[tuple[Any, ...]] = []
            gone: list[tuple[Any, ...]] = []
            wall = time.time()
            for t, rk, i, k in todo:
                claims = held.setdefault(k, [])
                own = next((c for c in claims if c.owner == rk), None)
                if own is not None:  # the owner again: written in place
                    claimed[i] = (k, own.t)
                    if not own.done:  # a failed job's or a crash's: settled by this one
                        own.job, own.at = job, wall
                        writes.append((self.name, k, rk, job, own.t, wall))
                    continue
                if self.spec.time is None:  # the wall clock, read under the lock: in order
                    t = int(wall * 1e6)
                covers = [c for c in claims if abs(t - c.t) < within]
                for c in covers:  # never committed and `remember` old: its owner ended
                    if not c.done and wall - c.at >= self.spec.remember_us / 1e6:
                        claims.remove(c)
                        gone.append((self.name, k, c.t))
                covers = [c for c in covers if c in claims]
                if not covers:
                    claims.append(_Claim(rk, job, t, 0, wall))
                    writes.append((self.name, k, rk, job, t, wall))
                    claimed[i] = (k, t)
                elif any(c.done for c in covers):  # a committed first: a repeat, dropped
                    dropped += 1
                elif (pending := covers[0]).job == job:  # every cover uncommitted
                    repeats.append((i, (k, pending.t)))
                else:
                    failed[i] = (
                        f"{WAITS}key {k[:200]} is held by another message's row ({pending.owner[:80]}) "
                        "whose batch has not settled"
                    )
            db.executemany("DELETE FROM dedupe WHERE op = ? AND k = ? AND t = ?", gone)
            db.executemany(
                "INSERT INTO dedupe (op, k, owner, job, t, at, done) VALUES (?, ?, ?, ?, ?, ?, 0) "
                "ON CONFLICT (op, k, t) DO UPDATE SET owner = excluded.owner, job = excluded.job, "
                "at = excluded.at, done = 0",
                writes,
            )
        return claimed, repeats, dropped

    def _held(self, db: Any, ks: list[str]) -> dict[str, list[_Claim]]:
        from ackflow.state.store import rows_in

        out: dict[str, list[_Claim]] = {}
        query = "SELECT k, owner, job, t, at, done FROM dedupe WHERE op = ? AND k IN ({marks})"
        for k, owner, job, t, at, done in rows_in(db, query, [self.name], ks):
            out.setdefault(k, []).append(_Claim(owner, job, int(t), int(done), float(at)))
        return out

    def _release(self, job: str, claims: list[tuple[str, str]]) -> None:
        """The sink refused these rows (key text, owner): their claims go, so the next
        row of the key is a first, not a repeat of a row never written."""
        with self._locked() as db:
            db.executemany(
                "DELETE FROM dedupe WHERE op = ? AND k = ? AND owner = ? AND job = ? AND done = 0",
                [(self.name, k, owner, job) for k, owner in claims],
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Any]:
        """One transaction holding the operator's claims alone (as the tasks' claims do):
        a commit never interleaves with a claim read and written by a task."""
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                if self.spec.state is not None:
                    db.execute(
                        "SELECT pg_advisory_xact_lock(hashtext(?))",
                        (f"ackflow-dedupe:{self.spec.state.schema}:{self.name}",),
                    )
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        finally:
            db.close()
