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

log = logging.getLogger(__name__)

TOKEN_ENV = "STALEFLOW_TOKEN"
# a file holding the token (e.g. a mounted Kubernetes or compose secret): the token itself never
# appears in the environment, where process listings and orchestrators' metadata can show it
TOKEN_FILE_ENV = "STALEFLOW_TOKEN_FILE"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class InsecureBind(RuntimeError):
    pass


class TokenFileError(InsecureBind):
    """$STALEFLOW_TOKEN_FILE names a file that cannot serve as the token (a server refuses to
    start, like an unprotected bind: every handler of InsecureBind reports it)."""


def configured_token(token: str | None = None) -> str | None:
    """The explicit token, else $STALEFLOW_TOKEN, else the file $STALEFLOW_TOKEN_FILE names, else none."""
    return token or os.environ.get(TOKEN_ENV) or token_from_file()


def token_from_file() -> str | None:
    """The token in the file $STALEFLOW_TOKEN_FILE names; None when the variable is unset. A set
    variable whose file is missing or empty is an error, never a silent run without a token."""
    path = os.environ.get(TOKEN_FILE_ENV)
    if not path:
        return None
    token = read_token_file(Path(path))
    if token is None:
        raise TokenFileError(f"${TOKEN_FILE_ENV} names {path}, which is missing, unreadable or empty; "
                             "mount the token there (e.g. a Kubernetes Secret) or unset the variable")
    return token


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
        body = json.dumps({"detail": f"{reason}: mutating requests need 'Authorization: Bearer <token>' "
                                     f"(the job's token file, or ${TOKEN_ENV})"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def protect(app, host: str, token: str | None, loopback: bool) -> None:  # noqa: ANN001
    """Install the token check on ``app``, or refuse an open non-loopback bind."""
    token = configured_token(token)
    if token:
        app.add_middleware(BearerTokenMiddleware, token=token)
        return
    if not loopback:
        raise InsecureBind(
            f"refusing to serve {app.title} on {host} without a token: anyone on the network could change its "
            f"state. Pass --token or set ${TOKEN_ENV}, or bind 127.0.0.1")
    log.warning("%s runs without a token on loopback (%s): mutating endpoints are open to local users",
                app.title, host)
