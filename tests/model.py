"""The model-based test's parts: what hypothesis generates, how it becomes a flow, and a
plain-Python model of what must happen to every message (tests/test_model.py).

A generated example is a flow over one or two sources (merged), Python steps (map,
filter, flat_map, a step that crashes its task), optionally Column steps (a cast that
fails, group_by, join, transform, and a last step making a column of every Spark SQL type
with nulls, whose values the sinks must hold: Spark only), optionally ``grouped_within``,
and one to
three keyed sinks (broadcast ``all``, with sub-flow branches, or ``primary`` with
fallbacks) that refuse rows, raise, or fail a commit before or after applying it;
``on_error`` dead letters; retries; batch size, window and concurrency; and fault points
armed to raise (a crash: the run stops, and the next run starts from what is durable).
Messages may be repeated: a copy with the same key and body (a producer's re-send) right
after the original (in flight with it: law 12 holds it out of the batch until the
first settles, then settles it as the first) or at the end of its source (in another
batch, often after the first was settled: it runs again and must give the same rows).
Some messages have a null key: ``"n": null`` (see :func:`nv` for what that means).

The model predicts, for every message, the steps it surely fails in (``must``), the
steps it may fail in as collateral (``may``: a raising sink fails its whole partition,
and which rows share one is the executor's business), the rows it leaves in every
branch when it is acked, and the reason its dead letter must carry.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement
from ackflow.testing import KeyedSink, ListSource

ENGINE_FAULTS = (
    "batch.after_job",
    "batch.after_commit",
    "engine.mid_ack",
    "engine.before_fail",
    "engine.dead_letter_written",
    "engine.drain",
)


# -- the example -------------------------------------------------------------------------


@dataclass(frozen=True)
class Branch:
    sink: str  # "ok" | "refuse" | "raise" | "down" (raises for every partition)
    mod: int
    rest: int
    steps: tuple[tuple[str, int], ...] = ()  # sub-flow steps: ("bmap", m) | ("bfilter", m)


@dataclass(frozen=True)
class Example:
    ns: tuple[int | None, ...]  # None: a body that is not JSON
    sources: int  # 1, or 2 (merged; message i is in source i % 2)
    steps: tuple[tuple[str, int], ...]
    grouped: bool  # grouped_within(4, 0.05, "n") after the steps
    mode: str  # "all" | "primary"
    branches: tuple[Branch, ...]
    on_error: bool
    commit_faults: tuple[tuple[int, int, str], ...]  # (branch or -1 for the error sink, nth, when)
    engine_faults: tuple[tuple[str, int], ...]
    batch_size: int
    window: int
    concurrency: int
    # copies: (index in ns, "next" | "end"): the same key and body again at its source,
    # right after the original or at the end (new fields go last: pinned examples)
    repeats: tuple[tuple[int, str], ...] = ()
    null_keys: tuple[int, ...] = ()  # indices whose body is {"n": null, "c": 0}

    @property
    def transient(self) -> int:
        return len(self.commit_faults) + len(self.engine_faults)

    @property
    def max_deliveries(self) -> int:
        # room for every transient fault and crash to hit one message, and one more try
        return self.transient + 2

    def n(self, i: int) -> int | None:
        """Message ``i``'s key ``n`` (None: a null key; see :func:`nv`)."""
        return None if i in self.null_keys else self.ns[i]


def nv(x: int | None) -> int:
    """A null key (``"n": null``, or a ``c`` a group made null) as the Python steps and
    the sinks' predicates read it: 0. The row keeps its null to the sinks, which must
    hold it; Column steps follow SQL: a null never fails the cast (``(n + c) % m = 0`` is
    null, not true), never matches a join, and all null-``n`` rows form one group of
    ``group_by("n")`` and of ``grouped_within(..., "n")``, as any other value does.

    A field null in every row of the first batch is a column of the null type: steps
    see it as ``None`` whatever the batch (``test_null_column_reaches_branch_step_as_none``)."""
    return 0 if x is None else x


def layout(ex: Example) -> list[list[int]]:
    """Per source, the message index of each body in its order (copies included)."""
    per: list[list[int]] = [[] for _ in range(ex.sources)]
    for i in range(len(ex.ns)):
        per[i % ex.sources].append(i)
        per[i % ex.sources].extend(i for j, where in ex.repeats if j == i and where == "next")
    for j, where in ex.repeats:
        if where == "end":
            per[j % ex.sources].append(j)
    return per


PY_STEPS = st.one_of(
    st.tuples(st.just("map"), st.integers(2, 9)),  # fails rows with (n + c) % m == 0
    st.tuples(st.just("filter"), st.integers(2, 6)),  # drops rows with (n + c) % m == 0
    st.tuples(st.just("flat_map"), st.integers(0, 3)),  # k children, c = 0..k-1
    st.tuples(st.just("crash"), st.integers(7, 13)),  # the task dies on (n + c) % m == 0
    # adds fields that vary with n (top-level and nested): the columns evolve from batch
    # to batch; arg 2 keeps them in _rescued instead (schema mode "rescue")
    st.tuples(st.just("shape"), st.integers(0, 2)),
)
COLUMN_STEPS = st.one_of(
    st.tuples(st.just("cast"), st.integers(3, 9)),  # a failing cast: the job fails
    st.tuples(st.just("group"), st.just(0)),  # group_by n: c = min(n)
    st.tuples(st.just("join"), st.integers(2, 4)),  # inner join: keeps n % m != 0, adds tag
    st.tuples(st.just("transform"), st.just(0)),  # identity through the DataFrame hatch
)


@st.composite
def examples(draw: Any, spark: bool = False, max_messages: int = 30) -> Example:
    ns = tuple(
        draw(
            st.lists(
                st.one_of(st.integers(0, 20), st.none()) if draw(st.booleans()) else st.integers(0, 20),
                min_size=1,
                max_size=max_messages,
            )
        )
    )
    step_kinds = st.one_of(PY_STEPS, COLUMN_STEPS) if spark else PY_STEPS
    steps = tuple(draw(st.lists(step_kinds, max_size=4)))
    grouped = not spark and draw(st.integers(0, 4)) == 0
    mode = draw(st.sampled_from(["all", "all", "primary"]))
    sink_kind = st.sampled_from(["ok", "ok", "refuse", "refuse", "raise"])
    bsteps = st.lists(st.tuples(st.sampled_from(["bmap", "bfilter"]), st.integers(2, 7)), max_size=2)
    n_branches = draw(st.integers(2, 3) if mode == "primary" else st.integers(1, 3))
    branches = []
    for _ in range(n_branches):
        with_steps = mode == "all" and not grouped and draw(st.booleans())
        branches.append(
            Branch(
                draw(sink_kind),
                draw(st.integers(2, 7)),
                draw(st.integers(0, 6)),
                tuple(draw(bsteps)) if with_steps else (),
            )
        )
    on_error = draw(st.booleans())
    targets = list(range(n_branches)) + ([-1] if on_error else [])
    commit_faults = tuple(
        draw(
            st.lists(
                st.tuples(st.sampled_from(targets), st.integers(1, 4), st.sampled_from(["before", "after"])),
                max_size=2,
                unique_by=lambda f: (f[0], f[1]),
            )
        )
    )
    engine_faults = tuple(
        draw(
            st.lists(
                st.tuples(st.sampled_from(ENGINE_FAULTS), st.integers(1, 3)),
                max_size=2,
                unique_by=lambda f: f[0],
            )
        )
    )
    if spark and not any(br.steps for br in branches) and draw(st.booleans()):
        steps = (*steps, ("types", 0))  # last: later Python steps would rebuild the rows
    batch_size = draw(st.integers(1, 16))
    sources = draw(st.sampled_from([1, 1, 2]))
    window = draw(st.integers(max(batch_size, sources), 40))  # merged: a share each
    concurrency = draw(st.integers(1, 3))
    index = st.integers(0, len(ns) - 1)
    repeats = (
        tuple(draw(st.lists(st.tuples(index, st.sampled_from(["next", "end"])), max_size=3)))
        if draw(st.booleans())
        else ()
    )
    null_keys = (
        tuple(sorted({i for i in draw(st.lists(index, max_size=3)) if ns[i] is not None}))
        if draw(st.booleans())
        else ()
    )
    return Example(
        ns,
        sources,
        steps,
        grouped,
        mode,
        tuple(branches),
        on_error,
        commit_faults,
        engine_faults,
        batch_size,
        window,
        concurrency,
        repeats,
        null_keys,
    )


@st.composite
def down_examples(draw: Any, spark: bool = False) -> Example:
    """Examples whose every sink is down (raises for every partition): no commit or
    engine faults, no crash or failing-cast steps (a job that fails alike for several
    messages is itself judged systemic), no grouped_within, broadcast ``all``."""
    from dataclasses import replace

    ex = draw(examples(spark=spark, max_messages=16))
    steps = tuple(s for s in ex.steps if s[0] not in ("crash", "cast"))
    branches = tuple(Branch("down", b.mod, b.rest, b.steps) for b in ex.branches)
    return replace(
        ex, steps=steps, branches=branches, mode="all", grouped=False, commit_faults=(), engine_faults=()
    )


# -- the source: a broker that redelivers what a dead consumer held ----------------------


class ModelSource(ListSource):
    """A :class:`ListSource` that behaves like a broker across crashes: deliveries still
    unsettled when a run ended (the consumer died) come again at the next ``open()``,
    and the previous connection's late settlements are refused. It records every
    settlement per delivery and per copy (``handle``: a body's index; a re-sent message
    is a second body with the same key, counted apart as a broker counts two published
    copies), and the most messages ever outstanding."""

    def __init__(self, bodies: Sequence[str], *, window: list[int], **kw: Any) -> None:
        super().__init__(bodies, **kw)
        self.outstanding: dict[tuple[int, int], Delivery] = {}  # (index, count) -> delivery
        self.window = window  # [outstanding now over every source, the most ever]
        self.per_delivery: Counter[tuple[int, int]] = Counter()  # (handle, count)
        self.per_copy: dict[int, list[str]] = {}  # handle -> its settlements
        self.copy_deliveries: Counter[int] = Counter()
        self.epoch = 0
        self.limit = 10**9  # deliveries of one message that mean "retried forever"
        self._mine: dict[int, int] = {}  # id(delivery) -> epoch
        self._guard = threading.Lock()

    def open(self) -> int:
        self.epoch += 1
        back = list(self.outstanding.values())
        self.outstanding.clear()
        self.window[0] -= len(back)
        for d in back:
            self._ready.append(int(d.handle))  # type: ignore[call-overload]
        return len(back)

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        got = super().pull(max_messages, min(timeout, 0.005))
        for d in got:  # counted per copy (ListSource counts per key)
            d.delivery_count = self._count(int(d.handle))  # type: ignore[call-overload]
        looping = [d.key for d in got if d.delivery_count > self.limit]
        if looping:
            raise AssertionError(
                f"messages delivered more than {self.limit} times (retried "
                f"forever, never dead-lettered): {looping}"
            )
        with self._guard:
            for d in got:
                self.outstanding[(int(d.handle), d.delivery_count)] = d  # type: ignore[call-overload]
                self._mine[id(d)] = self.epoch
            self.window[0] += len(got)
            self.window[1] = max(self.window[1], self.window[0])
        return got

    def _count(self, handle: int) -> int:
        self.copy_deliveries[handle] += 1
        return self.copy_deliveries[handle]

    def _record(self, d: Delivery, what: str) -> None:
        super()._record(d, what)
        self.per_copy.setdefault(int(d.handle), []).append(what)  # type: ignore[call-overload]

    def _settled(self, d: Delivery) -> bool:
        """Record a settlement; False if the delivery is not live (a stale receipt)."""
        with self._guard:
            key = (int(d.handle), d.delivery_count)  # type: ignore[call-overload]
            if self._mine.get(id(d)) != self.epoch or key not in self.outstanding:
                return False
            del self.outstanding[key]
            self.window[0] -= 1
            self.per_delivery[(int(d.handle), d.delivery_count)] += 1  # type: ignore[call-overload]
            return True

    def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        live = [d for d in deliveries if self._settled(d)]
        super().ack(live)
        return [d for d in deliveries if d not in live]

    def fail(self, failures: Sequence[tuple[Delivery, Any]]) -> list[Settlement]:
        out = []
        for d, f in failures:
            if not self._settled(d):
                out.append(Settlement.RELEASED)
                continue
            self.failures[d.key] = f
            if self.policy.exhausted(d.delivery_count):
                self.dead_letters[d.key] = f
                self._record(d, "dead_lettered")
                out.append(Settlement.DEAD_LETTERED)
            else:
                ListSource.nack(self, [(d, f)])
                out.append(Settlement.NACKED)
        return out

    def nack(self, failures: Sequence[tuple[Delivery, Any]]) -> None:
        ListSource.nack(self, [(d, f) for d, f in failures if self._settled(d)])

    def release(self, deliveries: Sequence[Delivery]) -> None:
        """Give back; the next delivery counts anew, as a broker's redelivery does (so
        every delivery of the model keeps a number of its own)."""
        for d in deliveries:
            if self._settled(d):
                self._record(d, "released")
                self._ready.append(int(d.handle))  # type: ignore[call-overload]

    def pending(self) -> int:
        """Messages not yet finally settled (ready, delayed or outstanding)."""
        return len(self._ready) + len(self._delayed) + len(self.outstanding)


class ModelSink(KeyedSink):
    """A :class:`KeyedSink` whose rows are compared as the model compares them
    (:func:`norm`): a row written again after a restart whose columns were inferred anew
    (no ``state_dir``) may hold a field in ``_rescued`` that the first write had as a
    column (schema mode "rescue"); the values are the same."""

    def same(self, old: dict[str, Any], new: dict[str, Any]) -> bool:
        return bool(norm(old) == norm(new))


# -- the flow ----------------------------------------------------------------------------


def _sink_pred(b: Branch) -> Any:
    def pred(r: dict[str, Any], m: int = b.mod, x: int = b.rest) -> bool:
        return nv(r.get("n")) % m == x % m  # a column null in every row of a batch is absent

    return pred


def _always(r: dict[str, Any]) -> bool:
    return True


#: the "types" step: a column of every Spark SQL type, from n (nulls where n % 3 == 0)
TYPE_COLUMNS = {
    "ts": "CASE WHEN n % 3 = 0 THEN NULL ELSE timestamp_seconds(n) END",
    "ntz": "CAST(timestamp_seconds(n) AS TIMESTAMP_NTZ)",
    "day": "date_from_unix_date(CAST(n AS INT))",
    "dec": "CASE WHEN n % 3 = 0 THEN NULL ELSE CAST(n / 4 AS DECIMAL(10,2)) END",
    "bin": "CAST(CAST(n AS STRING) AS BINARY)",
    "arr": "array(n, c)",
    "mp": "map('n', n)",
    "st": "named_struct('n', n, 'at', timestamp_seconds(n))",
    "ok": "n % 2 = 0",
    "f32": "CAST(n AS FLOAT) / 2",
    "i16": "CAST(n AS SMALLINT)",
}


def type_values(n: int | None, c: int | None) -> dict[str, Any]:
    """The values of :data:`TYPE_COLUMNS` as a sink's Arrow rows give them back."""
    import datetime as dt
    from decimal import Decimal

    if n is None:  # SQL: a null in, a null out (inside arrays, maps and structs too)
        return {
            "ts": None,
            "ntz": None,
            "day": None,
            "dec": None,
            "bin": None,
            "arr": [None, c],
            "mp": [("n", None)],
            "st": {"n": None, "at": None},
            "ok": None,
            "f32": None,
            "i16": None,
        }
    at = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=n)
    return {
        "ts": None if n % 3 == 0 else at,
        "ntz": at.replace(tzinfo=None),
        "day": dt.date(1970, 1, 1) + dt.timedelta(days=n),
        "dec": None if n % 3 == 0 else Decimal(n) / 4,
        "bin": str(n).encode(),
        "arr": [n, c],
        "mp": [("n", n)],
        "st": {"n": n, "at": at},
        "ok": n % 2 == 0,
        "f32": n / 2,
        "i16": n,
    }


def shape_fields(r: dict[str, Any]) -> dict[str, Any]:
    """The fields the "shape" step adds: their names depend on n, so each batch may
    bring new ones (a top-level column, a field inside a struct)."""
    n, c = r.get("n"), r.get("c")
    return {f"x{nv(n) % 3}": n, "d": {f"k{(nv(n) + nv(c)) % 2}": c}}


def norm(row: dict[str, Any]) -> Any:
    """A row as the model compares it: ``_rescued`` put back in place at every depth (a
    ``grouped_within`` row lists its members' rows, each with its own), null fields
    dropped (a column added after the row was written reads null)."""
    from ackflow.testing import present

    def back(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: back(v) for k, v in unrescued(value).items()}
        if isinstance(value, list):
            return [back(v) for v in value]
        return value

    return present(back(row))


def unrescued(row: dict[str, Any]) -> dict[str, Any]:
    """A copy of a rescue-mode row with its ``_rescued`` JSON put back in place."""
    import copy

    row = copy.deepcopy(row)  # never the sink's own row (put() fills nested dicts)
    rescued = json.loads(row.pop("_rescued", None) or "{}")

    def put(into: dict[str, Any], extra: dict[str, Any]) -> None:
        for k, v in extra.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict):
                put(into[k], v)
            else:
                into[k] = v

    put(row, rescued)
    return row


def build(
    ex: Example, spark: Any = None
) -> tuple[ackflow.Flow, list[ModelSource], list[KeyedSink], KeyedSink | None]:
    policy = RetryPolicy(max_deliveries=ex.max_deliveries, backoff_s=0)
    window = [0, 0]
    sources = []
    for k, order in enumerate(layout(ex)):
        keys = [f"m{i // ex.sources}" for i in order]  # a copy has its original's key
        bodies = ["{bad" if ex.ns[i] is None else json.dumps({"n": ex.n(i), "c": 0}) for i in order]
        sources.append(ModelSource(bodies, policy=policy, name=f"src{k}", window=window, keys=keys))
    flow = ackflow.Flow(sources[0]) if ex.sources == 1 else ackflow.merge(*(ackflow.Flow(s) for s in sources))
    for k, (kind, arg) in enumerate(ex.steps):
        flow = _add_step(flow, f"s{k}", kind, arg, spark)
    if ex.grouped:
        flow = flow.grouped_within(4, 0.05, "n", name="gw")
    commit_faults: dict[int, dict[int, str]] = {}
    for target, nth, when in ex.commit_faults:
        commit_faults.setdefault(target, {})[nth] = when
    sinks = []
    for b, br in enumerate(ex.branches):
        pred = _sink_pred(br)
        kw = (
            {"fail_if": pred}
            if br.sink == "refuse"
            else {"raise_if": pred}
            if br.sink == "raise"
            else {"raise_if": _always}
            if br.sink == "down"
            else {}
        )
        sinks.append(ModelSink(f"b{b}", fail_commits=commit_faults.get(b), **kw))
    if ex.mode == "primary":
        flow = flow.broadcast(sinks[0], mode="primary", fallback=sinks[1:])
    elif any(br.steps for br in ex.branches):
        subs = []
        for b, (br, sink) in enumerate(zip(ex.branches, sinks, strict=True)):
            sub = ackflow.branch()
            for j, (kind, arg) in enumerate(br.steps):
                sub = _add_step(sub, f"b{b}s{j}", kind, arg, spark)
            subs.append(sub.to(sink))
        flow = flow.broadcast(*subs)
    else:
        flow = flow.broadcast(*sinks)
    dlq = None
    if ex.on_error:
        dlq = KeyedSink("dlq", fail_commits=commit_faults.get(-1))
        flow = flow.on_error(dlq)
    return flow, sources, sinks, dlq


def _add_step(flow: ackflow.Flow, name: str, kind: str, arg: int, spark: Any) -> ackflow.Flow:
    import pyarrow as pa

    schema = pa.schema([("n", pa.int64()), ("c", pa.int64())])
    if kind == "map":

        def fn(r: dict[str, Any], m: int = arg) -> dict[str, Any]:
            if (nv(r.get("n")) + nv(r.get("c"))) % m == 0:
                raise ValueError("poison row")
            return {"n": r.get("n"), "c": nv(r.get("c")) + 1}

        return flow.map(fn, name=name, schema=schema)
    if kind == "bmap":

        def bfn(r: dict[str, Any], m: int = arg) -> dict[str, Any]:
            if (nv(r.get("n")) + nv(r.get("c"))) % m == 0:
                raise ValueError("poison row in a branch")
            return {"n": r.get("n"), "c": nv(r.get("c")) + 10}

        return flow.map(bfn, name=name)  # columns inferred from the batch
    if kind in ("filter", "bfilter"):
        return flow.filter(lambda r, m=arg: (nv(r.get("n")) + nv(r.get("c"))) % m != 0, name=name)
    if kind == "flat_map":
        return flow.flat_map(lambda r, k=arg: [{"n": r.get("n"), "c": j} for j in range(k)], name=name)
    if kind == "shape":

        def reshape(r: dict[str, Any]) -> dict[str, Any]:
            return {**r, **shape_fields(r)}

        return flow.map(reshape, name=name, schema_mode="rescue" if arg == 2 else "evolve")
    if kind == "crash":

        def crash(r: dict[str, Any], m: int = arg) -> dict[str, Any]:
            if (nv(r.get("n")) + nv(r.get("c"))) % m == 0:
                raise SystemExit("the task dies")  # not an Exception: fails the whole job
            return r

        return flow.map(crash, name=name, schema=schema)
    if kind == "cast":
        expr = f"CAST(CASE WHEN (n + c) % {arg} = 0 THEN 'x' ELSE CAST(c AS STRING) END AS BIGINT)"
        return flow.with_columns({"c": expr}, name=name)
    if kind == "group":
        return flow.group_by("n").agg("min(n) AS c", name=name)
    if kind == "join":
        keep = [(n, f"t{n}") for n in range(21) if n % arg != 0]
        other = spark.createDataFrame(keep, "n BIGINT, tag STRING")
        flow = flow.join(other, "n", name=name)
        return flow.transform(lambda df: df.drop("tag"), name=f"{name}drop")
    if kind == "transform":
        return flow.transform(lambda df: df.withColumn("c", df["c"] + 0), name=name)
    if kind == "types":
        return flow.with_columns(TYPE_COLUMNS, name=name)
    raise AssertionError(kind)


# -- the model ---------------------------------------------------------------------------


@dataclass
class Fate:
    key: str  # the message's identity in the flow (origin-prefixed in a merged flow)
    source: int
    local_key: str  # its key at its source
    handles: list[int] = field(default_factory=list)  # its copies at its source (indices)
    must: list[str] = field(default_factory=list)  # steps it surely fails in, plan order
    may: set[str] = field(default_factory=set)  # steps it may fail in (collateral)
    crash: str | None = None  # fails the job on its own: the located segment
    rows: dict[int, dict[str, dict[str, int]]] = field(default_factory=dict)  # branch -> key -> row


def segment_names(ex: Example) -> list[list[str]]:
    """The plan's segments as the compiler cuts them: consecutive Python steps run
    together (the first segment also decodes); each Column step is a segment."""
    segs: list[list[str]] = [[]]
    python = True
    for k, (kind, _) in enumerate(ex.steps):
        if kind in ("map", "filter", "flat_map", "crash", "shape"):
            if not python:
                segs.append([])
            segs[-1].append(f"s{k}")
            python = True
        else:
            segs.extend([[f"s{k}"], [f"s{k}drop"]] if kind == "join" else [[f"s{k}"]])
            python = False
    return segs


def _read_later(steps: Sequence[tuple[str, int]], k: int) -> bool:
    """Whether the column step ``k`` writes is ever computed. Spark prunes a column no
    later step reads: a ``group`` replaces ``c`` by ``min(n)``, so a cast whose only
    readers before that group are other Column steps is never evaluated and cannot fail
    (a plain-Python step, a branch step and the sinks read every column)."""
    for kind, _ in steps[k + 1 :]:
        if kind == "group":
            return False
        if kind in ("map", "filter", "flat_map", "crash"):
            return True
    return True


def model(ex: Example) -> list[Fate]:
    fates = []
    counts = [0] * ex.sources
    for i in range(len(ex.ns)):
        origin = i % ex.sources
        local = f"m{counts[origin]}"
        counts[origin] += 1
        fates.append(Fate(local if origin == 0 else f"{origin}|{local}", origin, local))
    for order in layout(ex):
        for h, i in enumerate(order):
            fates[i].handles.append(h)
    segs = segment_names(ex)
    seg_of = {name: "+".join(seg) for seg in segs for name in seg}
    rows: list[tuple[int, str, dict[str, int]]] = []
    for i, n in enumerate(ex.ns):
        if n is None:
            fates[i].must.append("decode")
        else:
            rows.append((i, fates[i].key, {"n": ex.n(i), "c": 0}))
    for k, (kind, arg) in enumerate(ex.steps):
        name = f"s{k}"
        out = []
        for i, key, r in rows:
            v = nv(r["n"]) + nv(r["c"])
            if kind == "map":
                if v % arg == 0:
                    fates[i].must.append(name)
                else:
                    out.append((i, key, {"n": r["n"], "c": nv(r["c"]) + 1}))
            elif kind == "filter":
                if v % arg != 0:
                    out.append((i, key, r))
            elif kind == "flat_map":
                out.extend((i, f"{key}#{j}", {"n": r["n"], "c": j}) for j in range(arg))
            elif kind == "crash":
                if v % arg == 0:
                    fates[i].crash = fates[i].crash or seg_of[name]
                else:  # its schema= keeps n and c
                    out.append((i, key, {"n": r["n"], "c": r["c"]}))
            elif kind == "shape":
                out.append((i, key, {**r, **shape_fields(r)}))
            elif kind == "cast":  # SQL: a null n or c never fails it
                if r["n"] is not None and r["c"] is not None and v % arg == 0 and _read_later(ex.steps, k):
                    fates[i].crash = fates[i].crash or name
                else:
                    out.append((i, key, r))
            elif kind == "group":
                out.append((i, "", {"n": r["n"], "c": r["n"]}))  # keys: digests of members
            elif kind == "join":  # a null never matches
                if r["n"] is not None and r["n"] % arg != 0:
                    out.append((i, key, r))
            elif kind == "types":
                out.append((i, key, {**r, **type_values(r["n"], r["c"])}))
            else:
                out.append((i, key, r))
        rows = out
    for b, br in enumerate(ex.branches):
        brows = rows
        for j, (kind, arg) in enumerate(br.steps):
            name = f"b{b}s{j}"
            out = []
            for i, key, r in brows:
                v = nv(r["n"]) + nv(r["c"])
                if kind == "bmap":
                    if v % arg == 0:
                        fates[i].must.append(name)
                    else:
                        out.append((i, key, {"n": r["n"], "c": nv(r["c"]) + 10}))
                elif v % arg != 0:
                    out.append((i, key, r))
            brows = out
        for i, key, r in brows:
            fates[i].rows.setdefault(b, {})[key] = r
    # the sinks
    pred = [_sink_pred(br) for br in ex.branches]
    any_raise = {b for b, br in enumerate(ex.branches) if br.sink == "raise"}
    for fate in fates:
        if ex.mode == "all":
            for b, br in enumerate(ex.branches):
                hit = [r for r in fate.rows.get(b, {}).values() if pred[b](r)]
                if hit and br.sink in ("refuse", "raise", "down"):
                    fate.must.append(f"b{b}")
                if any_raise and fate.rows.get(b):  # its rows share partitions with others
                    fate.may.update(f"b{x}" for x in any_raise)
        else:  # primary: a row fails only when every sink fails it
            mine = fate.rows.get(0, {})
            for r in mine.values():
                if all(pred[b](r) and br.sink != "ok" for b, br in enumerate(ex.branches)):
                    fate.must.append("b0")
            if any_raise and mine:
                fate.may.add("b0")
    return fates


def reasons(ex: Example, fate: Fate) -> set[str]:
    """The steps a dead letter of this message may name."""
    if fate.crash is not None:
        first = {fate.crash}
    elif fate.must:
        first = {fate.must[0]}
        sink_level = [s for s in fate.must if s.startswith("b") and "s" not in s[1:]]
        if fate.must[0] in sink_level:  # sinks are not ranked among each other
            first = set(sink_level)
    else:
        first = set()
    transient = set()
    if ex.commit_faults:
        transient |= {"broadcast", "b0", *(f"b{t}" for t, _, _ in ex.commit_faults if t >= 0)}
    return first | fate.may | transient


def settle_all(
    ex: Example, sources: list[ModelSource], run: Any, within_s: float = 60
) -> tuple[int, list[str]]:
    """Run until every message is finally settled, restarting after every crash (an
    armed fault point that raised); returns the number of crashes and their texts."""
    from ackflow import faults

    crashes: list[str] = []
    deadline = time.monotonic() + within_s
    for s in sources:  # every crash may release a message once; then it must end
        s.limit = ex.max_deliveries + len(ex.engine_faults) + 2
        if ex.repeats:  # a held copy is given back (and counts one) when the first fails
            s.limit *= 1 + len(ex.repeats)
    for name, nth in ex.engine_faults:
        faults.arm(name, "raise", nth=nth)
    try:
        while time.monotonic() < deadline:
            try:
                run()
            except faults.InjectedFault as e:
                crashes.append(str(e))
                continue
            if all(s.pending() == 0 for s in sources):
                return len(crashes), crashes
        raise AssertionError(f"not settled within {within_s:.0f} s: {[s.pending() for s in sources]}")
    finally:
        faults.disarm()
