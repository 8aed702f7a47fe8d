"""An in-process executor of a plan: the same task code, no JVM.

:class:`LocalFlow` runs a flow's batches the way :class:`~ackflow.spark.compile.
CompiledFlow` does on Spark: the batch is cut into ``parallelism`` partitions, each
partition's Python segments run through the very ``mapInArrow`` functions Spark runs
(:func:`~ackflow.spark.rows.make_segment`, the sampler that infers columns, the
writer that returns receipts), each task gets its own unpickled copy of the steps and
the sink, and an exception that escapes a task fails the job as a whole (then the
engine bisects, exactly as on Spark). It exists so that the model-based test can run
thousands of whole-engine examples in minutes.

What it does not cover, by design (those run on Spark in their own tests):

* Column steps (``with_columns``, Column filters), ``group_by(...).agg``, ``join`` and
  ``transform``: they are Spark expressions; a flow with one is refused here.
* Spark's own conversions: Arrow data goes from one task function to the next as it
  came out (Spark re-encodes it through its own types; the round trip of the schema
  through Spark's types is still applied), DDL-string ``schema=`` needs a JVM to parse
  (give a pyarrow schema), and nothing runs in a separate Python worker process (a
  step that kills its process kills this one).
* Task retries, speculative tasks, executor loss and job cancellation (jobs are not
  interrupted at shutdown; the engine's drain waits for them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pyarrow as pa
from pyspark import cloudpickle

from ackflow.core.errors import FlowError
from ackflow.flow import PYTHON_STEPS, Flow
from ackflow.sinks.base import Sink
from ackflow.spark.plan import Plan, Segment
from ackflow.spark.rows import (
    ERR,
    IDS,
    KEY,
    LOCAL_TASK,
    STATUS,
    STEP,
    TASK_RECEIPTS,
    LocalTally,
    internal_schema,
    make_segment,
)
from ackflow.spark.writer import make_writer

Partitions = list[pa.Table]
TaskFn = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


class TaskFailed(Exception):
    """A task raised: the job fails as a whole (like a Spark task failure)."""


class _Done:
    """A finished job's receipts, fetched like a Spark DataFrame's (``toArrow()``)."""

    def __init__(self, table: pa.Table) -> None:
        self._table = table

    def toArrow(self) -> pa.Table:
        return self._table


class LocalFlow(Plan):
    """A flow run in this process, with ``parallelism`` partitions per batch."""

    spark = None

    def __init__(
        self, flow: Flow, *, rows_input: bool = False, parallelism: int = 2, count_rows: bool = False
    ) -> None:
        super().__init__(flow, parallelism=parallelism, rows_input=rows_input)
        if count_rows:
            self.tally = LocalTally()
        fork = flow.forked
        steps = [*(flow.steps[:-1] if fork else flow.steps)]
        for b in fork.branches if fork is not None else ():
            steps += b.steps
        for step in steps:
            if not isinstance(step, PYTHON_STEPS):
                raise FlowError(
                    step.name,
                    f"the local executor runs Python steps only "
                    f"(map, filter, flat_map), not {step.kind}; run on Spark",
                )

    # -- tasks --------------------------------------------------------------------------

    def _tasks(self, fn: TaskFn, parts: Partitions, schema: pa.Schema | None) -> Partitions:
        """Run ``fn`` over each partition, each with its own unpickled copy of ``fn``."""
        blob = cloudpickle.dumps(fn)
        out = []
        for index, part in enumerate(parts):
            task = cloudpickle.loads(blob)
            LOCAL_TASK.partition = index
            try:
                batches = list(task(iter(part.to_batches())))
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                raise TaskFailed(f"task {index} failed: {type(e).__name__}: {e}") from e
            finally:
                LOCAL_TASK.partition = 0
            out.append(
                pa.Table.from_batches(batches, schema=schema)
                if schema is not None
                else pa.Table.from_batches(batches)
            )
        return out

    def _sample(self, parts: Partitions, sampler: TaskFn) -> list[tuple[str, int]]:
        # the steps before it do not run again here (the partitions are their output)
        return [
            (t.column("schema")[0].as_py(), t.column("rows")[0].as_py())
            for t in self._tasks(sampler, parts, None)
        ]

    # -- the job ------------------------------------------------------------------------

    def job(self, inputs: pa.Table, batch_id: str) -> _Done:
        parts, schema, lineage = self._start(inputs)
        parts, schema, alive = self._chain(
            self.segments, (), parts, schema, lineage, decode=not self.rows_input
        )
        if not self.branches:
            return _Done(self._write(self.sink, parts, schema, lineage, batch_id))
        outs = []
        for b, (segs, sink) in enumerate(self.branches):
            bparts, bschema, _ = self._chain(
                segs if alive else [], (b,), parts, schema, lineage, decode=False
            )
            outs.append(self._write(sink, bparts, bschema, lineage, batch_id))
        return _Done(pa.concat_tables(outs))

    def _start(self, inputs: pa.Table) -> tuple[Partitions, pa.Schema, str]:
        parts = [pa.Table.from_batches([b]) for b in inputs.to_batches() if b.num_rows]
        if self.rows_input:
            data = pa.schema([f for f in inputs.schema if not f.name.startswith("__af_")])
            return parts, data, IDS
        from ackflow.spark.rows import ID

        return parts, pa.schema([]), ID

    def _chain(
        self,
        segs: list[Segment],
        key: tuple[int, ...],
        parts: Partitions,
        schema: pa.Schema,
        lineage: str,
        decode: bool,
    ) -> tuple[Partitions, pa.Schema, bool]:
        for index, seg in enumerate(segs):
            data_in = None if decode and index == 0 else list(schema.names)
            sample = functools.partial(self._sample, parts)
            out = self._schema((*key, index), seg, sample, data_in, lineage)
            if out is not None and (*key, index) in self._probing:
                self.probe((*key, index), seg, sample, data_in, lineage)
                out = self._schemas[(*key, index)]
            dead_end = out is None
            schema = out if out is not None else pa.schema([])
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
            )
            parts = self._tasks(fn, parts, out_schema)
            if dead_end:
                return parts, schema, False
        return parts, schema, True

    def _write(
        self, sink: Sink, parts: Partitions, schema: pa.Schema, lineage: str, batch_id: str
    ) -> pa.Table:
        cols = list(schema.names)
        refused = {}
        if type(sink).prepare is not Sink.prepare:
            refused = self.prepare_sink(sink, schema)
        parts = [p.select([*cols, lineage, KEY, STATUS, STEP, ERR]) for p in parts]
        writer = make_writer(sink, batch_id, cols, lineage, self.step_order, self.tally, refused)
        out = self._tasks(writer, parts, TASK_RECEIPTS)
        return pa.concat_tables(out) if out else TASK_RECEIPTS.empty_table()

    def locate(self, inputs: pa.Table) -> str:
        """The first step whose plan prefix fails on its own over ``inputs``."""
        parts, schema, lineage = self._start(inputs)
        for k, seg in enumerate(self.segments, start=1):
            try:
                with self.uncounted():
                    _, _, alive = self._chain(
                        self.segments[:k], (), parts, schema, lineage, decode=not self.rows_input
                    )
            except TaskFailed:
                return "+".join(s.name for s in seg.steps) or "decode"
            if not alive:
                break
        return self.sink.name if len(self.sinks) == 1 else "broadcast"
