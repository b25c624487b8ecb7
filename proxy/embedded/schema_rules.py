"""What a JSON schema may hold to be enforced, and xgrammar's error text, in plain Python.

The proxy checks every schema against these rules before it forwards a request,
so they live apart from :mod:`proxima.proxy.embedded.grammar`, which compiles
grammars with xgrammar and masks logits with torch: the proxy's process never
imports either just to validate a request.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without its ``[time] source.cc:line:`` prefix."""
    return _XGRAMMAR_PREFIX.sub("", str(exc)).strip()


_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] [^:]+:[0-9]+: ")


# JSON-schema keywords xgrammar 0.2.x accepts but does not enforce; SGLang refuses schemas
# that use them rather than generate output that may violate them, and so do we.
UNENFORCED_KEYWORDS = frozenset(
    {"contains", "dependentRequired", "dependentSchemas", "else", "if", "maxContains"}
    | {"minContains", "multipleOf", "not", "then", "uniqueItems"}
)
STRING_FORMATS = frozenset(
    {"date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer"}
    | {"relative-json-pointer", "time", "uri", "uri-reference", "uri-template", "uuid"}
)
_ONE_SUBSCHEMA: tuple[str, ...] = (
    "additionalItems",
    "additionalProperties",
    "contains",
    "contentSchema",
)
_ONE_SUBSCHEMA += ("else", "if", "items", "not", "propertyNames", "then")
_ONE_SUBSCHEMA += ("unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")


def _subschemas(schema: dict[str, Any], pointer: str) -> Iterator[tuple[dict[str, Any], str]]:
    """``schema`` and every schema nested in it, with JSON pointers."""
    yield schema, pointer or "/"
    for key in _ONE_SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            yield from _subschemas(schema[key], f"{pointer}/{key}")
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            if isinstance(sub, dict):
                yield from _subschemas(sub, f"{pointer}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        for name, sub in value.items() if isinstance(value, dict) else []:
            if isinstance(sub, dict):
                yield from _subschemas(sub, f"{pointer}/{key}/{name}")


def unenforceable_schema_reason(schema: Any) -> str | None:
    """Why xgrammar would not fully enforce ``schema`` (None when it would).

    The same rules as SGLang's check before it compiles a schema: keywords
    xgrammar ignores, string formats it lacks, and a string constrained by
    more than one of ``format``, ``pattern`` and ``minLength``/``maxLength``
    (xgrammar keeps only one of them).
    """
    if not isinstance(schema, dict):
        return None
    for sub, pointer in _subschemas(schema, ""):
        ignored = sorted(UNENFORCED_KEYWORDS.intersection(sub))
        if ignored:
            return f"{pointer}: keyword(s) {', '.join(ignored)} cannot be enforced"
        kind = sub.get("type")
        if not (kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)):
            continue
        if "format" in sub and sub["format"] not in STRING_FORMATS:
            return f"{pointer}: string format {sub['format']!r} is not supported"
        groups: list[str] = [g for g in ("format", "pattern") if g in sub]
        if "minLength" in sub or "maxLength" in sub:
            groups.append("minLength/maxLength")
        if len(groups) > 1:
            return f"{pointer}: {' and '.join(groups)} cannot be enforced together"
    return None
