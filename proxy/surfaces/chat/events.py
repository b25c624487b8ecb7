"""OpenAI chat completions (``/v1/chat/completions``) from the driver's events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from proxima.proxy.rendering.reasoning import ReasoningDelta
from proxima.proxy.service.canonical import assistant_message
from proxima.proxy.service.events import (
    Completion,
    Delta,
    Done,
    Event,
    Failed,
    Finish,
    Part,
)
from proxima.proxy.service.prepare import Prepared
from proxima.proxy.surfaces.openai_common import logprob_content
from proxima.proxy.surfaces.sse import DONE, event_json, sse, usage
from proxima.proxy.tools import ContentDelta, ToolCallDelta


def chat_response(prep: Prepared, completion: Completion, *, model: str) -> dict[str, Any]:
    """The ``chat.completion`` object."""
    choices = []
    for finish in completion.choices:
        assert finish.parsed is not None
        choices.append(
            {
                "index": finish.index,
                "message": assistant_message(finish.parsed),
                "logprobs": {"content": logprob_content(finish.logprobs)}
                if finish.logprobs is not None
                else None,
                "finish_reason": finish.finish_reason,
            }
        )
    return {
        "id": prep.response_id,
        "object": "chat.completion",
        "created": prep.created,
        "model": model,
        "choices": choices,
        "usage": usage(completion.usage),
        "system_fingerprint": f"proxima-v{completion.policy_version}",
    }


_dumps = orjson.dumps
# The end of a chunk without logprobs or finish reason.
_PLAIN_END = b',"logprobs":null,"finish_reason":null}]}\n\n'


async def chat_stream(
    prep: Prepared,
    events: AsyncIterator[Event],
    *,
    model: str,
    policy_version: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """``chat.completion.chunk`` events: a role chunk per choice, deltas, finishes, [DONE]."""
    head = {
        "id": prep.response_id,
        "object": "chat.completion.chunk",
        "created": prep.created,
        "model": model,
        "system_fingerprint": f"proxima-v{policy_version}",
    }

    # The chunk's constant part is encoded once: each chunk is that prefix, then its one
    # choice's fields (the bytes of ``sse({**head, "choices": [choice]})``, built faster).
    prefix = b"data: " + event_json(head)[:-1] + b',"choices":[{"index":'

    def chunk(
        index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
    ) -> bytes:
        return b"".join(
            (
                prefix,
                b"%d" % index,
                b',"delta":',
                event_json(delta),
                b',"logprobs":',
                b"null" if logprobs is None else event_json(logprobs),
                b',"finish_reason":',
                b"null" if finish is None else orjson.dumps(finish),
                b"}]}\n\n",
            )
        )

    # The role chunks leave with the first event's chunks, in the same write, rather than
    # in a write of their own while the backend computes the first token.
    opening = [chunk(index, {"role": "assistant", "content": ""}) for index in range(prep.n)]
    async for event in events:
        for piece in opening:
            yield piece
        opening = []
        if isinstance(event, Delta):
            parts = event.parts
            if event.logprobs is None and len(parts) == 1 and type(parts[0]) is ContentDelta:
                # The common event, one piece of text: ``chunk``'s bytes, built in one go
                # (``event_json``, inline: the line-break escapes only when one is there).
                text = _dumps({"content": parts[0].text})
                if text.find(b"\xc2\x85") >= 0 or text.find(b"\xe2\x80") >= 0:
                    text = event_json(text.decode())
                yield b"".join((prefix, b"%d" % event.index, b',"delta":', text, _PLAIN_END))
                continue
            lp = (
                {"content": logprob_content(event.logprobs)} if event.logprobs is not None else None
            )
            deltas = message_deltas(event.parts)
            if not deltas and lp is not None:
                deltas = [{}]
            for i, d in enumerate(deltas):
                yield chunk(event.index, d, logprobs=lp if i == 0 else None)
        elif isinstance(event, Finish):
            for d in message_deltas(event.tail):
                yield chunk(event.index, d)
            yield chunk(event.index, {}, finish=event.finish_reason)
        elif isinstance(event, Done):
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(event.usage)})
            yield DONE
        elif isinstance(event, Failed):
            yield sse(event.error.envelope())
            yield DONE


def message_deltas(parts: list[Part]) -> list[dict[str, Any]]:
    """OpenAI chunk deltas for reply parts (consecutive content, or reasoning, merged).

    Reasoning goes in ``delta.reasoning_content``, as DeepSeek's API, SGLang
    and vLLM stream it.
    """
    out: list[dict[str, Any]] = []
    text, key = "", "content"
    for part in parts:
        if isinstance(part, ContentDelta | ReasoningDelta):
            kind = "reasoning_content" if isinstance(part, ReasoningDelta) else "content"
            if text and kind != key:
                out.append({key: text})
                text = ""
            text, key = text + part.text, kind
        elif isinstance(part, ToolCallDelta):
            if text:
                out.append({key: text})
                text = ""
            out.append({"tool_calls": [part.to_openai()]})
    if text:
        out.append({key: text})
    return out
