"""The contiguous offset tracker: examples, and a stateful property test over random
interleavings of pull, ack, nack-and-retry, dead-letter, gaps and crash-and-resume."""

import os
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ackflow.core.offsets import OffsetTracker

EXAMPLES = int(os.environ.get("ACKFLOW_OFFSET_EXAMPLES", "1000"))  # CI runs 1000


def test_in_flight_head_holds_the_commit():
    t = OffsetTracker()
    for o in range(5):
        t.pulled(o)
    for o in (1, 2, 3, 4):
        t.settled(o)
    assert t.committed == 0 and t.in_flight == 1
    t.failed(0)
    assert t.committed == 0  # failed: still unsettled, retried later
    t.pulled(0)
    t.settled(0)
    assert t.committed == 5 and len(t) == 0


def test_an_offset_never_pulled_blocks_until_declared_a_gap():
    t = OffsetTracker(start=100)
    t.pulled(100)
    t.pulled(103)
    t.settled(100)
    t.settled(103)
    assert t.committed == 101
    t.gap(101, 103)
    assert t.committed == 104


def test_settling_many_an_offset_never_pulled_raises():
    t = OffsetTracker()
    t.pulled(0)
    with pytest.raises(KeyError, match="offset 1 was never pulled"):
        t.settled_many([0, 1])


def test_bounded_to_the_window_and_below_committed_is_ignored():
    t = OffsetTracker()
    for o in range(10_000):
        t.pulled(o)
        t.settled(o)
        assert len(t) == 0
    assert t.committed == 10_000
    assert t.pulled(5) is False  # a stale re-read: skip it
    with pytest.raises(KeyError):
        t.settled(20_000)


class Log(RuleBasedStateMachine):
    """A log of N offsets, some of them holes the source skips (declared gaps). A
    reader pulls in order; messages settle in any order; failures are retried; a crash
    loses all in-memory state and resumes from the committed offset."""

    N = 60

    def __init__(self):
        super().__init__()
        self.holes = set()
        self.tracker = OffsetTracker()
        self.next = 0  # the reader's position
        self.pending = set()  # pulled, in flight
        self.failed = set()  # failed, waiting for their retry
        self.done = set()  # settled in this incarnation (or gaps)
        self.must_reprocess = set()  # unsettled (or uncommitted) at a crash
        self.settled_ever = set()

    @initialize(holes=st.sets(st.integers(0, N - 1), max_size=8))
    def declare_holes(self, holes):
        self.holes = set(holes)

    @precondition(lambda self: self.next < self.N)
    @rule(n=st.integers(1, 5))
    def pull(self, n):
        for _ in range(n):
            if self.next >= self.N:
                break
            o = self.next
            self.next += 1
            if o in self.holes:
                self.tracker.gap(o, o + 1)
                self.done.add(o)
                continue
            assert self.tracker.pulled(o)
            self.pending.add(o)
            self.must_reprocess.discard(o)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), dead_letter=st.booleans())
    def settle(self, data, dead_letter):  # acked, or dead-lettered durably: both settle
        o = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.discard(o)
        self.tracker.settled(o)
        self.done.add(o)
        self.settled_ever.add(o)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def settle_many(self, data):  # a batch settled at once (the Files source's ack)
        some = data.draw(st.lists(st.sampled_from(sorted(self.pending)), min_size=1, unique=True))
        self.pending.difference_update(some)
        self.tracker.settled_many(some)
        self.done.update(some)
        self.settled_ever.update(some)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def fail(self, data):
        o = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.discard(o)
        self.tracker.failed(o)
        self.failed.add(o)

    @precondition(lambda self: self.failed)
    @rule(data=st.data())
    def retry(self, data):
        o = data.draw(st.sampled_from(sorted(self.failed)))
        self.failed.discard(o)
        assert self.tracker.pulled(o)
        self.pending.add(o)

    @rule()
    def crash_and_resume(self):
        committed = self.tracker.committed
        # everything from the committed offset on must be processed again
        self.must_reprocess |= {o for o in range(committed, self.next) if o not in self.holes}
        self.tracker = OffsetTracker(start=committed)
        self.next = committed
        self.pending.clear()
        self.failed.clear()
        self.done = {o for o in self.done if o < committed}

    @invariant()
    def never_past_an_unsettled_offset(self):
        c = self.tracker.committed
        assert all(o >= c for o in self.pending | self.failed)
        assert all(o >= c for o in self.must_reprocess)

    @invariant()
    def advances_when_it_may(self):
        expect = 0
        while expect in self.done:  # every offset below the first unsettled one
            expect += 1
        assert self.tracker.committed == expect

    @invariant()
    def bounded(self):
        assert len(self.tracker) <= max(0, self.tracker.highest_pulled - self.tracker.committed + 1)

    def teardown(self):
        # run to the end: retry every failure, settle everything, all committed
        for o in sorted(self.failed):
            self.tracker.pulled(o)
            self.pending.add(o)
        self.failed.clear()
        while self.next < self.N:
            self.pull(5)
        for o in sorted(self.pending):
            self.tracker.settled(o)
            self.settled_ever.add(o)
        self.pending.clear()
        assert self.tracker.committed == self.N
        assert not self.must_reprocess  # every message not committed at a crash came again
        assert self.settled_ever == set(range(self.N)) - self.holes


Log.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None)
TestLog = Log.TestCase


class _Reference:
    """The tracker as a plain set-per-offset model (d2a9abf's implementation): the
    specification the range-based tracker is compared with."""

    def __init__(self, start=0):
        self.base, self.high, self.state = start, start - 1, {}

    def pulled(self, o):
        if o < self.base:
            return False
        if self.state.get(o) != "done":
            self.state[o] = "pending"
        self.high = max(self.high, o)
        return True

    def settled_many(self, offsets):
        for o in offsets:
            if o < self.base:
                continue
            if o not in self.state:
                raise KeyError(o)
            self.state[o] = "done"
        self._advance()

    def failed(self, o):
        if o >= self.base and o not in self.state:
            raise KeyError(o)

    def gap(self, start, end):
        for o in range(max(start, self.base), end):
            self.state.setdefault(o, "done")
        self.high = max(self.high, end - 1)
        self._advance()

    def _advance(self):
        while self.state.get(self.base) == "done":
            del self.state[self.base]
            self.base += 1


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("pull"), st.integers(0, 40)),
        st.tuples(st.just("settle"), st.lists(st.integers(0, 40), max_size=4)),
        st.tuples(st.just("fail"), st.integers(0, 40)),
        st.tuples(st.just("gap"), st.integers(0, 40), st.integers(0, 12)),
        st.tuples(st.just("range"), st.integers(0, 40), st.integers(0, 8)),
    ),
    max_size=60,
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(start=st.integers(0, 5), ops=_ops)
def test_ranges_agree_with_the_per_offset_model(start, ops):
    t, ref = OffsetTracker(start=start), _Reference(start=start)
    for op in ops:
        outcome = []
        for impl in (t, ref):
            try:
                if op[0] == "pull":
                    outcome.append(impl.pulled(op[1]))
                elif op[0] == "settle":
                    if impl is t and len(op[1]) == 1:
                        impl.settled(op[1][0])
                    else:
                        impl.settled_many(op[1])
                    outcome.append(None)
                elif op[0] == "range":  # a source's read of fresh lines
                    if impl is t:
                        impl.pulled_range(op[1], op[1] + op[2])
                    else:
                        for o in range(op[1], op[1] + op[2]):
                            impl.pulled(o)
                    outcome.append(None)
                elif op[0] == "fail":
                    outcome.append(impl.failed(op[1]))
                else:
                    outcome.append(impl.gap(op[1], op[1] + op[2]))
            except KeyError:
                outcome.append("KeyError")
        assert outcome[0] == outcome[1], op
        assert t.committed == ref.base
        assert t.highest_pulled == ref.high
        assert list(t.pending()) == sorted(o for o, s in ref.state.items() if s == "pending")
        assert t.in_flight == sum(1 for s in ref.state.values() if s == "pending")
        assert len(t) == len(ref.state)


def _cost(fn):
    tracemalloc.start()
    began = time.perf_counter()
    fn()
    took = time.perf_counter() - began
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return took, peak


@pytest.mark.parametrize("length", [10**6, 10**9])
def test_a_huge_gap_costs_what_a_small_one_does(length):
    # a stream resuming below its first kept offset: one gap of `length` offsets
    # (d2a9abf: 10**6 offsets took 0.35 s and 152 MB; 10**9 never finished)
    def run():
        t = OffsetTracker(start=0)
        t.gap(0, length)
        t.pulled(length + 1)
        t.gap(length + 2, 2 * length)  # a second gap, above one in flight
        assert t.committed == length
        t.pulled(length)
        t.settled_many([length, length + 1])
        assert t.committed == 2 * length and len(t) == 0

    took, peak = _cost(run)
    assert peak < 64 * 1024, f"{peak} bytes for a gap of {length}"
    assert took < 0.5, f"{took:.3f} s for a gap of {length}"
