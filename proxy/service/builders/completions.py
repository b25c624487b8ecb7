"""OpenAI text completions (``/v1/completions``) from the driver's events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from proxima.proxy.service.builders.sse import DONE, sse, usage
from proxima.proxy.service.events import (
    Completion,
    Delta,
    Done,
    Event,
    Failed,
    Finish,
    Part,
    TokenLogprob,
)
from proxima.proxy.service.prepare import Prepared
from proxima.proxy.tools import ContentDelta


def completion_response(prep: Prepared, completion: Completion, *, model: str) -> dict[str, Any]:
    """The ``text_completion`` object."""
    return {
        "id": prep.response_id,
        "object": "text_completion",
        "created": prep.created,
        "model": model,
        "choices": [
            {
                "index": finish.index,
                "text": finish.text,
                "logprobs": text_logprobs(finish.logprobs) if finish.logprobs is not None else None,
                "finish_reason": finish.finish_reason,
            }
            for finish in completion.choices
        ],
        "usage": usage(completion.usage),
    }


async def completion_stream(
    prep: Prepared, events: AsyncIterator[Event], *, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """``text_completion`` chunks: text as it becomes final, the finish, [DONE]."""
    head = {
        "id": prep.response_id,
        "object": "text_completion",
        "created": prep.created,
        "model": model,
    }

    def chunk(index: int, text: str, finish: str | None = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    async for event in events:
        if isinstance(event, Delta):
            text = _text(event.parts)
            if text:
                yield chunk(event.index, text)
        elif isinstance(event, Finish):
            yield chunk(event.index, _text(event.tail), event.finish_reason)
        elif isinstance(event, Done):
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(event.usage)})
            yield DONE
        elif isinstance(event, Failed):
            yield sse(event.error.envelope())
            yield DONE


def _text(parts: list[Part]) -> str:
    return "".join(p.text for p in parts if isinstance(p, ContentDelta))


def text_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """A text completion choice's ``logprobs`` (offsets count the token texts)."""
    offsets, pos = [], 0
    for lp in logprobs:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [dict(lp.top) for lp in logprobs],
        "text_offset": offsets,
    }
