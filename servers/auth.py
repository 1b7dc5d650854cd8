"""Bearer-token protection of the control plane.

Mutating requests (anything but GET, HEAD and OPTIONS) need ``Authorization: Bearer <token>``
whenever a token is configured; reads stay open so dashboards and scrapers work. A component
bound to a non-loopback address without a token refuses to start."""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from staleflow.errors import ErrorCode, error_body
from staleflow.transports.rest import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    TokenFileError,
    configured_token,
    token_from_file,
)

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class InsecureBind(RuntimeError):
    pass


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


class BearerTokenMiddleware:
    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        reason = "missing bearer token" if not given else "wrong bearer token"
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
