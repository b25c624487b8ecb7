"""Server-sent event framing: OpenAI's (``data: <json>``, ``[DONE]`` last), named events, usage."""

from __future__ import annotations

from typing import Any

import orjson
from proxima.proxy.service.events import Usage

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any] | str) -> bytes:
    # orjson: compact UTF-8 JSON, several times faster than json.dumps on the per-chunk path;
    # a non-finite float becomes null instead of the invalid token NaN.
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


def named_sse(event: dict[str, Any]) -> bytes:
    """One server-sent event named by an ``event:`` line after its ``type``.

    The Responses API and Anthropic's Messages API frame their events this way
    (Anthropic's SDK skips events without a name).
    """
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


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
