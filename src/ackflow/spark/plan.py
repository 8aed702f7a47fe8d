"""The plan of a flow: its segments, their columns, and what every executor shares.

A flow's Python steps run in segments (consecutive map, filter and flat_map steps
together); the columns of each are given (``schema=``) or inferred from the first
batch by a sampler that runs where the steps run, then evolved as new fields arrive.
:class:`~ackflow.spark.compile.CompiledFlow` runs a plan as Spark jobs,
:class:`~ackflow.spark.local.LocalFlow` in this process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType, _parse_datatype_string

from ackflow import faults
from ackflow.core.errors import ColumnsRefused, FlowError
from ackflow.core.schema import (
    EVOLVE,
    PROBED,
    RESCUE,
    RESCUED,
    SchemaStore,
    brought,
    describe_schema,
    duplicate_names,
    from_text,
    merge_schemas,
)
from ackflow.core.settlement import Delivery
from ackflow.flow import (
    PYTHON_STEPS,
    FlatMap,
    Flow,
    Map,
    Step,
)
from ackflow.sinks.base import Sink
from ackflow.spark.blocks import block_rows, parts_rows
from ackflow.spark.rows import (
    BODY,
    HDR,
    ID,
    KEY,
    SRC,
    Counts,
    Tally,
    fold,
    make_sampler,
    reserved,
    row_key,
    unaddressable,
)

log = logging.getLogger("ackflow.engine")

#: a probe runs the steps over one message in this many (see Plan.probe)
PROBE_STRIDE = 20
#: probes that find nothing new before the probing stops
PROBE_QUIET = 3
INPUT_SCHEMA = pa.schema(
    [(ID, pa.int64()), (KEY, pa.string()), (BODY, pa.binary()), (SRC, pa.int32()), (HDR, pa.string())]
)


class Receipts(Protocol):
    """A batch job's receipts, fetched with ``toArrow()``: a Spark DataFrame (lazy: the
    job runs then), or the in-process executor's result."""

    def toArrow(self) -> pa.Table: ...


@dataclass(frozen=True)
class Segment:
    """A run of Python steps (``python=True``) or one Column step."""

    steps: tuple[Step, ...]
    python: bool

    @property
    def name(self) -> str:
        return self.steps[-1].name if self.steps else "decode"


def segments(flow: Flow, decode: bool = True) -> list[Segment]:
    out: list[Segment] = [Segment((), True)] if decode else []  # the first segment decodes
    for step in flow.steps:
        if isinstance(step, PYTHON_STEPS):
            if out and out[-1].python:
                out[-1] = Segment((*out[-1].steps, step), True)
            else:
                out.append(Segment((step,), True))
        else:
            out.append(Segment((step,), False))
    return out


class Plan:
    """What every executor of a flow shares: its segments, its step order, its input
    table and the schemas of its Python segments (explicit, or inferred from the first
    batch by a sampler that runs where the steps run)."""

    def __init__(self, flow: Flow, *, parallelism: int, rows_input: bool = False) -> None:
        flow.validate()
        self.flow = flow
        self.sinks = flow.sinks
        self.sink = self.sinks[0]
        # rows_input: the job starts from rows (with __af_ids lineage), not message bodies
        self.rows_input = rows_input
        #: JSON read by msgspec where certainly the same (spark/decode.py's fast_json)
        self.fast_json = True
        fork = flow.forked
        main = Flow(flow.source, flow.steps[:-1] if fork else flow.steps, self.sink)
        self.segments = segments(main, decode=not rows_input)
        self.branches: list[tuple[list[Segment], Sink]] = []
        for b in fork.branches if fork is not None else ():
            assert b.sink is not None
            self.branches.append((segments(b, decode=False), b.sink))
        self._schemas: dict[tuple[int, ...], pa.Schema] = {}
        #: segments whose columns were inferred from data -> their schema mode (see
        #: ackflow.core.schema; with ``schema=`` given, the user chose the columns)
        self._inferred: dict[tuple[int, ...], str] = {}
        self._segment_names: dict[str, tuple[int, ...]] = {}
        #: segment name -> its current version; replaced whole, never changed in place,
        #: so the engine's thread reads it without the lock
        self._versions: dict[str, int] = {}
        #: where inferred columns are kept and versioned (the engine gives a durable one)
        self.schema_store = SchemaStore(None)
        self.schema_mode = EVOLVE  # the flow's default; a step's schema_mode= overrides
        self.schema_scope = "rows:" if rows_input else ""  # two plans, one store
        #: every evolution of this run: segment, version, changes, brought_by
        self.schema_changes: list[dict[str, Any]] = []
        #: segments whose columns changed lately -> probes left that may find nothing
        #: before the probing stops (see probe)
        self._probing: dict[tuple[int, ...], int] = {}
        self._data_columns: set[str] = set()  # every column name inferred from data
        #: (sink, schema signature) -> columns its table refused (name -> why), and
        #: columns it takes value by value in its own type (name -> type)
        self._refusals: dict[tuple[str, tuple[str, ...]], tuple[dict[str, str], dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._prepare_lock = threading.Lock()
        self.parallelism = max(1, parallelism)
        #: the session time zone: Spark's tasks hand timestamps to Arrow in it, so every
        #: Arrow schema made here from Spark's types must name it (the local executor
        #: and ackflow's own session use UTC)
        self.timezone = "UTC"
        self.shipped = _pickle_parts(flow)
        #: rows in, out and failed per step, added by tasks (set by executors asked to
        #: count, for the status page; None: tasks count nothing)
        self.tally: Tally | None = None

    def row_counts(self) -> Counts:
        """Rows in, out and failed per Python step and per sink so far (a snapshot).

        Rows of every job count, a job that failed and its bisection jobs too: these are
        rows processed, not messages (a message's outcome is in the run report)."""
        return dict(self.tally.value) if self.tally is not None else {}

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Jobs run inside (the sampler, a poison message's locating) count no rows."""
        from ackflow.spark.rows import LOCAL_TASK

        LOCAL_TASK.nocount = True
        try:
            yield
        finally:
            LOCAL_TASK.nocount = False

    @property
    def step_order(self) -> list[str]:
        """Step names in plan order (decoding first, sinks last): a message failed by
        several of its rows keeps the failure of the earliest step."""
        return ["decode", *(s.name for s in self.flow.all_steps), *(s.name for s in self.sinks)]

    @property
    def required_sinks(self) -> list[str] | None:
        """With several sinks, a message is written only when each of them wrote it."""
        return [s.name for s in self.sinks] if len(self.sinks) > 1 else None

    def bind_thread(self, batch_id: str) -> None:
        """Called on a batch's worker thread before its jobs run (Spark: the job group
        that shutdown can cancel)."""

    def release(self, batch_id: str) -> None:
        """Drop what :meth:`job` cached for ``batch_id`` (after its job ran)."""

    def prepare_sink(self, sink: Sink, schema: pa.Schema) -> dict[str, str]:
        """``sink.prepare(schema)``, one at a time: two batches' threads must not create
        a table at once. Returns the columns the sink's table refused (name -> why):
        columns inferred from outside data never stop the run; the rows that hold a value
        in them fail alone (see :func:`~ackflow.spark.writer.make_writer`)."""
        signature = (sink.name, tuple(f"{f.name}:{f.type}" for f in schema))
        with self._prepare_lock:
            refused, retyped = self._refusals.get(signature, ({}, {}))
            while True:  # each round settles at least one more column: it ends
                use = pa.schema(
                    [
                        f.with_type(retyped[f.name]) if f.name in retyped else f
                        for f in schema
                        if f.name not in refused
                    ]
                )
                try:
                    sink.prepare(use)
                    break
                except ColumnsRefused as e:
                    names = set(e.columns) | set(e.retype)
                    if (
                        not names
                        or names & {*refused, *retyped}
                        or any(c not in self._data_columns for c in names)
                    ):
                        raise  # a column the flow itself makes: configuration, stop
                    retyped = {**retyped, **e.retype}
                    refused = {**refused, **{c: why for c, why in e.columns.items() if c not in e.retype}}
            if signature not in self._refusals and (refused or retyped):
                log.warning(
                    "sink %r: column(s) %s come from the data; its table cannot take "
                    "them, and rows with a value there fail alone. Column(s) %s are "
                    "written value by value in the table's type",
                    sink.name,
                    ", ".join(map(repr, refused)) or "-",
                    ", ".join(map(repr, retyped)) or "-",
                )
            self._refusals[signature] = (refused, retyped)
            return refused

    # -- schemas -----------------------------------------------------------------------

    def _explicit_schema(self, seg: Segment) -> pa.Schema | None:
        shaping = [s for s in seg.steps if isinstance(s, (Map, FlatMap))]
        if not shaping or shaping[-1].schema is None:
            return None
        step = shaping[-1]
        schema: Any = step.schema
        try:
            if isinstance(schema, str):
                schema = _parse_datatype_string(schema)
            if isinstance(schema, StructType):
                schema = to_arrow_schema(schema, timezone=self.timezone)
            if not isinstance(schema, pa.Schema):
                raise TypeError(f"expected a DDL string, StructType or pyarrow schema, got {schema!r}")
        except Exception as e:
            raise FlowError(step.name, f"bad schema=: {e}") from e
        check_names(step.name, schema.names, "schema=")
        # every column nullable: a filtered or failed message's row holds nulls in each
        # (a NOT NULL one made Spark's pass between the steps and the writer fail the
        # whole job, and bisection dead-lettered good messages); a sink's own NOT NULL
        # columns still refuse a row without the value
        return pa.schema([_nullable(f) for f in schema])

    def segment_name(self, index: tuple[int, ...], seg: Segment) -> str:
        """The name of a segment's columns in the schema store: its place and last step
        (renaming or moving the step starts a new history)."""
        return f"{self.schema_scope}{'.'.join(map(str, index))}:{seg.name}"

    def segment_versions(self) -> dict[str, int]:
        """The current version of each segment whose columns are known so far (without
        the lock: the engine's thread asks while a batch's thread may hold it for a job)."""
        return self._versions

    def _mode(self, seg: Segment) -> str:
        shaping = [s for s in seg.steps if isinstance(s, (Map, FlatMap))]
        mode = getattr(shaping[-1], "schema_mode", None) if shaping else None
        return mode or self.schema_mode

    def _schema(
        self,
        index: tuple[int, ...],
        seg: Segment,
        sample: Callable[[Any], list[tuple[str, int]]],
        data_in: list[str] | None,
        lineage: str,
    ) -> pa.Schema | None:
        """The segment's output columns: given (``schema=``), stored (a restart reuses
        them), or inferred from every good row of this batch by a sampler job that runs
        the steps where tasks run (``sample(fn)`` returns each partition's columns and
        row count) and then stored as the segment's first version."""
        with self._lock:
            if index in self._schemas:
                return self._schemas[index]
            explicit = self._explicit_schema(seg)
            if explicit is not None:
                schema = explicit
                try:
                    schema = self.spark_types(schema)
                except Exception as e:
                    raise FlowError(seg.name, f"the rows' columns cannot be Spark columns: {e}") from e
            else:
                name = self.segment_name(index, seg)
                mode = self._mode(seg)
                stored = self.schema_store.current(name)
                if stored is not None:
                    schema = stored[1]
                    self._versions = {**self._versions, name: stored[0]}
                    if mode == RESCUE:  # stored by a run in another mode: add the column
                        schema = self._with_rescued(name, seg, schema)
                else:
                    # Run the steps where tasks run (never on the driver: a user function
                    # may crash its process or have side effects); every good row counts.
                    sampler = make_sampler(
                        seg.steps, self.flow.source.formats, data_in, lineage, fast_json=self.fast_json
                    )
                    found = [(from_text(t), n) for t, n in sample(sampler)]
                    if not sum(n for _, n in found):
                        return None  # no row of this batch gets past this segment
                    schema = pa.schema([])
                    nulls: dict[str, pa.Field] = {}  # fields null in every row so far
                    for part, _ in found:
                        schema = merge_schemas(schema, part)[0]
                        nulls.update((f.name, f) for f in part if pa.types.is_null(f.type))
                    schema = pa.schema(
                        [*schema, *(f for name, f in nulls.items() if name not in schema.names)]
                    )
                    schema = self._headers_as_maps(schema)
                    schema = _spark_safe(schema)
                    if mode == RESCUE:  # ackflow's column; a data field of that name is
                        schema = pa.schema([f for f in schema if f.name != RESCUED])  # kept
                        schema = schema.append(pa.field(RESCUED, pa.string()))  # inside it
                    try:
                        schema = self.spark_types(schema)
                    except Exception as e:
                        raise FlowError(seg.name, f"the rows' columns cannot be Spark columns: {e}") from e
                    version = self.schema_store.record(
                        name, schema, [f"+{c}" for c in describe_schema(schema)], None
                    )
                    faults.point("schema.recorded")
                    self._note(name, version, describe_schema(schema), None)
                    if index == (0,):  # the next batches may bring fields this one had not
                        self._probing[index] = PROBE_QUIET
                self._inferred[index] = mode
                self._segment_names[name] = index
                self._data_columns.update(schema.names)
            self._schemas[index] = schema
            return schema

    def _with_rescued(self, name: str, seg: Segment, schema: pa.Schema) -> pa.Schema:
        """``schema`` with the ``_rescued`` string column that mode rescue writes into,
        recorded as a new version if it lacked it."""
        if RESCUED in schema.names:
            if not pa.types.is_string(schema.field(RESCUED).type):
                raise FlowError(
                    seg.name,
                    f"schema mode rescue writes a JSON string column "
                    f"{RESCUED!r}, but the stored columns of {name!r} hold one of "
                    f"type {schema.field(RESCUED).type} (from the data of a run in "
                    "another mode): rename that field in a map step, or keep "
                    "the other mode",
                )
            return schema
        schema = self.spark_types(schema.append(pa.field(RESCUED, pa.string())))
        version = self.schema_store.record(name, schema, [f"+{RESCUED}: string"], None)
        faults.point("schema.recorded")
        self._note(name, version, [f"+{RESCUED}: string"], None)
        return schema

    def _headers_as_maps(self, schema: pa.Schema, current: pa.Schema | None = None) -> pa.Schema:
        """A source's headers field (``headers_field=``) whose values are all strings is a
        map of strings, not a struct: its keys are whatever producers send, and must not
        become struct fields one by one (nor names Spark cannot hold)."""
        names = {n for n in self.flow.source.header_fields if n}
        if not names:
            return schema
        as_map = pa.map_(pa.string(), pa.string())
        out = []
        for f in schema:
            t = f.type
            known = current.field(f.name).type if current is not None and f.name in current.names else None
            if (
                f.name in names
                and pa.types.is_struct(t)
                and all(pa.types.is_string(t.field(i).type) for i in range(t.num_fields))
                and (known is None or known.equals(as_map))
            ):
                f = f.with_type(as_map)
            out.append(f)
        return pa.schema(out)

    def spark_types(self, schema: pa.Schema) -> pa.Schema:
        """``schema`` round-tripped through Spark's types, so tasks produce exactly what
        Spark expects."""
        return to_arrow_schema(from_arrow_schema(schema), timezone=self.timezone)

    def _note(self, segment: str, version: int, changes: list[str], brought_by: str | None) -> None:
        self._versions = {**self._versions, segment: version}
        self.schema_changes.append(
            {
                "segment": segment,
                "version": version,
                "changes": changes,
                "brought_by": brought_by,
                "at": time.time(),
            }
        )
        log.info(
            "columns of %s: version %d%s: %s",
            segment,
            version,
            f" ({brought(brought_by)})" if brought_by else "",
            "; ".join(changes[:20]) + (" ..." if len(changes) > 20 else ""),
        )

    def evolve(self, misses: Sequence[tuple[str, pa.Schema, str]]) -> dict[str, str]:
        """Merge the columns that rows needed (segment, the row's columns, its message's
        identity) into their segments, each new version recorded (durable) before it is
        used. Returns the segments that could not evolve -> why (nothing grew: an
        ackflow bug; or Spark cannot hold the new columns)."""
        refused: dict[str, str] = {}
        with self._lock:
            # rows of one batch mostly share their columns: each distinct set merges once
            by_segment: dict[str, dict[pa.Schema, str]] = {}
            for segment, row_schema, who in misses:
                by_segment.setdefault(segment, {}).setdefault(row_schema, who)
            for segment, distinct in by_segment.items():
                wanted = list(distinct.items())
                index = self._segment_names.get(segment)
                if index is None or index not in self._schemas:
                    refused[segment] = f"no columns are known for {segment!r}"
                    continue
                current = self._schemas[index]
                merged, changes, brought = current, [], None
                for row_schema, who in wanted:
                    row_schema = self._headers_as_maps(row_schema, merged)
                    merged, more, _ = merge_schemas(merged, _new_fields_safe(merged, row_schema))
                    if more and brought is None:
                        brought = who
                    changes += more
                if not changes:
                    if not any(merge_schemas(current, rs)[1] for rs, _ in wanted):
                        continue  # another batch's thread evolved it first: run again
                    refused[segment] = "the columns did not grow"
                    continue
                try:
                    merged = self.spark_types(merged)
                except Exception as e:  # noqa: BLE001 - the rows' values, not the run
                    refused[segment] = f"the new columns cannot be Spark columns: {e}"
                    continue
                twice = duplicate_names(merged)
                if twice is not None:  # names Spark made one (or that were one already)
                    refused[segment] = f"the new fields would give {twice!r} two fields of one name"
                    continue
                version = self.schema_store.record(segment, merged, changes, brought)
                faults.point("schema.recorded")
                self._schemas[index] = merged
                self._data_columns.update(merged.names)
                self._note(segment, version, changes, brought)
                if index == (0,):
                    self._probing[index] = PROBE_QUIET
        return refused

    def probe(
        self,
        index: tuple[int, ...],
        seg: Segment,
        sample: Callable[[Any], list[tuple[str, int]]],
        data_in: list[str] | None,
        lineage: str,
    ) -> None:
        """After the first segment's columns were first inferred, and while they keep
        changing (a producer rolling out new fields), each batch first runs its steps
        over every ``PROBE_STRIDE``-th message and evolves the columns with what they
        bring: most rows of the batch then fit, and few run again after a schema miss.
        After ``PROBE_QUIET`` probes in a row that find nothing new (a re-run after a
        miss, a batch of known shapes) the probing stops until the next evolution. Only
        an optimisation: misses stay correct."""
        if index not in self._probing:
            return
        sampler = make_sampler(
            seg.steps,
            self.flow.source.formats,
            data_in,
            lineage,
            stride=PROBE_STRIDE,
            fast_json=self.fast_json,
        )
        found = pa.schema([])
        for text, _ in sample(sampler):
            found = merge_schemas(found, from_text(text))[0]
        name = self.segment_name(index, seg)
        with self._lock:
            current = self._schemas.get(index)
        if current is None:
            return
        if not merge_schemas(current, _new_fields_safe(current, found))[1]:
            with self._lock:
                left = self._probing.get(index, 0) - 1
                if left > 0:
                    self._probing[index] = left
                else:
                    self._probing.pop(index, None)
            return
        self.evolve([(name, found, PROBED)])

    def input_table(self, deliveries: Sequence[Delivery]) -> pa.Table:
        """One Arrow table, chunked so the executor makes ``parallelism`` partitions of it.

        A message's key is its source's stable identity (prefixed with its origin in
        a merged flow, where two sources may use the same identities), marked where it
        ends like a key suffix (:func:`~ackflow.spark.rows.row_key`)."""
        fields = self.flow.source.header_fields
        blocks = [d for d in deliveries if d.messages > 1]
        if blocks:  # a run of lines each: made in Arrow (spark/blocks.py)
            deliveries = [d for d in deliveries if d.messages == 1]
        n = len(deliveries)
        table = pa.table(
            {
                ID: pa.array([d.lineage_id for d in deliveries], pa.int64()),
                KEY: pa.array([row_key(d.identity) for d in deliveries], pa.string()),
                BODY: pa.array([d.body for d in deliveries], pa.binary()),
                SRC: pa.array([d.origin for d in deliveries], pa.int32()),
                HDR: pa.nulls(n, pa.string())
                if all(f is None for f in fields)
                else pa.array([_headers(fields[d.origin], d.headers) for d in deliveries], pa.string()),
            },
            schema=INPUT_SCHEMA,
        )
        if blocks:
            names = (ID, KEY, BODY, SRC, HDR)
            runs = [d for d in blocks if d.parts is None]  # runs of lines / separate messages
            parts = [d for d in blocks if d.parts is not None]
            made = [block_rows(runs, INPUT_SCHEMA, names)] if runs else []
            made += [parts_rows(parts, INPUT_SCHEMA, names)] if parts else []
            table = pa.concat_tables([table, *made]) if n else pa.concat_tables(made)
        per = max(1, -(-table.num_rows // self.parallelism))
        return pa.Table.from_batches(table.to_batches(max_chunksize=per), schema=INPUT_SCHEMA)

    def job(self, inputs: pa.Table, batch_id: str) -> Receipts:
        """The receipts of one batch's job over ``inputs`` (each executor defines it)."""
        raise NotImplementedError

    def locate(self, inputs: pa.Table) -> str:
        """The step that fails a job on its own over ``inputs`` (one poison message);
        each executor defines it."""
        raise NotImplementedError


def check_names(step: str, names: Sequence[str], what: str) -> None:
    """Columns named by configuration must be addressable by Spark: stop at start."""
    seen: dict[str, str] = {}
    for n in names:
        why = unaddressable(n)
        if why is not None:
            raise FlowError(step, f"{what} column {n!r}: {why}")
        if fold(n) in seen and seen[fold(n)] != n:
            raise FlowError(
                step,
                f"{what} columns {seen[fold(n)]!r} and {n!r} differ only "
                "in case, and Spark does not tell column names apart by case",
            )
        seen[fold(n)] = n


def _new_fields_safe(current: pa.Schema, wanted: pa.Schema) -> pa.Schema:
    """``wanted`` without the top-level fields that must not become columns of
    ``current`` (a name Spark cannot address, reserved, or a case twin of a column): the
    tasks fail rows holding them, this is the driver's guard."""
    have = {fold(n): n for n in current.names}
    return pa.schema(
        [
            f
            for f in wanted
            if f.name in current.names
            or (fold(f.name) not in have and unaddressable(f.name) is None and not reserved(f.name))
        ]
    )


def _spark_safe(schema: pa.Schema) -> pa.Schema:
    """An inferred column whose type Spark cannot hold (a list of nulls, say) becomes a
    string column: the rows whose values do not fit it then fail alone. A name Spark
    cannot address (:func:`~ackflow.spark.columns.unaddressable`) or that differs from an earlier one only in
    case (Spark, case-insensitive, could not tell the two apart) makes no column: the
    rows holding it fail alone, in ``conform``."""
    fields = []
    seen: set[str] = set()
    for f in schema:
        if fold(f.name) in seen or unaddressable(f.name) is not None or reserved(f.name):
            continue
        seen.add(fold(f.name))
        try:
            to_arrow_schema(from_arrow_schema(pa.schema([f])), timezone="UTC")
            fields.append(f)
        except Exception:  # noqa: BLE001 - any refusal by Spark's type mapping
            fields.append(pa.field(f.name, pa.string()))
    return pa.schema(fields)


def _pickle_parts(flow: Flow) -> dict[str, bytes]:
    """Everything that runs on executors, pickled now: a part that cannot be sent
    fails at start, with its name, rather than in the middle of a run."""
    from pyspark import cloudpickle

    parts: dict[str, Any] = {s.name: s for s in flow.all_steps if isinstance(s, PYTHON_STEPS)}
    for sink in flow.sinks:
        parts[sink.name] = sink
    out = {}
    for name, part in parts.items():
        try:
            out[name] = cloudpickle.dumps(part)
        except Exception as e:
            raise FlowError(
                name,
                f"cannot be sent to the executors (not picklable): "
                f"{type(e).__name__}: {e}. Open connections and files inside the "
                "function or in write_partition, not when building the flow",
            ) from e
    return out


def _headers(field: str | None, headers: dict[str, str]) -> str | None:
    import json

    return None if field is None else json.dumps({field: headers})


def _nullable(field: pa.Field) -> pa.Field:
    """``field`` nullable, and every field inside it (structs, lists, maps)."""
    t = field.type
    if pa.types.is_struct(t):
        t = pa.struct([_nullable(t.field(i)) for i in range(t.num_fields)])
    elif pa.types.is_large_list(t):
        t = pa.large_list(_nullable(t.value_field))
    elif pa.types.is_list(t):
        t = pa.list_(_nullable(t.value_field))
    elif pa.types.is_map(t):
        t = pa.map_(t.key_field.type, _nullable(t.item_field))
    return field.with_type(t).with_nullable(True)
