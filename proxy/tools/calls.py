"""Tool calls in OpenAI's shape, the parser and stream interfaces, and shared helpers.

``ToolCall``/``ParsedOutput`` are a parsed reply; ``ContentDelta``/``ToolCallDelta``
are the streaming events; ``ToolCallParser`` is one format and ``ToolCallStream``
its incremental state (it remembers what it emitted, so ``result()`` reports
the same call ids the client saw). The helpers decode a call object and hold
back text that could still become a marker; see the package docstring for the
formats and the streaming contract.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from proxima.proxy.rendering.canonical_message import CanonicalToolCall
from proxima.proxy.rendering.unicode import is_valid_unicode

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# Joins the content before and after a hermes tool call.
SEGMENT_SEPARATOR = "\n"


def new_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON string, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> CanonicalToolCall:
        """The call as an element of an assistant message's ``tool_calls``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """Generated text split into content and tool calls.

    ``content`` is ``None`` only when there are tool calls and no other text.
    ``reasoning`` is a thinking model's reasoning (``proxima.proxy.rendering.reasoning``),
    None when the reply has none.
    """

    content: str | None
    tool_calls: list[ToolCall]
    reasoning: str | None = None


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """A piece of content text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the tool call at ``index``, in OpenAI's streaming shape.

    The first delta of a call carries ``id`` and ``name`` (and empty
    ``arguments``); later deltas carry only pieces of ``arguments``.
    """

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The delta as an element of a chunk's ``choices[i].delta.tool_calls``."""
        function: dict[str, Any] = {"arguments": self.arguments}
        delta: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            delta["id"] = self.id
            delta["type"] = "function"
        if self.name is not None:
            function = {"name": self.name, **function}
        delta["function"] = function
        return delta


StreamEvent = ContentDelta | ToolCallDelta


class ToolCallStream(ABC):
    """Incremental parser state for one generated sequence.

    Subclasses implement ``_feed`` and ``_finish``; this class keeps what was
    emitted so that ``result()`` can hand the same reply, with the same call
    ids the client saw, to whoever records it.
    """

    def __init__(self) -> None:
        self._streamed_content: list[str] = []
        self._streamed_calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]

    def feed(self, delta_text: str) -> list[StreamEvent]:
        """Consume the next piece of generated text; return what is now final."""
        return self._collect(self._feed(delta_text))

    def finish(self) -> list[StreamEvent]:
        """The sequence has ended: release everything still held back."""
        return self._collect(self._finish())

    def result(self) -> ParsedOutput:
        """What has been emitted, as one ``ParsedOutput``.

        After ``finish()`` it equals ``parse`` of the whole text, except that
        the call ids are the ones that were streamed.
        """
        calls = [
            ToolCall(id=call_id, name=name, arguments=arguments)
            for call_id, name, arguments in (
                self._streamed_calls[i] for i in sorted(self._streamed_calls)
            )
        ]
        content = "".join(self._streamed_content)
        return ParsedOutput(content=(content or None) if calls else content, tool_calls=calls)

    @abstractmethod
    def _feed(self, delta_text: str) -> list[StreamEvent]:
        """Events made final by ``delta_text``."""

    @abstractmethod
    def _finish(self) -> list[StreamEvent]:
        """Events still held back at the end of the sequence."""

    def _collect(self, events: list[StreamEvent]) -> list[StreamEvent]:
        for event in events:
            if isinstance(event, ContentDelta):
                self._streamed_content.append(event.text)
            elif event.id is not None and event.name is not None:
                self._streamed_calls[event.index] = [event.id, event.name, event.arguments]
            else:
                self._streamed_calls[event.index][2] += event.arguments
        return events


class ToolCallParser(ABC):
    """A tool-call format: ``parse`` a whole reply or ``stream`` one."""

    name: str

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """Split a complete reply into content and tool calls."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one reply."""


def call_from_object(obj: Any) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a decoded call object, or None if it is not one.

    Accepts ``arguments`` or ``parameters`` (Llama) as an object, or as a
    string that already holds the JSON; a missing one means no arguments.
    """
    if not isinstance(obj, dict) or not is_valid_unicode(obj):
        # Escapes that decode to lone surrogates: no UTF-8 form, so the text stays content.
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, dict):
        return name, json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        return name, args
    return None


def decode_call(body: str) -> tuple[str, str] | None:
    """Decode a hermes block body; None when it is not a valid call."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    return call_from_object(obj)


_HERMES_SCAN = re.compile(r'\\.|"|' + re.escape(HERMES_END), re.DOTALL)


def hermes_block_end(text: str, start: int) -> int:
    """Where the hermes block whose body starts at ``start`` ends: the first end marker outside
    a JSON string, or -1 if none has arrived yet.

    A call's arguments may hold the end marker itself (a string value that mentions
    ``</tool_call>``; a small model sampled at temperature 1 under a forced-call grammar writes it
    now and then), so a marker inside a string does not end the block. Quotes are counted from the
    block's start, with backslash escapes inside strings.
    """
    in_string = False
    for match in _HERMES_SCAN.finditer(text, start):
        token = match.group()
        if token == '"':
            in_string = not in_string
        elif token == HERMES_END and not in_string:
            return match.start()
    return -1


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def header_and_arguments(index: int, name: str, arguments: str) -> list[StreamEvent]:
    events: list[StreamEvent] = [
        ToolCallDelta(index=index, arguments="", id=new_tool_call_id(), name=name)
    ]
    if arguments:
        events.append(ToolCallDelta(index=index, arguments=arguments))
    return events
