"""What a column accepts, checked before a value reaches the database: one answer on SQLite
and PostgreSQL.

SQLite stores what PostgreSQL refuses, and each refuses some values the other takes; a
value either database would refuse (or store differently) is refused here first, as
:class:`InvalidValue` (a 400 naming the field: ``BadRequest``'s kind), whichever database
is behind the store:

- text (:func:`text`): no NUL character (PostgreSQL's text types hold none);
- integers (:func:`integer`): within the column's type, ``INTEGER`` a signed 32-bit
  integer (PostgreSQL's; SQLite's holds 64 bits), ``BIGINT`` a signed 64-bit one;
- floats (:func:`finite`): finite (NaN and infinities are no JSON number, and a reward of
  NaN would poison training);
- JSON (:func:`json_value`): every number finite (PostgreSQL's JSON has neither NaN nor
  Infinity; Python writes them as bare words). A NUL in a JSON string is stored, escaped
  (``\u0000``), by both.

The store's methods check the values a client sends (ids looked up, names, metadata,
counts) at their top, before a transaction opens.
"""

from __future__ import annotations

import math
from typing import Any

from proxima.proxy.errors import BadRequest

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
"""An ``INTEGER`` column's range (PostgreSQL's 4 bytes; versions, eval items)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""A ``BIGINT`` column's range (and SQLite's every integer)."""

_MAX_JSON_ITEMS = 1_000_000
"""Most values one JSON document is walked through (a bound on the check's work)."""


class InvalidValue(BadRequest):
    """A value its column cannot hold; ``param`` names the field (a 400)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"Invalid value for '{field}': {why}.", param=field)


def text(value: str | None, field: str) -> str | None:
    """``value`` unless it holds a NUL character."""
    if value is not None and "\x00" in value:
        raise InvalidValue(field, "it contains a NUL character")
    return value


def integer(value: int | None, field: str, *, bits: int = 32) -> int | None:
    """``value`` if a signed ``bits``-bit integer holds it (32: ``INTEGER``, 64: ``BIGINT``)."""
    if value is None:
        return None
    low, high = (INT32_MIN, INT32_MAX) if bits == 32 else (INT64_MIN, INT64_MAX)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidValue(field, f"it must be an integer from {low} to {high}, got {value!r}")
    return value


def finite(value: float | None, field: str) -> float | None:
    """``value`` if it is a finite number."""
    if value is not None and not math.isfinite(value):
        raise InvalidValue(field, f"it must be a finite number, got {value!r}")
    return value


def json_value(value: Any, field: str) -> Any:
    """``value`` if every number in it is finite."""
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > _MAX_JSON_ITEMS:
            raise InvalidValue(field, f"it holds more than {_MAX_JSON_ITEMS} values")
        if isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidValue(field, f"JSON numbers must be finite, got {item!r}")
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return value
