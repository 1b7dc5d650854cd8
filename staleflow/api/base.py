"""The base every service client stands on: the bearer token, an httpx client with TCP_NODELAY,
the one error contract (``ServiceError`` from the ``{"detail", "code", ...}`` body of a non-2xx
reply) and ``Route``, a declared operation of a service.

A service's operations are declared once, as ``Route`` attributes of a routes class; a sync client
(``Client``) and an async one (``AsyncClient``) both execute them, so a path or a field lives in
one place. Calling ``client.reserve("g1", 3)`` fills the route's path parameters, then its body's
fields, then its query parameters, in that order (keywords work too), and parses the reply into
the route's reply type::

    class ManagerRoutes:
        reserve = Route("POST", "/v1/reservations", TransitionOut, body=ReservationRequest)

    class ManagerClient(ManagerRoutes, Client): ...
    class AsyncManagerClient(ManagerRoutes, AsyncClient): ...
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Self, TypeVar, cast, overload
from urllib.parse import quote, urlencode

import httpx
from pydantic import BaseModel, TypeAdapter
from pydantic_core import to_jsonable_python

from staleflow.backoff import Backoff
from staleflow.errors import ErrorCode

R = TypeVar("R")

TOKEN_ENV = "STALEFLOW_TOKEN"
# a file holding the token (e.g. a mounted Kubernetes or compose secret): the token itself never
# appears in the environment, where process listings and orchestrators' metadata can show it
TOKEN_FILE_ENV = "STALEFLOW_TOKEN_FILE"

TRANSIENT_STATUS = (502, 503, 504)
"""Replies that mean the service is restarting or cannot reach its own dependency: worth a retry."""


class TokenFileError(RuntimeError):
    """$STALEFLOW_TOKEN_FILE names a file that cannot serve as the token."""


def configured_token(token: str | None = None) -> str | None:
    """The explicit token, else $STALEFLOW_TOKEN, else the file $STALEFLOW_TOKEN_FILE names, else none."""
    return token or os.environ.get(TOKEN_ENV) or token_from_file()


def token_from_file() -> str | None:
    """The token in the file $STALEFLOW_TOKEN_FILE names; None when the variable is unset. A set
    variable whose file is missing or empty is an error, never a silent run without a token."""
    path = os.environ.get(TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError:
        token = ""
    if not token:
        raise TokenFileError(f"${TOKEN_FILE_ENV} names {path}, which is missing, unreadable or empty; "
                             "mount the token there (e.g. a Kubernetes Secret) or unset the variable")
    return token


# httpcore writes headers and body separately; without TCP_NODELAY, Nagle's algorithm and the
# peer's delayed ACK stall every request with a body by ~40 ms.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def auth_headers(token: str | None) -> dict[str, str]:
    token = configured_token(token)
    return {"Authorization": f"Bearer {token}"} if token else {}


def http_client(url: str, token: str | None = None, timeout: float = 10.0,
                transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """An httpx client for a StaleFlow service; the token defaults to $STALEFLOW_TOKEN."""
    transport = transport or httpx.HTTPTransport(socket_options=NODELAY)
    return httpx.Client(base_url=url, headers=auth_headers(token), timeout=timeout, transport=transport)


def async_http_client(url: str, token: str | None = None, timeout: float = 10.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers=auth_headers(token), timeout=timeout,
                             transport=httpx.AsyncHTTPTransport(socket_options=NODELAY))


class ServiceError(RuntimeError):
    """A non-2xx reply: its status, its ``detail``, its ``code`` (None when the body names none
    this client knows) and the whole error body ``{"detail", "code", ...}``."""

    def __init__(self, status: int, detail: str, body: dict[str, Any] | None = None):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        self.body = body or {}
        self.code = ErrorCode.parse(self.body.get("code"))

    @property
    def transient(self) -> bool:
        """The service is restarting or cannot reach its own dependency: a retry may succeed."""
        return self.status in TRANSIENT_STATUS


def transient(exc: BaseException) -> bool:
    """A failure a retry may cure: the service unreachable or restarting (a dropped connection,
    also on a raw data-plane socket), or unable to reach its own dependency."""
    if isinstance(exc, ServiceError):
        return exc.transient
    return isinstance(exc, httpx.TransportError | ConnectionError)


class RetriesStopped(Exception):
    """The caller's stop event was set while a call was being retried."""


def retry_transient(what: str, call: Callable[[], R], stop: threading.Event, *, outage_s: float | None = None,
                    backoff: Backoff | None = None, log: logging.Logger | None = None) -> R:
    """``call()``, tried again after each transient failure (``transient``) with a growing,
    jittered pause (``Backoff``, from 50 ms to 1 s by default) until it succeeds, ``stop`` is set
    (``RetriesStopped``) or it has failed for ``outage_s`` seconds (``RuntimeError``). Any other
    failure is raised at once."""
    log = log or logging.getLogger(__name__)
    backoff = backoff or Backoff(0.05, 1.0)
    began = warned = time.monotonic()
    while True:
        if stop.is_set():
            raise RetriesStopped(what)
        try:
            return call()
        except Exception as exc:
            if not transient(exc):
                raise
            now = time.monotonic()
            if outage_s is not None and now - began > outage_s:
                raise RuntimeError(f"{what}: still failing after {outage_s:.0f} s: {exc}") from exc
            if now - warned > 30:
                warned = now
                log.warning("%s: still failing after %.0f s (%s); retrying until it answers", what, now - began, exc)
            else:
                log.info("%s failed (%s); retrying", what, exc)
        stop.wait(backoff.failed())  # retry pacing while a component restarts


def check_reply(response: httpx.Response) -> httpx.Response:
    """``response`` if it is a 2xx one, else ``ServiceError`` from its error body."""
    if response.is_success:
        return response
    try:
        body: object = response.json()
    except ValueError:
        body = None
    error = cast("dict[str, Any]", body) if isinstance(body, dict) else None
    detail = error.get("detail", response.text) if error is not None else response.text
    raise ServiceError(response.status_code, str(detail), error)


_PATH_PARAM = re.compile(r"{(\w+)}")


@dataclass(frozen=True)
class Request:
    """One call of a route, ready to send."""

    method: str
    path: str
    query: dict[str, Any]
    json: Any
    options: dict[str, Any]  # httpx request options: timeout


class Route(Generic[R]):
    """One operation of a service: its method, its path template (``{name}`` for path
    parameters), the model of its JSON body (its fields become the call's parameters) or the name
    of one parameter that is the whole body, its query parameters, and the type of its 2xx reply
    (None: the reply's body is not read)."""

    def __init__(self, method: str, path: str, reply: type[R] | Any = None, *,
                 body: type[BaseModel] | str | None = None, query: tuple[str, ...] = ()):
        self.method, self.path, self.body, self.query = method, path, body, query
        self.path_params = tuple(_PATH_PARAM.findall(path))
        self.body_fields: tuple[str, ...] = (
            (body,) if isinstance(body, str) else tuple(body.model_fields) if body is not None else ())
        self.params = (*self.path_params, *self.body_fields, *query)
        self.reply = reply
        self._adapter = TypeAdapter(reply) if reply is not None else None
        self.name = path

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = f"{owner.__name__}.{name}"

    @overload
    def __get__(self, obj: None, owner: type) -> Route[R]: ...
    @overload
    def __get__(self, obj: AsyncClient, owner: type) -> Callable[..., Awaitable[R]]: ...
    @overload
    def __get__(self, obj: Client, owner: type) -> Callable[..., R]: ...

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self

        def call(*args: Any, **kwargs: Any) -> Any:
            return obj.send(self, self.request(*args, **kwargs))

        call.__name__ = call.__qualname__ = self.name
        return call

    def url_path(self, **path_params: Any) -> str:
        """The path with its parameters filled in (percent-encoded: an id may hold any character)."""
        try:
            return self.path.format(**{k: quote(str(v), safe="") for k, v in path_params.items()})
        except KeyError as exc:
            raise TypeError(f"{self.name}: missing path parameter {exc.args[0]!r}") from None

    def target(self, *args: Any, **kwargs: Any) -> str:
        """The request target (path and query string) of a call, for raw connections that send
        their own bodies (the parameter server's data plane)."""
        request = self.request(*args, **kwargs)
        return f"{request.path}?{urlencode(request.query)}" if request.query else request.path

    def url(self, base_url: str, *args: Any, **kwargs: Any) -> str:
        """The absolute URL of a call on the service at ``base_url`` (e.g. a callback address to
        hand another service)."""
        return base_url.rstrip("/") + self.target(*args, **kwargs)

    def request(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Request:
        if len(args) > len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments ({', '.join(self.params)}), "
                            f"got {len(args)}")
        values = dict(zip(self.params, args, strict=False))
        for name, value in kwargs.items():
            if name not in self.params:
                raise TypeError(f"{self.name} has no parameter {name!r}: it takes {', '.join(self.params) or 'none'}")
            if name in values:
                raise TypeError(f"{self.name} got {name!r} twice")
            values[name] = value
        path = self.url_path(**{p: values[p] for p in self.path_params if p in values})
        query = {q: to_jsonable_python(values[q]) for q in self.query if values.get(q) is not None}
        if isinstance(self.body, str):
            body = to_jsonable_python(values.get(self.body))
        elif self.body is not None:
            body = {f: to_jsonable_python(values[f]) for f in self.body_fields if f in values}
        else:
            body = None
        return Request(self.method, path, query, body, {} if timeout is None else {"timeout": timeout})

    def parse(self, response: httpx.Response) -> R:
        check_reply(response)
        if self._adapter is None:
            return None  # type: ignore[return-value]
        return self._adapter.validate_json(response.content)


def _send_kwargs(request: Request) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(request.options)
    if request.query:
        kwargs["params"] = request.query
    if request.json is not None:
        kwargs["json"] = request.json
    return kwargs


class Client:
    """A service's routes over one sync httpx client; a context manager. ``token`` defaults to
    $STALEFLOW_TOKEN."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None):
        self.url = url
        self.http = http_client(url, token, timeout, transport)

    def send(self, route: Route[R], request: Request) -> R:
        return route.parse(self.http.request(request.method, request.path, **_send_kwargs(request)))

    def json(self, route: Route[Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``route`` and return its reply's JSON as is (for clients that hand out plain data)."""
        request = route.request(*args, **kwargs)
        return check_reply(self.http.request(request.method, request.path, **_send_kwargs(request))).json()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """A service's routes over one httpx client on an event loop: every route call is awaited."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0):
        self.url = url
        self.http = async_http_client(url, token, timeout)

    async def send(self, route: Route[R], request: Request) -> R:
        return route.parse(await self.http.request(request.method, request.path, **_send_kwargs(request)))

    async def call_at(self, url: str, route: Route[R], *args: Any, **kwargs: Any) -> R:
        """Call ``route`` at the absolute ``url`` instead of at its path under this client's base
        URL: a callback address handed to this service (``Route.url``), which may be a proxy's."""
        return await self.send(route, replace(route.request(*args, **kwargs), path=url))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class ServiceRoutes:
    """What every StaleFlow service answers, for tools that do not know which service a URL is."""

    health = Route("GET", "/v1/health", dict[str, Any])


class ServiceClient(ServiceRoutes, Client):
    """Any StaleFlow service, by what they all answer: its health."""
