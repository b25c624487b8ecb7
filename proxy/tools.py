"""Tool-call parsing of generated text, non-streaming and streaming.

A model announces tool calls in text, in a format fixed by its chat template.
A ``ToolCallParser`` turns the generated text into OpenAI's shape: the content
outside tool calls plus a list of calls whose ``arguments`` is a JSON string.

Formats (``get_tool_parser(name)``):

- ``hermes`` (Qwen2.5, Hermes, many others)::

      Let me look that up.
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  Several blocks may follow each other; text around them is content, minus
  the whitespace that only separates it from a block.
- ``llama3_json`` (Llama 3.1/3.2): the whole reply is an optional
  ``<|python_tag|>`` then ``{"name": ..., "parameters": {...}}`` objects
  separated by ``;``. A reply that is not entirely tool calls is content.
- ``none``: everything is content.

A block that is not a valid call (bad JSON, no name, never closed because the
reply was cut at ``max_tokens``) stays in the content verbatim: parsing never
fails.

Streaming (``parser.stream()``) gets the text as it is generated and returns
``StreamEvent``s. Content streams as it comes, except for a tail that could be
the start of a tool-call marker (or whitespace that might turn out to precede
one), which is held back until the next text decides it. A tool call is
emitted once its block is complete and valid, as a header delta (index, id,
name) followed by an arguments delta. Holding a call back until it is known
to be valid is what guarantees the streaming contract: for any way of
splitting the text into deltas, the concatenated content deltas equal the
non-streaming ``content`` and the concatenated argument deltas of each call
equal its non-streaming ``arguments``.

``tool_choice``: ``"none"`` turns parsing off; ``"auto"``, ``"required"`` and
a named function turn it on. ``"required"`` and a named function are enforced
by constrained decoding (``proxy/structured.py`` builds the grammar of this
format's calls); a reply cut at ``max_tokens`` mid-call may still hold no
call, and ``apply_tool_choice`` then returns what was produced.
"""

from __future__ import annotations

import json
import logging
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxima.proxy.errors import BadRequest
from proxima.proxy.unicode import is_valid_unicode

logger = logging.getLogger(__name__)

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

    def to_openai(self) -> dict[str, Any]:
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
    """

    content: str | None
    tool_calls: list[ToolCall]


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


def _call_from_object(obj: Any) -> tuple[str, str] | None:
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


def _decode_call(body: str) -> tuple[str, str] | None:
    """Decode a hermes block body; None when it is not a valid call."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    return _call_from_object(obj)


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _header_and_arguments(index: int, name: str, arguments: str) -> list[StreamEvent]:
    events: list[StreamEvent] = [
        ToolCallDelta(index=index, arguments="", id=new_tool_call_id(), name=name)
    ]
    if arguments:
        events.append(ToolCallDelta(index=index, arguments=arguments))
    return events


# --------------------------------------------------------------------------- hermes


class HermesToolParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks among free text (Qwen, Hermes)."""

    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        # Content segments are the text between valid blocks; a malformed or
        # unclosed block is part of the segment it sits in.
        segments: list[str] = []
        current: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(HERMES_START, pos)
            end = -1 if start < 0 else text.find(HERMES_END, start + len(HERMES_START))
            if end < 0:
                current.append(text[pos:])
                break
            decoded = _decode_call(text[start + len(HERMES_START) : end])
            if decoded is None:
                current.append(text[pos : end + len(HERMES_END)])
            else:
                current.append(text[pos:start])
                segments.append("".join(current))
                current = []
                calls.append(ToolCall(id=new_tool_call_id(), name=decoded[0], arguments=decoded[1]))
            pos = end + len(HERMES_END)
        segments.append("".join(current))
        if not calls:
            return ParsedOutput(content=segments[0], tool_calls=[])
        # Whitespace that only separates content from a call is not content;
        # content on both sides of a call is joined by a line break.
        first, *middle, last = segments
        trimmed = [first.rstrip(), *(seg.strip() for seg in middle), last.lstrip()]
        content = SEGMENT_SEPARATOR.join(seg for seg in trimmed if seg)
        return ParsedOutput(content=content or None, tool_calls=calls)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream(ToolCallStream):
    """Incremental ``HermesToolParser.parse``.

    State: ``_pending`` is unread text outside a block (possibly ending in a
    partial start marker); ``_space`` is whitespace held back because a block
    may follow it; ``_after_call`` says a valid block was the last thing seen,
    so leading whitespace is dropped and the next content is separated from
    earlier content (``_has_content``); inside a block, ``_block`` collects
    the body and ``_block_space`` the whitespace that preceded the block.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._space = ""
        self._after_call = False
        self._has_content = False
        self._in_block = False
        self._block = ""
        self._block_space = ""
        self._searched = 0  # ``_block`` holds no end marker before this offset
        self._calls = 0

    def _feed(self, delta_text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._in_block:
            self._block += delta_text
        else:
            self._pending += delta_text
        self._advance(events)
        return events

    def _finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._in_block:  # never closed: the block is content
            self._emit_raw(self._block_space + HERMES_START + self._block, events)
            self._in_block = False
            self._block = self._block_space = ""
        else:
            self._emit_text(self._pending, events)
            self._pending = ""
        if self._space:
            self._content(self._space, events)
            self._space = ""
        return events

    def _advance(self, events: list[StreamEvent]) -> None:
        while True:
            if self._in_block:
                end = self._block.find(HERMES_END, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._block) - len(HERMES_END) + 1)
                    return
                body, rest = self._block[:end], self._block[end + len(HERMES_END) :]
                self._close_block(body, events)
                self._pending = rest
                continue
            start = self._pending.find(HERMES_START)
            if start < 0:
                keep = _partial_marker_len(self._pending, HERMES_START)
                cut = len(self._pending) - keep
                self._emit_text(self._pending[:cut], events)
                self._pending = self._pending[cut:]
                return
            self._emit_text(self._pending[:start], events)
            self._block_space, self._space = self._space, ""
            self._block = self._pending[start + len(HERMES_START) :]
            self._pending = ""
            self._in_block = True

    def _close_block(self, body: str, events: list[StreamEvent]) -> None:
        decoded = _decode_call(body)
        self._in_block = False
        self._searched = 0
        if decoded is None:
            self._emit_raw(self._block_space + HERMES_START + body + HERMES_END, events)
        else:
            events.extend(_header_and_arguments(self._calls, decoded[0], decoded[1]))
            self._calls += 1
            self._after_call = True
        self._block = self._block_space = ""

    def _emit_raw(self, text: str, events: list[StreamEvent]) -> None:
        """Emit text that starts with a (failed) marker, so it is never stripped."""
        self._resume_after_call(events)
        self._content(text, events)

    def _emit_text(self, text: str, events: list[StreamEvent]) -> None:
        """Emit content outside blocks, holding back trailing whitespace."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._resume_after_call(events)
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            self._content(body, events)

    def _resume_after_call(self, events: list[StreamEvent]) -> None:
        """Content follows a call: separate it from the content before the call."""
        if self._after_call and self._has_content:
            events.append(ContentDelta(SEGMENT_SEPARATOR))
        self._after_call = False

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        events.append(ContentDelta(text))
        self._has_content = True


# ----------------------------------------------------------------------- llama3_json


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
        call = _call_from_object(obj)
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
            events.extend(_header_and_arguments(index, name, arguments))
        return events


# ------------------------------------------------------------------------------ none


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


# -------------------------------------------------------------------------- registry

_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "none": NoToolParser,
}


def known_tool_parsers() -> list[str]:
    """Names accepted by ``get_tool_parser``."""
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolCallParser:
    """The parser registered under ``name``; ``ValueError`` naming the known ones."""
    try:
        factory = _PARSERS[name]
    except KeyError:
        known = ", ".join(known_tool_parsers())
        raise ValueError(f"unknown tool parser {name!r}; known parsers: {known}") from None
    return factory()


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser a chat template's tool-call format calls for (default ``hermes``)."""
    if chat_template:
        if HERMES_START in chat_template:
            return "hermes"
        if PYTHON_TAG in chat_template:
            return "llama3_json"
    return "hermes"


# ----------------------------------------------------------------------- tool_choice


class InvalidToolChoice(BadRequest, ValueError):
    """``tool_choice`` is malformed or names a function that is not in ``tools``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="tool_choice")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A validated ``tool_choice``: ``mode`` and, for ``"function"``, its name."""

    mode: Literal["none", "auto", "required", "function"]
    function_name: str | None = None

    @property
    def parses_tool_calls(self) -> bool:
        """Whether generated text is searched for tool calls at all."""
        return self.mode != "none"

    def is_satisfied_by(self, parsed: ParsedOutput) -> bool:
        """Whether the reply did what was asked (enforced by the grammar unless truncated)."""
        if self.mode == "required":
            return bool(parsed.tool_calls)
        if self.mode == "function":
            return any(call.name == self.function_name for call in parsed.tool_calls)
        return True


def resolve_tool_choice(
    tool_choice: str | dict[str, Any] | None, tools: Sequence[dict[str, Any]] | None
) -> ToolChoice:
    """Validate ``tool_choice`` against ``tools`` with OpenAI's defaults.

    Absent, it is ``"auto"`` when tools are given and ``"none"`` otherwise.
    Without tools nothing is parsed whatever was asked (``"auto"`` then means
    ``"none"``); ``"required"`` or a named function without tools is an error.
    """
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice == "none":
            return ToolChoice("none")
        if tool_choice == "auto":
            return ToolChoice("auto" if tools else "none")
        if tool_choice == "required":
            if not tools:
                raise InvalidToolChoice("tool_choice 'required' needs a non-empty 'tools' list.")
            return ToolChoice("required")
        raise InvalidToolChoice(
            f"Invalid tool_choice {tool_choice!r}: expected 'none', 'auto', 'required' "
            "or {'type': 'function', 'function': {'name': ...}}."
        )
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise InvalidToolChoice(
            "Invalid tool_choice: expected {'type': 'function', 'function': {'name': ...}}."
        )
    known = {
        t["function"].get("name")
        for t in tools or []
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    }
    if name not in known:
        raise InvalidToolChoice(f"tool_choice names function {name!r}, which is not in 'tools'.")
    return ToolChoice("function", function_name=name)


def parser_for_choice(parser: ToolCallParser, choice: ToolChoice) -> ToolCallParser:
    """``parser`` when the choice parses tool calls, else the ``none`` parser."""
    return parser if choice.parses_tool_calls else NoToolParser()


def apply_tool_choice(parsed: ParsedOutput, choice: ToolChoice) -> ParsedOutput:
    """The reply as produced, whatever ``tool_choice`` asked.

    Decoding is constrained to the asked calls, so this only differs when the
    reply was cut at ``max_tokens`` inside a call; that is logged, not an error.
    """
    if not choice.is_satisfied_by(parsed):
        logger.debug(
            "tool_choice not followed by the model",
            extra={"tool_choice": choice.mode, "function": choice.function_name},
        )
    return parsed


def finish_reason_for(finish_reason: str, parsed: ParsedOutput) -> str:
    """OpenAI's finish reason: a reply that stopped on its own with calls is ``tool_calls``."""
    if finish_reason == "stop" and parsed.tool_calls:
        return "tool_calls"
    return finish_reason
