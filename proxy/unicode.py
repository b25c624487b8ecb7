"""Valid Unicode in the strings the proxy tokenizes, stores or returns.

JSON can spell a lone UTF-16 surrogate (``"\\ud800"``) and Python's JSON
parser accepts it, but such a string has no UTF-8 form: the tokenizer, the
store and the response encoder all fail on it. Client strings are checked at
the request's edge (a 400 naming the field); strings decoded later from
client or model JSON (tool-call arguments) are checked where they are decoded.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\\ud800-\\udfff]")


class InvalidString(ValueError):
    """A string that cannot be tokenized or stored; ``param`` names where it is."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


def check_unicode(value: Any, param: str) -> None:
    """Raise ``InvalidString`` for the first lone surrogate in ``value``'s strings.

    Walks dicts (keys and values) and lists; ``param`` is the path of
    ``value``, extended OpenAI-style (``messages[0].tool_calls[1].function``).
    """
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found is not None:
            raise InvalidString(
                f"Invalid value for '{param}': the string holds a lone UTF-16 surrogate "
                f"({found.group()!a}) at index {found.start()}; send valid Unicode text.",
                param=param,
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _SURROGATE.search(key):
                # The key cannot be part of the path: the error itself must encode.
                where = param or "body"
                raise InvalidString(
                    f"Invalid value for '{where}': the key {key!a} holds a lone UTF-16 "
                    "surrogate; send valid Unicode text.",
                    param=where,
                )
            check_unicode(item, f"{param}.{key}" if param else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_unicode(item, f"{param}[{index}]")


def is_valid_unicode(value: Any) -> bool:
    """Whether every string in ``value`` (walked as ``check_unicode`` does) has a UTF-8 form."""
    try:
        check_unicode(value, "")
    except InvalidString:
        return False
    return True
