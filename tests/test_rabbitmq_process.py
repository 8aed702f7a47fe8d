"""The RabbitMQ source's consumer process (``consumer="process"``, rabbitmq_remote): a
child that owns the AMQP connection. Against a real broker (no Spark): the child's death
is a lost connection (what it held comes again, nothing acked twice or lost), the
driver's death ends the child and gives the messages back, the URL never reaches its
command line, and a closed source leaves no process behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ackflow.core.ledger import Failure
from ackflow.sources import RabbitMQ
from amqp import count, names, publish, setup
from helpers import wait_until

DLX = {"x-dead-letter-exchange": "ackflow-tests-dlx"}


def pull_all(src, n, timeout=15.0):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += src.pull(n - len(got), 0.2)
    return got


def opened(url, queue, window, **kw):
    src = RabbitMQ(url, queue, **{"reject_to_dlx": True, **kw})
    src.configure(max_inflight=window, error_sink=False)
    src.open()
    return src


def child_of(src):
    return src._conn._proc


def ended(pid: int) -> bool:
    """The process is gone, or a zombie nobody reaps (it ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.fixture
def queue(rabbitmq):
    q = names("proc")
    setup(rabbitmq.url, queue=q, arguments=DLX)
    return q


def test_a_killed_consumer_process_is_a_lost_connection_and_nothing_is_lost(rabbitmq, queue):
    publish(rabbitmq.url, queue, [{"n": i} for i in range(20)], ids=[f"k{i}" for i in range(20)])
    src = RabbitMQ(rabbitmq.url, queue, reject_to_dlx=True)
    src.configure(max_inflight=100, error_sink=False)
    src.open()
    try:
        got = sorted(pull_all(src, 20), key=lambda d: int(d.key[1:]))
        assert [d.key for d in got] == [f"k{i}" for i in range(20)]
        assert src.ack(got[:5]) == []  # the oldest: sent at once
        first = child_of(src)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        # the next broker call finds the child gone: the rest were not acked
        stale = src.ack(got[5:10])
        assert {d.key for d in stale} == {f"k{i}" for i in range(5, 10)}
        src.fail([(d, Failure("s", "e")) for d in got[10:12]])  # settles nothing now
        lost = {d.key for d in src.take_lost()}  # handed back (no engine settled them here)
        assert lost >= {f"k{i}" for i in range(10, 20)}
        assert lost.isdisjoint({f"k{i}" for i in range(5)})  # acked before the child died
        # a new consumer process; the broker delivers again all that was not acked
        again = pull_all(src, 15)
        assert sorted(d.key for d in again) == sorted(f"k{i}" for i in range(5, 20))
        assert all(d.delivery_count == 2 for d in again)
        assert child_of(src).pid != first.pid
        assert src.ack(again) == []
        src.close()
        assert wait_until(lambda: count(rabbitmq.url, queue) == 0, timeout=10)
    finally:
        src.close()


def test_a_killed_driver_ends_its_consumer_process_and_the_broker_takes_the_messages_back(rabbitmq, queue):
    publish(rabbitmq.url, queue, [{"n": i} for i in range(10)], ids=[f"k{i}" for i in range(10)])
    script = textwrap.dedent(
        f"""
        import sys, time
        from ackflow.sources import RabbitMQ
        src = RabbitMQ({rabbitmq.url!r}, {queue!r}, reject_to_dlx=True)
        src.configure(max_inflight=100, error_sink=False)
        src.open()
        got = []
        while len(got) < 10:
            got += src.pull(10, 0.2)
        print(src._conn._proc.pid, flush=True)
        time.sleep(60)
        """
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(driver.stdout.readline())
        assert count(rabbitmq.url, queue) == 0  # all ten held by the child's channel
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        assert wait_until(lambda: ended(child), timeout=10)
        assert wait_until(lambda: count(rabbitmq.url, queue) == 10, timeout=10)
    finally:
        if driver.poll() is None:
            driver.kill()


def test_a_ctrl_c_or_a_service_stop_leaves_the_consumer_process_to_the_drivers_graceful_stop(rabbitmq, queue):
    """SIGINT (Ctrl-C, to the whole process group) or SIGTERM (a service manager stopping
    every process of the service) must not end the child: the driver's stop still acks
    through it."""
    publish(rabbitmq.url, queue, [{"n": i} for i in range(3)], ids=[f"k{i}" for i in range(3)])
    src = opened(rabbitmq.url, queue, 10)
    try:
        got = pull_all(src, 3)
        child = child_of(src)
        child.send_signal(signal.SIGINT)
        child.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert child.poll() is None
        assert src.ack(got) == [] and src.take_lost() == []
        src.close()
        assert count(rabbitmq.url, queue) == 0
    finally:
        src.close()


def test_the_url_never_reaches_the_command_line_and_close_leaves_no_process(rabbitmq, queue):
    src = RabbitMQ(rabbitmq.url, queue, reject_to_dlx=True)
    src.configure(max_inflight=10, error_sink=False)
    src.open()
    proc = child_of(src)
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert not any(b"amqp" in a or b"guest" in a for a in argv), argv
    assert os.path.basename(argv[0].decode()).startswith("python")
    src.close()
    assert proc.poll() is not None  # waited for: no orphan, no zombie


def test_a_consumer_value_that_is_not_known_is_refused():
    from ackflow.core.errors import ConfigError

    with pytest.raises(ConfigError, match="consumer must be 'process' or 'inline'"):
        RabbitMQ("amqp://127.0.0.1:1/", "q", consumer="thread")


def test_large_dead_letters_while_large_deliveries_wait_never_hang(rabbitmq):
    """Both directions of the pipe full at once (the driver sending a 300 kB dead letter,
    the child forwarding 300 kB deliveries) hung both processes for ever before the child
    sent through a thread of its own."""
    import threading

    from ackflow.core.policy import RetryPolicy
    from ackflow.core.settlement import Settlement
    from amqp import names as fresh

    q, dlx, dead = fresh("big"), fresh("bigdlx"), fresh("bigdead")
    setup(rabbitmq.url, queue=q, dlx=dlx, dead_queue=dead)
    publish(rabbitmq.url, q, [{"pad": "x" * 300_000}] * 3, ids=["b0", "b1", "b2"])
    src = RabbitMQ(rabbitmq.url, q, dead_letter_exchange=dlx, policy=RetryPolicy(max_deliveries=1))
    src.configure(max_inflight=3, error_sink=False)
    src.open()
    try:
        (first,) = pull_all(src, 1)
        time.sleep(1.0)  # the child takes the other two and forwards them
        states = []
        t = threading.Thread(
            target=lambda: states.extend(src.fail([(first, Failure("s", "e"))])), daemon=True
        )
        t.start()
        t.join(30)
        assert not t.is_alive(), "the dead letter's publish hung"
        assert states == [Settlement.DEAD_LETTERED]
        rest = pull_all(src, 2)
        assert src.ack(rest) == []
    finally:
        src.close()
    assert count(rabbitmq.url, dead) == 1 and count(rabbitmq.url, q) == 0


def test_a_call_interrupted_before_its_answer_gives_the_connection_up(rabbitmq, queue):
    """An exception between a call and its answer (a signal) would leave the answer for
    the next call: the connection is given up instead, and what it held comes again."""
    publish(rabbitmq.url, queue, [{"n": i} for i in range(5)], ids=[f"k{i}" for i in range(5)])
    src = opened(rabbitmq.url, queue, 10)
    try:
        got = pull_all(src, 5)
        conn = src._conn
        real = conn._pipe.recv

        def interrupted():
            conn._pipe.recv = real
            raise KeyboardInterrupt

        conn._pipe.recv = interrupted
        with pytest.raises(KeyboardInterrupt):
            src._ch.basic_qos(prefetch_count=10)
        assert not conn.is_open and conn._proc.poll() is not None
        assert {d.key for d in src.ack(got)} == {d.key for d in got}  # none acked
        again = pull_all(src, 5)
        assert sorted(d.key for d in again) == sorted(d.key for d in got)
        assert src.ack(again) == []
    finally:
        src.close()
    assert count(rabbitmq.url, queue) == 0


def test_a_delivery_callback_that_raises_leaves_the_rest_of_its_batch_for_the_next_dispatch():
    """The child forwards deliveries in batches: a callback raising in the middle of
    one (a signal, a bug) no longer drops the batch's later deliveries, which stayed
    unsettled on the channel and came to no pull until the connection closed."""
    from collections import deque

    from ackflow.sources.rabbitmq_remote import RemoteConnection

    conn = RemoteConnection.__new__(RemoteConnection)  # (no child: only the dispatch)
    conn._pending, conn._lost, conn._open = deque(), None, False
    conn._check = lambda: None
    conn._recv = lambda wait: None
    seen = []

    def callback(consumer, tag, *rest):
        if tag == 2 and not seen.count(2):
            seen.append(2)
            raise KeyboardInterrupt
        seen.append(tag)

    conn._consumers = {"c": callback}
    batch = [("c", tag, False, f"k{tag}", {}, b"{}") for tag in range(1, 6)]
    with pytest.raises(KeyboardInterrupt):
        conn._dispatch(("d", batch))
    assert seen == [1, 2]
    conn.process_data_events(0)
    assert seen == [1, 2, 3, 4, 5]  # the rest, in order; the one that raised is not repeated
