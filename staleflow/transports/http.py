"""The ``http`` transport: chunks of the safetensors data section over plain HTTP/1.1.

Works anywhere the PS's port is reachable (other hosts included). The control plane (leases,
commits) goes through httpx; the chunk bodies go through :class:`RawHttpConnection`, a minimal
keep-alive HTTP/1.1 client that receives straight into the destination arrays with
``recv_into`` and sends straight from the source arrays. httpx copies every 64 KiB read into a
new bytes object; measured on loopback here it moves ~0.6-1 GB/s where ``recv_into`` moves
~2.5-3 GB/s.

The chunk bodies go to the PS's data plane when it runs one (its port is in ``/v1/health`` as
``data_port``; the same paths as the REST API, served by a thread per connection), else to the
API port.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from staleflow.api.base import ServiceError
from staleflow.api.params import ParamsRoutes
from staleflow.transports.base import PullLease, PushSession, Transport
from staleflow.transports.checksums import chunk_checksum
from staleflow.transports.layout import ChunkSpec
from staleflow.transports.regions import ByteRegions

log = logging.getLogger(__name__)

CHECKSUM_HEADER = "x-staleflow-checksum"
LANDED_THROUGH_HEADER = "x-staleflow-landed-through"  # a peer's HEAD of a chunk: the end of the run of landed chunks from it
# bytes per send / receive step and per verified piece: 0.5-1 MiB pieces measured ~2x faster than
# 4 MiB (asyncio copies what the socket does not take at once; the verifier hashes in cache)
PIECE_BYTES = 1 << 20
_HEAD_LIMIT = 64 << 10
DATA_PLANE_CONNECT_S = 3.0  # a data port behind a firewall that drops packets is given up on quickly


class SocketReader:
    """Reads HTTP/1.1 message heads and bodies off one socket, keeping what was read past a head
    (the start of its body) for the body. Bodies land with ``recv_into`` straight in the caller's
    buffers. Used by the raw client below and by the parameter server's data plane."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.leftover = b""

    def head(self, deadline: float | None = None) -> tuple[str, dict[str, str]] | None:
        """(first line, lower-cased headers) of the next message; None when the peer closed the
        connection cleanly before sending one. With a ``deadline`` (``time.monotonic()``), a head
        still incomplete then raises ``TimeoutError`` however slowly its bytes trickle in; the
        socket is left blocking, as a data-plane connection expects (``os.sendfile``)."""
        data = self.leftover
        while b"\r\n\r\n" not in data:
            if len(data) > _HEAD_LIMIT:
                raise ConnectionError("message head too large")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no complete message head before the deadline")
                self.sock.settimeout(left)
            try:
                piece = self.sock.recv(65536)
            finally:
                if deadline is not None:
                    self.sock.settimeout(None)
            if not piece:
                if data:
                    raise ConnectionError("the connection closed in the middle of a message head")
                return None
            data += piece
        head, self.leftover = data.split(b"\r\n\r\n", 1)
        first, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return first, headers

    def into(self, views: Sequence[memoryview], piece_bytes: int = PIECE_BYTES) -> Iterator[int]:
        """Fill ``views`` in order from the body; yields the byte count of each piece as it lands."""
        for view in views:
            filled = 0
            while filled < len(view):
                piece_end = min(len(view), filled + piece_bytes)
                start = filled
                if self.leftover:
                    n = min(len(self.leftover), piece_end - filled)
                    view[filled:filled + n] = self.leftover[:n]
                    self.leftover = self.leftover[n:]
                    filled += n
                while filled < piece_end:
                    n = self.sock.recv_into(view[filled:piece_end])
                    if n == 0:
                        raise ConnectionError("the connection closed in the middle of a body")
                    filled += n
                yield filled - start

    def body(self, length: int) -> bytes:
        buffer = bytearray(length)
        for _ in self.into([memoryview(buffer)]):
            pass
        return bytes(buffer)


class RawHttpConnection:
    """One keep-alive HTTP/1.1 connection. Responses must carry Content-Length (the PS's do)."""

    def __init__(self, url: str, timeout: float = 60.0, headers: Mapping[str, str] | None = None):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url!r}: the raw data plane speaks plain http://host:port only")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.timeout = timeout
        self.headers = dict(headers or {})  # sent with every request (e.g. Authorization)
        self._reader: SocketReader | None = None
        self._closing = False  # the last response said ``Connection: close``: drop the socket after its body

    def _connection(self, connect_timeout: float | None = None) -> SocketReader:
        if self._reader is None:
            sock = socket.create_connection((self.host, self.port), timeout=connect_timeout or self.timeout)
            sock.settimeout(self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._reader = SocketReader(sock)
        return self._reader

    def connect(self, timeout: float | None = None) -> None:
        """Open the connection now, waiting at most ``timeout`` (requests open it when needed)."""
        self._connection(timeout)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.sock.close()
            self._reader = None
        self._closing = False

    def __enter__(self) -> RawHttpConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, method: str, target: str, headers: Mapping[str, str] | None = None,
             body: Sequence[memoryview] = ()) -> None:
        length = sum(len(v) for v in body)
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{k}: {v}" for k, v in {**self.headers, **(headers or {})}.items()]
        if body or method in ("PUT", "POST"):
            lines.append(f"Content-Length: {length}")
        sock = self._connection().sock
        try:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            for view in body:
                sock.sendall(view)
        except OSError:
            self.close()
            raise

    def read_head(self) -> tuple[int, dict[str, str]]:
        try:
            message = self._connection().head()
            if message is None:
                raise ConnectionError("the server closed the connection before answering")
        except (OSError, ConnectionError):
            self.close()
            raise
        status_line, headers = message
        try:
            status = int(status_line.split(" ", 2)[1])
        except (IndexError, ValueError):
            self.close()
            raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}") from None
        if "content-length" not in headers:
            self.close()
            raise ConnectionError("response without Content-Length")
        self._closing = headers.get("connection", "").lower() == "close"
        return status, headers

    def read_into(self, views: Sequence[memoryview], piece_bytes: int = PIECE_BYTES) -> Iterator[int]:
        """Fill ``views`` in order from the body; yields the byte count of each piece as it lands."""
        try:
            yield from self._connection().into(views, piece_bytes)
        except (OSError, ConnectionError):
            self.close()
            raise
        if self._closing:  # the server closes its end: the next request opens a new connection
            self.close()

    def read_body(self, length: int) -> bytes:
        buffer = bytearray(length)
        for _ in self.read_into([memoryview(buffer)]):
            pass
        return bytes(buffer)

    def request(self, method: str, target: str, headers: Mapping[str, str] | None = None,
                body: Sequence[memoryview] = ()) -> tuple[int, dict[str, str], bytes]:
        self.send(method, target, headers, body)
        status, response_headers = self.read_head()
        return status, response_headers, self.read_body(int(response_headers["content-length"]))


def raise_for_status(status: int, body: bytes) -> None:
    if 200 <= status < 300:
        return
    try:
        parsed = json.loads(body)
        detail = parsed.get("detail", body.decode(errors="replace"))
    except (ValueError, AttributeError):
        parsed, detail = None, body.decode(errors="replace")
    raise ServiceError(status, str(detail), parsed if isinstance(parsed, dict) else None)  # with its code


class HttpTransport(Transport):
    name = "http"

    def __init__(self, url: str, timeout: float = 60.0, headers: Mapping[str, str] | None = None,
                 data_plane: Callable[[bool], str | None] | None = None):
        """``data_plane(refresh)``: the URL of the PS's data plane, or None when it runs none
        (``refresh``: ask the PS again, it may have restarted on another port)."""
        self.url = url
        self.timeout = timeout
        self.headers = dict(headers or {})
        self._data_plane = data_plane
        self._unreachable: set[str] = set()

    def _connect(self) -> RawHttpConnection:
        """A connection to the data plane, or to the API port when the data plane is not reachable
        from here (a firewall, a port not exposed): both serve the chunk routes."""
        for refresh in (False, True):
            url = self._data_plane(refresh) if self._data_plane is not None else None
            if url is None:
                break
            if url in self._unreachable:
                continue
            conn = RawHttpConnection(url, self.timeout, self.headers)
            try:
                conn.connect(min(self.timeout, DATA_PLANE_CONNECT_S))
                return conn
            except OSError as exc:
                log.warning("the parameter server's data plane %s is not reachable (%s); sending chunks through %s",
                            url, exc, self.url)
                self._unreachable.add(url)
        return RawHttpConnection(self.url, self.timeout, self.headers)

    def pull(self, lease: PullLease, into: ByteRegions) -> Iterator[tuple[int, int]]:
        chunks = lease.manifest.chunks

        def ask(index: int) -> None:
            conn.send("GET", ParamsRoutes.chunk.target(lease.manifest.version, index, lease=lease.lease_id))

        with self._connect() as conn:
            if chunks:
                ask(chunks[0].index)
            for position, chunk in enumerate(chunks):  # a selected pull's lease lists only some chunks
                if position + 1 < len(chunks):  # pipelined: the server starts on it while we read this one
                    ask(chunks[position + 1].index)
                status, headers = conn.read_head()
                length = int(headers["content-length"])
                if status != 200:
                    raise_for_status(status, conn.read_body(length))
                if length != chunk.length:
                    raise ConnectionError(f"chunk {chunk.index}: {length} bytes announced, the manifest says {chunk.length}")
                offset = chunk.offset
                for n in conn.read_into(into.views(chunk.offset, chunk.length)):
                    yield offset, n
                    offset += n

    def push(self, session: PushSession, source: ByteRegions) -> None:
        """Chunk by chunk over one connection; the next chunk's checksum is computed on a worker
        thread (the hash releases the GIL) while this one is on the wire."""

        def checksum(chunk: ChunkSpec) -> str:
            return chunk_checksum(chunk, session.checksum_algorithm, source.gather(chunk.spans()))

        chunks = session.chunks
        with self._connect() as conn, \
                ThreadPoolExecutor(1, thread_name_prefix="push-checksum") as hasher:
            upcoming = hasher.submit(checksum, chunks[0]) if chunks else None
            for i, chunk in enumerate(chunks):
                assert upcoming is not None
                claimed = upcoming.result()
                if i + 1 < len(chunks):
                    upcoming = hasher.submit(checksum, chunks[i + 1])
                status, _, body = conn.request(
                    "PUT", session.chunk_target(chunk.index),
                    {CHECKSUM_HEADER: claimed, "Content-Type": "application/octet-stream"},
                    source.gather(chunk.spans()),  # a gathered chunk's ranges, one after the other
                )
                raise_for_status(status, body)


async def stream_file_range(fd: int, offset: int, length: int, piece_bytes: int = PIECE_BYTES) -> AsyncIterator[bytes]:
    """Server side: a byte range of a stored file as response pieces. pread runs on the event loop:
    the stored versions are in the page cache right after a push, and a thread hop per piece
    measured ~25 % slower."""
    end = offset + length
    while offset < end:
        piece = os.pread(fd, min(piece_bytes, end - offset), offset)
        if not piece:
            raise OSError(f"stored file ended early at byte {offset}")
        offset += len(piece)
        yield piece



async def stream_mapped_range(mapping: Any, offset: int, length: int, piece_bytes: int = PIECE_BYTES) -> AsyncIterator[bytes]:
    """Server side: a byte range of a mapped version (the PS's memory slot) as response pieces."""
    end = offset + length
    while offset < end:
        piece = mapping[offset:min(end, offset + piece_bytes)]
        offset += len(piece)
        yield piece
