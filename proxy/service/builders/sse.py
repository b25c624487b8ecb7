"""Server-sent event framing: OpenAI's (``data: <json>``, ``[DONE]`` last), named events, usage."""

from __future__ import annotations

import json
from typing import Any

from proxima.proxy.service.events import Usage

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def named_sse(event: dict[str, Any]) -> bytes:
    """One server-sent event named by an ``event:`` line after its ``type``.

    The Responses API and Anthropic's Messages API frame their events this way
    (Anthropic's SDK skips events without a name).
    """
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def usage(u: Usage) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
