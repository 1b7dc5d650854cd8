"""The HTTP side every service shares: ``service_app`` (the app with the one error contract), the
request-body limit, the connection limits (``ConnectionLimits``: slow clients are shed, surplus
connections refused), and running apps under uvicorn, in a background thread (embedded mode, tests)
or in the foreground (``staleflow serve``). The listening socket is bound before uvicorn starts, so
the URL is valid immediately: connections queue in the backlog until the server accepts them."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from staleflow.api.base import Route
from staleflow.errors import HTTP_STATUS, ErrorCode, StaleFlowError, error_body
from staleflow.ports import EPHEMERAL_PORTS, LOWEST_PLANNED_PORT, free_port, free_port_between  # noqa: F401  (re-exported)
from staleflow.servers.auth import protect

log = logging.getLogger(__name__)

MAX_BODY_ENV = "STALEFLOW_MAX_BODY_BYTES"
DEFAULT_MAX_BODY_BYTES = 256 << 20
"""Large enough for a route command that migrates hundreds of 20K-token partials; a bound all the
same, so one request cannot make a component buffer gigabytes."""


class ErrorBody(BaseModel):
    """Every error body of every StaleFlow service (details of the refusal may follow)."""

    model_config = ConfigDict(extra="allow")
    detail: str
    code: ErrorCode


def error_response(code: ErrorCode, message: str, **details: Any) -> JSONResponse:
    return JSONResponse(error_body(code, message, **details), status_code=HTTP_STATUS[code])


def describe_errors(errors: Sequence[Any]) -> str:
    """Validation errors as one line: ``where: what; ...``."""
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "; ".join(parts)


def plain_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Validation errors as JSON (pydantic's may hold exceptions and bytes)."""
    return [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": str(e.get("type"))}
            for e in errors]


async def _refused(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StaleFlowError)
    return JSONResponse(exc.to_json(), status_code=exc.status)


async def _invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    return error_response(ErrorCode.INVALID_REQUEST, describe_errors(errors), errors=plain_errors(errors))


_ROUTING_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


async def _routing(_: Request, exc: Exception) -> JSONResponse:
    """No such path or method (raised by the router itself; the services raise StaleFlowError)."""
    assert isinstance(exc, StarletteHTTPException)
    code = _ROUTING_CODES.get(exc.status_code, ErrorCode.INVALID_REQUEST)
    return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)


async def _crashed(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(ErrorCode.INTERNAL_ERROR, f"{request.method} {request.url.path} failed: "
                                                    f"{exc.__class__.__name__}; the service's log has the traceback")


Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
T = TypeVar("T")
Handler = TypeVar("Handler", bound=Callable[..., Any])


@dataclass(frozen=True)
class Owned(Generic[T]):
    """What an app holds in ``app.state.<attribute>`` while it serves: ``given``, or what
    ``open`` makes at startup. ``running`` (optional) is entered next and left first: what runs
    alongside the handlers (background loops, a second listener), whoever owns the resource.
    ``ready`` then sees it (to log what the service serves with). At shutdown ``close`` runs on
    it when the app made it, or when ``owns`` says the app owns the given one too."""

    attribute: str
    open: Callable[[], Awaitable[T]]
    close: Callable[[T], Awaitable[None]]
    _: KW_ONLY
    given: T | None = None
    owns: bool | None = None
    running: Callable[[FastAPI, T], AbstractAsyncContextManager[None]] | None = None
    ready: Callable[[T], None] | None = None

    def lifespan(self) -> Lifespan:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            owned = self.given is None if self.owns is None else self.owns
            resource = self.given if self.given is not None else await self.open()
            setattr(app.state, self.attribute, resource)
            try:
                async with self.running(app, resource) if self.running is not None else nullcontext():
                    if self.ready is not None:
                        self.ready(resource)
                    yield
            finally:
                if owned:
                    await self.close(resource)

        return lifespan


@asynccontextmanager
async def background(*loops: Coroutine[Any, Any, Any]) -> AsyncIterator[None]:
    """Runs ``loops`` as tasks while the block runs; cancels them and waits for them on leaving."""
    tasks = [asyncio.create_task(loop) for loop in loops]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def service_app(title: str, owned: Owned | None = None, **kwargs: Any) -> FastAPI:
    """A FastAPI app with the one error contract: any ``StaleFlowError``, invalid request, unknown
    route or crash answers ``{"detail", "code", ...}`` (``ErrorBody``, documented as every
    operation's default response) with the status ``HTTP_STATUS`` gives the code. Its lifespan
    holds ``owned`` (the service object its handlers call)."""
    app = FastAPI(title=title, version="1", lifespan=owned.lifespan() if owned is not None else None,
                  responses={"default": {"model": ErrorBody, "description": "refused: the code says why"}}, **kwargs)
    app.add_exception_handler(StaleFlowError, _refused)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _routing)
    app.add_exception_handler(Exception, _crashed)
    return app


def handles(app: FastAPI, route: Route, **options: Any) -> Callable[[Handler], Handler]:
    """Registers the decorated function as the handler of ``route``, a service's declaration in
    ``staleflow.api``: its method, its path and its reply type (the response model) come from
    there, so a route is declared once. ``options`` are FastAPI's (``status_code``, ...)."""
    options.setdefault("response_model", route.reply)
    return app.api_route(route.path, methods=[route.method], **options)


def max_body_bytes(limit: int | None = None) -> int:
    """The explicit limit, else ``$STALEFLOW_MAX_BODY_BYTES``, else the default."""
    if limit is not None:
        return limit
    raw = os.environ.get(MAX_BODY_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BODY_BYTES
    if not raw.isdigit() or int(raw) < 1:
        log.warning("$%s=%r is not a positive whole number of bytes; using the default %d",
                    MAX_BODY_ENV, raw, DEFAULT_MAX_BODY_BYTES)
        return DEFAULT_MAX_BODY_BYTES
    return int(raw)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, path: str):
        super().__init__(413, f"request body to {path} is over this server's limit of {limit} bytes; raise it by "
                              f"starting the server with ${MAX_BODY_ENV} set higher, or send less per request")


class BodyLimitMiddleware:
    """Refuses request bodies over ``limit`` bytes with 413: by Content-Length before reading,
    and by counting what arrives for chunked bodies (the server frames any other body by its
    Content-Length, so no more than declared can arrive). Paths matching the app's
    ``state.body_limit_exempt`` (a regex; the PS's chunk uploads, bounded per chunk) pass."""

    def __init__(self, app: ASGIApp, limit: int, exempt: str | None = None):
        self.app = app
        self.limit = limit
        self.exempt = re.compile(exempt) if exempt else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.exempt and self.exempt.match(scope["path"])):
            await self.app(scope, receive, send)
            return
        limit, path = self.limit, scope["path"]
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, BodyTooLarge(limit, path))
            return
        if b"transfer-encoding" not in headers and (declared is None or declared.isdigit()):
            # the server frames such a body by its Content-Length (none: no body), so no more can arrive
            await self.app(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, path)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:  # read outside FastAPI's body parsing, which answers 413 itself
            if started:
                raise
            await self._refuse(send, exc)

    @staticmethod
    async def _refuse(send: Send, exc: BodyTooLarge) -> None:
        body = json.dumps(error_body(ErrorCode.BODY_TOO_LARGE, exc.detail)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def harden(app: FastAPI, host: str, token: str | None, body_limit: int | None = None) -> None:
    """What every served component gets: the token check (or the refusal of an open
    non-loopback bind) and the request-body limit."""
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes(body_limit),
                       exempt=getattr(app.state, "body_limit_exempt", None))
    protect(app, host, token, is_loopback(host))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it keep-alive responses stall ~40 ms on Nagle + delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror or exc}. Pick another --port or stop the other process.") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_for(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class ConnectionLimits:
    """How a server sheds slow and surplus clients (uvicorn itself has no header deadline)."""

    max_connections: int = 1024
    """Open connections at once; one more is answered 503 ``too_many_connections`` and closed."""
    header_timeout_s: float = 10.0
    """From the connection (or the previous response) until a request's head has arrived."""
    body_timeout_s: float = 60.0
    """The longest pause in a request body while the server is waiting for it."""
    min_body_rate: float = 1024.0
    """Bytes per second a request body must average, over the time the server has waited for it,
    once it has waited ``body_rate_grace_s``: a client trickling a byte every few seconds never
    pauses for ``body_timeout_s``, yet would hold its connection for as long as it liked."""
    body_rate_grace_s: float = 10.0
    send_timeout_s: float = 60.0
    """The longest a response waits for its client to take any more of it: a reader that never
    reads would otherwise hold the response (and what it pins, such as a weights version) forever."""
    min_send_rate: float = 1024.0
    """Bytes per second a client must take of a response, averaged over the time the server has
    waited for it to, once it has waited ``send_rate_grace_s`` (a trickling reader never pauses
    for ``send_timeout_s``)."""
    send_rate_grace_s: float = 10.0
    keep_alive_s: float = 5.0
    """An idle keep-alive connection is closed after this long."""
    max_head_bytes: int = 64 << 10
    """A request line and headers longer than this close the connection."""


def _refusal(limit: int) -> bytes:
    body = json.dumps(error_body(ErrorCode.TOO_MANY_CONNECTIONS,
                                 f"this server holds its limit of {limit} open connections; retry later")).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\nretry-after: 1\r\n\r\n")
    return head.encode() + body


def _uvicorn_protocol() -> type:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:  # httptools is optional for uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


class _MeteredTransport:
    """A transport that counts the bytes written to it: what the client has taken of them is
    that count less the transport's write buffer."""

    def __init__(self, transport: Any):
        self._transport = transport
        self.written = 0

    def write(self, data: Any) -> None:
        self.written += len(data)
        self._transport.write(data)

    def taken(self) -> int:
        return self.written - self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _ResponseWatch:
    """How a client takes one response, checked on each tick: it has held the server up too long
    (nothing taken for ``send_timeout_s`` while the server's writes are paused on it), or too
    slowly (below ``min_send_rate`` over the time they were paused, once that passes the grace)."""

    def __init__(self, transport: _MeteredTransport, limits: ConnectionLimits, now: float):
        self.transport, self.limits = transport, limits
        self.waited_s, self.taken_at_start = 0.0, transport.taken()
        self.last_taken, self.last_take = self.taken_at_start, now

    def refusal(self, now: float, since_check: float, write_paused: bool) -> str | None:
        """Why the connection should close, or None."""
        taken = self.transport.taken()
        if taken != self.last_taken or not write_paused:
            self.last_taken, self.last_take = taken, now
            if not write_paused:
                return None
        self.waited_s += since_check
        if now - self.last_take > self.limits.send_timeout_s:
            return f"took none of its response for {self.limits.send_timeout_s:g} s"
        rate = (taken - self.taken_at_start) / self.waited_s
        if self.waited_s > self.limits.send_rate_grace_s and rate < self.limits.min_send_rate:
            return f"took its response at {rate:.0f} bytes/s (the least is {self.limits.min_send_rate:g})"
        return None


if TYPE_CHECKING:  # mixed in before one of uvicorn's two protocols, both with this interface
    from uvicorn.protocols.http.h11_impl import H11Protocol as _UvicornProtocol
else:
    _UvicornProtocol = object


class _Guarded(_UvicornProtocol):
    """The limits ``guarded_protocol`` adds to uvicorn's protocol (mixed in before it)."""

    limits: ConnectionLimits
    tick: float
    refusal: bytes
    _refused = False
    _timer: asyncio.TimerHandle | None = None
    connections: Any
    loop: Any
    transport: Any
    cycle: Any
    flow: Any

    def connection_made(self, transport: Any) -> None:
        if len(self.connections) >= self.limits.max_connections:
            # half-close after the refusal and drain what the client sends: closing with unread
            # input would reset the connection, and the client might not read the refusal
            self._refused = True
            self.transport = transport
            transport.write(self.refusal)
            if transport.can_write_eof():
                transport.write_eof()
            self._timer = self.loop.call_later(self.limits.header_timeout_s, transport.close)
            return
        self._metered = _MeteredTransport(transport)
        super().connection_made(self._metered)  # pyright: ignore[reportArgumentType]  (a proxy: what it does not count, it forwards)
        self._head_since = self._last_read = self._last_check = self.loop.time()
        self._head_bytes = 0
        self._body_waited_s, self._body_bytes = 0.0, 0
        self._response = _ResponseWatch(self._metered, self.limits, self.loop.time())
        self._timer = self.loop.call_later(self.tick, self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._refused:
            super().connection_lost(exc)

    def eof_received(self) -> Any:
        if self._refused:
            self.transport.close()
            return None
        return super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._last_read = self.loop.time()
        super().data_received(data)
        if self._awaiting_head():
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes and not self.transport.is_closing():
                log.info("closing a connection whose request head passed %d bytes", self.limits.max_head_bytes)
                self.transport.close()
        else:
            self._head_bytes = 0
            self._body_bytes += len(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_since = self.loop.time()
        self._head_bytes = 0
        self._body_waited_s, self._body_bytes = 0.0, 0
        self._response = _ResponseWatch(self._metered, self.limits, self._head_since)

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _check(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        since_check, self._last_check = now - self._last_check, now
        cycle = self.cycle
        if self._awaiting_head():
            if now - self._head_since > self.limits.header_timeout_s:
                log.info("closing a connection that sent no complete request head in %g s", self.limits.header_timeout_s)
                self.transport.close()
                return
        elif cycle.more_body and not cycle.waiting_for_100_continue and not self.flow.read_paused:
            self._body_waited_s += since_check
            if now - self._last_read > self.limits.body_timeout_s:
                log.info("closing a connection whose request body paused for %g s", self.limits.body_timeout_s)
                self.transport.close()
                return
            if self._body_waited_s > self.limits.body_rate_grace_s \
                    and self._body_bytes < self.limits.min_body_rate * self._body_waited_s:
                log.info("closing a connection whose request body came at %.0f bytes/s (the least is %g)",
                         self._body_bytes / self._body_waited_s, self.limits.min_body_rate)
                self.transport.close()
                return
        else:  # the app's turn, or the client's to take the response
            self._last_read = now
            refusal = self._response.refusal(now, since_check, self.flow.write_paused)
            if refusal is not None:
                log.info("closing a connection whose client %s", refusal)
                self.transport.abort()  # its buffered response is dropped: the client never took it
                return
        self._timer = self.loop.call_later(self.tick, self._check)



def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with ``limits``: a deadline for each request head, a deadline for
    each pause in a body and a minimum average rate of a body while the server waits for it (not
    while the app is busy or holds the client back), the same two for a response while it waits
    for the client to take it, a cap on head bytes, and a cap on connections."""
    tick = min(limits.header_timeout_s, limits.body_timeout_s, limits.body_rate_grace_s,
               limits.send_timeout_s, limits.send_rate_grace_s) / 4
    return type("GuardedProtocol", (_Guarded, _uvicorn_protocol()),
                {"limits": limits, "tick": tick, "refusal": _refusal(limits.max_connections)})


def _uvicorn_config(app: FastAPI, log_level: str, limits: ConnectionLimits | None) -> uvicorn.Config:
    limits = limits or ConnectionLimits()
    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                          http=guarded_protocol(limits),
                          # uvicorn annotates int, but takes seconds as a float (it hands them to loop.call_later)
                          timeout_keep_alive=limits.keep_alive_s)  # pyright: ignore[reportArgumentType]


@dataclass
class RunningServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StartupFailed(RuntimeError):
    """The app's lifespan raised: the server never served."""


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                    startup_timeout: float = 60.0, token: str | None = None,
                    body_limit: int | None = None, limits: ConnectionLimits | None = None) -> RunningServer:
    """Serve ``app`` from a daemon thread; returns once its lifespan has started.

    A lifespan that fails raises ``StartupFailed`` here instead of leaving a socket that never
    answers. Request bodies over ``body_limit`` bytes (default: ``max_body_bytes()``) get 413."""
    harden(app, host, token, body_limit)
    sock = bind_socket(host, port)
    server = uvicorn.Server(_uvicorn_config(app, log_level, limits))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # uvicorn exits with SystemExit on a failed startup
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True, name=f"uvicorn-{url_for(sock)}")
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        thread.join(0.005)  # wakes as soon as the thread dies; otherwise re-checks the flag
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            reason = failure[0] if failure else "timed out"
            raise StartupFailed(f"{app.title} did not start: {reason!r}; see the log above for the cause")
    return RunningServer(url_for(sock), server, thread)


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info", token: str | None = None,
                  body_limit: int | None = None, limits: ConnectionLimits | None = None) -> None:
    """Serve in the foreground until SIGINT/SIGTERM (uvicorn handles both gracefully).

    With a token (or $STALEFLOW_TOKEN), mutating requests need it; without one, a non-loopback
    ``host`` is refused. Request bodies over ``body_limit`` bytes get 413."""
    harden(app, host, token, body_limit)
    sock = bind_socket(host, port)
    # printed at every log level: supervisors (staleflow up, tests) wait for this line
    print(f"{app.title} listening on {url_for(sock)}", file=sys.stderr, flush=True)
    uvicorn.Server(_uvicorn_config(app, log_level, limits)).run(sockets=[sock])
