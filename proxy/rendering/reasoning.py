"""Reasoning parsers: a thinking model's reasoning split from its answer.

A reasoning model writes its thinking before the answer, between markers its
chat template knows (``<think>`` ... ``</think>`` for Qwen3 and DeepSeek-R1).
A ``ReasoningParser`` splits the generated text into ``reasoning`` and the
``content`` that follows (which the tool-call parser then reads: a tool call
after the reasoning is parsed as usual). Families (``get_reasoning_parser``):

- ``qwen3``: the reply may open with ``<think>``; a reply that does not is
  all content (Qwen3 with ``enable_thinking=False`` puts an empty think block
  in the prompt, so its reply opens with the answer).
- ``deepseek-r1``: the reply is reasoning from its first token until
  ``</think>`` (R1 leaves the opening marker out, R1-0528 writes it: both
  parse); a reply that never closes it is all reasoning.
- ``none``: no reasoning; everything is content (the default for a template
  that has no think markers).

Either family also starts inside the reasoning when the prompt itself ends
with an open ``<think>`` (templates that put it in the generation prompt, as
Qwen3-Thinking-2507 does): ``opens_in_prompt`` tells, per request.

The split follows what a Qwen3-style template does with a reply it renders:
newlines around the reasoning and before the answer are not part of either
(``<think>\\nR\\n</think>\\n\\nA`` is reasoning ``R`` and content ``A``).
gpt-oss's harmony channels are not supported (its template is not available
offline to test against); serve it with ``--reasoning-parser none``.

Streaming (``parser.stream(in_reasoning=...)``) takes the text as it is
detokenized and returns ``ReasoningDelta`` pieces and content strings. Text
that may still be a marker (``</thi`` at the end of a delta) or newlines that
may still turn out to precede one are held back until the next text decides.
The contract, for any way of splitting the text: the concatenated reasoning
deltas equal ``parse(...).reasoning`` and the concatenated content pieces
equal ``parse(...).content``.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxima.proxy.tools.calls import partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"
# What a reply's reasoning and answer are trimmed of (what Qwen3's template trims).
_NEWLINES = "\n"


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of reasoning text."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """A reply split in two; ``reasoning`` is None when the reply has none.

    ``closed`` is whether the end marker was generated (a reply cut by
    ``max_tokens`` while thinking is not closed, and has no content).
    """

    reasoning: str | None
    content: str
    closed: bool = False


class ReasoningParser:
    """One family's reasoning markers and where a reply starts."""

    def __init__(self, name: str, start: str, end: str, *, always_thinks: bool) -> None:
        self.name = name
        self.start = start
        self.end = end
        self.always_thinks = always_thinks

    def opens_in_prompt(self, prompt_tail: str) -> bool:
        """Whether a prompt ending with ``prompt_tail`` leaves the reasoning open."""
        stripped = prompt_tail.rstrip()
        return stripped.endswith(self.start)

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether the reply to this prompt begins inside the reasoning."""
        return self.always_thinks or self.opens_in_prompt(prompt_tail)

    def parse(self, text: str, *, in_reasoning: bool) -> ReasoningSplit:
        """Split a complete reply; ``in_reasoning``: it starts inside the reasoning."""
        if in_reasoning:
            body = text
            if body.lstrip(_NEWLINES).startswith(self.start):  # the marker written anyway
                body = body.lstrip(_NEWLINES)[len(self.start) :]
        else:
            opened = text.lstrip()
            if not opened.startswith(self.start):
                return ReasoningSplit(None, text)
            body = opened[len(self.start) :]
        at = body.find(self.end)
        if at < 0:
            return ReasoningSplit(body.strip(_NEWLINES), "", closed=False)
        return ReasoningSplit(
            body[:at].strip(_NEWLINES), body[at + len(self.end) :].lstrip(_NEWLINES), closed=True
        )

    def stream(self, *, in_reasoning: bool) -> ReasoningStream:
        """A fresh incremental parser for one reply."""
        return ReasoningStream(self, in_reasoning=in_reasoning)


class ReasoningStream:
    """Incremental ``ReasoningParser.parse``.

    States: ``maybe`` (not yet known whether the reply opens with the start
    marker), ``lead`` (inside the reasoning, nothing of it emitted yet: leading
    newlines and a repeated start marker are dropped), ``reasoning``,
    ``answer_lead`` (the end marker seen, the answer's leading newlines
    dropped) and ``content``. ``_buffer`` is text not yet decided.
    """

    def __init__(self, parser: ReasoningParser, *, in_reasoning: bool) -> None:
        self._parser = parser
        self._state = "lead" if in_reasoning else "maybe"
        self._may_reopen = in_reasoning
        self._buffer = ""
        self.reasoning: list[str] = []
        self.saw_reasoning = in_reasoning
        self.closed = False

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the reasoning."""
        return self._state in ("lead", "reasoning")

    def feed(self, text: str) -> list[ReasoningDelta | str]:
        """Consume the next piece of reply text; return what is now final."""
        self._buffer += text
        out: list[ReasoningDelta | str] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ReasoningDelta | str]:
        """The reply has ended: release what is held back."""
        rest, self._buffer = self._buffer, ""
        if self._state == "maybe":
            return [rest] if rest else []
        if self._state in ("lead", "reasoning"):
            if self._state == "lead":
                rest = rest.lstrip(_NEWLINES)
            rest = rest.rstrip(_NEWLINES)
            return self._reasoning([], rest)
        if self._state == "answer_lead":
            rest = rest.lstrip(_NEWLINES)
        return [rest] if rest else []

    def _reasoning(self, out: list[ReasoningDelta | str], text: str) -> list[ReasoningDelta | str]:
        if text:
            self.reasoning.append(text)
            out.append(ReasoningDelta(text))
        return out

    def _step(self, out: list[ReasoningDelta | str]) -> bool:
        """Advance once; True when the state changed and the buffer should be read again."""
        start, end = self._parser.start, self._parser.end
        buffer = self._buffer
        if self._state == "maybe":
            opened = buffer.lstrip()
            if not opened or (len(opened) < len(start) and start.startswith(opened)):
                return False  # still undecided
            if opened.startswith(start):
                self._state, self._buffer = "lead", opened[len(start) :]
                self.saw_reasoning = True
                return True
            self._state, self._buffer = "content", ""
            out.append(buffer)
            return False
        if self._state == "lead":
            buffer = buffer.lstrip(_NEWLINES)
            self._buffer = buffer
            if self._may_reopen:
                if len(buffer) < len(start) and start.startswith(buffer):
                    return False  # perhaps the start marker, written again
                if buffer.startswith(start):
                    self._may_reopen = False
                    self._buffer = buffer[len(start) :]
                    return True
            if not buffer:
                return False
            self._may_reopen = False
            self._state = "reasoning"
            return True
        if self._state == "reasoning":
            at = buffer.find(end)
            if at >= 0:
                self._reasoning(out, buffer[:at].rstrip(_NEWLINES))
                self._state, self._buffer = "answer_lead", buffer[at + len(end) :]
                self.closed = True
                return True
            keep = partial_marker_len(buffer, end)
            body = buffer[: len(buffer) - keep]
            held = len(body) - len(body.rstrip(_NEWLINES))  # newlines that may precede the end
            self._reasoning(out, body[: len(body) - held])
            self._buffer = buffer[len(body) - held :]
            return False
        if self._state == "answer_lead":
            buffer = buffer.lstrip(_NEWLINES)
            self._buffer = buffer
            if not buffer:
                return False
            self._state = "content"
            return True
        # content
        if buffer:
            out.append(buffer)
            self._buffer = ""
        return False


_FAMILIES = {
    "qwen3": lambda: ReasoningParser("qwen3", THINK_START, THINK_END, always_thinks=False),
    "deepseek-r1": lambda: ReasoningParser(
        "deepseek-r1", THINK_START, THINK_END, always_thinks=True
    ),
}


def known_reasoning_parsers() -> list[str]:
    """Names accepted by ``get_reasoning_parser`` (``none`` included)."""
    return sorted([*_FAMILIES, "none"])


def get_reasoning_parser(name: str) -> ReasoningParser | None:
    """The parser registered under ``name`` (None for ``none``); ``ValueError`` otherwise."""
    if name == "none":
        return None
    try:
        return _FAMILIES[name]()
    except KeyError:
        known = ", ".join(known_reasoning_parsers())
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None


def detect_reasoning_parser(chat_template: str | None) -> str:
    """The family a chat template's markers call for; ``none`` when it has none.

    A template that writes both think markers thinks: DeepSeek's (its
    ``<｜Assistant｜>`` turn marker) always does, any other (Qwen3's) may. A
    template that has only ``</think>`` (DeepSeek-R1's first release and its
    distills: it strips the reasoning from earlier replies, and the model opens
    the block itself) is ``qwen3``: a reply that opens with ``<think>`` is
    reasoning until ``</think>``, one that does not is all content, and a
    generation prompt that opens the block still starts the reply inside it.
    """
    if not chat_template or THINK_END not in chat_template:
        return "none"
    if THINK_START in chat_template and "<｜Assistant｜>" in chat_template:
        return "deepseek-r1"
    return "qwen3"
