"""The ``hermes`` format (Qwen2.5, Hermes): ``<tool_call>{json}</tool_call>`` blocks.

Several blocks may follow each other; text around them is content, minus the
whitespace that only separates it from a block. A block that is not a valid
call stays in the content verbatim.

A block ends at the first end marker outside a JSON string of its body
(:func:`hermes_block_end`), so arguments may mention ``</tool_call>``. When no
marker qualifies but one is there (text that is not JSON, with an odd quote),
the first marker ends the block and the block is content.
"""

from __future__ import annotations

from proxima.proxy.tools.calls import (
    HERMES_END,
    HERMES_START,
    SEGMENT_SEPARATOR,
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    decode_call,
    header_and_arguments,
    hermes_block_end,
    new_tool_call_id,
    partial_marker_len,
)


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
            end = -1 if start < 0 else _block_end(text, start + len(HERMES_START))
            if end < 0:
                current.append(text[pos:])
                break
            decoded = decode_call(text[start + len(HERMES_START) : end])
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


def _block_end(text: str, body: int) -> int:
    """The end of a complete text's block whose body starts at ``body``, or -1 if unclosed."""
    end = hermes_block_end(text, body)
    return end if end >= 0 else text.find(HERMES_END, body)


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
        self._searched = 0  # no marker before this offset in ``_block`` ends it
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
        while self._in_block and (end := self._block.find(HERMES_END)) >= 0:
            # Every marker sat inside a string: the first one ends the block after all.
            body, rest = self._block[:end], self._block[end + len(HERMES_END) :]
            self._close_block(body, events)
            self._pending = rest
            self._advance(events)
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
                marker = self._block.find(HERMES_END, self._searched)
                end = -1 if marker < 0 else hermes_block_end(self._block, 0)
                if end < 0:  # no marker yet, or each one inside a string
                    self._searched = max(self._searched, len(self._block) - len(HERMES_END) + 1)
                    return
                body, rest = self._block[:end], self._block[end + len(HERMES_END) :]
                self._close_block(body, events)
                self._pending = rest
                continue
            start = self._pending.find(HERMES_START)
            if start < 0:
                keep = partial_marker_len(self._pending, HERMES_START)
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
        decoded = decode_call(body)
        self._in_block = False
        self._searched = 0
        if decoded is None:
            self._emit_raw(self._block_space + HERMES_START + body + HERMES_END, events)
        else:
            events.extend(header_and_arguments(self._calls, decoded[0], decoded[1]))
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
