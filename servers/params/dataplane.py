"""The parameter server's data plane: chunk bodies over plain HTTP/1.1 on a port of their own,
one thread per connection.

The REST app runs on one event loop, which hands a request body over in pieces of at most
256 KiB, each through several Python calls; at GB/s that per-piece work, not the copy, bounds a
push, and every pushing rank shares the one loop. Here a connection's thread receives a chunk
with ``recv_into`` straight into the version's memory slot (checksummed piece by piece while in
cache) and sends one straight from the slot (``sendfile`` from a version on disk): the copies run in the kernel or in xxhash,
without the GIL, so ranks pushing at once use several cores.

It serves the REST API's chunk routes, with the same paths, rules, bearer token and error bodies:

* ``PUT /v1/params/{version}/chunks/{index}?push_id=...``
* ``PUT /v1/params/{version}/parts/{part}/chunks/{index}?push_id=...``
* ``GET /v1/params/{version}/chunks/{index}?lease=...``

and what peers of a holder read its copies with besides (``PeerRoutes``): a lease on a copy for
shm or nixl reads (``POST /v1/params/{version}/peer-leases?transport=...``, ended with ``DELETE
/v1/peer-leases/{lease_id}``), and ``HEAD /v1/params/{version}/chunks/{index}?lease=...``, which
answers once the chunk landed verified in a copy still being pulled (the request a shm or nixl
reader waits on: it cannot wait on the memory itself).

Leases, joins and commits stay on the API port; clients find this port in ``/v1/health``
(``data_port``) and fall back to the API port when it is not reachable. At most
``max_connections`` are served at once (one more is answered 503 ``too_many_connections`` and
closed), a request that says ``Connection: close`` closes its connection once answered, and a
connection that sends no complete request head within ``header_timeout_s`` of its start (or of
its previous response) is closed, as on the API port. So is one whose client takes none of a
response for ``send_timeout_s``, or takes it slower than ``min_send_rate`` once it has kept the
server waiting ``send_rate_grace_s``: a chunk being sent pins its version, which a reader that
never reads would otherwise hold forever.

Running out of descriptors or memory (``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) while
accepting is logged and retried after a pause; the connection waits in the backlog meanwhile.
Should the accept loop stop for another reason, ``accepting`` says so (and ``/v1/health``
answers 503, so a supervisor restarts the server).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import select
import socket
import threading
import time
from urllib.parse import parse_qs, urlsplit

from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.servers.auth import bearer_refusal
from staleflow.servers.http import ConnectionLimits, bind_socket
from staleflow.servers.params.store import ParamStore
from staleflow.transports.egress import EgressLimiter
from staleflow.transports.http import CHECKSUM_HEADER, LANDED_THROUGH_HEADER, PIECE_BYTES, SocketReader

log = logging.getLogger(__name__)

_CHUNK_ROUTE = re.compile(r"^/v1/params/(\d{1,18})/(?:parts/(\d{1,9})/)?chunks/(\d{1,9})$")
_PEER_LEASE_ROUTE = re.compile(r"^/v1/params/(\d{1,18})/peer-leases$")
_PEER_LEASE_END_ROUTE = re.compile(r"^/v1/peer-leases/([0-9a-f]{1,64})$")
_SEND_STEP = 64 << 20  # bytes per send or sendfile call
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_TRANSIENT = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR})  # the connection, not the listener
ACCEPT_RETRY_S = 0.25
"""The pause before accepting again after running out of descriptors or memory: they come back
as connections close, and the pending connections wait in the backlog meanwhile."""


class _Refused(StaleFlowError):
    """A refusal sent before the request's body was read: the connection cannot carry another
    request after it."""


class _SlowReader(TimeoutError):
    """The client took a response too slowly, or not at all, within the send limits."""


class _Sender:
    """Sends the bytes of a connection's responses within ``limits``: the client must take some
    of them every ``send_timeout_s``, and on average ``min_send_rate`` bytes a second of the time
    the server waits for it, once that is over ``send_rate_grace_s``. The socket is non-blocking
    while sending; ``done`` hands it back blocking (``recv_into``, the request heads)."""

    def __init__(self, conn: socket.socket, limits: ConnectionLimits):
        self.conn, self.limits = conn, limits
        self.sent, self.waited_s = 0, 0.0
        self.last_take = time.monotonic()
        self._poll = select.poll()
        self._poll.register(conn, select.POLLOUT)
        conn.setblocking(False)

    def done(self) -> None:
        self.conn.setblocking(True)

    def data(self, data: bytes | memoryview) -> None:
        with memoryview(data) as view:
            at = 0
            while at < len(view):
                try:
                    at += self._took(self.conn.send(view[at:at + _SEND_STEP]))
                except BlockingIOError:
                    self._wait()

    def file(self, fd: int, offset: int, end: int) -> None:
        while offset < end:
            try:
                sent = os.sendfile(self.conn.fileno(), fd, offset, min(_SEND_STEP, end - offset))
            except BlockingIOError:
                self._wait()
                continue
            if sent == 0:
                raise OSError(f"the file ended at byte {offset} of {end}")
            offset += self._took(sent)

    def body(self, data: bytes | memoryview, egress: EgressLimiter | None) -> None:
        """A response body of version bytes: paced by the endpoint's ``egress`` when it has one."""
        if egress is None:
            self.data(data)
            return
        with memoryview(data) as view:
            for start, stop in egress.pieces(0, len(view)):
                self.data(view[start:stop])

    def file_body(self, fd: int, offset: int, end: int, egress: EgressLimiter | None) -> None:
        if egress is None:
            self.file(fd, offset, end)
            return
        for start, stop in egress.pieces(offset, end):
            self.file(fd, start, stop)

    def _took(self, n: int) -> int:
        self.sent += n
        self.last_take = time.monotonic()
        return n

    def _wait(self) -> None:
        limits = self.limits
        now = time.monotonic()
        left = self.last_take + limits.send_timeout_s - now
        if left <= 0:
            raise _SlowReader(f"the client took none of a response for {limits.send_timeout_s:g} s")
        if self.waited_s > limits.send_rate_grace_s and self.sent < limits.min_send_rate * self.waited_s:
            raise _SlowReader(f"the client took a response at {self.sent / self.waited_s:.0f} bytes/s "
                              f"(the least is {limits.min_send_rate:g})")
        self._poll.poll(max(1, int(1000 * min(left, limits.send_rate_grace_s))))
        self.waited_s += time.monotonic() - now


class ChunkDataPlane:
    """Serves the chunk routes of ``store`` on ``host:port`` (0: any free port) until ``close``.
    ``egress``: this endpoint's egress limit, shared by every chunk body it sends (and by the
    server's API port, given the same limiter); None: unlimited."""

    def __init__(self, store: ParamStore, host: str, port: int, token: str | None,
                 limits: ConnectionLimits | None = None, egress: EgressLimiter | None = None):
        self.store = store
        self.egress = egress
        self._listener = bind_socket(host, port)
        self.port: int = self._listener.getsockname()[1]
        self._token = token
        self.limits = limits or ConnectionLimits()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # wakes an accept loop pausing after running out of descriptors
        self.accept_failures = 0  # accepts that ran out of descriptors or memory, and were retried
        self._acceptor = threading.Thread(target=self._accept_forever, name="params-data-accept", daemon=True)
        self._acceptor.start()
        log.info("parameter server data plane on %s:%d", host, self.port)

    @property
    def accepting(self) -> bool:
        """Whether the accept loop runs (it may be pausing for descriptors to come back)."""
        return self._acceptor.is_alive() and not self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = dict(self._connections)
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor
        self._listener.close()
        for conn in connections:  # wakes their threads out of recv
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(5)
        for thread in connections.values():
            thread.join(5)

    def _accept_forever(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in _TRANSIENT:
                    continue
                if exc.errno not in _EXHAUSTED:
                    log.exception("the data plane stopped accepting connections; restart the parameter server")
                    return
                self._pause(f"{errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror})")
                continue
            try:
                self._admit(conn)
            except RuntimeError as exc:  # no thread to serve it: out of memory or of threads
                conn.close()
                self._pause(str(exc))

    def _pause(self, why: str) -> None:
        self.accept_failures += 1
        log.warning("the data plane cannot accept a connection: %s; retrying in %g s (%d time(s) so far)",
                    why, ACCEPT_RETRY_S, self.accept_failures)
        self._closing.wait(ACCEPT_RETRY_S)

    def _admit(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(target=self._serve, args=(conn,), name="params-data", daemon=True)
        with self._lock:
            if self._closed:
                conn.close()
                return
            full = len(self._connections) >= self.limits.max_connections
            if not full:
                self._connections[conn] = thread
                try:
                    thread.start()
                except BaseException:
                    del self._connections[conn]
                    raise
        if full:
            _refuse_connection(conn, self.limits.max_connections)

    def _serve(self, conn: socket.socket) -> None:
        reader = SocketReader(conn)
        try:
            while True:
                try:
                    message = reader.head(deadline=time.monotonic() + self.limits.header_timeout_s)
                except TimeoutError:
                    log.info("closing a data-plane connection that sent no complete request head in %g s",
                             self.limits.header_timeout_s)
                    return
                if message is None:
                    return
                request_line, headers = message
                closing = "close" in headers.get("connection", "").lower()
                try:
                    self._answer(conn, reader, request_line, headers)
                except StaleFlowError as exc:
                    self._send_json(conn, exc.status, exc.to_json(), close=closing or isinstance(exc, _Refused))
                    if isinstance(exc, _Refused):
                        return
                if closing:
                    return
        except _SlowReader as exc:
            log.info("closing a data-plane connection: %s", exc)
        except (OSError, ConnectionError):
            pass  # the peer went away (a push in flight was abandoned where it stood)
        except Exception:
            log.exception("the data plane failed on a connection")
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, reader: SocketReader, request_line: str, headers: dict[str, str]) -> None:
        method, _, rest = request_line.partition(" ")
        target = rest.rpartition(" ")[0] or rest
        parts = urlsplit(target)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        route = _CHUNK_ROUTE.match(parts.path)
        # an unread body leaves the connection unusable: refuse, then close it
        bodiless = headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers
        refuse = StaleFlowError if bodiless else _Refused
        if route is None and bodiless and self._answer_peer(conn, method, parts.path, query):
            return
        if route is None:
            raise refuse(ErrorCode.NOT_FOUND, f"{parts.path}: the data plane serves chunk bodies only "
                                                "(/v1/params/{version}[/parts/{part}]/chunks/{index}); use the API port")
        version, part, index = int(route.group(1)), int(route.group(2) or 0), int(route.group(3))
        if method == "GET" and route.group(2) is None:
            self._send_chunk(conn, version, index, query.get("lease"))
        elif method == "HEAD" and route.group(2) is None:
            self._confirm_chunk(conn, version, index, query.get("lease"))
        elif method == "PUT":
            self._receive_chunk(conn, reader, version, part, index, query, headers)
        else:
            raise refuse(ErrorCode.METHOD_NOT_ALLOWED, f"{method} {parts.path}: chunks are PUT (pushes) and GET (pulls)")

    def _receive_chunk(self, conn: socket.socket, reader: SocketReader, version: int, part: int, index: int,
                       query: dict[str, str], headers: dict[str, str]) -> None:
        reason = self._token and bearer_refusal([headers["authorization"].encode("latin-1")]
                                                 if "authorization" in headers else [], self._token)
        if reason:
            raise _Refused(ErrorCode.UNAUTHORIZED, f"{reason}: pushes need 'Authorization: Bearer <token>'")
        length = headers.get("content-length", "")
        if not length.isdigit():
            raise _Refused(ErrorCode.INVALID_REQUEST, "a chunk needs a Content-Length (no chunked transfer encoding)")
        if "push_id" not in query:
            raise _Refused(ErrorCode.INVALID_REQUEST, "query parameter push_id is missing")
        try:
            writer = self.store.pushes.chunk_writer(version, query["push_id"], index, headers.get(CHECKSUM_HEADER), int(length), part)
        except StaleFlowError as exc:
            raise _Refused(exc.code, exc.message) from None
        if headers.get("expect", "").lower() == "100-continue":
            self._send(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
        views = writer.remaining()  # the chunk's ranges in the slot; Content-Length is their sum (checked)
        try:
            for n in reader.into(views, PIECE_BYTES):
                writer.landed(n)
        except BaseException:
            writer.abandon()
            raise
        finally:
            for view in views:
                view.release()
        self._send_json(conn, 200, {"index": index, "checksum": writer.finish()}, False)

    def _send_chunk(self, conn: socket.socket, version: int, index: int, lease: str | None) -> None:
        fd, stored = self.store.open_range(version, lease)
        try:
            chunks = stored.manifest.chunks
            if not 0 <= index < len(chunks):
                raise StaleFlowError(ErrorCode.UNKNOWN_CHUNK, f"version {version} has chunks 0..{len(chunks) - 1}, not {index}")
            chunk = chunks[index]
            if stored.held is not None:  # a copy still being pulled serves each chunk once it lands
                self.store.wait_chunk(stored, index, self.store.config.holder_ttl_s)
            sender = _Sender(conn, self.limits)
            try:
                sender.data(_head(200, {"Content-Type": "application/octet-stream", "Content-Length": str(chunk.length),
                                        CHECKSUM_HEADER: chunk.checksum or ""}))
                offset = stored.manifest.data_offset + chunk.offset
                if stored.slot is not None and stored.slot.mapping is not None:  # measured faster than sendfile from tmpfs
                    with memoryview(stored.slot.mapping) as mapped:
                        sender.body(mapped[offset:offset + chunk.length], self.egress)
                else:
                    sender.file_body(fd, offset, offset + chunk.length, self.egress)
            finally:
                sender.done()
        finally:
            os.close(fd)
            self.store.stream_done(stored)

    def _answer_peer(self, conn: socket.socket, method: str, path: str, query: dict[str, str]) -> bool:
        """A peer's lease request (``PeerRoutes``); False: not one."""
        opened, ended = _PEER_LEASE_ROUTE.match(path), _PEER_LEASE_END_ROUTE.match(path)
        if method == "POST" and opened is not None:
            self._send_json(conn, 201, self._open_peer_lease(int(opened.group(1)), query.get("transport", "")), False)
        elif method == "DELETE" and ended is not None:
            released = self.store.release(ended.group(1))
            if not released:
                raise StaleFlowError(ErrorCode.UNKNOWN_LEASE, f"lease {ended.group(1)!r} is unknown or lapsed")
            self._send_json(conn, 200, {"lease_id": ended.group(1), "released": True}, False)
        else:
            return False
        return True

    def _open_peer_lease(self, version: int, transport: str) -> dict:
        lease, stored = self.store.acquire_peer(version, transport)
        try:
            details = self.store.transport_details(stored, transport)
        except Exception:
            self.store.release(lease.lease_id)
            raise
        with self.store.cond:
            held = None if stored.held is None else sorted(stored.held)
        return {"lease_id": lease.lease_id, "version": version, "transport": transport,
                "ttl_s": self.store.config.lease_ttl_s, "details": details, "held": held}

    def _confirm_chunk(self, conn: socket.socket, version: int, index: int, lease: str | None) -> None:
        """Answers (no body) once chunk ``index`` landed verified; renews ``lease``."""
        fd, stored = self.store.open_range(version, lease)
        try:
            os.close(fd)
            chunks = stored.manifest.chunks
            if not 0 <= index < len(chunks):
                raise StaleFlowError(ErrorCode.UNKNOWN_CHUNK, f"version {version} has chunks 0..{len(chunks) - 1}, not {index}")
            if stored.held is not None:
                self.store.wait_chunk(stored, index, self.store.config.holder_ttl_s)
            self._send(conn, _head(200, {"Content-Length": str(chunks[index].length),
                                         CHECKSUM_HEADER: chunks[index].checksum or "",
                                         LANDED_THROUGH_HEADER: str(self.store.landed_through(stored, index))}))
        finally:
            self.store.stream_done(stored)

    def _send(self, conn: socket.socket, data: bytes) -> None:
        sender = _Sender(conn, self.limits)
        try:
            sender.data(data)
        finally:
            sender.done()

    def _send_json(self, conn: socket.socket, status: int, body: dict, close: bool) -> None:
        self._send(conn, _json_response(status, body, close))


def _refuse_connection(conn: socket.socket, limit: int) -> None:
    """503 and close, draining what already arrived: closing with unread input would reset the
    connection before the client read the refusal."""
    error = StaleFlowError(ErrorCode.TOO_MANY_CONNECTIONS, f"the data plane holds its limit of {limit} connections; "
                                                            "retry later")
    with contextlib.suppress(OSError):
        conn.sendall(_json_response(error.status, error.to_json(), close=True))
        conn.shutdown(socket.SHUT_WR)
        conn.setblocking(False)
        while conn.recv(1 << 16):
            pass
    conn.close()


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _json_response(status: int, body: dict, close: bool) -> bytes:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}
    if close:
        headers["Connection"] = "close"
    return _head(status, headers) + data


_REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            409: "Conflict", 410: "Gone", 413: "Payload Too Large", 422: "Unprocessable Entity", 503: "Service Unavailable"}
