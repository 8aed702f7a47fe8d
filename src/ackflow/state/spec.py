"""A window operator's configuration, checked when the flow is built (:meth:`Flow.window`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ackflow.core.errors import ConfigError
from ackflow.sinks.base import Sink
from ackflow.windows import Aggregate, Count, Hopping, Kind, Session, Tumbling, _is_column, duration_us

if TYPE_CHECKING:
    from ackflow.flow import Flow

OUTPUTS = ("final", "update")


@dataclass(frozen=True)
class WindowSpec:
    """What a window operator computes; every column is a name (Spark Column inputs
    were given hidden names by :func:`window_flow`)."""

    name: str
    kind: Kind
    by: tuple[str, ...]
    aggs: tuple[Aggregate, ...]
    time: str | None
    lateness_us: int
    output: str
    idle_us: int
    remember_us: int
    state: Any = None  # a PostgresState, or None: the SQLite file beside the run's state

    @property
    def columns(self) -> list[str]:
        """The input columns the window reads."""
        cols = [*([self.time] if self.time else []), *self.by]
        return cols + [a.column for a in self.aggs if a.column is not None and a.column not in cols]

    @property
    def out_names(self) -> list[str]:
        window = ["window_index"] if isinstance(self.kind, Count) else ["window_start", "window_end"]
        return [*self.by, *window, *[a.name for a in self.aggs]]


def check_columns(op: str, schema: Any, columns: list[str], keys: tuple[str, ...], what: str) -> None:
    """A stateful operator's ``prepare``: its ``columns`` are among the flow's (a
    FlowError naming the operator otherwise). A key column of a nested type (a list, an
    object) is the data's, not the flow's: a batch whose first message had a list there
    makes one, and the rows holding such a value fail alone, in the fold (``what`` names
    the key in their error), never the run."""
    from ackflow.core.errors import FlowError

    missing = [c for c in columns if c not in schema.names]
    if missing:
        nested = next((c for c in missing if "." in c and c.split(".", 1)[0] in schema.names), None)
        hint = ""
        if nested is not None:  # a field inside a struct: give it a column of its own first
            name = nested.replace(".", "_")
            hint = f"; a nested field needs a column of its own first: .with_columns({name}={nested!r})"
        have = list(schema.names)
        raise FlowError(op, f"column(s) {missing} are not among the flow's columns {have}{hint}")


@dataclass(frozen=True)
class WindowedFlow:
    """A flow whose rows go into a window: end it with ``.to(sink)``, the sink its
    results are written to (a keyed sink: each window's row has a stable key)."""

    flow: Flow
    spec: WindowSpec
    on_late: Sink | None

    def to(self, sink: Sink) -> Flow:
        from ackflow.state.window_sink import WindowSink

        if not isinstance(sink, Sink):
            raise ConfigError(
                f"window {self.spec.name!r}: .to() needs an ackflow Sink, got {type(sink).__name__}"
            )
        return self.flow.to(WindowSink(self.spec, sink, self.on_late))


def window_flow(
    flow: Flow,
    kind: Any,
    *,
    aggs: Any,
    by: Any = (),
    time: Any = None,
    lateness: Any = 0,
    output: str = "final",
    on_late: Sink | None = None,
    idle: Any = 60,
    remember: Any = 3600,
    state: Any = None,
    name: str | None = None,
) -> WindowedFlow:
    """Check :meth:`Flow.window`'s arguments; Spark Column inputs become hidden
    columns of a ``with_columns`` step (``<name>.inputs``) before the window."""
    op = flow._name(name, "window")
    if not isinstance(kind, (Tumbling, Hopping, Session, Count)):
        raise ConfigError(
            f"window {op!r}: the first argument is a window: tumbling(...), hopping(...), "
            f"session(...) or count_window(n); got {type(kind).__name__}"
        )
    by_t = (by,) if isinstance(by, str) else tuple(by)
    if not all(isinstance(k, str) and k for k in by_t):
        raise ConfigError(f"window {op!r}: by= takes column names")
    agg_t = (aggs,) if isinstance(aggs, Aggregate) else tuple(aggs)
    if not agg_t or not all(isinstance(a, Aggregate) for a in agg_t):
        raise ConfigError(
            f"window {op!r}: aggs= takes aggregates from ackflow.windows (count(), sum_('x'), ...)"
        )
    if output not in OUTPUTS:
        raise ConfigError(f"window {op!r}: output must be 'final' or 'update', got {output!r}")
    if output == "update" and isinstance(kind, Session):
        raise ConfigError(
            f"window {op!r}: session windows are written once, when they close (output='final'): "
            "a session's start moves when two of them merge, so an updated row would be left behind"
        )
    if time is None and not isinstance(kind, Count):
        raise ConfigError(f"window {op!r}: time= (the event time column) is needed for time windows")
    from ackflow.state.pg import PostgresState

    if state is not None and not isinstance(state, PostgresState):
        raise ConfigError(
            f"window {op!r}: state= takes a PostgresState (or None: a file beside the run's state)"
        )
    if on_late is not None and not isinstance(on_late, Sink):
        raise ConfigError(f"window {op!r}: on_late= takes an ackflow Sink")
    hidden: dict[str, Any] = {}
    if time is not None and not isinstance(time, str):
        if not _is_column(time):
            raise ConfigError(f"window {op!r}: time= takes a column name or a Spark Column")
        hidden[f"_{op}_time"] = time
        time = f"_{op}_time"
    resolved = []
    for a in agg_t:
        if a.column is not None and not isinstance(a.column, str):
            col = f"_{op}_{a.name}"
            hidden[col] = a.column
            a = dataclasses.replace(a, column=col)
        resolved.append(a)
    names = [*by_t, *WindowSpec(op, kind, by_t, (), None, 0, output, 0, 0).out_names[len(by_t) :]]
    names += [a.name for a in resolved]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"window {op!r}: output column names {dupes} are used twice (use .alias())")
    spec = WindowSpec(
        op,
        kind,
        by_t,
        tuple(resolved),
        time,
        duration_us(lateness, f"window {op!r}: lateness"),
        output,
        duration_us(idle, f"window {op!r}: idle"),
        duration_us(remember, f"window {op!r}: remember"),
        state,
    )
    if hidden:
        flow = flow.with_columns(hidden, name=f"{op}.inputs")
    return WindowedFlow(flow, spec, on_late)
