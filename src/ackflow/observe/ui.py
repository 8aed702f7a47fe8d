"""The live status page: a small ASGI app (Starlette on uvicorn) in a daemon thread.

Opt-in (``ui_port=`` / ``--ui-port``), on 127.0.0.1 unless told otherwise. It serves:

* ``GET /``: the page (static HTML, JS and CSS shipped with ackflow; no build step);
* ``GET /api/status``: the latest snapshot of the run (:mod:`ackflow.observe.status`);
* ``GET /api/events``: the same snapshots as server-sent events, as they are published;
* ``POST /api/replay``: replay selected dead letters (sources that can, such as the
  embedded queue), only with ``allow_replay`` (``--ui-allow-replay``).

The server only reads what the engine published; it never calls into the engine. Its
cost when nobody watches is an idle thread. Serialising a snapshot happens once per
version, whatever the number of browsers.

Requests are refused unless their ``Host`` is this server's own address (a loopback
name when bound to loopback), which keeps DNS-rebinding pages out. A replay must come
from the page itself: a ``POST`` with the header ``X-Ackflow-Replay: 1`` (which a
cross-site form cannot send, and a cross-site ``fetch`` cannot send without a CORS
preflight this server never grants) and an ``Origin`` equal to this server's. Those
headers keep other web pages out, not other local processes (any of which can send
them): a replay also needs this run's secret token, made at start and given only to the
operator (:attr:`StatusServer.replay_url` holds it in the URL's fragment, which the
browser never sends; the page keeps it in the tab's session storage and sends it as
``X-Ackflow-Replay-Token``). It is never served, logged or shown in a snapshot.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
import time
from importlib import resources
from typing import Any

from ackflow.core.errors import ConfigError
from ackflow.core.secrets import redact
from ackflow.observe.status import StatusBoard
from ackflow.sources.base import Source

log = logging.getLogger("ackflow.ui")

REPLAY_HEADER = "x-ackflow-replay"
TOKEN_HEADER = "x-ackflow-replay-token"
MAX_REPLAY_IDS = 200
MAX_BODY_BYTES = 64 * 1024  # every request's body, whatever the endpoint
MAX_EVENT_CLIENTS = 16
PROBE_EVERY_S = 2.0
EVENT_POLL_S = 0.2
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")
_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
_SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; "
        b"img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        b"frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class StatusServer:
    """Serve ``board`` on ``host:port`` (port 0: a free one) until :meth:`close`.

    :meth:`start` binds the socket in the caller's thread (a port in use is a
    :class:`ConfigError` there) and returns once the server accepts connections.
    """

    def __init__(
        self,
        board: StatusBoard,
        source: Source,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        allow_replay: bool = False,
    ) -> None:
        self.board = board
        self.source = source
        self.host = host
        self.requested_port = port
        self.allow_replay = allow_replay
        self.replay_supported = bool(source.replays_dead_letters)
        #: this run's replay secret (see the module's docstring); None when replay is off
        self.replay_token = secrets.token_urlsafe(24) if allow_replay else None
        self._probes = type(source).probe is not Source.probe
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._clients = 0
        self._probed_at = float("-inf")
        self._probing = False
        self._replayed: dict[int, float] = {}  # dead-letter note id -> when
        self._replayed_version = 0
        self._cache: tuple[tuple[int, int], bytes] = ((-1, -1), b"{}")
        self._cache_lock = threading.Lock()
        self._static = {
            path: (resources.files("ackflow.observe").joinpath("static", name).read_bytes(), ctype)
            for path, (name, ctype) in _STATIC.items()
        }
        self.app = self._build_app()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """The address the server is bound to (host, port)."""
        if self._sock is None:
            raise RuntimeError("the status page is not started")
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        port = self.address[1]
        shown = "127.0.0.1" if _is_wildcard(self.host) else self.host
        if ":" in shown:
            shown = f"[{shown}]"
        return f"http://{shown}:{port}/"

    @property
    def replay_url(self) -> str | None:
        """The page's URL with this run's replay token in its fragment (for the operator
        only: whoever holds it can replay dead letters), or None when replay is off."""
        if self.replay_token is None:
            return None
        return f"{self.url}#replay-token={self.replay_token}"

    def start(self, timeout_s: float = 15.0) -> None:
        import uvicorn

        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                self.host or None, self.requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError as e:
            raise ConfigError(
                f"status page: cannot listen on {self.host}:{self.requested_port}: {e}"
            ) from None
        sock.set_inheritable(False)
        self._sock = sock
        config = uvicorn.Config(
            self.app,
            loop="asyncio",
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=1,
            limit_concurrency=64,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="ackflow-ui", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise ConfigError(
                    f"status page: the server on {self.host}:{self.requested_port} did not start"
                )
            time.sleep(0.01)

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except Exception as e:  # noqa: BLE001 - the page must never take the run down
            log.error("status page stopped: %s", e)

    def close(self) -> None:
        """Stop serving: open event streams end, then the thread (a daemon) exits."""
        self._closing = True
        deadline = time.monotonic() + 1.0  # open event streams send the last snapshot
        while self._clients and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(2)
            self._thread = None
        if self._sock is not None:
            self._sock.close()

    # -- what is served ------------------------------------------------------------------

    def payload(self) -> tuple[tuple[int, int], bytes]:
        """The latest snapshot as JSON bytes (built once per version)."""
        version, snapshot = self.board.current()
        key = (version, self._replayed_version)
        cached = self._cache
        if cached[0] == key:
            return cached
        with self._cache_lock:
            if self._cache[0] == key:
                return self._cache
            data = dict(snapshot)
            data["replay"] = {
                "allowed": self.allow_replay,
                "supported": self.replay_supported,
                "enabled": self.allow_replay and self.replay_supported,
                "replayed": sorted(self._replayed),
            }
            body = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
            self._cache = (key, body)
            return self._cache

    async def _maybe_probe(self) -> None:
        """Ask the source for facts that cost I/O, at most every PROBE_EVERY_S seconds and
        only while someone is looking; in a worker thread, never the event loop's."""
        now = time.monotonic()
        if not self._probes or self._probing or now - self._probed_at < PROBE_EVERY_S:
            return
        self._probing, self._probed_at = True, now
        try:
            result = await asyncio.to_thread(self.source.probe)
        except Exception as e:  # noqa: BLE001 - shown, never raised
            result = {"probe": f"failed: {type(e).__name__}: {redact(str(e))[:200]}"}
        finally:
            self._probing = False
        self.board.probed = result

    def _allowed_host(self, host_header: str) -> bool:
        """Is ``Host`` this server? A loopback name when bound to loopback, the bound name
        otherwise; any name when bound to every interface (then DNS rebinding is possible:
        bind to loopback, or put the page behind a proxy that checks names)."""
        if not host_header:
            return False
        name, sep, port = host_header.rpartition(":")
        if not sep or not port.isdigit() or name.endswith(":"):  # no port, or a bare IPv6
            return False
        if int(port) != self.address[1]:
            return False
        if _is_wildcard(self.host):
            return True
        if _is_loopback(self.host):
            return name in LOOPBACK_NAMES or _is_loopback(name)
        return name.strip("[]") == self.host.strip("[]")

    def _build_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def static(request: Request) -> Response:
            body, ctype = self._static[request.url.path]
            return Response(body, media_type=ctype)

        async def status(request: Request) -> Response:
            await self._maybe_probe()
            return Response(self.payload()[1], media_type="application/json")

        async def events(request: Request) -> Response:
            if self._clients >= MAX_EVENT_CLIENTS:
                return JSONResponse({"error": "too many open event streams"}, status_code=429)

            async def stream() -> Any:
                self._clients += 1
                try:
                    sent: tuple[int, int] | None = None
                    beat = time.monotonic()
                    yield b"retry: 2000\n\n"
                    while True:
                        closing = self._closing  # then send the last snapshot, and end
                        if not closing:
                            await self._maybe_probe()
                        key, body = self.payload()
                        now = time.monotonic()
                        if key != sent:
                            sent, beat = key, now
                            yield b"data: " + body + b"\n\n"
                        elif now - beat >= 15:
                            beat = now
                            yield b": keep-alive\n\n"
                        if closing:
                            return
                        await asyncio.sleep(EVENT_POLL_S)
                finally:
                    self._clients -= 1

            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"x-accel-buffering": "no"}
            )

        async def replay(request: Request) -> Response:
            refused = self._refuse_replay(request)
            if refused is not None:
                return JSONResponse({"error": refused[1]}, status_code=refused[0])
            try:
                payload = json.loads(await request.body())
                ids = payload["ids"]
                if (
                    not isinstance(ids, list)
                    or not ids
                    or len(ids) > MAX_REPLAY_IDS
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                ):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                return JSONResponse(
                    {"error": f'expected {{"ids": [1 to {MAX_REPLAY_IDS} dead letter ids]}}'}, status_code=400
                )
            notes = {n.id: n for n in self.board.dead_letters()}
            wanted = [notes[i] for i in dict.fromkeys(ids) if i in notes]
            todo = [n for n in wanted if n.ref is not None and n.id not in self._replayed]
            skipped = sorted(set(ids) - {n.id for n in todo})
            replayed, kept = 0, {}
            if todo:
                try:
                    replayed, kept_refs = await asyncio.to_thread(
                        self.source.replay_dead_letters, [n.ref for n in todo]
                    )
                except Exception as e:  # noqa: BLE001 - answered, never raised
                    log.error("status page: replay failed: %s", e)
                    return JSONResponse(
                        {"error": f"replay failed: {type(e).__name__}: {redact(str(e))[:300]}"},
                        status_code=500,
                    )
                kept = {n.id: kept_refs[n.ref] for n in todo if n.ref in kept_refs}
                todo = [n for n in todo if n.id not in kept]
                now = time.time()
                for n in todo:
                    self._replayed[n.id] = now
                live = {n.id for n in self.board.dead_letters()}
                for i in [i for i in self._replayed if i not in live]:  # bounded by the ring
                    del self._replayed[i]
                self._replayed_version += 1
                log.warning("status page: %d dead letters replayed (ids %s)", replayed, [n.id for n in todo])
            return JSONResponse(
                {
                    "replayed": replayed,
                    "ids": [n.id for n in todo],
                    "skipped": skipped,
                    "kept": {str(i): why for i, why in kept.items()},
                }
            )

        async def no_icon(request: Request) -> Response:
            return Response(status_code=204)

        routes = [Route(path, static, methods=["GET"]) for path in _STATIC]
        routes.append(Route("/favicon.ico", no_icon, methods=["GET"]))
        routes += [
            Route("/api/status", status, methods=["GET"]),
            Route("/api/events", events, methods=["GET"]),
            Route("/api/replay", replay, methods=["POST"]),
        ]
        return _Guard(Starlette(routes=routes), self._allowed_host)

    def _refuse_replay(self, request: Any) -> tuple[int, str] | None:
        """Why this replay request is refused (status, reason), or None to go ahead."""
        if not self.allow_replay:
            return 403, "replay is off: start the run with --ui-allow-replay"
        if not self.replay_supported:
            return 409, f"source {self.source.name!r} cannot replay dead letters"
        if request.headers.get(REPLAY_HEADER) != "1":
            return 403, "refused: the X-Ackflow-Replay: 1 header is missing"
        origin = request.headers.get("origin")
        if origin != f"http://{request.headers.get('host')}":
            return 403, "refused: a cross-site request (its Origin is not this page's)"
        site = request.headers.get("sec-fetch-site")
        if site is not None and site != "same-origin":
            return 403, f"refused: a cross-site request (Sec-Fetch-Site: {site[:40]})"
        token = request.headers.get(TOKEN_HEADER, "")
        if self.replay_token is None or not hmac.compare_digest(
            token.encode("utf-8", "replace"), self.replay_token.encode()
        ):
            return 403, (
                "refused: the replay token is missing or wrong (open the page from "
                "the link ackflow printed at start)"
            )
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return 415, "expected Content-Type: application/json"
        return None


class _Guard:
    """ASGI middleware: refuse a foreign ``Host`` (DNS rebinding), refuse a request body
    over ``MAX_BODY_BYTES`` (413: by its ``Content-Length`` before reading any of it, or
    once a chunked body passes the limit; the rest is never read, and the connection is
    closed), add security headers. The app gets the (small) body already read."""

    def __init__(self, app: Any, allowed_host: Any) -> None:
        self.app = app
        self.allowed_host = allowed_host

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_SECURITY_HEADERS]}
            await send(message)

        async def answer(status: int, body: bytes, close: bool = False) -> None:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if close:  # the unread rest of the body must not be taken for a request
                headers.append((b"connection", b"close"))
            await with_headers({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        if not self.allowed_host(host):
            await answer(421, b'{"error": "unexpected Host header"}')
            return
        too_big = b'{"error": "request body too large (at most %d bytes)"}' % MAX_BODY_BYTES
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None:
            if not declared.strip().isdigit():
                await answer(400, b'{"error": "bad Content-Length"}', close=True)
                return
            if int(declared) > MAX_BODY_BYTES:
                await answer(413, too_big, close=True)
                return
        chunks, size = [], 0
        while True:  # at most MAX_BODY_BYTES (plus one message) are ever held
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            size += len(message.get("body", b""))
            if size > MAX_BODY_BYTES:
                await answer(413, too_big, close=True)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        first: list[Any] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_body() -> Any:
            return first.pop() if first else await receive()

        await self.app(scope, replay_body, with_headers)
