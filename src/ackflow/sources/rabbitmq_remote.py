"""pika in a process of its own, for the RabbitMQ source (``consumer="process"``).

pika's frame decoding costs the driver about 10 µs a message, as much as everything
else the engine does for it: run in the driver, it caps one driver at a rate no engine
change can raise. Here a child process (``python -m ackflow.sources.rabbitmq_remote``)
owns the AMQP connection and forwards deliveries to the driver in batches, over a
socket pair; the driver's :class:`RemoteConnection` and :class:`RemoteChannel` stand in
for pika's ``BlockingConnection`` and ``BlockingChannel``, and every channel call
(ack, nack, publish with confirms, cancel, declare) runs in the child and returns its
result or its exception, as the call in the driver would.

What stays as it was:

* **Order.** The child sends what it received before it answers a call; the driver
  dispatches deliveries and ``basic.cancel`` only in :meth:`process_data_events` (as
  pika does: never inside another call), in the order the child saw them.
* **Tags.** The channel, its delivery tags and the consumers live in the child: an ack
  names the tag the broker gave. A tag of a dead child is never sent on a new one (the
  source's channel generation, as before).
* **Loss.** A lost connection in the child, the child's death, or a broken pipe raises
  pika's own exception in the driver (``StreamLostError`` when the child died): the
  source handles it as any lost connection, and the broker delivers again what was
  unsettled. The child ends when the driver closes it or dies (end of file on its
  pipe: it closes the connection, and the broker takes the messages back).
* **Signals.** The child ignores SIGINT and SIGTERM (a Ctrl-C or a service stop that
  signals the whole group): the driver's graceful stop acks and releases through it.
* **Secrets.** The URL goes to the child over the pipe, never in its command line; the
  child logs nothing of pika's (its errors reach the driver, which redacts them).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, cast

#: deliveries forwarded in one message at most
BATCH = 2000
#: how long the child waits for I/O on its two sockets when nothing is pending
IDLE_S = 0.05

# -- the child ----------------------------------------------------------------------------


def _portable(e: BaseException) -> Any:
    """An exception as it crosses the pipe (see :func:`_exception`): itself if it
    pickles, else its type's name and text (pika's UnroutableError and NackError would be
    rebuilt from the length of their text)."""
    import pika.exceptions as pe

    if isinstance(e, (pe.UnroutableError, pe.NackError)):
        return ("pika", type(e).__name__, str(e))
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception that does not pickle
        return RuntimeError(f"{type(e).__name__}: {e}")


def _exception(value: Any) -> BaseException:
    """The driver's exception for what :func:`_portable` sent."""
    if isinstance(value, tuple):
        import pika.exceptions as pe

        e: BaseException = getattr(pe, value[1])([])
        e.args = (value[2],)
        return e
    return cast(BaseException, value)


class _Child:
    """The child's side: one pika connection, driven by the driver's calls."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe
        self.conn: Any = None
        self.channels: dict[int, Any] = {}
        self.batch: list[tuple[Any, ...]] = []
        # Everything for the driver goes through one queue and one sender thread, in
        # order: this thread never blocks on a full pipe, so it always reads the driver's
        # calls (a driver sending a large publish while the child sends large deliveries
        # filled both directions of the pipe, and both waited for ever)
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._sender, name="to-driver", daemon=True).start()

    def _sender(self) -> None:
        while True:
            try:
                self.pipe.send(self.outbox.get())
            except OSError:
                return  # the driver is gone: the main thread reads its end of file

    def send(self, msg: tuple[Any, ...]) -> None:
        self.outbox.put(msg)

    def on_message(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        self.batch.append(
            (
                method.consumer_tag,
                method.delivery_tag,
                method.redelivered,
                props.message_id,
                props.headers,
                body,
            )
        )

    def flush(self) -> None:
        while self.batch:
            part, self.batch = self.batch[:BATCH], self.batch[BATCH:]
            self.send(("d", part))

    def lost(self, e: BaseException) -> None:
        self.flush()  # what came before the loss reaches the driver first
        self.send(("lost", _portable(e)))
        conn, self.conn = self.conn, None
        self.channels.clear()
        try:
            if conn is not None and conn.is_open:
                conn.close()
        except Exception:  # noqa: BLE001 - it is dead already
            pass

    def call(self, op: str, args: tuple[Any, ...]) -> Any:
        import pika

        if op == "open":
            url, settings = args
            params = pika.URLParameters(url)
            for k, v in settings.items():
                setattr(params, k, v)
            self.conn = pika.BlockingConnection(params)
            return None
        if self.conn is None:
            raise pika.exceptions.ConnectionWrongStateError("the connection is closed")
        if op == "channel":
            ch = self.conn.channel()
            self.channels[ch.channel_number] = ch
            return ch.channel_number
        number, name, a, kw = args
        ch = self.channels[number]
        if op == "is_open":
            return bool(ch.is_open)
        if name == "basic_consume":
            return ch.basic_consume(a[0], self.on_message, **kw)
        if name == "add_on_cancel_callback":
            return ch.add_on_cancel_callback(lambda frame: self.events.append(frame.method.consumer_tag))
        return getattr(ch, name)(*a, **kw)

    def cast(self, args: tuple[Any, ...]) -> None:
        import pika.exceptions as pe

        try:
            self.call("call", args)
        except (pe.AMQPError, OSError) as e:
            if self.conn is not None and not self.conn.is_open:
                self.lost(e)
            # else the channel closed: the driver's next call on it raises
        except Exception:  # noqa: BLE001 - as above: the next call says what is wrong
            pass

    events: list[str]

    def serve(self) -> None:
        import pika.exceptions as pe

        self.events = []
        while True:
            fds = [self.pipe.fileno()]
            if self.conn is not None:
                try:
                    fds.append(self.conn._impl._transport._sock.fileno())
                except (AttributeError, OSError):
                    pass  # closing: process_data_events says how
            select.select(fds, [], [], IDLE_S)
            if self.conn is not None:
                try:
                    self.conn.process_data_events(time_limit=0)
                except (pe.AMQPError, OSError) as e:
                    self.lost(e)
            self.flush()
            for tag in self.events:
                self.send(("c", tag))
            self.events.clear()
            while self.pipe.poll(0):
                try:
                    op, args = self.pipe.recv()
                except EOFError:  # the driver is gone: the broker takes its messages back
                    op = "close"
                if op == "close":
                    if self.conn is not None and self.conn.is_open:
                        self.conn.close()
                    return
                if op == "cast":  # no answer: a failure shows as the connection's loss
                    self.cast(args)
                    continue
                try:
                    value, failed = self.call(op, args), False
                except (pe.AMQPError, OSError) as e:
                    value, failed = _portable(e), True
                    if op != "open" and self.conn is not None and not self.conn.is_open:
                        self.lost(e)
                except Exception as e:  # noqa: BLE001 - handed to the caller, as pika would raise it
                    value, failed = _portable(e), True
                self.flush()
                self.send(("r", failed, value))


def _main(argv: list[str]) -> None:
    logging.getLogger("pika").setLevel(logging.CRITICAL + 1)  # see the module's docstring
    # Ctrl-C reaches the whole process group, and a service manager's stop may signal every
    # process of the service: the driver's graceful stop still needs this connection for
    # its last acks and releases, so the child ends only when the driver closes it or dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipe = Connection(int(argv[0]))
    try:
        _Child(pipe).serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone


# -- the driver -----------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    """The driver's environment, with this ackflow's folder first on the child's path:
    the child runs the same code, wherever the driver found it."""
    import ackflow

    root = os.path.dirname(os.path.dirname(os.path.abspath(ackflow.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class RemoteChannel:
    """A channel of the child's connection; see the module's docstring."""

    def __init__(self, conn: RemoteConnection, number: int) -> None:
        self._conn = conn
        self.channel_number = number

    @property
    def is_open(self) -> bool:
        if not self._conn.is_open:
            return False
        return bool(self._conn._rpc("is_open", (self.channel_number, "", (), {})))

    def basic_consume(self, queue: str, on_message: Callable[..., None], **kw: Any) -> str:
        """``on_message(consumer_tag, delivery_tag, redelivered, message_id, headers,
        body)`` (not pika's four arguments: no frame objects are made here)."""
        tag = str(self._conn._rpc("call", (self.channel_number, "basic_consume", (queue,), kw)))
        self._conn._consumers[tag] = on_message
        return tag

    def basic_nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        """A give-back (``requeue=True``) is sent without waiting for the child: if it
        fails, the connection or channel is gone, and the broker gives the message back
        just the same; the next call learns of it. (A release of a whole window took one
        round trip a message.)"""
        kw = {"delivery_tag": delivery_tag, "multiple": multiple, "requeue": requeue}
        if not requeue:
            self._conn._rpc("call", (self.channel_number, "basic_nack", (), kw))
            return
        self._conn._check()
        try:
            self._conn._pipe.send(("cast", (self.channel_number, "basic_nack", (), kw)))
        except OSError:
            self._conn._recv(0)  # the child's last words, or its end: raised here
            raise

    def add_on_cancel_callback(self, callback: Callable[[Any], None]) -> None:
        self._conn._on_cancel[self.channel_number] = callback
        self._conn._rpc("call", (self.channel_number, "add_on_cancel_callback", (), {}))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*a: Any, **kw: Any) -> Any:
            return self._conn._rpc("call", (self.channel_number, name, a, kw))

        return call


class _Frame:
    """What a cancel callback reads of pika's frame: ``frame.method.consumer_tag``."""

    def __init__(self, consumer_tag: str) -> None:
        self.method = self
        self.consumer_tag = consumer_tag


class RemoteConnection:
    """pika's ``BlockingConnection`` in a child process; see the module's docstring."""

    def __init__(self, url: str, settings: dict[str, Any]) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ackflow.sources.rabbitmq_remote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=_child_env(),
                start_new_session=True,  # a terminal's Ctrl-C is the driver's to handle
            )
        finally:
            theirs.close()
        self._pipe = Connection(ours.detach())
        self._open = True
        self._consumers: dict[str, Callable[..., None]] = {}
        self._on_cancel: dict[int, Callable[[Any], None]] = {}
        self._pending: deque[tuple[Any, ...]] = deque()  # received during a call
        self._lost: BaseException | None = None
        try:
            self._rpc("open", (url, settings))
        except BaseException:
            self._end()
            raise

    @property
    def is_open(self) -> bool:
        return self._open and self._lost is None

    def channel(self) -> RemoteChannel:
        return RemoteChannel(self, int(self._rpc("channel", ())))

    def _check(self) -> None:
        if self._lost is not None:
            raise self._lost
        if not self._open:
            import pika.exceptions as pe

            raise pe.ConnectionWrongStateError("the connection is closed")

    def _recv(self, timeout: float | None) -> tuple[Any, ...] | None:
        """One message of the child, or None after ``timeout``; the child's death is a
        lost stream."""
        import pika.exceptions as pe

        try:
            if timeout is not None and not self._pipe.poll(timeout):
                return None
            msg: tuple[Any, ...] = self._pipe.recv()
        except (EOFError, OSError):
            code = self._proc.poll()
            self._lost = pe.StreamLostError(f"the RabbitMQ consumer process ended (exit code {code})")
            self._end()
            raise self._lost from None
        if msg[0] == "lost":
            self._lost = _exception(msg[1])
            self._end()
            raise self._lost
        return msg

    def _rpc(self, op: str, args: tuple[Any, ...]) -> Any:
        self._check()
        try:
            self._pipe.send((op, args))
            while True:
                msg = self._recv(None)
                if msg is None:
                    continue
                if msg[0] == "r":
                    break
                self._pending.append(msg)  # dispatched at the next process_data_events
        except BaseException:
            if self._open and self._lost is None:
                # interrupted between a call and its answer (a signal, a broken pipe): its
                # outcome is unknown and the answer would answer the next call: the
                # connection is given up (the broker delivers again what it held)
                import pika.exceptions as pe

                self._lost = pe.StreamLostError("a call to the RabbitMQ consumer process was interrupted")
                self._end()
            raise
        if msg[1]:
            raise _exception(msg[2])
        return msg[2]

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind, what = msg
        if kind == "d":
            consumers = self._consumers
            for i, t in enumerate(what):
                try:
                    consumers[t[0]](*t)
                except BaseException:  # the rest of the batch is dispatched next time,
                    if i + 1 < len(what):  # not dropped (it is unsettled on the channel)
                        self._pending.appendleft(("d", what[i + 1 :]))
                    raise
        elif kind == "c":
            for callback in list(self._on_cancel.values()):
                callback(_Frame(what))

    def process_data_events(self, time_limit: float | None = 0) -> None:
        """Dispatch what the child sent; wait up to ``time_limit`` s for something if
        nothing is there (return as soon as something was dispatched, as pika does)."""
        self._check()
        done = False
        while self._pending:
            self._dispatch(self._pending.popleft())
            done = True
        deadline = time.monotonic() + (time_limit or 0)
        while True:
            wait = 0.0 if done else max(0.0, deadline - time.monotonic())
            msg = self._recv(wait)
            if msg is None:
                return
            self._dispatch(msg)
            done = True

    def close(self) -> None:
        if self._open:
            self._end()

    def _end(self) -> None:
        """Tell the child to close the connection and end; wait for it briefly, then
        make sure it did."""
        self._open = False
        try:
            self._pipe.send(("close", ()))
        except OSError:
            pass  # it is gone already
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._pipe.close()

    def __del__(self) -> None:
        if getattr(self, "_open", False) and self._proc.poll() is None:
            self._proc.kill()


if __name__ == "__main__":
    _main(sys.argv[1:])
    os._exit(0)
