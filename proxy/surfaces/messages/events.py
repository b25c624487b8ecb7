"""Generated replies -> Anthropic Messages API objects, events and errors.

``message_object`` builds the non-streaming ``message``; ``MessagesStream``
turns the tool-call parser's events into the SSE sequence the Anthropic SDK
accumulates (every event is named by an ``event:`` line, which the SDK
requires)::

    message_start, ping
    per content block:
      content_block_start (thinking: "", signature: "" | text: "" | tool_use: id, name, input {})
      content_block_delta (thinking_delta... then one signature_delta | text_delta...
                           | one input_json_delta)
      content_block_stop

A thinking model's reasoning is a ``thinking`` block before the answer, with a
``signature`` the proxy verifies when the block comes back
(``proxima.proxy.rendering.reasoning_seal``).
    message_delta (stop_reason, stop_sequence, usage.output_tokens)
    message_stop

``stop_reason``: ``tool_use`` when the reply calls tools, ``max_tokens`` when
it was cut, ``stop_sequence`` (with the sequence) when a stop sequence ended
it, else ``end_turn``. A tool call's ``input`` is its arguments as a JSON
object (``{}`` if the model wrote something else), sent as one
``input_json_delta`` when the call is complete, so the SDK always parses it.

A stream that fails ends with an ``error`` event in Anthropic's envelope
(``proxima.proxy.surfaces.messages.errors``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from proxima.proxy.errors import ProximaError
from proxima.proxy.rendering.reasoning import ReasoningDelta
from proxima.proxy.service.events import Completion, Delta, Done, Event, Failed, Finish, Part
from proxima.proxy.surfaces.messages.errors import error_of
from proxima.proxy.surfaces.sse import named_sse
from proxima.proxy.tools import ContentDelta, ParsedOutput, ToolCallDelta


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON-string arguments as the object Anthropic's ``input`` must be."""
    try:
        value = json.loads(arguments) if arguments else {}
    except (json.JSONDecodeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str, has_calls: bool, stop_sequence: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if has_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


@dataclass(frozen=True, slots=True)
class MessageHead:
    message_id: str
    model: str
    seal: Callable[[str], str] | None = None
    """Thinking text -> its ``signature`` (``proxima.proxy.rendering.reasoning_seal``)."""

    def signature(self, thinking: str) -> str:
        return self.seal(thinking) if self.seal is not None else ""


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def content_blocks(parsed: ParsedOutput, head: MessageHead) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        thinking = parsed.reasoning
        blocks.append(
            {"type": "thinking", "thinking": thinking, "signature": head.signature(thinking)}
        )
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": tool_input(call.arguments),
            }
        )
    return blocks


def message_object(
    head: MessageHead,
    parsed: ParsedOutput,
    finish_reason: str,
    *,
    stop_sequence: str | None,
    input_tokens: int,
    output_tokens: int,
) -> dict[str, Any]:
    """The non-streaming ``message`` for one finished reply."""
    sequence = stop_sequence if finish_reason == "stop" and not parsed.tool_calls else None
    return {
        "id": head.message_id,
        "type": "message",
        "role": "assistant",
        "model": head.model,
        "content": content_blocks(parsed, head),
        "stop_reason": stop_reason(finish_reason, bool(parsed.tool_calls), sequence),
        "stop_sequence": sequence,
        "usage": _usage(input_tokens, output_tokens),
    }


class MessagesStream:
    """The SSE events of one streamed message: ``start``, ``feed``..., ``finish`` or ``fail``."""

    def __init__(self, head: MessageHead) -> None:
        self.head = head
        self._blocks = 0
        self._open: str | None = None  # "text" or "tool_use"
        self._arguments: list[str] = []
        self._thinking: list[str] = []
        self._saw_calls = False

    def start(self, input_tokens: int) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.head.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.head.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(input_tokens, 0),
        }
        return [
            named_sse({"type": "message_start", "message": message}),
            named_sse({"type": "ping"}),
        ]

    def feed(self, events: list[Part]) -> list[bytes]:
        out: list[bytes] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta) and ev.text:
                if self._open != "thinking":
                    out += self._close()
                    out += self._begin(
                        {"type": "thinking", "thinking": "", "signature": ""}, "thinking"
                    )
                self._thinking.append(ev.text)
                out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
            elif isinstance(ev, ContentDelta) and ev.text:
                if self._open != "text":
                    out += self._close()
                    out += self._begin({"type": "text", "text": ""}, "text")
                delta = {"type": "text_delta", "text": ev.text}
                out.append(self._delta(delta))
            elif isinstance(ev, ToolCallDelta):
                if ev.id is not None:
                    out += self._close()
                    block = {"type": "tool_use", "id": ev.id, "name": ev.name or "", "input": {}}
                    out += self._begin(block, "tool_use")
                    self._saw_calls = True
                self._arguments.append(ev.arguments)
        return out

    def _begin(self, block: dict[str, Any], kind: str) -> list[bytes]:
        self._open = kind
        self._arguments = []
        event = {"type": "content_block_start", "index": self._blocks, "content_block": block}
        return [named_sse(event)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_sse({"type": "content_block_delta", "index": self._blocks, "delta": delta})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "tool_use":
            arguments = json.dumps(tool_input("".join(self._arguments)), ensure_ascii=False)
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        elif self._open == "thinking":
            signature = self.head.signature("".join(self._thinking))
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
            self._thinking = []
        out.append(named_sse({"type": "content_block_stop", "index": self._blocks}))
        self._open = None
        self._blocks += 1
        return out

    def finish(
        self, finish_reason: str, *, stop_sequence: str | None, output_tokens: int
    ) -> list[bytes]:
        out = self._close()
        sequence = stop_sequence if finish_reason == "stop" and not self._saw_calls else None
        delta = {
            "stop_reason": stop_reason(finish_reason, self._saw_calls, sequence),
            "stop_sequence": sequence,
        }
        out.append(
            named_sse(
                {"type": "message_delta", "delta": delta, "usage": {"output_tokens": output_tokens}}
            )
        )
        out.append(named_sse({"type": "message_stop"}))
        return out

    def fail(self, exc: ProximaError) -> list[bytes]:
        return [named_sse(error_of(exc))]


# ------------------------------------------------------------------ driver events


def message_from(head: MessageHead, completion: Completion) -> dict[str, Any]:
    """The ``message`` object of a non-streaming generation (one choice)."""
    (finish,) = completion.choices
    assert finish.parsed is not None
    return message_object(
        head,
        finish.parsed,
        finish.finish_reason,
        stop_sequence=finish.stop_sequence,
        input_tokens=completion.usage.prompt_tokens,
        output_tokens=completion.usage.completion_tokens,
    )


async def message_events(
    head: MessageHead, input_tokens: int, events: AsyncIterator[Event]
) -> AsyncIterator[bytes]:
    """The streamed message: the driver's events as Anthropic SSE events."""
    stream = MessagesStream(head)
    for chunk in stream.start(input_tokens):
        yield chunk
    last: Finish | None = None
    async for event in events:
        if isinstance(event, Delta):
            chunks = stream.feed(event.parts)
        elif isinstance(event, Finish):
            last = event
            chunks = stream.feed(event.tail)
        elif isinstance(event, Done):
            assert last is not None
            chunks = stream.finish(
                last.finish_reason,
                stop_sequence=last.stop_sequence,
                output_tokens=event.usage.completion_tokens,
            )
        elif isinstance(event, Failed):
            chunks = stream.fail(event.error)
        for chunk in chunks:
            yield chunk
