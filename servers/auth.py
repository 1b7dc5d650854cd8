"""Bearer-token protection of the control plane.

Mutating requests (anything but GET, HEAD and OPTIONS) need ``Authorization: Bearer <token>``
whenever a token is configured; reads stay open so dashboards and scrapers work. The scheme is
case-insensitive (RFC 7235); a request with more than one Authorization header is refused, since
proxies and servers disagree on which one counts. A component bound to a non-loopback address
without a token refuses to start."""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from staleflow.api.base import TOKEN_ENV, TOKEN_FILE_ENV, TokenFileError, configured_token, token_from_file
from staleflow.errors import ErrorCode, error_body

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class InsecureBind(RuntimeError):
    pass


PRIVATE_UMASK = 0o077
"""Files 0600 and directories 0700: a run's state holds every prompt and response, its token and weights."""


@contextmanager
def private_files(state_dir: Path | None = None) -> Iterator[None]:
    """While inside, what this process (and the processes it starts) creates is its owner's only.
    ``state_dir``, if given, is created 0700, and what it already holds (a resumed run) is made
    owner-only too. The process's umask is restored on the way out."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        if state_dir is not None:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            make_private(state_dir)
        yield
    finally:
        os.umask(previous)


def make_private(root: Path) -> None:
    """Take group and other permissions off ``root`` and everything under it."""
    for path in [root, *root.rglob("*")]:
        try:
            mode = path.lstat().st_mode
            if not path.is_symlink() and mode & 0o077:
                path.chmod(mode & ~0o077 & 0o7777)
        except OSError:  # vanished meanwhile, or not ours: nothing to protect here
            continue


def run_token(state_dir: Path) -> tuple[str, Path]:
    """A run's token and the file that holds it: the file $STALEFLOW_TOKEN_FILE names (a secret
    the deployment manages, so clients outside can hold it too), else a fresh random token in
    ``state_dir/token``, readable by the owner only."""
    token = token_from_file()
    if token is not None:
        return token, Path(os.environ[TOKEN_FILE_ENV]).resolve()
    path = state_dir / "token"
    return write_token_file(path), path.resolve()


def write_token_file(path: Path) -> str:
    """A fresh random token, readable by the owner only."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(path, 0o600)
    return token


def read_token_file(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def bearer_refusal(values: list[bytes], token: str) -> str | None:
    """Why the Authorization header ``values`` of one request do not carry ``token``; None if they do."""
    if not values:
        return "missing bearer token"
    if len(values) > 1:
        return f"{len(values)} Authorization headers; send exactly one"
    scheme, _, credentials = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return "not a bearer token"
    if not hmac.compare_digest(credentials.strip(), token.encode()):
        return "wrong bearer token"
    return None


class BearerTokenMiddleware:
    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        reason = bearer_refusal([value for name, value in scope["headers"] if name == b"authorization"], self.token)
        if reason is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(ErrorCode.UNAUTHORIZED,
                                     f"{reason}: mutating requests need 'Authorization: Bearer <token>' "
                                     f"(the job's token file, or ${TOKEN_ENV})")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def protect(app, host: str, token: str | None, loopback: bool) -> None:
    """Install the token check on ``app``, or refuse an open non-loopback bind (and a token file
    that is set but unusable: the server must not start unprotected by mistake)."""
    try:
        token = configured_token(token)
    except TokenFileError as exc:
        raise InsecureBind(str(exc)) from None
    app.state.token = token  # for what the app serves beside its routes (the PS's data plane)
    if token:
        app.add_middleware(BearerTokenMiddleware, token=token)
        return
    if not loopback:
        raise InsecureBind(
            f"refusing to serve {app.title} on {host} without a token: anyone on the network could change its "
            f"state. Pass --token or set ${TOKEN_ENV}, or bind 127.0.0.1")
    log.warning("%s runs without a token on loopback (%s): mutating endpoints are open to local users",
                app.title, host)
