"""Database URLs of the durable state: which ones StaleFlow accepts, and how they are shown.

SQLite (``sqlite:///PATH``) and PostgreSQL through psycopg 3 (``postgresql+psycopg://``; plain
``postgresql://`` and ``postgres://`` mean the same) are supported. Messages never show a password.
"""

from __future__ import annotations

import importlib.util

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

SUPPORTED = "sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DATABASE"


class DatabaseUrlError(ValueError):
    """A database URL StaleFlow cannot use; the message says what to write instead."""


def normalize_url(url: str) -> str:
    """Check ``url`` and return the form SQLAlchemy is given: ``postgresql://`` and
    ``postgres://`` mean the psycopg (3) driver, the one the ``postgres`` extra installs."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseUrlError(f"database URL {url!r} is not a URL; use {SUPPORTED}") from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "postgres":
        backend = "postgresql"
    if backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise DatabaseUrlError(f"database URL {masked(url)}: the SQLite driver {driver!r} is not supported; "
                                   "use sqlite:///PATH")
        return url
    if backend != "postgresql":
        raise DatabaseUrlError(f"database URL {masked(url)}: {backend!r} is not supported; use {SUPPORTED}")
    if driver not in ("", "psycopg"):
        raise DatabaseUrlError(f"database URL {masked(url)}: the PostgreSQL driver {driver!r} is not supported; "
                               "use postgresql+psycopg://")
    if not parsed.database:
        raise DatabaseUrlError(f"database URL {masked(url)} names no database; use {SUPPORTED}")
    if importlib.util.find_spec("psycopg") is None:
        raise DatabaseUrlError(f"database URL {masked(url)} needs the psycopg driver, which is not installed: "
                               "pip install 'staleflow[postgres]'")
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def masked(url: str) -> str:
    """``url`` with its password hidden, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<not a URL>"
