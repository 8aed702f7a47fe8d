"""One batch: run its Spark job, bisect a job that fails as a whole, commit the sink.

Law 7: errors are data. A row error fails only its message (the tasks record it);
a job that fails as a whole (an ANSI cast error, a crashed Python worker) is split
in halves and retried until the poison messages are isolated. The bisection has a
budget of Spark jobs per batch; when it is spent, the rest of the batch fails.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from ackflow import faults
from ackflow.core.errors import FlowError, StoreAway, describe, of_row_data
from ackflow.core.groups import Group
from ackflow.core.ledger import Failure, Outcomes, settle_receipts
from ackflow.core.schema import parse_miss
from ackflow.core.settlement import Delivery
from ackflow.engine.blocks import messages, stateless
from ackflow.flow import Transform
from ackflow.sinks.collect import CollectSink
from ackflow.spark.job import JobFailed, run_job
from ackflow.spark.plan import Plan

log = logging.getLogger("ackflow.engine")


@dataclass
class BatchResult:
    batch_id: str
    size: int
    outcomes: Outcomes = field(default_factory=Outcomes)
    released: list[int] = field(default_factory=list)  # cancelled at shutdown: give back
    jobs: int = 0
    bisections: int = 0
    evolutions: int = 0  # times rows of the batch ran again after their columns evolved
    seconds: float = 0.0
    collected: list[pa.Table] = field(default_factory=list)  # rows for grouped_within
    member_rows: dict[int, int] = field(default_factory=dict)  # group job: id -> memberships
    #: failed ids whose failure was inferred (their set failed the same way as probes
    #: tried alone), not seen on a job of their own
    untested: set[int] = field(default_factory=set)
    #: (step, error) of a failure -> the whole error text behind it (a traceback, when
    #: Spark sent one), for a systemic failure's last words
    details: dict[tuple[str, str], str] = field(default_factory=dict)
    full_errors: dict[str, str] = field(default_factory=dict)  # job error -> its cause's text
    #: the windows hold their watermark for this batch until the engine lets go
    #: (``Settling._let_go``): it failed as a whole, and its messages may come back
    kept: bool = False


def execute(
    compiled: Plan,
    deliveries: list[Delivery],
    batch_id: str,
    *,
    max_jobs: int,
    cancelled: threading.Event,
    phase: Callable[[str], None] | None = None,
    count: Callable[[bool], None] | None = None,
    uniform_probes: int = 3,
) -> BatchResult:
    """Run ``deliveries`` through the flow; every lineage id gets an outcome or is released.

    ``phase`` (optional) is told ``"job"`` before each Spark job and ``"commit"`` before
    the sinks commit (the status page shows what the window waits on); ``count(bisection)``
    is told of each Spark job (False) and each split (True) as it happens.

    A job that fails as a whole is split in halves. When both halves fail with the very
    error of the whole, the failure may not be the messages' (a sink that refuses
    every row, a bug): up to ``uniform_probes`` messages are then tried alone, and if
    each fails with that same error, the rest of the set gets that failure without a job
    of its own and is marked *untested* (the engine gives untested messages back unless
    the failure is judged systemic: it never dead-letters a message on inference). A
    probe that passes, or fails otherwise, resumes the bisection."""
    result = BatchResult(batch_id, messages(deliveries))
    sink = compiled.sink
    # a partition's write that raised for one row runs again in halves (``rerun``) only
    # where a message's rows are the same whichever messages it runs with
    isolate = stateless(compiled.flow)

    def fail_all(ds: list[Delivery], failure: Failure) -> None:
        for d in ds:
            result.outcomes.failed[d.lineage_id] = failure

    last_error: list[str] = []

    def run_once(ds: list[Delivery], bid: str, evolving: bool = False) -> str | None:
        """One job over ``ds``: None when it ran (its outcomes recorded, or released when
        cancelled, or failed by the budget), else the error that failed it as a whole.
        ``evolving``: the run again after the columns evolved, outside the bisection's
        budget (bounded by MAX_EVOLUTIONS)."""
        if cancelled.is_set():
            result.released.extend(d.lineage_id for d in ds)
            return None
        if result.jobs - result.evolutions >= max_jobs and not evolving and last_error:
            fail_all(
                ds,
                Failure(
                    "spark",
                    f"the Spark job failed and bisection gave up after {max_jobs} jobs: {last_error[-1]}",
                ),
            )
            return None
        result.jobs += 1
        if count is not None:
            count(False)
        ids = [d.lineage_id for d in ds]
        if phase is not None:
            phase("job")
        try:
            job = run_job(compiled, ds, bid)
        except StoreAway as e:  # not the data's: the batch fails as a whole (given back)
            log.error("batch %s: %s", bid, e)
            abort_all(compiled, bid, {})
            fail_all(ds, Failure(e.step, e.why, whole=True))
            return None
        except JobFailed as e:
            text = str(e)
            last_error.append(text)
            abort_all(compiled, bid, {})
            if cancelled.is_set():
                result.released.extend(ids)
                return None
            cause = e.__cause__
            if cause is not None and text not in result.full_errors:
                result.full_errors[text] = str(cause)[:8000]
            return text
        faults.point("batch.after_job")
        if phase is not None:
            phase("commit")
        failed_sink = commit_all(compiled, bid, job.tokens)
        if failed_sink is not None:
            fail_all(ds, failed_sink)
            return None
        faults.point("batch.after_commit")
        collected = sink.take(bid) if isinstance(sink, CollectSink) else []
        stray = _stray_ids(ids, job.receipts)
        if stray:
            culprit = next((s.name for s in compiled.flow.steps if isinstance(s, Transform)), "ledger")
            log.error("batch %s: receipts for %d ids that are not in the batch; failing it", batch_id, stray)
            fail_all(
                ds,
                Failure(
                    culprit,
                    f"the job returned receipts for {stray} lineage ids "
                    "that no message of this batch has (fabricated ids); not acked",
                ),
            )
            return None
        part = settle_receipts(
            ids, job.receipts, required_sinks=compiled.required_sinks, order=compiled.step_order
        )
        if part.over_reported:
            over = set(part.over_reported)
            keys = [d.key for d in ds if d.lineage_id in over]
            log.error(
                "batch %s: a sink reported more rows written than emitted for %d "
                "messages (a bug; failing them, never acking): %s",
                batch_id,
                len(keys),
                keys[:5],
            )
        misses = take_misses(part.failed)
        # rows handed to grouped_within by a message that runs again (its other rows
        # needed new columns) come again from that run: not these, or it is in twice
        result.collected.extend(_without(t, misses.keys()) for t in collected)
        result.outcomes.acked.extend(part.acked)
        result.outcomes.failed.update(part.failed)
        for name, n in job.rows_written.items():
            result.outcomes.rows_written[name] = result.outcomes.rows_written.get(name, 0) + n
        # (the batch's rows as the proof that the sink works: a half's own job may hold
        # no other row to write)
        again = _partition_suspects(ds, part.failed, result.outcomes.rows_written) if isolate else []
        if again and result.jobs - result.evolutions < max_jobs:
            rerun(again, bid, {d.lineage_id: result.outcomes.failed.pop(d.lineage_id) for d in again})
        if misses:
            evolve_then_again([d for d in ds if d.lineage_id in misses], misses, bid)
        return None

    def evolve_then_again(
        ds: list[Delivery], misses: dict[int, tuple[Failure, str, pa.Schema]], bid: str
    ) -> None:
        """Rows of ``ds`` needed columns their segment did not have yet (schema mode
        ``evolve``): record the new version (durable first), then run them again; the
        sinks evolve when the job prepares them. Never a dead letter for shape."""
        result.evolutions += 1
        refused = compiled.evolve(
            [(misses[d.lineage_id][1], misses[d.lineage_id][2], d.identity) for d in ds]
        )
        again = []
        for d in ds:
            failure, segment, _ = misses[d.lineage_id]
            why = refused.get(segment)
            if why is None and result.evolutions > MAX_EVOLUTIONS:
                why = f"its columns had to evolve more than {MAX_EVOLUTIONS} times in one batch"
            if why is not None:
                log.error(
                    "batch %s: message %s needs new columns that cannot be added: %s", batch_id, d.key, why
                )
                # fields Spark cannot hold are the message's own (its dead letter says
                # why); running out of evolutions is not (given back if systemic)
                result.outcomes.failed[d.lineage_id] = Failure(
                    failure.step, f"the columns could not evolve: {why}", whole=segment not in refused
                )
            else:
                again.append(d)
        if again:
            attempt(again, f"{bid}e{result.evolutions}", evolving=True)

    def attempt(ds: list[Delivery], bid: str, evolving: bool = False) -> None:
        """One job over ``ds``, bisected if it fails as a whole."""
        error = run_once(ds, bid, evolving)
        if error is not None:
            if len(ds) == 1:
                alone(ds[0], error)
            else:
                split(ds, bid, error, probe=True)

    def alone(d: Delivery, error: str, whole: bool = False) -> Failure:
        """The failure of a message whose job failed with it alone (``whole``: as the
        whole batch's did, a probe of :func:`probe_each`)."""
        step = _locate(compiled, [d])
        log.warning(
            "batch %s: message %s fails the Spark job on its own in step %r: %s", batch_id, d.key, step, error
        )
        failure = Failure(step, f"the Spark job failed on this message: {error}", whole=whole)
        result.details[(failure.step, failure.error)] = result.full_errors.get(error, "")
        result.outcomes.failed[d.lineage_id] = failure
        return failure

    def split(ds: list[Delivery], bid: str, error: str, probe: bool) -> None:
        """``ds`` (two or more messages) failed as a whole with ``error``: isolate."""
        if result.jobs - result.evolutions + 2 > max_jobs:
            log.error(
                "batch %s: job failed and the bisection budget of %d jobs is spent; failing %d messages: %s",
                batch_id,
                max_jobs,
                len(ds),
                error,
            )
            fail_all(
                ds,
                Failure(
                    "spark", f"the Spark job failed and bisection gave up after {max_jobs} jobs: {error}"
                ),
            )
            return
        half = len(ds) // 2
        result.bisections += 1
        if count is not None:
            count(True)
        log.warning(
            "batch %s: Spark job over %d messages failed (%s); retrying as %d + %d",
            batch_id,
            len(ds),
            error,
            half,
            len(ds) - half,
        )
        halves = [(ds[:half], f"{bid}a"), (ds[half:], f"{bid}b")]
        errors = [run_once(h, b) for h, b in halves]
        if probe and uniform_probes and errors[0] == error and errors[1] == error:
            probe_each(ds, bid, error)
            return
        for (h, b), e in zip(halves, errors, strict=True):
            if e is None:
                continue
            if len(h) == 1:  # failing alone as the whole did: a candidate (the engine judges)
                alone(h[0], e, whole=e == error)
            else:
                split(h, b, e, probe)

    def rerun(ds: list[Delivery], bid: str, failures: dict[int, Failure]) -> None:
        """``ds`` failed together in a sink's partition whose write raised, while the
        sink wrote other partitions of the same job: not each is guilty (one row's data
        may have made the write raise). Run them again in halves, within the bisection's
        budget, until the failure is one message's alone (then judged as usual)."""
        half = len(ds) // 2
        result.bisections += 1
        if count is not None:
            count(True)
        log.warning(
            "batch %s: a sink's write failed for %d messages of one partition while it wrote "
            "others; running them again as %d + %d",
            batch_id,
            len(ds),
            half,
            len(ds) - half,
        )
        for h, b in ((ds[:half], f"{bid}w"), (ds[half:], f"{bid}x")):
            if result.jobs - result.evolutions >= max_jobs:  # the budget is spent: as they were
                result.outcomes.failed.update((d.lineage_id, failures[d.lineage_id]) for d in h)
                continue
            attempt(h, b)

    def probe_each(ds: list[Delivery], bid: str, error: str) -> None:
        """Both halves failed as the whole did: try a few messages alone, spread over the
        set (first, middle, last, then the rest in order: poison that a broker keeps at
        the head of its queue must not be all that is probed). A probe that passes but
        wrote no row (filtered out) proves nothing: the next one is tried."""

        def resume(rest: list[Delivery]) -> None:
            """Not uniform after all: the untried messages as one job, bisected as usual."""
            e = run_once(rest, f"{bid}r") if rest else None
            if e is not None:
                if len(rest) == 1:
                    alone(rest[0], e, whole=e == error)
                else:
                    split(rest, f"{bid}r", e, probe=False)

        order = sorted(
            set(range(len(ds))),
            key=lambda i: (0 if i == 0 else 1 if i == len(ds) // 2 else 2 if i == len(ds) - 1 else 3, i),
        )
        failure: Failure | None = None
        tried: set[int] = set()
        alike = 0
        for i in order:
            if alike >= uniform_probes:
                break
            d = ds[i]
            tried.add(i)
            before = sum(result.outcomes.rows_written.values())
            e = run_once([d], f"{bid}p{i}")
            if e is not None and e == error:
                f = alone(d, e, whole=True)
                failure = failure or f
                alike += 1
                continue
            if (
                e is None
                and sum(result.outcomes.rows_written.values()) == before
                and d.lineage_id not in result.outcomes.failed
            ):
                continue  # passed without writing a row: no proof either way
            if e is not None:  # failed alone, but otherwise: its own failure
                alone(d, e)
            rest = [x for j, x in enumerate(ds) if j not in tried]
            resume(rest)
            return
        rest = [x for j, x in enumerate(ds) if j not in tried]
        if failure is None:  # every probe passed without a row: the rest, as one job
            resume(rest)
            return
        if rest:
            log.error(
                "batch %s: %d messages alone each failed the Spark job the same way as "
                "the whole (%s); the other %d get that failure untested",
                batch_id,
                len(tried),
                error,
                len(rest),
            )
            fail_all(rest, failure)
            result.untested.update(d.lineage_id for d in rest)

    holding = []
    try:
        for s in compiled.sinks:  # a window keeps the batch's place while its jobs (halves, probes) run
            if hasattr(s, "hold"):
                s.hold(batch_id)
                holding.append(s)
    except StoreAway as e:  # its state's database is away: the batch fails as a whole
        log.error("batch %s: %s", batch_id, e)
        fail_all(deliveries, Failure(s.name, e.why, whole=True))
    else:
        attempt(deliveries, batch_id)
    finally:
        # failed as a whole: its messages may be given back (the engine decides); the
        # windows hold their watermark for them until the engine lets go
        result.kept = bool(holding) and any(f.whole for f in result.outcomes.failed.values())
        for s in holding:
            try:
                s.keep(batch_id) if result.kept else s.unhold(batch_id)  # type: ignore[attr-defined]
            except StoreAway as e:  # the watermark moves with a later batch
                log.warning("batch %s: %s", batch_id, e)
    return result


#: a batch runs a message again after its columns evolved at most this many times
MAX_EVOLUTIONS = 16


def _without(table: pa.Table, ids: Collection[int]) -> pa.Table:
    """``table`` (rows for grouped_within) without the rows of the lineage ids ``ids``
    only (a row several messages made stays for the others)."""
    if not ids or table.num_rows == 0:
        return table
    if "__af_ids" in table.column_names:
        gone = set(ids)
        drop = [set(r) <= gone for r in table.column("__af_ids").to_pylist()]
        return table.filter(pa.array([not d for d in drop], pa.bool_()))
    return table.filter(pc.invert(pc.is_in(table.column("__af_id"), pa.array(list(ids), pa.int64()))))


def take_misses(failed: dict[int, Failure]) -> dict[int, tuple[Failure, str, pa.Schema]]:
    """Remove and return the failures that are schema misses (id -> the failure, the
    segment, the columns its row needed): they are run again, never settled as such."""
    out = {}
    parsed: dict[str, tuple[str, pa.Schema] | None] = {}  # rows of a batch share one text
    for lid, f in list(failed.items()):
        if f.error not in parsed:
            parsed[f.error] = parse_miss(f.error)
        miss = parsed[f.error]
        if miss is not None:
            out[lid] = (f, *miss)
            del failed[lid]
    return out


def execute_groups(
    compiled: Plan,
    groups: list[Group],
    keys: tuple[str, ...],
    batch_id: str,
    row_keys: list[str],
    count: Callable[[bool], None] | None = None,
    cancelled: threading.Event | None = None,
    *,
    evolutions: int = 0,
    step_name: str = "grouped_within",
) -> BatchResult:
    """Run emitted ``grouped_within`` groups through the rest of the flow: one Spark job,
    one row per group (keyed by ``row_keys``). If the job fails as a whole, every member
    of every group fails (no bisection here: the groups' messages are retried by their
    source), unless shutdown cancelled it (``cancelled`` set): then every member is
    released (stopping never spends a delivery or makes a dead letter)."""
    from collections import Counter

    from ackflow.spark.job import run_rows_job
    from ackflow.spark.rows import ERR, IDS, KEY, STATUS, STEP

    members = Counter(m for g in groups for m in g.members)
    expected = sorted(members)
    result = BatchResult(batch_id, len(expected), member_rows=dict(members), evolutions=evolutions)
    try:  # rows are outside data: groups keyed by a text and by a list make no one column
        data = pa.Table.from_pylist(
            [
                {
                    **dict(zip(keys, g.values or g.key, strict=True)),
                    "count": len(g.rows),
                    "rows": g.ordered_rows(),
                }
                for g in groups
            ]
        )
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        if len(groups) == 1:  # this group alone cannot be a row: its members fail
            why = f"the group's row cannot be made: {describe(e)}"[:500]
            result.outcomes.failed = {m: Failure(step_name, why) for m in expected}
            return result
        for i, g in enumerate(groups):  # each group as its own job
            one = execute_groups(
                compiled, [g], keys, f"{batch_id}-{i}", [row_keys[i]], count, cancelled, step_name=step_name
            )
            _merge_groups(result, one)
        return result
    n = data.num_rows
    table = (
        data.append_column(IDS, pa.array([sorted(set(g.members)) for g in groups], pa.list_(pa.int64())))
        .append_column(KEY, pa.array(row_keys, pa.string()))
        .append_column(STATUS, pa.array([0] * n, pa.int32()))
        .append_column(STEP, pa.nulls(n, pa.string()))
        .append_column(ERR, pa.nulls(n, pa.string()))
    )
    if cancelled is not None and cancelled.is_set():
        result.released = expected
        return result
    result.jobs = 1
    if count is not None:
        count(False)
    try:
        job = run_rows_job(compiled, table, batch_id)
    except JobFailed as e:
        abort_all(compiled, batch_id, {})
        if cancelled is not None and cancelled.is_set():
            log.warning(
                "groups %s: job over %d groups cancelled at shutdown; their %d messages are given back",
                batch_id,
                n,
                len(expected),
            )
            result.released = expected
            return result
        log.error("groups %s: Spark job over %d groups failed: %s", batch_id, n, e)
        result.outcomes.failed = {
            m: Failure("spark", f"the group's Spark job failed: {e}", whole=True) for m in expected
        }
        return result
    failed_sink = commit_all(compiled, batch_id, job.tokens)
    if failed_sink is not None:
        result.outcomes.failed = dict.fromkeys(expected, failed_sink)
        return result
    result.outcomes = settle_receipts(
        expected, job.receipts, required_sinks=compiled.required_sinks, order=compiled.step_order
    )
    result.outcomes.rows_written = dict(job.rows_written)
    misses = take_misses(result.outcomes.failed)
    if misses:  # groups whose rows needed new columns: evolve, then run those groups again
        refused = compiled.evolve(
            [(seg, schema, f"group of {lid}") for lid, (_, seg, schema) in misses.items()]
        )
        redo = [i for i, g in enumerate(groups) if set(g.members) & set(misses)]
        if refused or result.evolutions >= MAX_EVOLUTIONS or not redo:
            for lid, (f, seg, _) in misses.items():
                why = refused.get(seg, f"more than {MAX_EVOLUTIONS} evolutions")
                result.outcomes.failed[lid] = Failure(
                    f.step, f"the columns could not evolve: {why}", whole=True
                )
            return result
        again = execute_groups(
            compiled,
            [groups[i] for i in redo],
            keys,
            f"{batch_id}e",
            [row_keys[i] for i in redo],
            count,
            cancelled,
            evolutions=result.evolutions + 1,
            step_name=step_name,
        )
        # The groups run again; their members' outcomes there replace the first ones. A
        # failure a member met in a group that is not run again stays (it failed there,
        # whatever the run again gives: acking it would lose that group's row).
        redone = {m for i in redo for m in groups[i].members}
        kept = {m for i, g in enumerate(groups) if i not in redo for m in g.members}
        for m in redone:
            if m in misses or m not in kept:
                result.outcomes.failed.pop(m, None)
        result.outcomes.failed.update(again.outcomes.failed)
        acked = [m for m in result.outcomes.acked if m not in redone]
        acked.extend(again.outcomes.acked)
        result.outcomes.acked = [m for m in acked if m not in result.outcomes.failed]
        _add_counts(result, again)
    return result


def _merge_groups(result: BatchResult, one: BatchResult) -> None:
    """Add the outcomes of a job over other groups (disjoint members) to ``result``."""
    result.outcomes.acked.extend(one.outcomes.acked)
    result.outcomes.failed.update(one.outcomes.failed)
    _add_counts(result, one)


def _add_counts(result: BatchResult, one: BatchResult) -> None:
    """Add a later group job's rows written, released members, jobs and evolutions."""
    for name, n in one.outcomes.rows_written.items():
        result.outcomes.rows_written[name] = result.outcomes.rows_written.get(name, 0) + n
    result.released.extend(one.released)
    result.jobs += one.jobs
    result.evolutions = max(result.evolutions, one.evolutions)


def group_key(row_keys: list[str], values: tuple[object, ...]) -> str:
    """A group's row key: a digest of its rows' keys and its group-by values (as the
    first row had them, as before 0.6.11, so that a group written by an older version
    keeps its key; but a ``-0.0`` as ``0.0``, the value of its equal twin, and an
    object's fields in sorted order: objects could not be keys before)."""
    import hashlib
    import json

    plain = [0.0 if isinstance(v, float) and v == 0 else v for v in values]
    text = json.dumps([sorted(row_keys), plain], default=str, sort_keys=True)
    return "g:" + hashlib.sha256(text.encode()).hexdigest()


def _locate(compiled: Plan, ds: list[Delivery]) -> str:
    """The step that fails the job for this one message ("spark" if that is unknown)."""
    try:
        inputs = compiled.input_table(ds)
        return compiled.locate(inputs)
    except Exception as e:  # noqa: BLE001 - naming the step is a courtesy, not a must
        log.warning("could not locate the failing step: %s", e)
        return "spark"


def commit_all(compiled: Plan, batch_id: str, tokens: dict[str, list[bytes]]) -> Failure | None:
    """Commit every sink of the batch; on the first failure abort the rest and return
    the failure (the batch then fails: nothing is acked)."""
    for sink in compiled.sinks:
        try:
            sink.commit(batch_id, tokens.get(sink.name, []))
        except FlowError:  # the sink cannot go on (not this batch's data): stop the run
            abort_all(compiled, batch_id, tokens)
            raise
        except Exception as e:  # noqa: BLE001 - a failed commit fails the batch, never acks
            log.error("batch %s: sink %r commit failed: %s", batch_id, sink.name, e)
            abort_all(compiled, batch_id, tokens)
            return Failure(sink.name, f"commit failed: {describe(e)}", whole=True)
    return None


def abort_all(compiled: Plan, batch_id: str, tokens: dict[str, list[bytes]]) -> None:
    for sink in compiled.sinks:
        try:
            sink.abort(batch_id, tokens.get(sink.name, []))
        except Exception as e:  # noqa: BLE001 - cleanup only
            log.warning("batch %s: sink %r abort failed: %s", batch_id, sink.name, e)


#: the end of the writer's text for a partition whose write raised (``errors.where``)
_RAISED_AT = re.compile(r" \(at [^()]*:\d+ in [^()]*\)$")


def _partition_suspects(
    ds: list[Delivery], failed: dict[int, Failure], rows_written: dict[str, int]
) -> list[Delivery]:
    """The messages of ``ds`` that failed in a partition write that raised (``write
    failed: ... (at file:line in function)``, the writer's text) of a sink that wrote rows
    in the same job, where more than one failed so (see ``rerun``). A sink's own
    whole-write failures per row (a broker's missing confirms or delivery reports) are
    left to retries: running them again at once would wait for the broker again."""
    by_sink: dict[str, list[Delivery]] = {}
    for d in ds:
        f = failed.get(d.lineage_id)
        if (
            f is not None
            and of_row_data(f.error)  # (a ``write failed: `` text)
            and _RAISED_AT.search(f.error)
            and not f.written  # (rows of it written elsewhere would be written again)
            and rows_written.get(f.step, 0) > 0
        ):
            by_sink.setdefault(f.step, []).append(d)
    return [d for group in by_sink.values() if len(group) > 1 for d in group]


def _stray_ids(expected: list[int], receipts: pa.Table) -> int:
    ids = receipts.column("id")
    return int(pc.sum(pc.invert(pc.is_in(ids, value_set=pa.array(expected, pa.int64())))).as_py() or 0)
