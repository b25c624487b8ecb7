"""Valid Unicode in the strings the proxy tokenizes, stores or returns.

JSON can spell a lone UTF-16 surrogate (``"\\ud800"``) and Python's JSON
parser accepts it, but such a string has no UTF-8 form: the tokenizer, the
store and the response encoder all fail on it. Client strings are checked at
the request's edge (a 400 naming the field); strings decoded later from
client or model JSON (tool-call arguments) are checked where they are decoded.
"""

from __future__ import annotations

from typing import Any

import orjson


class InvalidString(ValueError):
    """A string that cannot be tokenized or stored; ``param`` names where it is."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


def _surrogate_at(text: str) -> int | None:
    """Index of the first lone surrogate in ``text``, or None.

    Runs at C speed on the request's event loop: ``isascii`` is a flag on the
    string, and a UTF-8 encode fails exactly at a surrogate (a 6.8 MB message
    takes a few milliseconds, where a regex search took ~150 ms).
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def check_unicode(value: Any, param: str) -> None:
    """Raise ``InvalidString`` for the first lone surrogate in ``value``'s strings.

    Walks dicts (keys and values) and lists; ``param`` is the path of
    ``value``, extended OpenAI-style (``messages[0].tool_calls[1].function``).
    A value that encodes to UTF-8 JSON as a whole holds no surrogate and is not
    walked (the walk formats a path per item: a millisecond for a long session's
    conversation, against tens of microseconds for the encode).
    """
    if isinstance(value, dict | list) and _encodes(value):
        return
    _check(value, param)


def _encodes(value: Any) -> bool:
    """Whether orjson encodes ``value``; it refuses a string with a lone surrogate
    (and types JSON lacks, which the walk then judges)."""
    try:
        orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError included
        return False
    return True


def _check(value: Any, param: str) -> None:
    if isinstance(value, str):
        at = _surrogate_at(value)
        if at is not None:
            raise InvalidString(
                f"Invalid value for '{param}': the string holds a lone UTF-16 surrogate "
                f"({value[at]!a}) at index {at}; send valid Unicode text.",
                param=param,
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _surrogate_at(key) is not None:
                # The key cannot be part of the path: the error itself must encode.
                where = param or "body"
                raise InvalidString(
                    f"Invalid value for '{where}': the key {key!a} holds a lone UTF-16 "
                    "surrogate; send valid Unicode text.",
                    param=where,
                )
            _check(item, f"{param}.{key}" if param else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check(item, f"{param}[{index}]")


def is_valid_unicode(value: Any) -> bool:
    """Whether every string in ``value`` (walked as ``check_unicode`` does) has a UTF-8 form."""
    try:
        check_unicode(value, "")
    except InvalidString:
        return False
    return True
