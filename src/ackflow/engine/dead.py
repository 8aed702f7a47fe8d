"""The engine's dead letters: given-up messages written to the flow's error sink, the
record of every failure, and the messages held in flight while their dead letter is
refused (a give-back would cost a delivery the broker does not have for them: a quorum
queue's ``x-delivery-limit``). A mixin of :class:`~ackflow.engine.settle.Settling`; the
state it uses is the engine's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ackflow import faults
from ackflow.core.groups import GroupBuffer
from ackflow.core.ledger import Failure
from ackflow.core.policy import dead_letter_retry_after
from ackflow.core.settlement import Delivery, Settlement
from ackflow.engine.report import RunReport
from ackflow.flow import Flow
from ackflow.observe.metrics import Metrics
from ackflow.observe.status import StatusBoard
from ackflow.sinks.base import ROW_KEY

log = logging.getLogger("ackflow.engine")


class DeadLetters:
    flow: Flow
    report: RunReport
    metrics: Metrics
    board: StatusBoard | None
    groups: GroupBuffer | None
    held: dict[int, int]
    _dead_letter_failures: int
    #: (due, tries, delivery, failure): given up, refused by the error sink, and at a
    #: delivery the broker would drop if given back: held in flight, written again
    dead_waiting: list[tuple[float, int, Delivery, Failure]]
    _ending: bool
    # Settling's
    _fail: Callable[[str, list[tuple[Delivery, Failure]]], None]
    _forget: Callable[[list[Delivery]], None]
    _count_redelivered: Callable[[int], None]

    def _dead_letter_to_sink(
        self, batch_id: str, failures: list[tuple[Delivery, Failure]], *, tries: int = 1
    ) -> list[tuple[Delivery, Failure]]:
        """Write given-up messages to the flow's error sink, then settle them; return the
        failures that are still to be retried by the source. Refused, they are nacked, but
        for those at a delivery the broker would drop if given back: held in flight
        (:meth:`_hold_dead`; ``tries``: the how-many-th write this is)."""
        source, sink = self.flow.source, self.flow.error_sink
        assert sink is not None
        done = [(d, f) for d, f in failures if source.exhausted(d)]
        if not done:
            return failures
        rest = [(d, f) for d, f in failures if not source.exhausted(d)]
        try:
            write_dead_letters(sink, f"{batch_id}-dead", done)
        except Exception as e:  # noqa: BLE001 - not written: nack, never drop
            self._dead_letter_failures += len(done)
            self.metrics.dead_letter_write_failures.inc(len(done))
            log.error(
                "batch %s: error sink %r failed to write %d dead letters (%s); nacking "
                "them, or holding those at their last delivery (%d dead-letter writes "
                "failed in this run)",
                batch_id,
                sink.name,
                len(done),
                e,
                self._dead_letter_failures,
            )
            last = {id(d) for d in source.unreleasable([d for d, _ in done])}
            if last and self._ending:
                _log_given_back(sink.name, len(last))
            elif last:
                self._hold_dead([(d, f) for d, f in done if id(d) in last], tries)
                done = [(d, f) for d, f in done if id(d) not in last]
            for d, _ in done:
                d.settle(Settlement.NACKED)
            source.nack(done)
            for d, f in done:
                self._record_failure(d, f, Settlement.NACKED)
            return rest
        faults.point("engine.dead_letter_written")
        self.report.rows_written[sink.name] = self.report.rows_written.get(sink.name, 0) + len(done)
        self.metrics.rows_written.labels(sink=sink.name).inc(len(done))
        for d, _ in done:
            d.settle(Settlement.DEAD_LETTERED)
        stale = {id(d) for d in source.ack([d for d, _ in done]) or ()}
        for d, f in done:
            if id(d) in stale:  # written, but the source comes with it again: written again
                d.revise(Settlement.RELEASED)
                self._count_redelivered(1)
            else:
                self._record_failure(d, f, Settlement.DEAD_LETTERED, kept_by=sink.name)
        return rest

    def _held_ids(self) -> set[int]:
        """``id()`` of the deliveries held for their dead letters (:meth:`_hold_dead`):
        failed for good, not settled; never failed, given back or acked again."""
        return {id(w[2]) for w in self.dead_waiting}

    def _hold_dead(self, failures: list[tuple[Delivery, Failure]], tries: int = 1) -> None:
        """Keep given-up messages whose dead letter the error sink refused in flight
        (unsettled: they hold their credits, so a sink down for long stops the pulling)
        and write them again after a backoff: a give-back would spend a delivery the
        broker does not have for them (a quorum queue's ``x-delivery-limit``), and it
        would drop them. Their rows still waiting in ``grouped_within`` groups go (the
        groups are written without them), as for any failed message."""
        wait = dead_letter_retry_after(tries)
        due = time.monotonic() + wait
        self.dead_waiting.extend((due, tries, d, f) for d, f in failures)
        waiting = {d.lineage_id for d, _ in failures if self.held.pop(d.lineage_id, 0) > 0}
        if waiting and self.groups is not None:
            self.groups.discard(waiting)
        log.warning(
            "%d given-up messages are at their last delivery (a give-back would make the "
            "broker drop them): held in flight, their dead letters written again in %.1f s",
            len(failures),
            wait,
        )

    def _retry_dead_letters(self, *, now_all: bool = False) -> None:
        """Write the held dead letters that are due (all of them with ``now_all``)."""
        now = time.monotonic()
        waiting = [w for w in self.dead_waiting if not w[2].settled]  # a lost channel: gone
        due = [w for w in waiting if now_all or w[0] <= now]
        self.dead_waiting = [w for w in waiting if not (now_all or w[0] <= now)]
        if not due:
            return
        tries = max(t for _, t, _, _ in due) + 1  # refused again: a longer wait
        left = self._dead_letter_to_sink("dead-letter-retry", [(d, f) for _, _, d, f in due], tries=tries)
        if left:  # (exhausted once, exhausted still: a guard)
            self._fail("dead-letter-retry", left)
        self._forget([d for _, _, d, _ in due])

    def _give_up_held(self) -> None:
        """The run ends with dead letters still refused: nack them (their original
        failure), the broker's to drop, with one error line."""
        held = [(d, f) for _, _, d, f in self.dead_waiting if not d.settled]
        self.dead_waiting = []
        if not held:
            return
        _log_given_back(self.flow.error_sink.name if self.flow.error_sink is not None else None, len(held))
        for d, _ in held:
            d.settle(Settlement.NACKED)
        self.flow.source.nack(held)
        for d, f in held:
            self._record_failure(d, f, Settlement.NACKED)
        self._forget([d for d, _ in held])

    def _late_dead_letter(self, d: Delivery, f: Failure) -> None:
        """A failure recorded as nacked (its dead letter refused) that the source held
        and dead-lettered since: counted as a dead letter instead."""
        self.report.nacked -= 1
        self._count_dead_letter(d, f)
        for entry in self.report.failures:
            if entry["message"] == d.key and entry["outcome"] == Settlement.NACKED.value:
                entry["outcome"] = Settlement.DEAD_LETTERED.value
        if self.board is not None:
            self.board.failed(d, f, Settlement.DEAD_LETTERED.value, kept_by="source", ref=None)

    def _count_dead_letter(self, d: Delivery, f: Failure) -> None:
        """A dead letter in the report, the metrics and the log."""
        self.report.dead_lettered += 1
        self.report.dead_lettered_by_step[f.step] = self.report.dead_lettered_by_step.get(f.step, 0) + 1
        self.metrics.dead_lettered.labels(step=f.step).inc()
        log.info("message %s dead-lettered after %d deliveries: %s", d.key, d.delivery_count, f)
        self.report.count_reason(f.step, f.error)

    def _record_failure(self, d: Delivery, f: Failure, state: Settlement, *, kept_by: str = "source") -> None:
        if state is Settlement.DEAD_LETTERED:
            self._count_dead_letter(d, f)
        else:
            self.report.nacked += 1
            self.metrics.nacked.inc()
            log.debug("message %s nacked (delivery %d): %s", d.key, d.delivery_count, f)
        if self.board is not None:
            ref = (
                self.flow.source.dead_letter_ref(d)
                if kept_by == "source" and state is Settlement.DEAD_LETTERED
                else None
            )
            self.board.failed(d, f, state.value, kept_by=kept_by, ref=ref)
        self.report.failures_total += 1
        if len(self.report.failures) < 20:
            self.report.failures.append(
                {"message": d.key, "step": f.step, "error": f.error, "outcome": state.value}
            )


def _log_given_back(sink: str | None, n: int) -> None:
    log.error(
        "the run is ending and the error sink %r still refuses the dead letters of %d "
        "messages at their last delivery: they are given back, and the broker drops them "
        "(or moves them to the queue's own x-dead-letter-exchange)",
        sink,
        n,
    )


def write_dead_letters(sink: Any, batch_id: str, failures: list[tuple[Delivery, Failure]]) -> None:
    """Write failed messages with their provenance to ``sink`` and commit; raise if any
    row was not written."""
    import json

    import pyarrow as pa

    now = time.time()
    table = pa.Table.from_pylist(
        [
            {
                "message": d.identity,
                "body": d.body,
                "headers": json.dumps(d.headers),
                "step": f.step,
                "error": f.error,
                "deliveries": d.delivery_count,
                "failed_at": now,
            }
            for d, f in failures
        ],
        schema=pa.schema(
            [
                ("message", pa.string()),
                ("body", pa.binary()),
                ("headers", pa.string()),
                ("step", pa.string()),
                ("error", pa.string()),
                ("deliveries", pa.int64()),
                ("failed_at", pa.float64()),
            ]
        ),
    )
    table = sink.dead_letter_rows(table)  # in the types its readers want (PostgreSQL: text)
    sink.prepare(table.schema)  # the error sink is a sink: check or create its table first
    if getattr(sink, "wants_keys", False):  # a dead letter written again is the same row
        table = table.append_column(ROW_KEY, pa.array([d.identity for d, _ in failures], pa.string()))
    result = sink.write_partition(batch_id, 0, table)
    if result.failed:
        sink.abort(batch_id, [result.token] if result.token else [])
        raise RuntimeError(
            f"{len(result.failed)} dead letters were refused: {next(iter(result.failed.values()))}"
        )
    sink.commit(batch_id, [result.token] if result.token else [])
