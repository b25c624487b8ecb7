"""The store's errors: the store subtree of ``proxima.proxy.errors``' one tree, and where the
database drivers' outage errors become ``StoreUnavailable``.

The store raises these; the edge answers them from the one table
(``proxima.proxy.errors.KINDS``)::

    NotFound                   a session / completion / key / version does not exist (404)
    Conflict                   the request contradicts the stored state (409)
     +-- RewardAlreadySet      a reward was already posted for this target
     +-- SessionClosed         the session is no longer open (finished, failed, taken)
     +-- NotAdmitted           admission refused a new training session (capacity)
    StoreError                 the store cannot work (schema not current, a broken chain): 500
     +-- StoreUnavailable      the database does not answer now: 503 + Retry-After

Outages: every transaction the store opens runs under :func:`outages`, which turns what a
driver raises when the database is out of reach (:func:`is_outage`) into
``StoreUnavailable``; anything else (a constraint, a bug) passes unchanged. An outage is:

- a socket error (``OSError``: connection refused or reset, a timeout, a DNS failure):
  asyncpg raises these bare while it connects;
- a PostgreSQL error of SQLSTATE class 08 (connection exception), 53 (insufficient
  resources: too many connections, disk full) or 57 (operator intervention: the server
  shutting down or starting up, ``57P01``-``57P03``);
- SQLAlchemy's disconnect (``connection_invalidated``), a pool timeout, or an
  ``OperationalError`` from PostgreSQL's driver;
- a SQLite ``OperationalError`` of a busy, locked, I/O, can't-open, full or protocol
  result code (``database is locked`` past the 30 s busy timeout among them); SQLite's
  other operational errors (``no such table``) are not outages.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

from proxima.proxy.errors import (
    Conflict,
    NotAdmitted,
    NotFound,
    ProximaError,
    RewardAlreadySet,
    SessionClosed,
    StoreError,
    StoreUnavailable,
)
from sqlalchemy import exc as sa_exc

__all__ = [
    "Conflict",
    "NotAdmitted",
    "NotFound",
    "RewardAlreadySet",
    "SessionClosed",
    "StoreError",
    "StoreUnavailable",
    "is_outage",
    "outages",
    "unavailable",
]

logger = logging.getLogger(__name__)

_OUTAGE_SQLSTATE_CLASSES = ("08", "53", "57")
"""PostgreSQL SQLSTATE classes of an unreachable or unavailable server."""

_SQLITE_OUTAGE_CODES = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_PROTOCOL,
    }
)
"""SQLite primary result codes of a database that cannot be used now."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, the driver error SQLAlchemy wraps (``.orig``), and their causes."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen or len(seen) >= 16:
            continue
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        todo.extend(
            [
                orig if isinstance(orig, BaseException) else None,
                current.__cause__,
                current.__context__,
            ]
        )


def _sqlite_outage(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in _SQLITE_OUTAGE_CODES
    return "locked" in str(exc) or "busy" in str(exc)


def _one_is_outage(exc: BaseException) -> bool | None:
    """Whether ``exc`` itself says outage (True), says another failure (False), or neither."""
    if isinstance(exc, StoreUnavailable | OSError):
        return True
    if isinstance(exc, sqlite3.OperationalError):
        return _sqlite_outage(exc)
    if isinstance(exc, sqlite3.Error):
        return False
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and len(sqlstate) == 5:
        return sqlstate.startswith(_OUTAGE_SQLSTATE_CLASSES)
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, sa_exc.DisconnectionError | sa_exc.TimeoutError):
        return True
    return None


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (from a driver, or SQLAlchemy's wrapping of one) means the database
    is out of reach now rather than the request or the code being wrong."""
    if isinstance(exc, ProximaError):  # the store's own answer (NotFound, Conflict...)
        return isinstance(exc, StoreUnavailable)
    verdict = None
    for one in _chain(exc):
        says = _one_is_outage(one)
        if says is True:
            return True
        if says is False:
            verdict = False
    # PostgreSQL's drivers' OperationalError, with no code that says otherwise: the server or
    # the link failed.
    return verdict is None and isinstance(exc, sa_exc.OperationalError)


LOG_EVERY_S = 5.0
"""An outage is logged at most once per this many seconds (with the count in between)."""

_log_state = {"last": -LOG_EVERY_S, "quiet": 0.0}


def unavailable(exc: BaseException) -> StoreUnavailable:
    """The ``StoreUnavailable`` to raise from the outage ``exc`` (logged here, at most once
    every :data:`LOG_EVERY_S`: an outage fails every request at once)."""
    now = time.monotonic()
    if now - _log_state["last"] >= LOG_EVERY_S:
        quiet = int(_log_state["quiet"])
        also = f" ({quiet} more since the last report)" if quiet else ""
        logger.warning("trajectory store unavailable: %s: %s%s", type(exc).__name__, exc, also)
        _log_state.update(last=now, quiet=0.0)
    else:
        _log_state["quiet"] += 1
    return StoreUnavailable()


@contextmanager
def outages() -> Iterator[None]:
    """Raise ``StoreUnavailable`` (from the driver's error) for an outage in the block."""
    try:
        yield
    except StoreUnavailable:
        raise
    except Exception as exc:
        if not is_outage(exc):
            raise
        raise unavailable(exc) from exc
