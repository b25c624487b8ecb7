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
by constrained decoding (``proxy/rendering/structured.py`` builds the grammar of this
format's calls); a reply cut at ``max_tokens`` mid-call may still hold no
call, and ``apply_tool_choice`` then returns what was produced.

Modules: ``calls`` (shapes, interfaces, shared helpers), ``hermes`` and
``formats`` (llama3_json, none) the formats, ``choice`` the ``tool_choice``
rules; the registry of formats is here.
"""

from __future__ import annotations

from collections.abc import Callable

from proxima.proxy.tools.calls import (
    HERMES_START,
    PYTHON_TAG,
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
    new_tool_call_id,
)
from proxima.proxy.tools.choice import (
    InvalidToolChoice,
    ToolChoice,
    apply_tool_choice,
    finish_reason_for,
    parser_for_choice,
    resolve_tool_choice,
)
from proxima.proxy.tools.formats import Llama3JsonToolParser, NoToolParser
from proxima.proxy.tools.hermes import HermesToolParser

__all__ = [
    "ContentDelta",
    "HermesToolParser",
    "InvalidToolChoice",
    "Llama3JsonToolParser",
    "NoToolParser",
    "ParsedOutput",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "ToolChoice",
    "apply_tool_choice",
    "detect_tool_parser",
    "finish_reason_for",
    "get_tool_parser",
    "known_tool_parsers",
    "new_tool_call_id",
    "parser_for_choice",
    "resolve_tool_choice",
]

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
