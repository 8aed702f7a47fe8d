"""Plan → DataFrame: compile a flow into one Spark job per batch.

Consecutive Python steps (map, filter, flat_map) run together in one
``mapInArrow``; Column steps (with_columns, Column filters) are plain Spark
expressions, evaluated only on live rows. The job ends in the sink's writer, which
returns receipts, and the job's result is fetched with ``toArrow()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from ackflow.core.errors import FlowError
from ackflow.flow import (
    ColumnFilter,
    Flow,
    GroupBy,
    Join,
    Step,
    Transform,
    WithColumns,
)
from ackflow.sinks.base import Sink, key_columns
from ackflow.spark import jvm_decode
from ackflow.spark.feed import Feeds, Fn, fed, feed_enabled
from ackflow.spark.plan import (
    INPUT_SCHEMA,
    Plan,
    Receipts,
    Segment,
    check_names,
)
from ackflow.spark.rows import (
    ERR,
    FAILED,
    FILTERED,
    ID,
    IDS,
    KEY,
    LIVE,
    NO_COUNT,
    STATUS,
    STEP,
    TASK_RECEIPTS,
    CountsParam,
    fold,
    held_columns,
    internal_schema,
    make_segment,
)
from ackflow.spark.session import switched_on
from ackflow.spark.writer import make_writer

Feed = Callable[[Fn], Fn] | None
_INPUT = from_arrow_schema(INPUT_SCHEMA)
log = logging.getLogger("ackflow.engine")


class CompiledFlow(Plan):
    """A flow bound to a SparkSession.

    The output columns of a run of Python steps come from the schema store; the first
    time, a small Spark job runs the steps over the first batch on the executors and
    returns the columns inferred from every good row of each partition. A step's
    ``schema=`` skips this. If that job fails as a whole, the batch's job fails and is
    bisected like any other. Rows that need more columns later evolve them
    (:meth:`Plan.evolve`, by the segment's schema mode).
    """

    def __init__(
        self, flow: Flow, spark: SparkSession, *, rows_input: bool = False, count_rows: bool = False
    ) -> None:
        super().__init__(flow, parallelism=spark.sparkContext.defaultParallelism, rows_input=rows_input)
        self.spark = spark
        self.timezone = spark.conf.get("spark.sql.session.timeZone") or "UTC"
        if count_rows:
            self.tally = spark.sparkContext.accumulator({}, CountsParam())  # type: ignore[arg-type]
        self._persisted: dict[str, DataFrame] = {}
        # a local master's workers read a batch's messages from a file (see spark/feed.py)
        local = (spark.sparkContext.master or "").startswith("local")
        self._feeds = Feeds() if local and not rows_input and feed_enabled(spark) else None
        # what Spark hands a mapInArrow function at a time: the feed gives the same pieces
        pieces = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch") or 10_000)
        self._pieces = pieces if pieces > 0 else 10_000
        # local masters too: their Python workers may lack a module the driver has (another
        # interpreter, another sys.path), and then every message would fail as if poison
        check_executors_can_load(spark, self.shipped)
        # a Python segment and the writer in one pass (see _write); the session's
        # spark.ackflow.fuse=false keeps two
        self._fuse = switched_on(spark, "fuse")
        # spark.ackflow.fastjson=false: JSON by the exact reader only (spark/decode.py)
        self.fast_json = switched_on(spark, "fastjson")
        # spark.ackflow.jvmjson=true: JSON decoded in the JVM where it certainly reads as
        # Python does, for flows that begin with Column steps (spark/jvm_decode.py; off by
        # default: measured, it costs more than the Python workers' reader on 2 cores)
        self._jvm_json = switched_on(spark, "jvmjson", default=False) and not rows_input
        large = spark.conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false")
        self._large = str(large).lower() == "true"  # (Spark hands Python large_string then)

    def bind_thread(self, batch_id: str) -> None:
        self.spark.sparkContext.setJobGroup(batch_id, f"ackflow {batch_id}", interruptOnCancel=True)

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        sc = self.spark.sparkContext
        before = sc.getLocalProperty(NO_COUNT)
        sc.setLocalProperty(NO_COUNT, "1")  # this thread's jobs (local properties are per thread)
        try:
            yield
        finally:
            sc.setLocalProperty(NO_COUNT, before)  # type: ignore[arg-type]

    # -- the job ------------------------------------------------------------------------

    def job(self, inputs: pa.Table, batch_id: str) -> Receipts:
        """The receipts of one batch (lazy: the job runs at ``toArrow()``)."""
        jvm = self._jvm_decodes()
        receipts = self._job(inputs, batch_id, jvm)
        if jvm and self.tally is not None:  # the Python decoder adds only its failures
            return _Counted(receipts, self.tally, inputs.num_rows)
        return receipts

    def _job(self, inputs: pa.Table, batch_id: str, jvm: bool) -> DataFrame:
        df, data_cols, lineage, feed = self._start(inputs, batch_id, jvm)
        one_pass = not self.branches and self._fuse
        last: list[tuple[Fn, pa.Schema]] | None = [] if one_pass else None
        df, data_cols, lineage, alive = self._chain(
            self.segments,
            (),
            df,
            data_cols,
            lineage,
            decode=not self.rows_input,
            feed=feed,
            last=last,
            jvm=jvm,
        )
        if not self.branches:
            return self._write(self.sink, df, data_cols, lineage, batch_id, last[0] if last else None)
        # Sub-flows: the shared part is cached for the batch, each branch continues from
        # it and writes its receipts; one job returns them all (see release()).
        shared = df.persist()
        with self._lock:
            self._persisted[batch_id] = shared
        outs = []
        for b, (segs, sink) in enumerate(self.branches):
            bdf, bcols, blin, _ = self._chain(
                segs if alive else [], (b,), shared, data_cols, lineage, decode=False
            )
            outs.append(self._write(sink, bdf, bcols, blin, batch_id))
        return functools.reduce(DataFrame.unionByName, outs)

    def _jvm_decodes(self) -> bool:
        """Whether this batch's messages are decoded in the JVM where it certainly reads
        them as Python does (spark/jvm_decode.py): the first segment only decodes (no
        Python step in it) and its columns are known."""
        if not self._jvm_json or self.segments[0].steps:
            return False
        schema = self._schemas.get((0,))
        return schema is not None and jvm_decode.applies(schema, self.flow.source.formats)

    def _start(
        self, inputs: pa.Table, batch_id: str, jvm: bool = False
    ) -> tuple[DataFrame, list[str], str, Feed]:
        """The batch's first DataFrame, its data columns, its lineage column, and what
        the first Python function is wrapped in to read the messages (None: they are in
        the DataFrame). ``jvm``: the messages go to the JVM (as Parquet files Spark reads,
        on a local master), for its JSON reader."""
        if jvm and self._feeds is not None and inputs.num_rows:
            try:
                paths = self._feeds.write_parquet(inputs, batch_id)
            except OSError as e:  # a full or unwritable temporary folder: the other way
                log.warning("cannot write the batch's input files (%s); they go through the JVM", e)
            else:
                return self.spark.read.schema(_INPUT).parquet(*paths), [], ID, None
        elif self._feeds is not None and inputs.num_rows:
            try:
                path, parts = self._feeds.write(inputs, batch_id)
            except OSError as e:  # a full or unwritable temporary folder: the other way
                log.warning("cannot write the batch's input file (%s); it goes through the JVM", e)
            else:
                feed = functools.partial(fed, path, max_rows=self._pieces)
                return self.spark.range(0, parts, 1, parts), [], ID, feed
        df = self.spark.createDataFrame(inputs)
        if self.rows_input:  # rows from grouped_within: data columns and __af_ids
            return df, [c for c in inputs.column_names if not c.startswith("__af_")], IDS, None
        return df, [], ID, None

    def locate(self, inputs: pa.Table) -> str:
        """Name the step that fails a job on its own over ``inputs`` (one poison message):
        run growing prefixes of the plan, a Spark job each, and return the first step
        whose prefix fails; the sink's name if every prefix succeeds."""
        key = f"locate-{id(inputs)}-{threading.get_ident()}"
        try:
            df, data_cols, lineage, feed = self._start(inputs, key)
            for k, seg in enumerate(self.segments, start=1):
                try:
                    out, _, _, alive = self._chain(
                        self.segments[:k], (), df, data_cols, lineage, decode=not self.rows_input, feed=feed
                    )
                    with self.uncounted():
                        out.toArrow()  # every column evaluated
                except FlowError:
                    raise
                except Exception:  # noqa: BLE001 - this prefix is where it breaks
                    return "+".join(s.name for s in seg.steps) or "decode"
                if not alive:
                    break
            return self.sink.name if len(self.sinks) == 1 else "broadcast"
        finally:
            self.release(key)

    def _sample(self, df: DataFrame, sampler: Any, feed: Feed = None) -> list[tuple[str, int]]:
        with self.uncounted():  # the steps before it run again here
            out = df.mapInArrow(feed(sampler) if feed else sampler, "schema string, rows bigint").toArrow()
        return list(zip(out.column("schema").to_pylist(), out.column("rows").to_pylist(), strict=True))

    def release(self, batch_id: str) -> None:
        with self._lock:
            shared = self._persisted.pop(batch_id, None)
        if self._feeds is not None:
            self._feeds.release(batch_id)
        if shared is not None:
            shared.unpersist()

    def _chain(
        self,
        segs: list[Segment],
        key: tuple[int, ...],
        df: DataFrame,
        data_cols: list[str],
        lineage: str,
        decode: bool,
        feed: Feed = None,
        last: list[tuple[Fn, pa.Schema]] | None = None,
        jvm: bool = False,
    ) -> tuple[DataFrame, list[str], str, bool]:
        """Apply segments; returns the DataFrame, its data columns, its lineage column,
        and False if a segment let no live row through (later steps were skipped).
        ``feed``: wraps the first segment's functions (they read the messages).
        ``last``: if the segments end in Python, that segment's function and output
        schema are put there instead of applied (the writer runs it in its own pass).
        ``jvm``: the first segment (decoding only) decodes in the JVM what it can."""
        for index, seg in enumerate(segs):
            if seg.python:
                data_in = None if decode and index == 0 else data_cols
                first = feed if index == 0 else None
                sample = functools.partial(self._sample, df, feed=first)
                fresh = (*key, index) not in self._schemas  # inferred from every row now
                schema = self._schema((*key, index), seg, sample, data_in, lineage)
                if schema is not None and not fresh and (*key, index) in self._probing:
                    self.probe((*key, index), seg, sample, data_in, lineage)
                    schema = self._schemas[(*key, index)]
                dead_end = schema is None  # no live row past this segment in this batch
                if schema is None:
                    schema = pa.schema([])
                out_schema = pa.schema([*schema, *internal_schema(lineage)])
                fn = make_segment(
                    seg.steps,
                    self.flow.source.formats,
                    data_in,
                    schema,
                    out_schema,
                    lineage,
                    self.tally,
                    mode=self._inferred.get((*key, index)),
                    segment=self.segment_name((*key, index), seg),
                    fast_json=self.fast_json,
                    counted_in=jvm and index == 0,
                )
                fn = first(fn) if first else fn
                data_cols = list(schema.names)
                if jvm and index == 0 and not dead_end:
                    decoded, rest = jvm_decode.split(df, schema, self.flow.source.formats)
                    df = decoded.unionByName(rest.mapInArrow(fn, from_arrow_schema(out_schema)))
                    continue
                if last is not None and index == len(segs) - 1:
                    last.append((fn, out_schema))
                    return df, data_cols, lineage, not dead_end
                df = df.mapInArrow(fn, from_arrow_schema(out_schema))
                if dead_end:
                    return df, data_cols, lineage, False  # no rows, no columns for later steps
                continue
            step = seg.steps[0]
            try:
                df, data_cols, lineage = self._apply(step, df, data_cols, lineage)
            except AnalysisException as e:
                raise FlowError(step.name, _first_line(e)) from e
        return df, data_cols, lineage, True

    def _write(
        self,
        sink: Sink,
        df: DataFrame,
        data_cols: list[str],
        lineage: str,
        batch_id: str,
        last: tuple[Fn, pa.Schema] | None = None,
    ) -> DataFrame:
        """The writer's pass; with ``last`` (a Python segment's function and schema, see
        :meth:`_chain`), the segment and the writer in one pass: its rows go from the
        steps to the sink in the same Python worker, without becoming JVM rows between."""
        cols = [*data_cols, lineage, KEY, STATUS, STEP, ERR]
        if last is None:
            df = df.select(*[quoted(c) for c in data_cols], lineage, KEY, STATUS, STEP, ERR)
        fields = {}
        if type(sink).prepare is not Sink.prepare or last is not None:  # (a JVM call without last)
            fields = {f.name: f for f in (from_arrow_schema(last[1]) if last else df.schema).fields}
        refused = {}
        if type(sink).prepare is not Sink.prepare:
            schema = to_arrow_schema(StructType([fields[c] for c in data_cols]), timezone=self.timezone)
            held = held_columns(schema, data_cols, key_columns(sink))
            refused = self.prepare_sink(sink, pa.schema([schema.field(c) for c in held]))
        writer = make_writer(sink, batch_id, data_cols, lineage, self.step_order, self.tally, refused)
        if last is not None:
            # the types Spark would have handed the writer after a pass of its own (data
            # columns nullable: a filtered or failed row holds nulls even in a NOT NULL one)
            seen = to_arrow_schema(
                StructType([fields[c] for c in cols]), timezone=self.timezone, prefers_large_types=self._large
            )
            seen = pa.schema([f.with_nullable(True) if f.name in data_cols else f for f in seen])
            writer = functools.partial(_fused, last[0], writer, seen)
        return df.mapInArrow(writer, from_arrow_schema(TASK_RECEIPTS))

    def _apply(
        self, step: Step, df: DataFrame, data_cols: list[str], lineage: str
    ) -> tuple[DataFrame, list[str], str]:
        """Apply one Spark step; rows that are not live pass through untouched."""
        live = F.col(STATUS) == LIVE
        if isinstance(step, ColumnFilter):
            df = df.withColumn(
                STATUS,
                F.when(~live, F.col(STATUS))
                .when(F.coalesce(_column(step.condition), F.lit(False)), F.lit(LIVE))
                .otherwise(F.lit(FILTERED)),
            )
            return df, data_cols, lineage
        if isinstance(step, WithColumns):
            check_names(step.name, [c for c, _ in step.columns], "with_columns")
            df = df.withColumns({c: F.when(live, _column(e)) for c, e in step.columns})
            # read back: a new name that a data column has in another case replaces it
            return df, [c for c in df.columns if not c.startswith("__af_")], lineage
        if isinstance(step, GroupBy):
            return self._group(step, df, lineage)
        if isinstance(step, Join):
            return self._join(step, df, data_cols, lineage)
        if isinstance(step, Transform):
            return self._transform(step, df, lineage)
        raise FlowError(step.name, f"unknown step kind {step.kind}")

    def _group(self, step: GroupBy, df: DataFrame, lineage: str) -> tuple[DataFrame, list[str], str]:
        # Live rows group by the keys. A row that is not live forms a group of its own
        # (keyed by its lineage), so its status and error reach the receipts unchanged.
        live = F.col(STATUS) == LIVE
        keys = [F.when(live, F.col(k)).alias(k) for k in step.keys]
        solo = F.when(~live, F.col(lineage)).alias("__af_solo")
        members = F.collect_list(F.col(ID)) if lineage == ID else F.flatten(F.collect_list(F.col(IDS)))
        failure = F.first(F.when(F.col(ERR).isNotNull(), F.struct(STEP, ERR)), ignorenulls=True)
        aggs = [_column(a) for a in step.aggs]
        # a group's key: the keys of its member rows and its group-by values
        key = F.concat(
            F.lit("g:"),
            F.sha2(
                F.to_json(
                    F.struct(
                        F.array_sort(F.collect_list(F.col(KEY))).alias("m"),
                        *[F.first(F.col(k)).alias(k) for k in step.keys],
                    )
                ),
                256,
            ),
        )
        out = df.groupBy(*keys, solo).agg(
            *aggs,
            members.alias(IDS),
            key.alias(KEY),
            F.max(STATUS).alias(STATUS),
            failure.alias("__af_failure"),
        )
        out = (
            out.withColumn(STEP, F.col("__af_failure." + STEP))
            .withColumn(ERR, F.col("__af_failure." + ERR))
            .drop("__af_failure", "__af_solo")
        )
        data_cols = [c for c in out.columns if not c.startswith("__af_")]
        return out, data_cols, IDS

    def _join(
        self, step: Join, df: DataFrame, data_cols: list[str], lineage: str
    ) -> tuple[DataFrame, list[str], str]:
        live = F.col(STATUS) == LIVE
        other = step.other
        missing = [c for c in step.on if c not in other.columns]
        if missing:
            raise FlowError(step.name, f"join column(s) {missing} must exist on both sides")
        if any(c.startswith("__af_") for c in other.columns):
            raise FlowError(step.name, "the static DataFrame has __af_ columns (reserved)")
        check_names(step.name, other.columns, "the static DataFrame's")
        extra = [c for c in other.columns if c not in step.on]
        taken = {fold(c) for c in (extra if step.how in ("inner", "left") else [])}
        taken |= {fold(c) for c in step.on}
        clash = [c for c in data_cols if fold(c) in taken and c not in step.on]
        if any(c not in self._data_columns for c in clash):
            raise FlowError(step.name, f"column(s) {clash} exist on both sides; rename them")
        df, data_cols = self._refuse(
            df, data_cols, clash, step.name, "the join's static side has a column of this name"
        )
        # a join column the data never had (in the batch the columns came from) is null:
        # its rows match nothing, as a row without the field would
        types = {f.name: f.dataType for f in other.schema.fields}
        absent = [c for c in step.on if c not in data_cols]
        if absent:
            df = df.withColumns({c: F.lit(None).cast(types[c]) for c in absent})
            data_cols = data_cols + absent
        if step.how in ("inner", "left"):
            # A stream row's matches are the static rows with its join values: numbered
            # here, within those (in the order of their content), they are the row's
            # repeats, and the second on gets `~n` on its key. Numbered at the join, a
            # repeat keeps its key whatever later steps do to the others (numbered at the
            # writer, a repeat a later step failed, or whose flat_map failed into one
            # row, renumbered the rest on a retry: a row went under another's key).
            order = Window.partitionBy(*[quoted(c) for c in step.on]).orderBy(
                F.to_json(F.struct(*[quoted(c) for c in other.columns]))
            )
            right = other.withColumn("__af_match", F.lit(True)).withColumn(
                "__af_rep", F.row_number().over(order) - 1
            )
        else:  # semi/anti: only whether a match exists
            right = other.select(*step.on).dropDuplicates().withColumn("__af_match", F.lit(True))
            extra = []
        # Always a left join, so that no stream row (nor its receipt) can vanish; the
        # rows an inner/semi join would drop are marked filtered instead.
        out = df.join(F.broadcast(right), on=list(step.on), how="left")
        matched = F.col("__af_match").isNotNull()
        drop = {"inner": ~matched, "left_semi": ~matched, "left_anti": matched}.get(step.how)
        if drop is not None:
            out = out.withColumn(STATUS, F.when(live & drop, F.lit(FILTERED)).otherwise(F.col(STATUS)))
        if "__af_rep" in out.columns:
            out = out.withColumn(
                KEY,
                F.when(
                    F.col("__af_rep") > 0, F.concat(F.col(KEY), F.lit("~"), F.col("__af_rep").cast("string"))
                ).otherwise(F.col(KEY)),
            )
        return out.drop("__af_match", "__af_rep"), data_cols + extra, lineage

    def _refuse(
        self, df: DataFrame, data_cols: list[str], cols: list[str], step: str, why: str
    ) -> tuple[DataFrame, list[str]]:
        """Columns from the data that a step cannot take: each live row with a value in
        one of them fails (naming the field), and the columns are dropped."""
        if not cols:
            return df, data_cols
        live = F.col(STATUS) == LIVE
        for c in cols:
            hit = live & quoted(c).isNotNull()
            df = df.withColumns(
                {
                    STATUS: F.when(hit, F.lit(FAILED)).otherwise(F.col(STATUS)),
                    STEP: F.when(hit, F.lit(step)).otherwise(F.col(STEP)),
                    ERR: F.when(hit, F.lit(f"field {c!r}: {why}")).otherwise(F.col(ERR)),
                }
            )
        keep = [c for c in data_cols if c not in cols]
        internal = [c for c in df.columns if c.startswith("__af_")]
        return df.select(*[quoted(c) for c in keep], *internal), keep

    def _transform(self, step: Transform, df: DataFrame, lineage: str) -> tuple[DataFrame, list[str], str]:
        try:
            out = step.fn(df)
        except AnalysisException:
            raise
        except Exception as e:
            raise FlowError(step.name, f"transform function raised {type(e).__name__}: {e}") from e
        if not isinstance(out, DataFrame):
            raise FlowError(step.name, f"transform must return a DataFrame, got {type(out).__name__}")
        lost = [c for c in (lineage, KEY, STATUS, STEP, ERR) if c not in out.columns]
        if lost:
            raise FlowError(
                step.name,
                f"the DataFrame returned lost ackflow's column(s) {lost}; "
                "keep them (select them along, or use withColumn)",
            )
        expected = internal_schema(lineage)
        types = {f.name: f.dataType for f in out.schema.fields}
        want = from_arrow_schema(expected)[lineage].dataType
        if types[lineage].simpleString() != want.simpleString():  # nullability aside
            raise FlowError(step.name, f"column {lineage} changed type to {types[lineage]}")
        cols = [c for c in out.columns if not c.startswith("__af_")]
        check_names(step.name, cols, "the returned DataFrame's")
        return self._number_repeats(step, out, cols, lineage), cols, lineage

    def _number_repeats(self, step: Transform, df: DataFrame, cols: list[str], lineage: str) -> DataFrame:
        """Rows a transform repeated (a union with itself, an explode) share their key:
        number them across the whole batch, not within a writer's partition (a copy in
        another partition kept its original's key, and a keyed sink kept one of the
        two). Among one key's rows, in the order of their content, the n-th (n >= 1)
        gets ``~0~<step index>~n``: ``~0`` no other step makes (joins and the writer
        number from 1), and the step index keeps a later transform's repeats apart from
        this one's, so the keys stay unique when transforms are chained."""
        tag = f"~0~{self.step_order.index(step.name)}~"
        content = F.to_json(F.struct(*[quoted(c) for c in cols], F.col(lineage)))
        rep = F.row_number().over(Window.partitionBy(KEY).orderBy(content)) - 1
        return (
            df.withColumn("__af_rep", rep)
            .withColumn(
                KEY,
                F.when(
                    F.col("__af_rep") > 0, F.concat(F.col(KEY), F.lit(tag), F.col("__af_rep").cast("string"))
                ).otherwise(F.col(KEY)),
            )
            .drop("__af_rep")
        )


class _Counted:
    """A job's receipts whose messages the driver counts into and out of decoding once
    the job has succeeded (the JVM decoded them: no task of Python counted them; a task
    of a failed job counts nothing either)."""

    def __init__(self, receipts: DataFrame, tally: Any, n: int) -> None:
        self.receipts, self.tally, self.n = receipts, tally, n

    def toArrow(self) -> pa.Table:  # the Receipts protocol (Spark's name)
        table = self.receipts.toArrow()
        self.tally.add({"decode": (self.n, self.n, 0)})
        return table


def _fused(
    segment: Fn, writer: Fn, schema: pa.Schema, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """A Python segment and the writer in one pass (see :meth:`CompiledFlow._write`)."""

    def shaped() -> Iterator[pa.RecordBatch]:
        for batch in segment(batches):
            batch = batch.select(schema.names)
            yield batch if batch.schema.equals(schema) else batch.cast(schema)

    return writer(shaped())


def quoted(name: str) -> Column:
    """A column by its exact name: dots, backticks and spaces in it are not syntax."""
    return F.col("`" + name.replace("`", "``") + "`")


def check_executors_can_load(spark: SparkSession, shipped: dict[str, bytes]) -> None:
    """Unpickle every step and the sink on an executor; name the one that fails."""

    def load(item: tuple[str, bytes]) -> tuple[str, str | None]:
        import pickle

        name, blob = item
        try:
            pickle.loads(blob)
            return name, None
        except Exception as e:  # noqa: BLE001 - reported on the driver, by name
            return name, f"{type(e).__name__}: {e}"

    items = list(shipped.items())
    results = spark.sparkContext.parallelize(items, 1).map(load).collect()
    for name, error in results:
        if error is not None and "No module named 'ackflow'" in error:
            raise FlowError(
                name,
                "the executors' Python has no ackflow installed: install it "
                "there, or point PYSPARK_PYTHON at the interpreter that has it",
            )
        if error is not None:
            raise FlowError(
                name,
                f"the executors cannot load it ({error}). Make its module "
                "importable there: run the flow with `ackflow run file.py:flow` "
                "(the file is shipped by value), or add the module with "
                "SparkContext.addPyFile / spark.submit.pyFiles",
            )


def _column(expr: Any) -> Any:
    return F.expr(expr) if isinstance(expr, str) else expr


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
