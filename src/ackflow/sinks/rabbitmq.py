"""RabbitMQ as a sink: each row published with publisher confirms, from Spark tasks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

from ackflow.core.errors import WHOLE_WRITE, ConfigError, describe
from ackflow.core.secrets import redact
from ackflow.sinks.base import ROW_KEY, PartitionResult, Sink, missing_id, require_columns
from ackflow.sinks.jsonrows import json_records


class RabbitMQSink(Sink):
    """Publish each row as a JSON message to ``exchange``.

    The routing key is ``routing_key`` or, per row, the value of ``routing_key_column``.
    Every partition publishes from its Spark task on its own connection, with publisher
    confirms handled asynchronously in a window of ``confirm_window`` messages (not one
    at a time). A row counts as written only when the broker confirmed it; a
    ``basic.nack``, an unroutable message (published ``mandatory``, returned by the
    broker), a closed channel, a lost connection or ``timeout_s`` without any confirm
    (a timeout on progress, not a deadline) fail that row, and so its source message
    (which is then retried, never acked).

    Messages are persistent (``delivery_mode=2``) and carry a ``message_id``: the row's
    key by default (its source message's id and its position among the message's rows:
    a consumer can drop a redelivered copy), or the value of ``message_id_column``.
    ``headers_column`` names a map/struct column whose entries become headers (the
    column is not put in the body). A row AMQP cannot carry (a routing key, message id
    or header name over 255 bytes, a null routing key, a header value pika cannot
    encode) fails alone, before anything of its partition is published.
    """

    wants_keys = True

    def __init__(
        self,
        url: str,
        exchange: str,
        routing_key: str | None = None,
        *,
        routing_key_column: str | None = None,
        message_id_column: str | None = None,
        headers_column: str | None = None,
        persistent: bool = True,
        mandatory: bool = True,
        confirm_window: int = 10_000,
        timeout_s: float = 60.0,
        name: str | None = None,
    ) -> None:
        super().__init__(name or f"rabbitmq:{exchange or '(default)'}")
        if (routing_key is None) == (routing_key_column is None):
            raise ConfigError(
                f"sink {self.name!r}: give routing_key='...' or routing_key_column='...' (one of them)"
            )
        if confirm_window < 1:
            raise ConfigError(f"sink {self.name!r}: confirm_window must be >= 1")
        self.url = url
        self.exchange = exchange
        self.routing_key = routing_key
        self.routing_key_column = routing_key_column
        self.message_id_column = message_id_column
        self.headers_column = headers_column
        self.persistent = persistent
        self.mandatory = mandatory
        self.confirm_window = confirm_window
        self.timeout_s = timeout_s

    def open(self) -> None:
        import pika
        from pika.exceptions import ChannelClosedByBroker

        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.url))
        except Exception as e:  # noqa: BLE001 - a clear message at start
            raise ConfigError(
                f"sink {self.name!r}: cannot connect to {redact(self.url)}: "
                f"{type(e).__name__}: {redact(str(e))}"
            ) from None
        try:
            if self.exchange:
                try:
                    conn.channel().exchange_declare(self.exchange, passive=True)
                except ChannelClosedByBroker as e:
                    raise ConfigError(
                        f"sink {self.name!r}: exchange {self.exchange!r} does "
                        f"not exist ({e.reply_text}); declare it first"
                    ) from None
        finally:
            if conn.is_open:
                conn.close()

    def prepare(self, schema: Any) -> None:
        require_columns(
            self.name,
            schema,
            routing_key_column=self.routing_key_column,
            message_id_column=self.message_id_column,
            headers_column=self.headers_column,
        )

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        import pika

        if rows.num_rows == 0:
            return PartitionResult()
        keys = rows.column(ROW_KEY).to_pylist()
        data = rows.drop_columns([ROW_KEY])
        headers = None
        if self.headers_column is not None:
            headers = data.column(self.headers_column).to_pylist()
            data = data.drop_columns([self.headers_column])
        records = data.to_pylist()
        bodies = json_records(data)  # a row JSON cannot hold fails alone
        messages = []
        sent: list[int] = []  # row index of each message
        empty: dict[int, str] = {i: b for i, b in enumerate(bodies) if isinstance(b, str)}
        for i, r in enumerate(records):
            if i in empty:
                continue
            rk = self.routing_key if self.routing_key is not None else r[self.routing_key_column]
            mid = keys[i] if self.message_id_column is None else r[self.message_id_column]
            why = missing_id(mid, "message_id_column", self.message_id_column)
            if why is not None:
                empty[i] = why
                continue
            h = _maps_as_dicts(headers[i]) if headers is not None else None
            why = self._unsendable(rk, str(mid), h)
            props = None
            if why is None:
                props = pika.BasicProperties(
                    delivery_mode=2 if self.persistent else 1,
                    message_id=str(mid),
                    content_type="application/json",
                    headers=h or None,
                )
                try:  # what the checks above missed: the frame pika would build
                    props.encode()
                except Exception as e:  # noqa: BLE001 - this row cannot be sent; not its neighbours
                    why = f"its message properties cannot be encoded: {type(e).__name__}: {e}"
            if why is not None:
                empty[i] = f"the row cannot be published: {why}"
                continue
            messages.append((str(rk), cast(bytes, bodies[i]), props))  # a reason (str) is in empty
            sent.append(i)
        failed = publish_confirmed(
            self.url,
            self.exchange,
            messages,
            mandatory=self.mandatory,
            window=self.confirm_window,
            timeout_s=self.timeout_s,
        )
        return PartitionResult(failed={**empty, **{sent[j]: e for j, e in failed.items()}})

    def _unsendable(self, rk: Any, mid: str, headers: Any) -> str | None:
        """Why AMQP cannot carry this row's routing key, message id or headers, or None
        (checked before publishing: pika raises mid-partition otherwise)."""
        if rk is None:
            return f"routing_key_column {self.routing_key_column!r} is null"
        for field, value in (("routing key", str(rk)), ("message id", mid)):
            size = len(value.encode("utf-8", "surrogatepass"))
            if size > 255:
                return f"its {field} is {size} bytes ({value[:40]!r}...); AMQP carries at most 255"
        if headers is None:
            return None
        if not isinstance(headers, dict):
            return f"headers_column {self.headers_column!r} holds a {type(headers).__name__}, not a map"
        for key, value in headers.items():
            why = _header_problem(key, value)
            if why is not None:
                return f"header {str(key)[:60]!r}: {why}"
        return None


def _maps_as_dicts(value: Any) -> Any:
    """Arrow maps (``[(key, value), ...]`` from ``to_pylist``), at any depth, as dicts."""
    if isinstance(value, list):
        if value and all(isinstance(x, tuple) and len(x) == 2 for x in value):
            return {k: _maps_as_dicts(v) for k, v in value}
        return [_maps_as_dicts(x) for x in value]
    if isinstance(value, dict):
        return {k: _maps_as_dicts(v) for k, v in value.items()}
    return value


def _header_problem(key: Any, value: Any) -> str | None:
    """Why pika cannot encode the header (or table entry) ``key: value``, or None."""
    import struct

    from pika.data import encode_value

    if not isinstance(key, str):
        return f"its name is a {type(key).__name__}, not a string"
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > 255:
        return f"its name is {size} bytes; AMQP carries at most 255"
    if isinstance(value, dict):
        for k, v in value.items():
            why = _header_problem(k, v)
            if why is not None:
                return f"in {str(k)[:60]!r}: {why}"
        return None
    if isinstance(value, list):
        for v in value:
            why = _header_problem("", v)
            if why is not None:
                return why
        return None
    try:
        encode_value([], value)
    except struct.error:
        return f"the {type(value).__name__} {value!r:.60} is out of AMQP's range"
    except Exception:  # noqa: BLE001 - pika's UnsupportedAMQPFieldException, and others
        return f"AMQP (pika) cannot carry a {type(value).__name__} value ({value!r:.60})"
    return None


#: how long a publisher's connection waits for the broker to confirm its close
CLOSE_WAIT_S = 10.0


def publish_confirmed(
    url: str,
    exchange: str,
    messages: Sequence[tuple[str, bytes, Any]],
    *,
    mandatory: bool = True,
    window: int = 10_000,
    timeout_s: float = 60.0,
) -> dict[int, str]:
    """Publish ``(routing_key, body, properties)`` messages with asynchronous publisher
    confirms, at most ``window`` unconfirmed at a time. Returns index -> reason for every
    message that was not confirmed (nacked, returned as unroutable, or lost)."""
    import pika
    from pika.spec import Basic

    n = len(messages)
    unconfirmed: dict[int, int] = {}  # delivery tag -> index, in publish order
    failed: dict[int, str] = {}
    returned: dict[str, str] = {}
    state: dict[str, Any] = {"next": 0, "tag": 0, "error": None, "done": False, "progress": time.monotonic()}

    def stop(conn: Any, error: str | None) -> None:
        if error is not None and state["error"] is None:
            state["error"] = error
        if conn.is_closed:
            conn.ioloop.stop()
        elif not conn.is_closing:  # open, or still opening (close() aborts that)
            conn.close()  # on_closed stops the loop once the broker closed it
            conn.ioloop.call_later(CLOSE_WAIT_S, conn.ioloop.stop)  # one that never answers
        # closing (a channel's close callback during conn.close()): on_closed stops the
        # loop; stopping it here left the socket open until a garbage collection

    def publish_more(ch: Any) -> None:
        while state["next"] < n and len(unconfirmed) < window:
            i = state["next"]
            rk, body, props = messages[i]
            ch.basic_publish(exchange, rk, body, props, mandatory=mandatory)
            state["next"] += 1
            state["tag"] += 1
            unconfirmed[state["tag"]] = i
        if state["next"] >= n and not unconfirmed:
            state["done"] = True
            stop(ch.connection, None)

    def on_confirm(frame: Any) -> None:
        m = frame.method
        state["progress"] = time.monotonic()
        nack = isinstance(m, Basic.Nack)
        tags = [t for t in unconfirmed if t <= m.delivery_tag] if m.multiple else [m.delivery_tag]
        for t in tags:
            i = unconfirmed.pop(t, None)
            if i is None:
                continue
            mid = messages[i][2].message_id
            if nack:
                failed[i] = "the broker refused the message (basic.nack)"
            elif mid in returned:
                failed[i] = returned[mid]
        publish_more(channel[0])

    def on_return(ch: Any, method: Any, props: Any, body: bytes) -> None:
        returned[props.message_id] = (
            f"unroutable: {method.reply_code} {method.reply_text} "
            f"(exchange {method.exchange!r}, routing key "
            f"{method.routing_key!r})"
        )

    channel: list[Any] = [None]

    def on_channel(ch: Any) -> None:
        channel[0] = ch
        ch.add_on_return_callback(on_return)
        ch.add_on_close_callback(
            lambda c, reason: stop(
                c.connection, None if state["done"] else f"channel closed: {redact(str(reason))}"
            )
        )
        ch.confirm_delivery(on_confirm, callback=lambda _: publish_more(ch))

    def on_open(conn: Any) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_open_error(conn: Any, err: Any) -> None:
        text = describe(err) if isinstance(err, BaseException) else str(err)
        state["error"] = f"cannot connect to RabbitMQ: {redact(text)}"
        conn.ioloop.stop()

    def on_closed(conn: Any, reason: Any) -> None:
        if not state["done"] and state["error"] is None:
            state["error"] = f"connection closed: {redact(str(reason))}"
        conn.ioloop.stop()

    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 10
    conn = pika.SelectConnection(
        params, on_open_callback=on_open, on_open_error_callback=on_open_error, on_close_callback=on_closed
    )

    def watchdog() -> None:
        """A timeout on progress, not one deadline: fail only when no confirm came for
        ``timeout_s`` (a large or throttled partition that keeps moving is not cut)."""
        if state["done"]:
            return
        idle = time.monotonic() - state["progress"]
        if idle >= timeout_s:
            closing = conn.is_closing  # a close already under way that never ended
            stop(conn, f"no confirm for {timeout_s:g} s")
            if closing:
                conn.ioloop.stop()
        else:
            conn.ioloop.call_later(timeout_s - idle, watchdog)

    conn.ioloop.call_later(timeout_s, watchdog)
    try:
        conn.ioloop.start()
    finally:
        conn.ioloop.close()  # its own wake-up sockets and poller, not left to a collection
    if state["error"] is not None or unconfirmed or state["next"] < n:
        # the connection, the channel or the broker's confirms failed, not these rows:
        # a failure of the write as a whole (a candidate for a systemic failure)
        why = WHOLE_WRITE + (state["error"] or "not confirmed")
        for i in list(unconfirmed.values()) + list(range(state["next"], n)):
            failed.setdefault(i, why)
    return failed
