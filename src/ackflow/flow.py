"""The Flow DSL: an immutable plan of named steps from one source to one sink.

A flow is built by chaining operators; each returns a new :class:`Flow`, so a
flow can be shared and extended safely. Nothing runs until :func:`ackflow.run`.

>>> from ackflow.testing import ListSource
>>> from ackflow.sinks import MemorySink
>>> flow = (Flow(ListSource([b'{"qty": 2}']))
...         .map(lambda r: {**r, "qty": r["qty"] * 10}, name="scale")
...         .filter(lambda r: r["qty"] > 0, name="positive")
...         .to(MemorySink()))
>>> [s.name for s in flow.steps]
['scale', 'positive']

Lineage and outcome rules (the same for every operator, enforced by the compiler
and the ledger, not by each step):

* ``map`` / ``with_columns``: a row keeps its message's id; an error in the row
  fails that message;
* ``filter``: a dropped row emits nothing; a message all of whose rows were
  dropped is acked;
* ``flat_map``: each child keeps its parent's id; the message is acked only if
  every child was written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ackflow.core.errors import ConfigError
from ackflow.sinks.base import Sink
from ackflow.sources.base import Source

Row = dict[str, Any]
SchemaLike = str | Any  # a DDL string ("a INT, b STRING"), a StructType or a pyarrow schema


def is_column(obj: object) -> bool:
    """True for a Spark ``Column`` (checked without importing pyspark)."""
    return any(c.__name__ == "Column" and c.__module__.startswith("pyspark") for c in type(obj).__mro__)


@dataclass(frozen=True)
class Step:
    """One named step of a flow."""

    name: str

    @property
    def kind(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Map(Step):
    fn: Callable[[Row], Row]
    schema: SchemaLike | None = None
    schema_mode: str | None = None  # evolve, rescue or freeze; None: the run's


@dataclass(frozen=True)
class Filter(Step):
    fn: Callable[[Row], bool]


@dataclass(frozen=True)
class FlatMap(Step):
    fn: Callable[[Row], Iterable[Row]]
    schema: SchemaLike | None = None
    schema_mode: str | None = None


@dataclass(frozen=True)
class ColumnFilter(Step):
    condition: Any  # pyspark Column


@dataclass(frozen=True)
class WithColumns(Step):
    columns: tuple[tuple[str, Any], ...]  # (name, pyspark Column)


@dataclass(frozen=True)
class GroupBy(Step):
    keys: tuple[str, ...]
    aggs: tuple[Any, ...]  # pyspark Columns or SQL strings ("sum(qty) AS qty")


@dataclass(frozen=True)
class Join(Step):
    other: Any  # a static pyspark DataFrame
    on: tuple[str, ...]
    how: str


@dataclass(frozen=True)
class Transform(Step):
    fn: Callable[[Any], Any]  # DataFrame -> DataFrame


@dataclass(frozen=True)
class GroupedWithin(Step):
    n: int
    timeout_s: float
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Fork(Step):
    """The end of a flow that broadcasts to sub-flows: each branch has steps and a sink."""

    branches: tuple[Flow, ...]


PYTHON_STEPS = (Map, Filter, FlatMap)
JOIN_HOWS = ("inner", "left", "left_semi", "left_anti")


@dataclass(frozen=True)
class Flow:
    """A plan: a source, named steps, and (once :meth:`to` was called) a sink."""

    source: Source
    steps: tuple[Step, ...] = ()
    sink: Sink | None = None
    error_sink: Sink | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, Source):
            raise ConfigError(
                f"Flow(source): expected an ackflow Source, got {type(self.source).__name__}"
                + (" (a DataFrame is not a source; use a Source)" if _is_dataframe(self.source) else "")
            )

    # -- building ------------------------------------------------------------------------

    @property
    def forked(self) -> Fork | None:
        return self.steps[-1] if self.steps and isinstance(self.steps[-1], Fork) else None

    @property
    def all_steps(self) -> list[Step]:
        """Every step, a broadcast's branches' steps after the flow's own (the fork too)."""
        return [*self.steps, *(s for b in getattr(self.forked, "branches", ()) for s in b.steps)]

    @property
    def sinks(self) -> list[Sink]:
        """Every sink the flow writes to (one, or one per broadcast branch)."""
        if (fork := self.forked) is not None:
            return [s for b in fork.branches for s in b.sinks]
        return [self.sink] if self.sink is not None else []

    def _add(self, step: Step) -> Flow:
        if self.sink is not None:
            raise ConfigError(f"step {step.name!r}: the flow already ends in sink {self.sink.name!r}")
        if self.forked is not None:
            raise ConfigError(f"step {step.name!r}: the flow already ends in a broadcast")
        if any(s.name == step.name for s in self.steps):
            raise ConfigError(f"step name {step.name!r} is used twice; step names must be unique")
        return dataclasses.replace(self, steps=(*self.steps, step))

    def _name(self, name: str | None, kind: str) -> str:
        if name is None:
            return f"{kind}_{len(self.steps) + 1}"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{kind}: name must be a non-empty string")
        return name

    def map(
        self,
        fn: Callable[[Row], Row],
        *,
        name: str | None = None,
        schema: SchemaLike | None = None,
        schema_mode: str | None = None,
    ) -> Flow:
        """Replace each row by ``fn(row)`` (a dict), in plain Python on the executors.

        The output columns are inferred from the rows (or given by ``schema``), kept
        in the run's schema store and evolved when rows bring new fields, by the run's
        schema mode or this step's ``schema_mode`` (``evolve``, ``rescue``, ``freeze``;
        see :mod:`ackflow.core.schema`). An exception fails only the message the row
        came from.

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src, sink = ListSource(['{"n": 1}', '{"n": 0}']), MemorySink()
        >>> report = ackflow.run(Flow(src).map(lambda r: {"inv": 10 // r["n"]}, name="inv")
        ...                      .to(sink), master="local[2]", until_idle=0.2)
        >>> sink.rows, src.final()
        ([{'inv': 10}], {'m0': 'acked', 'm1': 'dead_lettered'})
        >>> src.failures["m1"].step, src.failures["m1"].error.split(":")[0]
        ('inv', 'ZeroDivisionError')
        """
        _check_callable(fn, "map", name)
        return self._add(
            Map(self._name(name, "map"), fn, schema, _schema_mode(schema_mode, schema, name or "map"))
        )

    def filter(self, predicate: Callable[[Row], bool] | Any, *, name: str | None = None) -> Flow:
        """Keep rows for which ``predicate`` holds: a Python function, a Spark Column,
        or a Spark SQL expression string (``"qty > 0"``).

        A message whose rows are all dropped is acked (it was handled on purpose).

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src, sink = ListSource(['{"n": 1}', '{"n": 2}', '{"n": 3}']), MemorySink()
        >>> report = ackflow.run(Flow(src).filter(lambda r: r["n"] != 2).filter("n < 3")
        ...                      .to(sink), master="local[2]", until_idle=0.2)
        >>> sink.rows, report.acked
        ([{'n': 1}], 3)
        """
        step_name = self._name(name, "filter")
        if is_column(predicate) or isinstance(predicate, str):
            return self._add(ColumnFilter(step_name, predicate))
        _check_callable(predicate, "filter", name)
        return self._add(Filter(step_name, predicate))

    def flat_map(
        self,
        fn: Callable[[Row], Iterable[Row]],
        *,
        name: str | None = None,
        schema: SchemaLike | None = None,
        schema_mode: str | None = None,
    ) -> Flow:
        """Replace each row by the rows ``fn(row)`` yields (zero or more).

        Each child keeps its parent's message id: the message is acked only when
        every child was written; a message with no children is acked.

        >>> import ackflow
        >>> from ackflow.testing import FailingSink, ListSource
        >>> src = ListSource(['{"k": 2}', '{"k": 3}', '{"k": 0}'])
        >>> sink = FailingSink(fail_if=lambda r: r["i"] == 2)  # refuses one child of m1
        >>> report = ackflow.run(Flow(src).flat_map(lambda r: [{"i": i} for i in range(r["k"])])
        ...                      .to(sink), master="local[2]", until_idle=0.2)
        >>> sorted(src.final().items())
        [('m0', 'acked'), ('m1', 'dead_lettered'), ('m2', 'acked')]
        """
        _check_callable(fn, "flat_map", name)
        return self._add(
            FlatMap(
                self._name(name, "flat_map"),
                fn,
                schema,
                _schema_mode(schema_mode, schema, name or "flat_map"),
            )
        )

    def with_columns(
        self, columns: Mapping[str, Any] | None = None, /, *, name: str | None = None, **kw: Any
    ) -> Flow:
        """Add or replace columns with Spark Column expressions, evaluated in Spark.

        ``flow.with_columns(total=F.col("qty") * F.col("price"))`` (Columns need a
        SparkSession: create it first with :func:`ackflow.session`), or with SQL
        strings, which need none: ``flow.with_columns(total="qty * price")``. With ANSI mode on,
        a row whose expression fails (a bad cast) fails the whole Spark job; the
        engine then bisects the batch so that only that row's message fails.

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src, sink = ListSource(['{"qty": 2, "price": 1.5}']), MemorySink()
        >>> report = ackflow.run(Flow(src).with_columns(total="qty * price").to(sink),
        ...                      master="local[2]", until_idle=0.2)
        >>> sink.rows
        [{'qty': 2, 'price': 1.5, 'total': 3.0}]
        """
        merged = {**(columns or {}), **kw}
        step_name = self._name(name, "with_columns")
        if not merged:
            raise ConfigError(f"step {step_name!r}: with_columns needs at least one column")
        for col, expr in merged.items():
            if not (is_column(expr) or isinstance(expr, str)):
                raise ConfigError(
                    f"step {step_name!r}: column {col!r} must be a Spark Column expression "
                    f"or a SQL expression string, got {type(expr).__name__}; use map() for Python"
                )
            if col.startswith("__af_"):
                raise ConfigError(f"step {step_name!r}: column names starting with __af_ are reserved")
        return self._add(WithColumns(step_name, tuple(merged.items())))

    def group_by(self, *keys: str) -> GroupedFlow:
        """Group the rows of each batch by ``keys``; finish with ``.agg(...)``.

        An output row carries the ids of every message that had a row in the group:
        if writing it fails, every member fails; a member is acked only when all its
        groups (and other rows) were written. Groups never span batches.
        """
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise ConfigError("group_by: give one or more column names")
        return GroupedFlow(self, tuple(keys))

    def grouped_within(self, n: int, timeout_s: float, *keys: str, name: str | None = None) -> Flow:
        """Gather rows across batches into groups of up to ``n`` rows (per value of
        ``keys``, or all together), each emitted at most ``timeout_s`` seconds after its
        first row arrived.

        Downstream steps see one row per group: the key columns, ``count`` and ``rows``
        (the list of the group's rows). The messages of the rows stay unsettled, and
        count against ``max_inflight``, until every group they have a row in was
        written; then they are acked (or, if one of those groups failed, failed). The
        timer flushes partial groups, so a full window cannot deadlock the pipeline.
        One ``grouped_within`` per flow.

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src = ListSource(['{"k": "a", "v": 1}', '{"k": "a", "v": 2}', '{"k": "b", "v": 3}'])
        >>> sink = MemorySink()
        >>> flow = (Flow(src).grouped_within(2, 0.5, "k")
        ...         .map(lambda g: {"k": g["k"], "total": sum(r["v"] for r in g["rows"])}, name="sum")
        ...         .to(sink))
        >>> report = ackflow.run(flow, master="local[2]", until_idle=0.2)
        >>> sorted((r["k"], r["total"]) for r in sink.rows), report.acked
        ([('a', 3), ('b', 3)], 3)
        """
        step_name = self._name(name, "grouped_within")
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"step {step_name!r}: n must be a positive integer, got {n!r}")
        if not timeout_s > 0:
            raise ConfigError(f"step {step_name!r}: timeout_s must be positive")
        if any(isinstance(s, GroupedWithin) for s in self.steps):
            raise ConfigError(f"step {step_name!r}: only one grouped_within per flow")
        if not all(isinstance(k, str) and k for k in keys):
            raise ConfigError(f"step {step_name!r}: keys must be column names")
        return self._add(GroupedWithin(step_name, n, float(timeout_s), tuple(keys)))

    def window(self, kind: Any, *, aggs: Any, name: str | None = None, **options: Any) -> Any:
        """Aggregate rows over event-time windows kept in durable state; end with ``.to(sink)``.

        ``kind`` is :func:`~ackflow.windows.tumbling`, :func:`~ackflow.windows.hopping`,
        :func:`~ackflow.windows.session` or :func:`~ackflow.windows.count_window`;
        ``aggs`` aggregates from :mod:`ackflow.windows`. Options: ``by`` (key columns),
        ``time`` (the event time: a column or a Spark Column; timestamps, epoch seconds
        or ISO text), ``lateness`` (how far behind the largest event time the watermark
        trails), ``output`` (``"final"``: once, when the watermark passes the window's
        end; ``"update"``: after each batch that changed it), ``on_late`` (a sink for
        rows below the watermark; without it they fail their message as ``late``),
        ``idle`` (no batch for this long: every open window closes, as if the watermark
        passed them; default 60 s), ``remember`` (how long applied row keys are kept against
        redelivery; default 1 hour), ``state`` (``windows.PostgresState(dsn)`` keeps the
        state on a PostgreSQL server; default: a SQLite file beside the run's state). A
        message is acked once its rows are committed in the state store. See the windows
        page of the docs.

        >>> import ackflow, tempfile
        >>> from ackflow import windows as w
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src = ListSource(['{"k": "a", "t": 0.1, "v": 2}', '{"k": "a", "t": 0.7, "v": 3}',
        ...                   '{"k": "a", "t": 1.2, "v": 4}'])
        >>> out = MemorySink()
        >>> flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", idle=0.2,
        ...                         aggs=[w.sum_("v").alias("total"), w.count()]).to(out)
        >>> report = ackflow.run(flow, master="local[2]", until_idle=1.5,
        ...                      state_dir=tempfile.mkdtemp())
        >>> sorted((r["window_start"].second, r["total"], r["count"]) for r in out.rows)
        [(0, 5, 2), (1, 4, 1)]
        """
        from ackflow.state.spec import window_flow

        return window_flow(self, kind, aggs=aggs, name=name, **options)

    def dedupe(
        self,
        by: str | Iterable[str],
        *,
        within: Any,
        time: Any = None,
        remember: Any = 3600,
        state: Any = None,
        name: str | None = None,
    ) -> Any:
        """Drop repeats of a business key inside a horizon; end with ``.to(sink)``.

        The first row of each value of ``by`` goes to the sink; a row with that value
        less than ``within`` from a first (either side, by ``time``: an event time
        column or Spark Column; without it by the wall clock, from the first's commit,
        ``within`` at least 10 s) is dropped and its message acked (the metric
        ``ackflow_dedupe_dropped_total`` counts it); a row ``within`` or more from
        every first is a first again. The first rows are kept in durable state (a SQLite
        file beside the run's state, or ``state=windows.PostgresState(dsn)``), claimed
        before the sink writes and committed with it: a crash or a redelivery never
        lets two rows of one key through, nor drops a row whose first was never
        written. A claim is kept until it is ``within`` behind the newest and at least
        ``remember`` old (wall clock; default one hour): a repeat that comes later than
        both (a very late row) is written as a first. See the dedupe section of the
        windows page.

        >>> import ackflow, tempfile
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src = ListSource(['{"order": "o1", "n": 1}', '{"order": "o2", "n": 2}',
        ...                   '{"order": "o1", "n": 3}'])
        >>> out = MemorySink()
        >>> flow = Flow(src).dedupe("order", within="1h").to(out)
        >>> report = ackflow.run(flow, master="local[2]", until_idle=0.5,
        ...                      state_dir=tempfile.mkdtemp())
        >>> sorted(r["order"] for r in out.rows), report.acked
        (['o1', 'o2'], 3)
        """
        from ackflow.state.dedupe import dedupe_flow

        return dedupe_flow(self, by, within=within, time=time, remember=remember, state=state, name=name)

    def join(
        self, other: Any, on: str | Iterable[str], how: str = "inner", *, name: str | None = None
    ) -> Flow:
        """Join each row with a static DataFrame (a lookup table) on column names.

        The stream side keeps its message ids; a row with several matches becomes
        several rows (like ``flat_map``). With ``how="inner"`` (or ``"left_semi"``) a
        row without a match is dropped *like a filter*: its message is acked if it has
        no other rows. ``"left"`` keeps it with nulls; ``"left_anti"`` keeps only rows
        without a match. Joins that would fabricate rows without a source message
        (right, full) are refused.

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> spark = ackflow.session("local[2]")
        >>> names = spark.createDataFrame([(1, "one")], "k BIGINT, name STRING")
        >>> src, sink = ListSource(['{"k": 1}', '{"k": 7}']), MemorySink()
        >>> report = ackflow.run(Flow(src).join(names, "k").to(sink), spark=spark, until_idle=0.2)
        >>> sink.rows, report.acked  # k=7 had no match: dropped like a filter, acked
        ([{'k': 1, 'name': 'one'}], 2)
        """
        step_name = self._name(name, "join")
        if not _is_dataframe(other):
            raise ConfigError(
                f"step {step_name!r}: join needs a static Spark DataFrame, got {type(other).__name__}"
            )
        if how not in JOIN_HOWS:
            raise ConfigError(
                f"step {step_name!r}: how={how!r} is not supported; use one of "
                f"{', '.join(JOIN_HOWS)} (a right or full join would emit rows "
                "that no source message can be acked for)"
            )
        cols = (on,) if isinstance(on, str) else tuple(on)
        if not cols or not all(isinstance(c, str) for c in cols):
            raise ConfigError(f"step {step_name!r}: on= must name one or more columns")
        return self._add(Join(step_name, other, cols, how))

    def transform(self, fn: Callable[[Any], Any], *, name: str | None = None) -> Flow:
        """The escape hatch: ``fn`` takes the batch's DataFrame and returns one.

        The DataFrame carries ackflow's internal ``__af_*`` columns (the lineage ids
        and the row status); ``fn`` must keep them. A DataFrame that lost them fails
        the flow with an error naming the step, and receipts for ids that no message
        of the batch has fail the batch: never an ack. Rows that ``fn`` removes lose
        their lineage, so their messages are nacked; use :meth:`filter` to drop rows.

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src, sink = ListSource(['{"a": 1}']), MemorySink()
        >>> flow = Flow(src).transform(lambda df: df.withColumn("b", df["a"] + 1)).to(sink)
        >>> report = ackflow.run(flow, master="local[2]", until_idle=0.2)
        >>> sink.rows
        [{'a': 1, 'b': 2}]
        """
        _check_callable(fn, "transform", name)
        return self._add(Transform(self._name(name, "transform"), fn))

    def broadcast(
        self,
        *branches: Sink | Flow,
        mode: str = "all",
        fallback: Iterable[Sink] = (),
        name: str = "broadcast",
    ) -> Flow:
        """End the flow in several sinks at once (see :class:`ackflow.sinks.Broadcast`),
        or in several sub-flows: ``ackflow.branch().map(...).to(sink)`` (mode ``all``;
        the shared part is computed once per batch and cached while the branches run).

        ``mode="all"``: a message is acked when every branch wrote all its rows.
        ``mode="primary", fallback=[...]``: acked when the primary wrote them, or a
        fallback did after the primary failed. Failures name the branch.

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import FailingSink, ListSource
        >>> src = ListSource(['{"n": 1}', '{"n": 2}'])
        >>> flow = Flow(src).broadcast(MemorySink("a"), FailingSink(fail_if=lambda r: r["n"] == 2))
        >>> report = ackflow.run(flow, master="local[2]", until_idle=0.2)
        >>> src.final(), src.failures["m1"].step
        ({'m0': 'acked', 'm1': 'dead_lettered'}, 'failing')
        """
        from ackflow.sinks.broadcast import Broadcast

        sinks = [b for b in branches if isinstance(b, Sink)]
        if len(sinks) == len(branches):
            return self.to(Broadcast(*sinks, mode=mode, fallback=tuple(fallback), name=name))
        if mode != "all" or tuple(fallback):
            raise ConfigError("broadcast: sub-flow branches need mode='all' (fallbacks are for sinks)")
        subflows: list[Flow] = []
        for b in branches:
            if isinstance(b, Sink):
                b = branch().to(b)
            if not isinstance(b, Flow) or not isinstance(b.source, _BranchSource):
                raise ConfigError(
                    f"broadcast: a branch is a sink or ackflow.branch()...to(sink), got {type(b).__name__}"
                )
            if b.sink is None or b.forked is not None:
                raise ConfigError("broadcast: each branch must end in one sink (.to(sink))")
            if any(isinstance(s, GroupedWithin) for s in b.steps):
                raise ConfigError("broadcast: grouped_within cannot be inside a branch")
            subflows.append(b)
        return self._add(Fork(name, tuple(subflows)))

    def on_error(self, sink: Sink) -> Flow:
        """Dead-letter failed messages to ``sink`` instead of the source's own dead letters.

        When the source's retry policy gives a message up, a row with its ``message``
        key, ``body``, ``headers`` (JSON), the failing ``step``, the ``error``, its
        ``deliveries`` and ``failed_at`` is written to ``sink`` (on the driver) and only
        then is the message settled at the source. If that write fails, the message is
        nacked and retried later: it is never dropped. A PostgreSQL error sink keeps
        ``body`` as text (the bytes in ``body_bytes`` where it is not UTF-8) and
        ``failed_at`` as ``timestamptz``; other sinks keep the bytes and epoch seconds
        (docs/tools.md lists the columns).

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src, dlq = ListSource(['not json']), MemorySink("dlq")
        >>> report = ackflow.run(Flow(src).to(MemorySink()).on_error(dlq), master="local[2]",
        ...                      until_idle=0.2)
        >>> [(r["message"], r["step"], r["body"]) for r in dlq.rows], src.final()
        ([('m0', 'decode', b'not json')], {'m0': 'acked'})
        """
        if not isinstance(sink, Sink):
            raise ConfigError(f"on_error(): expected an ackflow Sink, got {type(sink).__name__}")
        return dataclasses.replace(self, error_sink=sink)

    def merge(self, *others: Flow) -> Flow:
        """Read from this flow's source and the others' at once (see :func:`merge`)."""
        return merge(self, *others)

    def to(self, sink: Sink) -> Flow:
        """End the flow in ``sink``. Returns the complete flow, ready for :func:`ackflow.run`."""
        if not isinstance(sink, Sink):
            raise ConfigError(
                f"to(): expected an ackflow Sink, got {type(sink).__name__}"
                + ("; a Spark writer cannot ack: use ackflow.sinks" if _is_dataframe(sink) else "")
            )
        if self.sink is not None or self.forked is not None:
            raise ConfigError("the flow already ends in a sink or a broadcast")
        return dataclasses.replace(self, sink=sink)

    def validate(self) -> None:
        """Raise :class:`ConfigError` if the flow cannot run (no sink, name clashes)."""
        if not self.sinks:
            raise ConfigError("the flow has no sink: end it with .to(sink)")
        names = [s.name for s in self.all_steps] + [s.name for s in self.sinks]
        if self.error_sink is not None:  # its rows are counted by name too
            names.append(self.error_sink.name)
        from ackflow.state.dedupe import DedupeSink

        if any(isinstance(s, GroupedWithin) for s in self.steps) and any(
            isinstance(s, DedupeSink) for s in self.sinks
        ):
            raise ConfigError(
                "dedupe after grouped_within is not built (its rows are groups of several "
                "messages): dedupe before the grouped_within, or group after"
            )
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(
                f"names {dupes} are used more than once (steps, branches, "
                "sinks and the error sink need distinct names: rows are "
                "counted by name; pass name=...)"
            )


class _BranchSource(Source):
    """Stands for "the stream being broadcast" in a branch built with :func:`branch`."""

    name = "branch"

    def pull(self, max_messages: int, timeout: float) -> list[Any]:
        raise ConfigError("a branch has no source of its own: use it in Flow.broadcast()")

    ack = fail = nack = release = pull  # type: ignore[assignment]


def branch() -> Flow:
    """Start a sub-flow for :meth:`Flow.broadcast`: ``branch().map(f).to(sink)``.

    >>> import ackflow
    >>> from ackflow.sinks import MemorySink
    >>> from ackflow.testing import ListSource
    >>> src, raw, doubled = ListSource(['{"n": 1}', '{"n": 2}']), MemorySink("raw"), MemorySink("x2")
    >>> flow = Flow(src).broadcast(raw, branch().map(lambda r: {"n": r["n"] * 2}, name="x2f").to(doubled))
    >>> report = ackflow.run(flow, master="local[2]", until_idle=0.2)
    >>> sorted(r["n"] for r in raw.rows), sorted(r["n"] for r in doubled.rows), report.acked
    ([1, 2], [2, 4], 2)
    """
    return Flow(_BranchSource())


def merge(*flows: Flow) -> Flow:
    """One flow over several sources: ``merge(Flow(a), Flow(b)).map(...).to(sink)``.

    Lineage ids are unique across the sources, and every message is settled at its
    own source with that source's retry policy. Merge before adding steps: each
    source may have its own format, and the steps then see all messages.

    >>> import ackflow
    >>> from ackflow.sinks import MemorySink
    >>> from ackflow.testing import ListSource
    >>> a, b = ListSource(['{"x": 1}'], name="a"), ListSource(['hi'], format="text", name="b")
    >>> sink = MemorySink()
    >>> report = ackflow.run(merge(Flow(a), Flow(b)).to(sink), master="local[2]", until_idle=0.2)
    >>> report.acked, a.final(), b.final()
    (2, {'m0': 'acked'}, {'m0': 'acked'})
    """
    from ackflow.sources.merge import MergedSource

    if len(flows) < 2 or not all(isinstance(f, Flow) for f in flows):
        raise ConfigError("merge: give two or more flows")
    for f in flows:
        if f.steps or f.sink is not None or f.error_sink is not None:
            raise ConfigError(
                "merge: merge flows that have only a source, then add steps and the sink to the merged flow"
            )
    sources: list[Source] = []
    for f in flows:
        inner = f.source.sources if isinstance(f.source, MergedSource) else (f.source,)
        sources.extend(inner)
    return Flow(MergedSource(*sources))


@dataclass(frozen=True)
class GroupedFlow:
    """A flow waiting for its aggregation: ``flow.group_by("k").agg(...)``."""

    flow: Flow
    keys: tuple[str, ...]

    def agg(self, *aggs: Any, name: str | None = None) -> Flow:
        """Aggregate each group with Spark aggregate Columns or SQL strings.

        ``flow.group_by("sku").agg(F.sum("qty").alias("qty"), "count(*) AS n")``

        >>> import ackflow
        >>> from ackflow.sinks import MemorySink
        >>> from ackflow.testing import ListSource
        >>> src = ListSource(['{"k": "a", "v": 1}', '{"k": "a", "v": 2}', '{"k": "b", "v": 5}'])
        >>> sink = MemorySink()
        >>> flow = Flow(src).group_by("k").agg("sum(v) AS total").to(sink)
        >>> report = ackflow.run(flow, master="local[2]", until_idle=0.2)
        >>> sorted((r["k"], r["total"]) for r in sink.rows), report.acked
        ([('a', 3), ('b', 5)], 3)
        """
        step_name = self.flow._name(name, "group_by")
        if not aggs:
            raise ConfigError(f"step {step_name!r}: agg needs at least one aggregate")
        for a in aggs:
            if not (is_column(a) or isinstance(a, str)):
                raise ConfigError(
                    f"step {step_name!r}: aggregates must be Spark Columns or "
                    f"SQL strings, got {type(a).__name__}"
                )
        return self.flow._add(GroupBy(step_name, self.keys, tuple(aggs)))


def _check_callable(fn: object, kind: str, name: str | None) -> None:
    if is_column(fn):
        raise ConfigError(f"{kind} {name or ''}: expected a Python function, got a Spark Column")
    if not callable(fn):
        raise ConfigError(f"{kind} {name or ''}: expected a function, got {type(fn).__name__}")


def _is_dataframe(obj: object) -> bool:
    return any(c.__name__ == "DataFrame" for c in type(obj).__mro__)


def _schema_mode(mode: str | None, schema: object, step: str) -> str | None:
    """A step's ``schema_mode=`` checked: one of the modes, and not with ``schema=``."""
    if mode is None:
        return None
    from ackflow.core.schema import check_mode

    check_mode(mode, f"step {step!r}: schema_mode")
    if schema is not None:
        raise ConfigError(
            f"step {step!r}: schema_mode= applies to columns inferred from "
            "data; with schema= the step's columns are the ones given"
        )
    return mode
