"""Settling: what the driver loop does with a batch that came back.

Each message is settled once (acked, failed, released or forgotten) when every row
derived from it is written, fails, or is given back; rows handed to grouped_within
hold their messages until their groups are written. :class:`Settling` is the part of
the :class:`~ackflow.engine.loop.Engine` that does this, on the engine's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from ackflow import faults
from ackflow.core.errors import SystemicFailure, describe
from ackflow.core.groups import GroupBuffer
from ackflow.core.ledger import Failure
from ackflow.core.secrets import redact
from ackflow.core.settlement import Delivery, Settlement
from ackflow.core.systemic import ANY_STEP, SystemicDetector
from ackflow.core.window import InflightWindow
from ackflow.engine.batch import BatchResult
from ackflow.engine.blocks import live_all, messages
from ackflow.engine.dead import DeadLetters, write_dead_letters  # noqa: F401 - re-exported
from ackflow.engine.report import RunReport
from ackflow.flow import Flow, GroupedWithin
from ackflow.observe.metrics import Metrics
from ackflow.observe.status import StatusBoard
from ackflow.sinks.base import ROW_KEY
from ackflow.sources.rabbitmq_keys import UNNAMED

log = logging.getLogger("ackflow.engine")

#: how long a message that waits for another message's row stays in flight before it
#: runs again (a dedupe's repeat of an unsettled first)
PARK_S = 1.0

#: how long the windows hold their watermark for messages given back (a batch failed
#: as a whole: a database away, a sink down) that have not come back and settled: a
#: message another process took, or a source that keeps it longer, lets go then
BACK_HOLD_S = 600.0


class Settling(DeadLetters):
    """The engine's settling methods; the state they share is the engine's (set in
    ``Engine.__init__``)."""

    flow: Flow
    parked: list[tuple[float, Delivery]]
    report: RunReport
    metrics: Metrics
    window: InflightWindow
    systemic: SystemicDetector
    board: StatusBoard | None
    inflight: dict[int, Delivery]  # lineage id -> its delivery, until settled
    groups: GroupBuffer | None
    held: dict[int, int]
    batch_seconds: deque[float]
    _live: dict[str, int]
    _dupes: dict[int, list[Delivery]]
    #: batch id -> (since, identities given back not yet settled): windows hold their
    #: watermark for them (:meth:`_let_go`)
    _back: dict[str, tuple[float, set[str]]]
    _back_now: list[str] | None
    _next_id: int
    _gw_index: int
    _pause_until: float
    _counts_lock: threading.Lock
    _dead_letter_failures: int
    _blocks: bool

    def _admit(self, got: list[Delivery]) -> list[Delivery]:
        """Give pulled deliveries their lineage ids and put them in flight; the ones to
        batch (law 12: a delivery of an identity already in flight waits for the first
        to settle, and contributes nothing)."""
        pulled_at = time.monotonic()
        inflight, live, lid = self.inflight, self._live, self._next_id
        fresh = []
        repeats = []
        try:
            for d in got:
                d.lineage_id = mine = lid
                lid += 1  # first: an id given out is never given again, whatever raises
                d.pulled_at = pulled_at
                inflight[mine] = d
                if d.parts is not None:  # a block of messages: each identity is live
                    if live_all(live, d.parts[0], mine):
                        fresh.append(d)
                    else:  # one of them is in flight already: split (law 12 for each)
                        repeats.append(d)
                    continue
                first = live.setdefault(d.identity, mine)
                if first == mine:
                    fresh.append(d)
                else:  # one identity, one contribution: held until the first settles
                    self._dupes.setdefault(first, []).append(d)
                    self.report.duplicates += 1
        finally:
            self._next_id = lid
        if repeats:
            self._split_blocks([(d, Failure("engine", "a repeat of a message in flight")) for d in repeats])
            self._forget(repeats)
        return fresh

    # -- settling -----------------------------------------------------------------------

    def _ack(self, deliveries: list[Delivery]) -> None:
        """Settle first (a second settle raises here, before the broker hears of it), then
        ack at the source; what it refuses (a stale receipt) becomes released."""
        if not deliveries:
            return
        Delivery.settle_all(deliveries, Settlement.ACKED)
        if faults.active() and len(deliveries) == 1 and deliveries[0].messages > 1:
            faults.point("engine.mid_ack")  # one block: its ack is one call (none before)
        if faults.active() and len(deliveries) > 1:  # a middle, for the fault point
            half = len(deliveries) // 2
            stale = {id(d) for d in self.flow.source.ack(deliveries[:half]) or ()}
            faults.point("engine.mid_ack")
            stale |= {id(d) for d in self.flow.source.ack(deliveries[half:]) or ()}
        else:
            stale = {id(d) for d in self.flow.source.ack(deliveries) or ()}
        for d in deliveries:
            if id(d) in stale:
                d.revise(Settlement.RELEASED)
        # a block's messages whose ack the source refused (its others were acked)
        lost = sum(self.flow.source.unacked(d) for d in deliveries if id(d) in stale) if stale else 0
        self._count_redelivered(lost)
        n = self._count(deliveries) - lost
        self.report.acked += n
        self.metrics.acked.inc(n)
        if self.board is not None:
            self.board.acked([d for d in deliveries if id(d) not in stale] if stale else deliveries)

    def _count_redelivered(self, n: int) -> None:
        if n:
            log.warning(
                "%d deliveries could not be settled (their channel or lease is gone); "
                "the source delivers them again",
                n,
            )
            self.report.redelivered += n
            self.metrics.redelivered.inc(n)

    def _drop_lost(self) -> None:
        """Stop tracking deliveries the source lost (it delivers them again)."""
        lost = [d for d in self.flow.source.take_lost() if not d.settled and d.lineage_id in self.inflight]
        for d in lost:
            d.settle(Settlement.RELEASED)
        self._count_redelivered(self._count(lost))
        self._forget(lost)
        # acks the engine counted that never reached the broker: no acks, they come again
        # (of a block, those of its messages whose acks were not sent: unacked())
        source = self.flow.source
        unsent = [d for d in source.take_unsent_acks() if d.state is Settlement.ACKED and not d.revised]
        for d in unsent:
            d.revise(Settlement.RELEASED)
        if unsent:
            n = sum(source.unacked(d) for d in unsent)
            self.report.acked -= n
            self._count_redelivered(n)
        # failures reported nacked (their dead letter refused) that the source held and
        # dead-lettered since
        for d, f in self.flow.source.take_dead_lettered():
            self._late_dead_letter(d, f)

    def _count(self, deliveries: Sequence[Delivery]) -> int:
        """The source messages ``deliveries`` carry (a block carries several)."""
        return messages(deliveries) if self._blocks else len(deliveries)

    def _uncount_split(self, result: BatchResult, failures: list[tuple[Delivery, Failure]]) -> None:
        """The rows that blocks about to be split (``failures``: their own, not a whole
        write's) wrote are written again when their messages come one by one: out of this
        batch's count (a broadcast's receipt names the broadcast; its rows were written by
        each branch, or by the primary)."""
        written = result.outcomes.rows_written
        for d, f in failures:
            if d.messages == 1:
                continue
            for sink, n in f.written:
                target = next((s for s in self.flow.sinks if s.name == sink), None)
                branches = [b.name for b in getattr(target, "branches", ())]
                if branches and getattr(target, "mode", "all") != "all":
                    branches = branches[:1]
                for name in branches or [sink]:
                    if name in written:
                        written[name] = max(0, written[name] - n)

    def _split_blocks(self, failures: list[tuple[Delivery, Failure]]) -> list[tuple[Delivery, Failure]]:
        """Blocks among ``failures`` are split (engine/blocks.py): settled ``RELEASED``,
        counted in ``split``, their messages delivered again one by one by the source.
        The other failures are returned."""
        if not self._blocks:
            return failures
        blocks = [d for d, _ in failures if d.messages > 1 and not d.settled]
        if not blocks:
            return failures
        for d in blocks:
            d.settle(Settlement.RELEASED)
        self.flow.source.split(blocks)
        self.report.split += messages(blocks)  # they come again, one by one
        log.debug("%d blocks failed (%s): their messages come one by one", len(blocks), failures[0][1].error)
        return [(d, f) for d, f in failures if d.messages == 1]

    def _fail(self, batch_id: str, failures: list[tuple[Delivery, Failure]]) -> None:
        failures = self._split_blocks(failures)
        if self.dead_waiting:  # held for their dead letters already: decided
            held = self._held_ids()
            failures = [(d, f) for d, f in failures if id(d) not in held]
        if failures and self.flow.error_sink is not None:
            failures = self._dead_letter_to_sink(batch_id, failures)
        if not failures:
            return
        source = self.flow.source
        for d, _ in failures:  # settled first; the source may answer otherwise (below)
            d.settle(Settlement.DEAD_LETTERED if source.exhausted(d) else Settlement.NACKED)
        faults.point("engine.before_fail")
        states = source.fail(failures)
        for (d, f), state in zip(failures, states, strict=True):
            if state is Settlement.NACKED and d.state is Settlement.DEAD_LETTERED:
                # given up, but the dead-letter route refused it (a full dead-letter
                # queue, say): nacked, retried later; counted as a dead-letter failure
                self._dead_letter_failures += 1
                self.metrics.dead_letter_write_failures.inc()
            if state is not d.state:
                d.revise(state)
            if state is Settlement.RELEASED:
                self._count_redelivered(1)
            else:
                self._record_failure(d, f, state)

    def _forget(self, deliveries: list[Delivery]) -> None:
        """Drop settled deliveries from the window (their credits return). A message that
        still had rows waiting in grouped_within groups (it failed, or its source lost it)
        takes them out: those groups are written without it, and it comes again."""
        inflight, live, held, all_dupes = self.inflight, self._live, self.held, self._dupes
        done = [d for d in deliveries if d.state is not Settlement.PENDING and d.lineage_id in inflight]
        waiting = set()
        followers = []
        for d in done:
            lid = d.lineage_id
            del inflight[lid]
            if held and held.pop(lid, 0) > 0:
                waiting.add(lid)
            if d.parts is not None:
                for identity in d.parts[0]:
                    if live.get(identity) == lid:
                        del live[identity]
            else:
                identity = d.identity
                if live.get(identity) == lid:
                    del live[identity]
            dupes = all_dupes.pop(lid, None) if all_dupes else None
            if dupes:
                followers.append((d, dupes))
        if self.groups is not None:
            self.groups.discard(waiting)
        if self._back:
            self._came_back([d for d in done if d.state in (Settlement.ACKED, Settlement.DEAD_LETTERED)])
        self.window.give_back(self._count(done))
        for first, dupes in followers:
            self._settle_duplicates(first, dupes)

    def _settle_duplicates(self, first: Delivery, dupes: list[Delivery]) -> None:
        """Law 12: deliveries of an identity that was in flight already (a producer's
        re-send, a redelivery racing a slow batch) contributed nothing; they settle as
        what the first became: acked with it (its rows, or its dead letter, stand for
        them), else given back to come again."""
        live = [d for d in dupes if not d.settled]
        if not live:
            return
        if first.state in (Settlement.ACKED, Settlement.DEAD_LETTERED):
            log.info(
                "%d repeated deliveries of %s settled as the first (%s)",
                len(live),
                first.identity,
                first.state.value,
            )
            self._ack(live)
        else:
            self._give_back([(d, Failure("engine", "a repeat of a message in flight")) for d in live])
        self._forget(live)

    def _settle(self, result: BatchResult, deliveries: list[Delivery]) -> None:
        # deliveries the source lost meanwhile are settled (released) already: skip them
        by_id = {d.lineage_id: d for d in deliveries if not d.settled}
        held = self._hold(result) if self.groups is not None else set()
        acked = [by_id[i] for i in result.outcomes.acked if i not in held and i in by_id]
        self._ack(acked)
        failures = [(by_id[i], f) for i, f in result.outcomes.failed.items() if i in by_id]
        # a line's own failure splits its block now; a failure of the write or the job as
        # a whole goes to the systemic judge first (a sink down: given back, paused)
        own = [(d, f) for d, f in failures if not f.whole]
        if self._blocks:
            self._uncount_split(result, own)
        failures = self._split_blocks(own) + [(d, f) for d, f in failures if f.whole]
        self._back_now = [] if result.kept else None
        try:
            failures = self._give_back_systemic(result, failures, acked=bool(acked))
        finally:
            if result.kept:  # the windows hold for what was given back, else let go now
                if self._back_now:
                    self._back[result.batch_id] = (time.monotonic(), set(self._back_now))
                else:
                    self._let_go(result.batch_id)
            self._back_now = None
        waiting = [(d, f) for d, f in failures if f.waits]
        if waiting:  # not their failure: another message's row settles first (a dedupe)
            self._park(waiting)
            failures = [(d, f) for d, f in failures if not f.waits]
        self._fail(result.batch_id, failures)
        self._release([by_id[i] for i in result.released if i in by_id])

        outcome_ids = set(result.outcomes.acked) | set(result.outcomes.failed) | set(result.released)
        missing = [d for d in by_id.values() if d.lineage_id not in outcome_ids]
        if missing:  # cannot happen by construction; never ack what has no outcome
            log.error("batch %s: %d messages got no outcome; failing them", result.batch_id, len(missing))
            lost = Failure("engine", "no outcome for this message; not acked", whole=True)
            self._fail(result.batch_id, [(d, lost) for d in missing])

        self._forget(deliveries)
        self.report.batches += 1
        self._account(result)
        log.debug(
            "batch %s: %d messages, %d acked, %d failed, %d held, %d jobs, %.3f s",
            result.batch_id,
            result.size,
            len(acked),
            len(failures),
            len(held),
            result.jobs,
            result.seconds,
        )

    def _account(self, result: BatchResult) -> None:  # jobs and bisections: _count_job
        for name, n in result.outcomes.rows_written.items():
            if self.groups is not None and name == self.flow.steps[self._gw_index].name:
                continue  # rows handed to grouped_within are not written anywhere yet
            self.report.rows_written[name] = self.report.rows_written.get(name, 0) + n
            self.metrics.rows_written.labels(sink=name).inc(n)
        self.batch_seconds.append(result.seconds)
        if self.board is not None:
            self.board.batch(result.seconds)
        self.metrics.batch_seconds.observe(result.seconds)
        self.metrics.batch_size.observe(result.size)
        self._window_metrics()

    # -- grouped_within ------------------------------------------------------------------

    def _hold(self, result: BatchResult) -> set[int]:
        """Put the rows a batch handed to grouped_within into the buffer; return the ids
        of messages that now wait for their groups (not failed in this batch)."""
        assert self.groups is not None
        step = self.flow.steps[self._gw_index]
        assert isinstance(step, GroupedWithin)
        now = time.monotonic()
        held: set[int] = set()
        for table in result.collected:
            lineage = "__af_ids" if "__af_ids" in table.column_names else "__af_id"
            ids = table.column(lineage).to_pylist()
            keys = table.column(ROW_KEY).to_pylist()
            rows = table.drop_columns([lineage, ROW_KEY]).to_pylist()
            for row, mid, row_key in zip(rows, ids, keys, strict=True):
                members = mid if isinstance(mid, list) else [mid]
                # not a member: failed in this batch, or lost (and forgotten) meanwhile
                members = [
                    m
                    for m in members
                    if m not in result.outcomes.failed and m in self.inflight and not self.inflight[m].settled
                ]
                if not members:
                    continue
                self.groups.add(tuple(row.get(k) for k in step.keys), row, members, now, row_key)
                for m in members:
                    self.held[m] = self.held.get(m, 0) + 1
                    held.add(m)
        return held

    def _settle_groups(self, result: BatchResult) -> None:
        """A group job finished: fail members of failed groups, ack members whose
        every group is now written; a job cancelled at shutdown releases its members."""
        released = [
            d for d in (self.inflight.get(m) for m in result.released) if d is not None and not d.settled
        ]
        self._release(released)
        touched: list[Delivery] = released
        failures = []
        held = self._held_ids()
        for mid, failure in result.outcomes.failed.items():
            d = self.inflight.get(mid)
            if d is not None and not d.settled and id(d) not in held:
                failures.append((d, failure))
                touched.append(d)
        failures = self._give_back_systemic(result, failures, acked=False)
        self._fail(result.batch_id, failures)
        done = []
        held = self._held_ids()  # with those the failures above held
        for mid, n in result.member_rows.items():
            d = self.inflight.get(mid)
            if d is None or d.settled or id(d) in held:  # (held: failed, its groups discarded)
                continue
            left = self.held.get(mid, 0) - n
            self.held[mid] = left
            if left <= 0:
                done.append(d)
        self._ack(done)
        self._forget(touched + done)
        self._account(result)

    def _give_back_systemic(
        self, result: BatchResult, failures: list[tuple[Delivery, Failure]], *, acked: bool
    ) -> list[tuple[Delivery, Failure]]:
        """Give back (release) failures the detector judges systemic; return the rest,
        to be nacked or dead-lettered as usual. Raises :class:`SystemicFailure` once an
        episode has lasted ``systemic_stop_after_s``."""
        working = {name for name, n in result.outcomes.rows_written.items() if n > 0}
        for sink in self.flow.sinks:  # a broadcast, a dedupe: rows are counted by branch
            if any(b.name in working for b in getattr(sink, "branches", ())):
                working.add(sink.name)
        if working:  # rows reached a sink: every step before it works
            working.add(ANY_STEP)
        detector = self.systemic
        was = detector.episode
        # only failures of a write or job as a whole; a message counts once however often
        # it is delivered (its identity), a delivery is given back by its lineage id. A
        # block is never judged, nor given back untested: it is split (no delivery spent),
        # and its messages are judged each by its own identity (a block's label is new at
        # each delivery: given back as a suspect, it came back as a new suspect)
        whole = [(d, f) for d, f in failures if f.whole and d.messages == 1]
        judged = detector.judge(
            [(d.identity, f.step, f.error) for d, f in whole],
            working=working,
            detail=lambda step, error: result.details.get((step, error)) or error,
            stable=lambda identity: UNNAMED not in str(identity),  # (a RabbitMQ message without an id)
        )
        systemic = {d.lineage_id for d, _ in whole if d.identity in judged}
        suspects = {d.lineage_id for d, _ in whole if d.identity in detector.suspects}
        if was is not None and detector.episode is None:
            log.warning(
                "step %r works again: the systemic failure is over (%d deliveries were given back)",
                was.step,
                was.messages,
            )
            self.metrics.systemic.labels(step=was.step).set(0)
        self.report.systemic = detector.episode.as_json() if detector.episode is not None else None
        self.report.systemic_episodes = detector.episodes
        rest = [(d, f) for d, f in failures if d.lineage_id not in systemic]
        untested = {d.lineage_id for d, _ in rest if d.lineage_id in result.untested and d.messages == 1}
        if untested:  # never dead-letter (nor spend a delivery) on an inferred failure
            log.warning(
                "batch %s: %d messages whose failure was inferred, not seen alone, are given back",
                result.batch_id,
                len(untested),
            )
            self._give_back([(d, f) for d, f in rest if d.lineage_id in untested])
            rest = [(d, f) for d, f in rest if d.lineage_id not in untested]
        if suspects:  # a whole failure not yet shown by enough messages: give back, pause
            back = [d for d, _ in rest if d.lineage_id in suspects]
            why = (
                f"a partial outage of {', '.join(map(repr, sorted(detector.partial)))} (it wrote other "
                f"rows): given back while it lasts; the run stops if it lasts {detector.stop_after_s:g} s"
                if detector.partial
                else "given back while it is unknown whether every message fails so"
            )
            log.warning(
                "batch %s: %d messages failed a write or job as a whole (%s); %s",
                result.batch_id,
                self._count(back),
                redact(whole[0][1].error),
                why,
            )
            self._give_back([(d, f) for d, f in rest if d.lineage_id in suspects])
            self._pause_until = max(self._pause_until, time.monotonic() + detector.backoff_s(1))
            rest = [(d, f) for d, f in rest if d.lineage_id not in suspects]
        if not systemic:
            return rest
        episode = detector.episode
        assert episode is not None
        back = [d for d, _ in failures if d.lineage_id in systemic]
        self._give_back([(d, f) for d, f in failures if d.lineage_id in systemic])
        self.report.given_back_systemic += self._count(back)
        self.metrics.given_back_systemic.inc(self._count(back))
        self.metrics.systemic.labels(step=episode.step).set(1)
        pause = detector.backoff_s(detector.strikes)
        self._pause_until = time.monotonic() + pause
        left = detector.stop_after_s - (time.monotonic() - episode.since)
        log.error(
            "batch %s: systemic failure at step %r: %d messages failed the same way "
            "(%s); given back, not dead-lettered; pulling paused %.1f s; the run stops "
            "in %.0f s if it persists",
            result.batch_id,
            episode.step,
            self._count(back),
            episode.error,
            pause,
            max(left, 0),
        )
        self._stop_if_overdue()
        return rest

    def _stop_if_overdue(self) -> None:
        """Raise :class:`SystemicFailure` once the systemic episode has lasted
        ``systemic_stop_after_s``: when a batch settles, and while nothing is in flight
        (the messages given back may never come back: another consumer took them)."""
        detector, episode = self.systemic, self.systemic.episode
        if episode is None or not detector.overdue():
            return
        if episode.detail:
            log.error("the systemic failure in full:\n%s", episode.detail)
        raise SystemicFailure(
            episode.step,
            episode.error,
            messages=episode.messages,
            seconds=detector.stop_after_s,
            detail=episode.detail,
            partial=episode.partial,
        )

    def _count_job(self, bisection: bool) -> None:
        """A Spark job started (a worker thread calls this): live counts for the page."""
        with self._counts_lock:
            if bisection:
                self.report.bisections += 1
                self.metrics.bisections.inc()
            else:
                self.report.jobs += 1
                self.metrics.jobs.inc()

    def _release(self, deliveries: list[Delivery], *, ending: bool = False) -> None:
        """Give back what was not processed; deliveries settled meanwhile (lost with their
        channel, say) are the source's already and are skipped."""
        if not ending and not any(not d.settled for d in deliveries):
            return
        # a release means the run is ending: stop receiving first (a message given back
        # while consuming comes straight back), and settle what was received meanwhile
        extra = self.flow.source.stop_consuming()
        if extra:
            for d in extra:
                d.lineage_id = self._next_id
                d.pulled_at = time.monotonic()
                self._next_id += 1
            self.report.pulled += len(extra)
            self.metrics.pulled.inc(len(extra))
        deliveries = [d for d in [*deliveries, *extra] if not d.settled]
        if not deliveries:
            return
        last = {id(d) for d in self.flow.source.unreleasable(deliveries)}
        if last:  # a give-back would spend their last delivery: the broker drops them
            log.warning(
                "%d unprocessed messages are at their last delivery (the broker "
                "counts a give-back as one and would drop them): dead-lettering "
                "them instead (step 'release')",
                len(last),
            )
            why = Failure(
                "release",
                "not processed before the stop, at its last delivery: "
                "the broker counts a give-back as a delivery (x-delivery-limit) and "
                "would drop it; dead-lettered instead",
            )
            self._fail("release", [(d, why) for d in deliveries if id(d) in last])
            deliveries = [d for d in deliveries if id(d) not in last and not d.settled]
            if not deliveries:
                return
        for d in deliveries:
            d.settle(Settlement.RELEASED)
        self.flow.source.release(deliveries)
        n = self._count(deliveries)
        self.report.released += n
        self.metrics.released.inc(n)

    def _park(self, failures: list[tuple[Delivery, Failure]]) -> None:
        """Failures that wait for another message's row (:data:`~ackflow.core.ledger.WAITS`):
        kept in flight for :data:`PARK_S`, then run again in a batch of their own choosing
        (:meth:`_unpark`): never given back to the source, where a broker that counts
        deliveries (a quorum queue's limit) would spend one per wait."""
        due = time.monotonic() + PARK_S
        self.parked.extend((due, d) for d, _ in failures)

    def _unpark(self) -> list[Delivery]:
        """The parked deliveries that are due, out of the parking (the loop batches them
        again; they are still in flight, their identities still live)."""
        now = time.monotonic()
        due = [d for t, d in self.parked if t <= now and not d.settled]
        self.parked = [(t, d) for t, d in self.parked if t > now and not d.settled]
        return due

    def _give_back(self, failures: list[tuple[Delivery, Failure]]) -> None:
        """Give failed messages back mid-run without failing them (a systemic or suspect
        failure, an untested one): released, the source goes on consuming. A message at
        its last delivery on a queue that counts a give-back as one (a quorum queue with
        a delivery limit) would be dropped by the broker: it is failed (dead-lettered
        with its failure, knowingly) instead."""
        held = self._held_ids()
        failures = [(d, f) for d, f in failures if not d.settled and id(d) not in held]
        if not failures:
            return
        last = {id(d) for d in self.flow.source.unreleasable([d for d, _ in failures])}
        if last:
            log.warning(
                "%d messages to give back are at their last delivery (the broker "
                "counts a give-back as one and would drop them): dead-lettering them "
                "with their failure instead",
                len(last),
            )
            self._fail("give-back", [(d, f) for d, f in failures if id(d) in last])
        back = [d for d, _ in failures if id(d) not in last and not d.settled]
        if not back:
            return
        for d in back:
            d.settle(Settlement.RELEASED)
        if self._back_now is not None:  # (a key unique to one delivery never comes back)
            self._back_now.extend(d.identity for d in back if not d.identity.startswith(UNNAMED))
        self.flow.source.release(back)  # (a block's lines come again one by one)
        self.report.released += self._count(back)
        self.metrics.released.inc(self._count(back))

    def _came_back(self, deliveries: Sequence[Delivery]) -> None:
        """These settled for good (acked, dead-lettered): a window held for them no more."""
        for bid, (_, ids) in list(self._back.items()):
            ids.difference_update(d.identity for d in deliveries)
            if not ids:
                self._let_go(bid)

    def _let_go(self, batch_id: str) -> None:
        """The windows' watermark may move past the messages of ``batch_id``."""
        self._back.pop(batch_id, None)
        for sink in self.flow.sinks:
            if hasattr(sink, "let_go"):
                try:
                    sink.let_go(batch_id)
                except Exception as e:  # noqa: BLE001 - the watermark moves with a later batch
                    log.warning("window %r: %s", sink.name, describe(e))

    def _expire_back(self) -> None:
        """Let go of batches whose given-back messages did not come back in BACK_HOLD_S."""
        now = time.monotonic()
        for bid, (since, ids) in list(self._back.items()):
            if now - since >= BACK_HOLD_S:
                log.warning(
                    "batch %s: %d messages given back have not come back in %.0f s; "
                    "the windows' watermark moves on without them (they may be late)",
                    bid,
                    len(ids),
                    BACK_HOLD_S,
                )
                self._let_go(bid)

    def _window_metrics(self) -> None:
        w = self.window
        self.metrics.window(w.in_flight, w.throttled, w.throttle_episodes)
