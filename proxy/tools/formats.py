"""The ``llama3_json`` format (Llama 3.1/3.2), and ``none`` (everything is content).

A llama3 reply is an optional ``<|python_tag|>`` then ``{"name", "parameters"}``
objects separated by ``;``; a reply that is not entirely tool calls is content.
"""

from __future__ import annotations

import json
from typing import Literal

from proxima.proxy.tools.calls import (
    PYTHON_TAG,
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    call_from_object,
    header_and_arguments,
    new_tool_call_id,
)


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.1 JSON calls: ``[<|python_tag|>]{"name", "parameters"}; {...}``.

    The reply is either entirely tool calls or entirely content, as in
    Meta's format; anything unparseable makes all of it content.
    """

    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        calls = _parse_llama3_calls(text)
        if calls is None:
            return ParsedOutput(content=text, tool_calls=[])
        return ParsedOutput(
            content=None,
            tool_calls=[ToolCall(id=new_tool_call_id(), name=n, arguments=a) for n, a in calls],
        )

    def stream(self) -> ToolCallStream:
        return _Llama3Stream()


def _llama3_start(text: str) -> Literal["calls", "content", "undecided"]:
    """Whether a reply beginning with ``text`` is tool calls, content, or unknown yet."""
    head = text.lstrip()
    if not head:
        return "undecided"
    if head.startswith(PYTHON_TAG) or head.startswith("{"):
        return "calls"
    if PYTHON_TAG.startswith(head):
        return "undecided"
    return "content"


def _parse_llama3_calls(text: str) -> list[tuple[str, str]] | None:
    """``[(name, arguments)]`` if ``text`` is one or more calls, else None."""
    if _llama3_start(text) != "calls":
        return None
    rest = text.lstrip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG) :]
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = 0
    while True:
        pos = _skip_space(rest, pos)
        try:
            obj, pos = decoder.raw_decode(rest, pos)
        except (json.JSONDecodeError, RecursionError):
            return None
        call = call_from_object(obj)
        if call is None:
            return None
        calls.append(call)
        pos = _skip_space(rest, pos)
        if pos == len(rest):
            return calls
        if rest[pos] != ";":
            return None
        pos = _skip_space(rest, pos + 1)
        if pos == len(rest):  # a trailing separator
            return calls


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class _Llama3Stream(ToolCallStream):
    """Content streams once the reply's start shows it is not a call; calls wait for the end."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._mode: Literal["calls", "content", "undecided"] = "undecided"

    def _feed(self, delta_text: str) -> list[StreamEvent]:
        if self._mode == "content":
            return [ContentDelta(delta_text)] if delta_text else []
        self._text += delta_text
        if self._mode == "undecided":
            self._mode = _llama3_start(self._text)
            if self._mode == "content":
                text, self._text = self._text, ""
                return [ContentDelta(text)]
        return []

    def _finish(self) -> list[StreamEvent]:
        text, self._text = self._text, ""
        calls = _parse_llama3_calls(text)
        if calls is None:
            return [ContentDelta(text)] if text else []
        events: list[StreamEvent] = []
        for index, (name, arguments) in enumerate(calls):
            events.extend(header_and_arguments(index, name, arguments))
        return events


class NoToolParser(ToolCallParser):
    """No tool calls: the whole reply is content (also used for ``tool_choice="none"``)."""

    name = "none"

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text, tool_calls=[])

    def stream(self) -> ToolCallStream:
        return _PassthroughStream()


class _PassthroughStream(ToolCallStream):
    def _feed(self, delta_text: str) -> list[StreamEvent]:
        return [ContentDelta(delta_text)] if delta_text else []

    def _finish(self) -> list[StreamEvent]:
        return []
