"""``chat_stream``'s chunks: built from a prefix encoded once, byte for byte what encoding
each whole chunk gives (``sse({**head, "choices": [choice]})``), line breaks escaped."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from proxima.proxy.service.events import Delta, Done, Event, Finish, TokenLogprob, Usage
from proxima.proxy.surfaces.chat.events import chat_stream, message_deltas
from proxima.proxy.surfaces.openai_common import logprob_content
from proxima.proxy.surfaces.sse import DONE, sse
from proxima.proxy.tools import ContentDelta

TEXT = 'a\x85b\u2028c\u2029d \u201cquoted\u201d 日本 "q" \\ \n'


async def _events(events: list[Event]) -> AsyncIterator[Event]:
    for event in events:
        yield event


async def test_chunks_are_the_bytes_of_the_whole_chunk_encoded() -> None:
    prep: Any = SimpleNamespace(response_id="chatcmpl-x", created=1764300000, n=2)
    model = "model\u2028name"
    logprobs = [TokenLogprob("tok\u2028", -0.5, [("tok\u2028", -0.5), ("b", -1.25)])]
    events: list[Event] = [
        Delta(0, [ContentDelta(TEXT)]),
        Delta(1, [], logprobs),
        Delta(1, [ContentDelta("x")], logprobs),
        Finish(0, "stop", TEXT, None, 3, tail=[ContentDelta("end")]),
        Finish(1, "length", "x", None, 1),
        Done(Usage(5, 4), 7),
    ]
    stream = chat_stream(prep, _events(events), model=model, policy_version=7, include_usage=True)
    got = [piece async for piece in stream]
    head = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1764300000,
        "model": model,
        "system_fingerprint": "proxima-v7",
    }

    def whole(
        index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    lp = {"content": logprob_content(logprobs)}
    expected = [
        whole(0, {"role": "assistant", "content": ""}),
        whole(1, {"role": "assistant", "content": ""}),
        whole(0, message_deltas([ContentDelta(TEXT)])[0]),
        whole(1, {}, lp=lp),
        whole(1, {"content": "x"}, lp=lp),
        whole(0, {"content": "end"}),
        whole(0, {}, finish="stop"),
        whole(1, {}, finish="length"),
        sse(
            {
                **head,
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
            }
        ),  # fmt: skip
        DONE,
    ]
    assert got == expected
    for piece in got[:-1]:  # each one line, whatever the text holds
        body = piece.decode().removeprefix("data: ").removesuffix("\n\n")
        assert len(body.splitlines()) == 1
        json.loads(body)
