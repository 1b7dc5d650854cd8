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

Leases, joins and commits stay on the API port; clients find this port in ``/v1/health``
(``data_port``) and fall back to the API port when it is not reachable. At most
``max_connections`` are served at once (one more is answered 503 ``too_many_connections`` and
closed), a request that says ``Connection: close`` closes its connection once answered, and a
connection that sends no complete request head within ``header_timeout_s`` of its start (or of
its previous response) is closed, as on the API port.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from urllib.parse import parse_qs, urlsplit

from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.servers.auth import bearer_refusal
from staleflow.servers.http import ConnectionLimits, bind_socket
from staleflow.servers.params.store import ParamStore
from staleflow.transports.http import CHECKSUM_HEADER, PIECE_BYTES, SocketReader

log = logging.getLogger(__name__)

_CHUNK_ROUTE = re.compile(r"^/v1/params/(\d{1,18})/(?:parts/(\d{1,9})/)?chunks/(\d{1,9})$")
_SEND_STEP = 64 << 20  # bytes per sendfile call


class _Refused(StaleFlowError):
    """A refusal sent before the request's body was read: the connection cannot carry another
    request after it."""


class ChunkDataPlane:
    """Serves the chunk routes of ``store`` on ``host:port`` (0: any free port) until ``close``."""

    def __init__(self, store: ParamStore, host: str, port: int, token: str | None,
                 max_connections: int = ConnectionLimits.max_connections,
                 header_timeout_s: float = ConnectionLimits.header_timeout_s):
        self.store = store
        self._listener = bind_socket(host, port)
        self.port: int = self._listener.getsockname()[1]
        self._token = token
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_forever, name="params-data-accept", daemon=True)
        self._acceptor.start()
        log.info("parameter server data plane on %s:%d", host, self.port)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = dict(self._connections)
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
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(conn,), name="params-data", daemon=True)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections[conn] = thread
                    thread.start()
            if full:
                _refuse_connection(conn, self.max_connections)

    def _serve(self, conn: socket.socket) -> None:
        reader = SocketReader(conn)
        try:
            while True:
                try:
                    message = reader.head(deadline=time.monotonic() + self.header_timeout_s)
                except TimeoutError:
                    log.info("closing a data-plane connection that sent no complete request head in %g s",
                             self.header_timeout_s)
                    return
                if message is None:
                    return
                request_line, headers = message
                closing = "close" in headers.get("connection", "").lower()
                try:
                    self._answer(conn, reader, request_line, headers)
                except StaleFlowError as exc:
                    _send_json(conn, exc.status, exc.to_json(), close=closing or isinstance(exc, _Refused))
                    if isinstance(exc, _Refused):
                        return
                if closing:
                    return
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
        refuse = _Refused if "content-length" in headers or "transfer-encoding" in headers else StaleFlowError
        if route is None:
            raise refuse(ErrorCode.NOT_FOUND, f"{parts.path}: the data plane serves chunk bodies only "
                                                "(/v1/params/{version}[/parts/{part}]/chunks/{index}); use the API port")
        version, part, index = int(route.group(1)), int(route.group(2) or 0), int(route.group(3))
        if method == "GET" and route.group(2) is None:
            self._send_chunk(conn, version, index, query.get("lease"))
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
            writer = self.store.chunk_writer(version, query["push_id"], index, headers.get(CHECKSUM_HEADER), int(length), part)
        except StaleFlowError as exc:
            raise _Refused(exc.code, exc.message) from None
        if headers.get("expect", "").lower() == "100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
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
        _send_json(conn, 200, {"index": index, "checksum": writer.finish()}, False)

    def _send_chunk(self, conn: socket.socket, version: int, index: int, lease: str | None) -> None:
        fd, stored = self.store.open_range(version, lease)
        try:
            chunks = stored.manifest.chunks
            if not 0 <= index < len(chunks):
                raise StaleFlowError(ErrorCode.UNKNOWN_CHUNK, f"version {version} has chunks 0..{len(chunks) - 1}, not {index}")
            chunk = chunks[index]
            conn.sendall(_head(200, {"Content-Type": "application/octet-stream", "Content-Length": str(chunk.length),
                                     CHECKSUM_HEADER: chunk.checksum or ""}))
            offset, end = stored.manifest.data_offset + chunk.offset, stored.manifest.data_offset + chunk.offset + chunk.length
            if stored.slot is not None and stored.slot.mapping is not None:  # measured faster than sendfile from tmpfs
                with memoryview(stored.slot.mapping) as mapped:
                    conn.sendall(mapped[offset:end])
                return
            while offset < end:
                sent = os.sendfile(conn.fileno(), fd, offset, min(_SEND_STEP, end - offset))
                if sent == 0:
                    raise OSError(f"version {version} ended at byte {offset}")
                offset += sent
        finally:
            os.close(fd)
            self.store.stream_done(stored)


def _refuse_connection(conn: socket.socket, limit: int) -> None:
    """503 and close, draining what already arrived: closing with unread input would reset the
    connection before the client read the refusal."""
    error = StaleFlowError(ErrorCode.TOO_MANY_CONNECTIONS, f"the data plane holds its limit of {limit} connections; "
                                                            "retry later")
    with contextlib.suppress(OSError):
        _send_json(conn, error.status, error.to_json(), close=True)
        conn.shutdown(socket.SHUT_WR)
        conn.setblocking(False)
        while conn.recv(1 << 16):
            pass
    conn.close()


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _send_json(conn: socket.socket, status: int, body: dict, close: bool) -> None:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}
    if close:
        headers["Connection"] = "close"
    conn.sendall(_head(status, headers) + data)


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            409: "Conflict", 410: "Gone", 413: "Payload Too Large", 422: "Unprocessable Entity", 503: "Service Unavailable"}
