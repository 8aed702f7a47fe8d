"""The settlement state machine, the window and the retry policy: no Spark."""

import pytest

from ackflow.core import (
    AlreadySettled,
    ConfigError,
    Delivery,
    InflightWindow,
    RetryPolicy,
    Settlement,
)


def test_a_delivery_settles_once():
    d = Delivery(1, "m1", b"{}")
    assert not d.settled
    d.settle(Settlement.ACKED)
    assert d.state is Settlement.ACKED
    for again in (Settlement.ACKED, Settlement.NACKED, Settlement.DEAD_LETTERED, Settlement.RELEASED):
        with pytest.raises(AlreadySettled, match=r"m1.*already acked"):
            d.settle(again)
    assert d.state is Settlement.ACKED


def test_settling_as_pending_is_refused():
    with pytest.raises(ValueError):
        Delivery(1, "m1", b"").settle(Settlement.PENDING)


def test_window_counts_credits_and_throttle_episodes():
    w = InflightWindow(3)
    w.take(2)
    assert (w.credits, w.throttled) == (1, False)
    w.take(1)
    assert w.throttled and w.throttle_episodes == 1
    with pytest.raises(ValueError):
        w.take(1)  # never past the bound: the caller pulls less instead
    w.give_back(2)
    assert w.credits == 2 and not w.throttled
    w.take(2)
    assert w.throttle_episodes == 2
    with pytest.raises(ValueError):
        w.give_back(4)


def test_window_rejects_a_bad_bound():
    with pytest.raises(ConfigError, match="max_inflight"):
        InflightWindow(0)


def test_retry_policy_backs_off_exponentially_up_to_a_cap():
    p = RetryPolicy(max_deliveries=6, backoff_s=0.5, max_backoff_s=3)
    assert [p.delay_after(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert not p.exhausted(5) and p.exhausted(6)
    with pytest.raises(ConfigError):
        RetryPolicy(max_deliveries=0)


def test_settle_all_settles_each_once_and_refuses_a_second_settle():
    ds = [Delivery(i, f"k{i}", b"") for i in range(3)]
    Delivery.settle_all(ds, Settlement.ACKED)
    assert [d.state for d in ds] == [Settlement.ACKED] * 3
    fresh = Delivery(9, "fresh", b"")
    with pytest.raises(AlreadySettled, match="'k0' was already acked; refusing to mark it nacked"):
        Delivery.settle_all([fresh, ds[0]], Settlement.NACKED)
    assert fresh.state is Settlement.NACKED and ds[0].state is Settlement.ACKED  # as a loop would
    with pytest.raises(ValueError, match="pending"):
        Delivery.settle_all([Delivery(10, "x", b"")], Settlement.PENDING)
