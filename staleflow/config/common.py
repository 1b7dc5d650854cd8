"""What every component's settings build on: the strict base, an http(s) URL field, the database
URL check and ``ServiceConfig`` (where a service listens)."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

from staleflow.database_url import normalize_url
from staleflow.strict import StrictModel

_HOST_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def valid_host(host: str) -> bool:
    """An IP address, or a host name as RFC 1123 allows: at most 253 characters, dot-separated
    labels of 1-63 letters, digits and inner hyphens."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_HOST_LABEL.match(label) for label in name.split("."))


def _check_http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises on a malformed port
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(ord(c) < 33 for c in value):
        raise ValueError(f"{value!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8350")
    if not valid_host(parts.hostname):
        raise ValueError(f"{value[:300]!r}: the host is neither an IP address nor a valid host name (RFC 1123: at "
                         "most 253 characters, labels of 1-63 letters, digits and inner hyphens)")
    return value.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(_check_http_url)]
"""An http(s) URL with a host, kept as a string (no trailing slash)."""


def check_database_url(value: str | None) -> str | None:
    """A database URL StaleFlow supports (kept as given); the error names the fix."""
    if value is not None:
        normalize_url(value)
    return value


STATE_DIR = Path(".staleflow")
"""Where a run keeps its state unless told otherwise (every component's ``state_dir`` default)."""


class ServiceConfig(StrictModel):
    host: str = Field(default="127.0.0.1", description="address to bind; loopback by default")
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")


def default_of(model: type[StrictModel], name: str):
    """The declared default of ``model.name``: CLI options read their defaults from here, so a
    default is declared once, in the model."""
    field = model.model_fields[name]
    return field.get_default(call_default_factory=True)
