"""Server-sent event framing: OpenAI's (``data: <json>``, ``[DONE]`` last), named events, usage."""

from __future__ import annotations

from typing import Any

import orjson
from proxima.proxy.service.events import Usage

DONE = b"data: [DONE]\n\n"

# Characters JSON leaves raw that ``str.splitlines()`` takes for line ends: NEL, LINE
# SEPARATOR, PARAGRAPH SEPARATOR. SSE ends lines at CR and LF only, but readers built on
# httpx's ``iter_lines`` (a splitlines) cut an event holding one in two; a model's text may
# hold any of them (the tiny test model's byte tokens do). Escaped, the JSON is the same.
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def event_json(data: dict[str, Any] | str) -> bytes:
    """One event's JSON (``data`` already serialized when a str), safe on one line for every
    reader. orjson: compact UTF-8 JSON, several times faster than json.dumps on the per-chunk
    path; a non-finite float becomes null instead of the invalid token NaN."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    # find, not ``in``: a bytes ``in`` first tries its needle as an int (an exception each).
    if payload.find(b"\xc2\x85") >= 0 or payload.find(b"\xe2\x80") >= 0:
        for raw, escaped in _LINE_BREAKS:
            payload = payload.replace(raw, escaped)
    return payload


def sse(data: dict[str, Any] | str) -> bytes:
    return b"data: " + event_json(data) + b"\n\n"


def named_sse(event: dict[str, Any]) -> bytes:
    """One server-sent event named by an ``event:`` line after its ``type``.

    The Responses API and Anthropic's Messages API frame their events this way
    (Anthropic's SDK skips events without a name).
    """
    name: str = event["type"]
    return b"event: " + name.encode() + b"\ndata: " + event_json(event) + b"\n\n"


def usage(u: Usage) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
    if u.reasoning_tokens:
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return out
