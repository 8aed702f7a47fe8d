"""What the status page shows: a snapshot the engine publishes a few times a second.

The engine keeps a :class:`StatusBoard` while the status page is on. It tells the
board about acks, failures and batches (once per call, never per row; pull-to-ack
latency is sampled, at most 16 messages per ack call), and calls
:meth:`StatusBoard.publish` from its loop. The board builds a plain-JSON snapshot at
most every ``every_s`` seconds and swaps it in with one assignment; the page's server
thread only ever reads the latest one, so a slow or absent browser never holds up
settlement.

Nothing secret leaves the board: error texts, source details and body previews pass
through :func:`~ackflow.core.secrets.redact`, and a body preview is at most
``PREVIEW_BYTES`` bytes. Escaping is the page's job (it renders text, never HTML).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ackflow.core.secrets import redact

if TYPE_CHECKING:
    from ackflow.core.ledger import Failure
    from ackflow.core.settlement import Delivery
    from ackflow.engine.report import RunReport
    from ackflow.flow import Flow

PREVIEW_BYTES = 1024  # of a dead letter's body
ERROR_CHARS = 2000  # of a dead letter's error
DEAD_LETTERS_KEPT = 200  # the newest, in a ring
HISTORY_SAMPLES = 600  # one a second: the last 10 minutes
LATENCY_SAMPLES_PER_ACK = 16
EPISODES_KEPT = 20


@dataclass(frozen=True)
class DeadLetterNote:
    """One dead letter as the page shows it. ``ref`` is what the source's
    ``replay_dead_letters`` takes (None: it cannot be replayed from the page)."""

    id: int
    at: float  # wall clock
    message: str
    step: str
    error: str
    deliveries: int
    body: str  # a redacted preview of at most PREVIEW_BYTES bytes
    body_bytes: int
    kept_by: str  # "source", or the name of the flow's error sink
    ref: object | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at,
            "message": self.message,
            "step": self.step,
            "error": self.error,
            "deliveries": self.deliveries,
            "body": self.body,
            "body_bytes": self.body_bytes,
            "truncated": self.body_bytes > PREVIEW_BYTES,
            "kept_by": self.kept_by,
            "replayable": self.ref is not None,
        }


@dataclass(frozen=True)
class EngineFacts:
    """What the engine knows at one moment, gathered in its own thread."""

    state: str  # starting, running, stopping, draining, stopped
    in_flight: int
    max_inflight: int
    throttled: bool
    throttle_episodes: int
    batching: int  # pulled, not yet handed to a Spark job
    jobs: tuple[tuple[int, str], ...]  # (messages, phase) of each running batch
    held: int  # waiting for their grouped_within groups
    connected: bool
    source: dict[str, object]
    #: rows (in, out, failed) per Python step and sink, counted by the tasks
    rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: per window operator: its watermark, open windows, late rows, ... (WindowSink.facts)
    windows: dict[str, dict[str, object]] = field(default_factory=dict)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _clean(details: dict[str, object]) -> dict[str, object]:
    """Source details fit for the page: scalars only, strings redacted and bounded."""
    out: dict[str, object] = {}
    for k, v in list(details.items())[:40]:
        if isinstance(v, bool | int | float) or v is None:
            out[str(k)[:100]] = v
        else:
            out[str(k)[:100]] = redact(str(v))[:300]
    return out


def rows_by_node(
    graph: dict[str, Any], counts: dict[str, tuple[int, int, int]]
) -> dict[str, dict[str, int | None]]:
    """Rows in / out / failed for each step and sink of the graph.

    Python steps, decoding and the sinks are counted by the tasks. A Spark step
    (with_columns, group_by, join, transform) runs inside Spark, where nothing counts its
    rows; they are read off its neighbours: its rows in are the rows out of the step
    before it, its rows out the rows into the step after it (None where that neighbour
    is a Spark step too). A ``grouped_within`` step's rows out are the groups it made.
    Rows that a Spark step fails fail the whole job; such messages are counted in
    ``failed_by_step``, not here.

    >>> g = {"nodes": [{"id": "step:decode", "role": "step", "name": "decode", "kind": "decode"},
    ...                {"id": "step:agg", "role": "step", "name": "agg", "kind": "GroupBy"},
    ...                {"id": "sink:out", "role": "sink", "name": "out", "kind": "Parquet"}],
    ...      "edges": [["step:decode", "step:agg"], ["step:agg", "sink:out"]]}
    >>> rows_by_node(g, {"decode": (10, 9, 1), "out": (3, 3, 0)})["agg"]
    {'in': 9, 'out': 3, 'failed': None}
    """
    counts = {redact(k): v for k, v in counts.items()}  # the graph's names are redacted
    known = {"step", "sink", "error_sink"}
    nodes = {n["id"]: n for n in graph["nodes"] if n["role"] in known}
    prev: dict[str, str] = {}
    nxt: dict[str, str] = {}
    for a, b in graph["edges"]:
        if a in nodes and b in nodes and nodes[b]["role"] != "error_sink":
            prev.setdefault(b, a)
            nxt.setdefault(a, b)
    out: dict[str, dict[str, int | None]] = {}
    for n in nodes.values():
        c = counts.get(n["name"])
        if c is not None:
            out[n["name"]] = {"in": c[0], "out": c[1], "failed": c[2]}
    for node_id, n in nodes.items():
        name = n["name"]
        if (name in out and n["kind"] != "GroupedWithin") or n["role"] != "step":
            continue  # counted; or a sink of a broadcast (its rows written are known)
        before = nodes.get(prev.get(node_id, ""))
        after = nodes.get(nxt.get(node_id, ""))
        mine = out.get(name, {"in": None, "out": None, "failed": None})
        if mine["in"] is None and before is not None and before["name"] in out:
            mine["in"] = out[before["name"]]["out"]
        if after is not None and after["name"] in counts:
            mine["out"] = counts[after["name"]][0]
        elif n["kind"] == "GroupedWithin":
            mine["out"] = None  # what it collected is not what it made
        out[name] = mine
    return out


def flow_graph(flow: Flow) -> dict[str, Any]:
    """Nodes (source, decode, each step, each sink, the dead letters) with a column and
    a row for drawing, and edges between them.

    >>> import ackflow
    >>> from ackflow.sinks import MemorySink
    >>> from ackflow.testing import ListSource
    >>> g = flow_graph(ackflow.Flow(ListSource([])).map(lambda r: r, name="parse")
    ...                .to(MemorySink()))
    >>> [(n["role"], n["name"], n["col"], n["row"]) for n in g["nodes"]]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('source', 'list', 0, 0), ('step', 'decode', 1, 0), ('step', 'parse', 2, 0),
     ('sink', 'memory', 3, 0), ('error_sink', 'dead letters', 1, 1)]
    >>> g["edges"][-1]
    ['source:list', 'error_sink:dead letters']
    """
    from ackflow.sinks.broadcast import Broadcast

    nodes: list[dict[str, Any]] = []
    edges: list[list[str]] = []

    def add(role: str, name: str, kind: str, col: int, row: int, after: str | None) -> str:
        node_id = f"{role}:{name}"
        nodes.append(
            {"id": node_id, "role": role, "name": redact(name), "kind": kind, "col": col, "row": row}
        )
        if after is not None:
            edges.append([after, node_id])
        return node_id

    source = flow.source
    prev = add("source", source.name, type(source).__name__, 0, 0, None)
    prev = add("step", "decode", "decode", 1, 0, prev)
    col = 2
    fork = flow.forked
    for step in flow.steps:
        if step is fork:
            break
        prev = add("step", step.name, step.kind, col, 0, prev)
        col += 1
    row = 0
    if fork is not None:
        for branch in fork.branches:
            c, p = col, prev
            for step in branch.steps:
                p = add("step", step.name, step.kind, c, row, p)
                c += 1
            for sink in branch.sinks:
                add("sink", sink.name, type(sink).__name__, c, row, p)
                row += 1
    elif isinstance(flow.sink, Broadcast):
        b = add("step", flow.sink.name, f"broadcast ({flow.sink.mode})", col, 0, prev)
        for sink in flow.sink.branches:
            add("sink", sink.name, type(sink).__name__, col + 1, row, b)
            row += 1
    elif flow.sink is not None:
        add("sink", flow.sink.name, type(flow.sink).__name__, col, 0, prev)
        row = 1
    if flow.error_sink is not None:
        add(
            "error_sink", flow.error_sink.name, type(flow.error_sink).__name__, 1, max(row, 1), nodes[0]["id"]
        )
    else:
        add("error_sink", "dead letters", "kept by the source", 1, max(row, 1), nodes[0]["id"])
    return {"nodes": nodes, "edges": edges}


class StatusBoard:
    """The run's status, fed by the engine (its thread only) and read by the page.

    ``current()`` returns the latest ``(version, snapshot)``: a dict of plain JSON
    values, never changed once published. ``probed`` is set by the page's thread (the
    source's :meth:`~ackflow.sources.base.Source.probe`) and shown from the next
    snapshot on.
    """

    def __init__(
        self, flow: Flow, report: RunReport, *, every_s: float = 0.5, replay_supported: bool = False
    ) -> None:
        self.every_s = every_s
        self.report = report
        self.graph = flow_graph(flow)
        self.source_name = redact(flow.source.name)
        self.replay_supported = replay_supported
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self.probed: dict[str, object] | None = None
        self._dead: deque[DeadLetterNote] = deque(maxlen=DEAD_LETTERS_KEPT)
        self._dead_seq = 0
        self._failed: dict[str, dict[str, int]] = {}
        self._ack_latency: deque[float] = deque(maxlen=2000)
        self._batch_seconds: deque[float] = deque(maxlen=500)
        self._lat_since: deque[float] = deque(maxlen=2000)  # since the last history sample
        self._batch_since: deque[float] = deque(maxlen=500)
        self._history: deque[tuple[Any, ...]] = deque(maxlen=HISTORY_SAMPLES)
        self._last_sample: tuple[float, int, int, int, int, int] | None = None
        self._throttled_since_sample = False
        self._episodes: deque[list[float | None]] = deque(maxlen=EPISODES_KEPT)
        self._episodes_seen = 0
        self._published_at = float("-inf")
        self._current: tuple[int, dict[str, Any]] = (0, {})
        self._dead_letters: tuple[DeadLetterNote, ...] = ()

    # -- fed by the engine (its thread) -----------------------------------------------------

    def acked(self, deliveries: Sequence[Delivery]) -> None:
        """Sample the pull-to-ack latency of a few of these (just acked) deliveries."""
        if not deliveries:
            return
        now = time.monotonic()
        stride = max(1, len(deliveries) // LATENCY_SAMPLES_PER_ACK)
        for d in deliveries[::stride]:
            if d.pulled_at:
                lat = now - d.pulled_at
                self._ack_latency.append(lat)
                self._lat_since.append(lat)

    def batch(self, seconds: float) -> None:
        self._batch_seconds.append(seconds)
        self._batch_since.append(seconds)

    def failed(
        self, d: Delivery, f: Failure, outcome: str, *, kept_by: str = "source", ref: object | None = None
    ) -> None:
        """A message was nacked or dead-lettered (``outcome``) in step ``f.step``."""
        per = self._failed.setdefault(f.step, {"nacked": 0, "dead_lettered": 0})
        per[outcome] = per.get(outcome, 0) + 1
        if outcome != "dead_lettered":
            return
        self._dead_seq += 1
        body = d.body[:PREVIEW_BYTES].decode("utf-8", "replace")
        self._dead.append(
            DeadLetterNote(
                id=self._dead_seq,
                at=time.time(),
                message=redact(d.key)[:300],
                step=f.step,
                error=redact(f.error)[:ERROR_CHARS],
                deliveries=d.delivery_count,
                body=redact(body),
                body_bytes=len(d.body),
                kept_by=kept_by,
                ref=ref,
            )
        )

    def due(self) -> bool:
        return time.monotonic() - self._published_at >= self.every_s

    def publish(self, facts: EngineFacts) -> None:
        """Build a snapshot and swap it in (the engine calls this when :meth:`due`, and
        at its state changes)."""
        now = time.monotonic()
        self._published_at = now
        self._episode(facts)
        self._throttled_since_sample |= facts.throttled
        self._sample(now, facts)
        r = self.report
        jobs = [m for m, phase in facts.jobs if phase != "commit"]
        commits = [m for m, phase in facts.jobs if phase == "commit"]
        source = _clean(facts.source)
        probed = _clean(self.probed) if self.probed else {}
        retries = probed.get("retries_waiting", source.get("retries_waiting"))
        self._dead_letters = tuple(self._dead)
        snapshot = {
            "state": facts.state,
            "started_at": self.started_at,
            "elapsed_s": round(now - self._t0, 3),
            "flow": self.graph,
            "totals": {
                "pulled": r.pulled,
                "acked": r.acked,
                "nacked": r.nacked,
                "dead_lettered": r.dead_lettered,
                "released": r.released,
                "recovered": r.recovered,
                "redelivered": r.redelivered,
                "batches": r.batches,
                "jobs": r.jobs,
                "bisections": r.bisections,
                "given_back_systemic": r.given_back_systemic,
            },
            "systemic": r.systemic,
            "schema": {
                "versions": dict(r.schema_versions),
                "changes": [{**c, "changes": c["changes"][:10]} for c in r.schema_changes[-10:]],
            },
            "rows_written": {redact(k): v for k, v in r.rows_written.items()},
            "failed_by_step": {k: dict(v) for k, v in self._failed.items()},
            "rows_by_step": rows_by_node(self.graph, facts.rows),
            "window": {
                "in_flight": facts.in_flight,
                "max_inflight": facts.max_inflight,
                "throttled": facts.throttled,
                "throttle_episodes": facts.throttle_episodes,
                "episodes": [{"start": s, "end": e} for s, e in self._episodes],
            },
            "waiting": {
                "batching": facts.batching,
                "jobs_running": {"batches": len(jobs), "messages": sum(jobs)},
                "sink_commit": {"batches": len(commits), "messages": sum(commits)},
                "held_in_groups": facts.held,
                "retries_waiting": retries,
            },
            "latency": {
                "batch_p50_s": _round(_percentile(self._batch_seconds, 0.5)),
                "batch_p99_s": _round(_percentile(self._batch_seconds, 0.99)),
                "ack_p50_s": _round(_percentile(self._ack_latency, 0.5)),
                "ack_p99_s": _round(_percentile(self._ack_latency, 0.99)),
            },
            "source": {
                "name": self.source_name,
                "connected": facts.connected,
                "redelivered": r.redelivered,
                "recovered": r.recovered,
                "details": source,
                "probed": probed,
            },
            "windows": facts.windows,
            "history": self._history_columns(),
            "dead_letters": [n.as_json() for n in reversed(self._dead_letters)],
            "replay_supported": self.replay_supported,
        }
        # one assignment: readers see the old pair or the new one, never a mix
        self._current = (self._current[0] + 1, snapshot)

    # -- read by the page (any thread) --------------------------------------------------------

    def current(self) -> tuple[int, dict[str, Any]]:
        """The latest ``(version, snapshot)``; version 0 is the empty one before the first."""
        return self._current

    def dead_letters(self) -> tuple[DeadLetterNote, ...]:
        """The dead letters of the latest snapshot (with their replay refs)."""
        return self._dead_letters

    # -- helpers ----------------------------------------------------------------------------

    def _episode(self, facts: EngineFacts) -> None:
        """Throttle episodes as seen at publish times (a few a second): an episode
        shorter than that may show as a new count without a period of its own."""
        wall = time.time()
        open_ = bool(self._episodes) and self._episodes[-1][1] is None
        if facts.throttle_episodes > self._episodes_seen:
            self._episodes_seen = facts.throttle_episodes
            if not open_:
                self._episodes.append([wall, None if facts.throttled else wall])
                return
        if facts.throttled and not open_:
            self._episodes.append([wall, None])
        elif not facts.throttled and open_:
            self._episodes[-1][1] = wall

    def _sample(self, now: float, facts: EngineFacts) -> None:
        r = self.report
        totals = (now, r.pulled, r.acked, r.nacked, r.dead_lettered, facts.throttle_episodes)
        last = self._last_sample
        if last is None:
            self._last_sample = totals
            return
        dt = now - last[0]
        if dt < 1.0:
            return
        rates = [round((totals[i] - last[i]) / dt, 2) for i in range(1, 5)]
        throttled = self._throttled_since_sample or totals[5] > last[5]
        self._history.append(
            (
                round(time.time(), 2),
                *rates,
                facts.in_flight,
                facts.max_inflight,
                1 if throttled else 0,
                _round(_percentile(self._batch_since, 0.5)),
                _round(_percentile(self._batch_since, 0.99)),
                _round(_percentile(self._lat_since, 0.5)),
                _round(_percentile(self._lat_since, 0.99)),
            )
        )
        self._last_sample = totals
        self._throttled_since_sample = facts.throttled
        self._batch_since.clear()
        self._lat_since.clear()

    _COLUMNS = (
        "t",
        "pulled",
        "acked",
        "nacked",
        "dead_lettered",
        "in_flight",
        "max_inflight",
        "throttled",
        "batch_p50_s",
        "batch_p99_s",
        "ack_p50_s",
        "ack_p99_s",
    )

    def _history_columns(self) -> dict[str, list[Any]]:
        cols: dict[str, list[Any]] = {c: [] for c in self._COLUMNS}
        for sample in self._history:
            for c, v in zip(self._COLUMNS, sample, strict=True):
                cols[c].append(v)
        return cols
