"""OpenAI text completions (``/v1/completions``) from the driver's events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

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
from proxima.proxy.surfaces.sse import DONE, sse, usage
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
    """``text_completion`` chunks: text (and logprobs) as they arrive, the finish, [DONE].

    A chunk whose text is held back (a partial character, a possible stop
    string) still carries its tokens' logprobs, with ``text: ""``.
    """
    head = {
        "id": prep.response_id,
        "object": "text_completion",
        "created": prep.created,
        "model": model,
    }

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    offsets = [0] * prep.n  # text_offset of each choice's next token
    async for event in events:
        if isinstance(event, Delta):
            text = _text(event.parts)
            logprobs = None
            if event.logprobs is not None:
                logprobs = text_logprobs(event.logprobs, start=offsets[event.index])
                offsets[event.index] += sum(len(lp.token) for lp in event.logprobs)
            if text or logprobs is not None:
                yield chunk(event.index, text, logprobs=logprobs)
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


def text_logprobs(logprobs: list[TokenLogprob], *, start: int = 0) -> dict[str, Any]:
    """A text completion's ``logprobs`` (offsets count the token texts from ``start``).

    A stream sends each chunk's tokens with the chunk, offsets continuing
    where the previous chunk's ended, so the chunks concatenate to the
    non-streaming object.
    """
    offsets, pos = [], start
    for lp in logprobs:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [dict(lp.top) for lp in logprobs],
        "text_offset": offsets,
    }
