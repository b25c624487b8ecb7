"""What every API surface translates its request into, and the canonical reply.

An API surface (OpenAI chat, OpenAI completions, and next the Responses and
Anthropic Messages APIs) owns its wire schema; the service never sees it. The
surface's translation module turns its request into a ``CanonicalRequest``:

- ``ChatInput``: canonical messages (``proxima.proxy.rendering.chat_messages.normalize_messages``),
  OpenAI-shaped ``tools`` and a resolved ``ToolChoice``; or
- ``TextInput``: a raw prompt (one string or one list of token ids);
- ``Sampling`` (``proxima.proxy.rendering.sampling``): how tokens are drawn, the one
  sampling type from here to the backend's wire;
- ``logprobs`` / ``top_logprobs``: whether to report them, and how many
  alternatives per token.

The reply side is API-neutral too: ``assistant_message`` is the canonical
assistant message that is recorded (and that the next turn's messages are
compared with), whatever API the client speaks.

Both are typed: ``CanonicalMessage`` and ``AssistantReply`` (defined beside the renderer
that reads them, ``proxima.proxy.rendering.canonical_message``, and exported here). What
stays ``Any`` is JSON the service passes through as the client sent it: OpenAI ``tools``,
``response_format``, template variables, a text prompt before ``prepare`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxima.proxy.rendering.canonical_message import (
    AssistantReply,
    CanonicalFunction,
    CanonicalMessage,
    CanonicalToolCall,
    Role,
)
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.tools import ParsedOutput, ToolChoice

__all__ = [
    "AssistantReply",
    "CanonicalFunction",
    "CanonicalMessage",
    "CanonicalRequest",
    "CanonicalToolCall",
    "ChatInput",
    "Role",
    "TextInput",
    "assistant_message",
]


@dataclass(frozen=True, slots=True)
class ChatInput:
    """A conversation: canonical messages, tools and the resolved tool choice."""

    messages: list[CanonicalMessage]
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice
    response_format: dict[str, Any] | None = None
    """OpenAI chat's shape (``{"type": "json_schema", "json_schema": {"schema": ...}}``);
    enforced with ``tool_choice`` by constrained decoding (``proxima.proxy.rendering.structured``)."""
    parallel_tool_calls: bool | None = None
    template_kwargs: dict[str, Any] | None = None
    reasoning_budget: int | None = None
    """Most reasoning tokens; then the reasoning is closed (Messages ``budget_tokens``)."""
    """Extra variables of the chat template (``chat_template_kwargs``: ``enable_thinking``)."""


@dataclass(frozen=True, slots=True)
class TextInput:
    """A raw text prompt: one string or one list of token ids (validated in ``prepare``)."""

    prompt: Any


@dataclass(frozen=True, slots=True)
class CanonicalRequest:
    """One generation request, independent of the API it arrived through.

    ``id_prefix`` starts the response id (``chatcmpl-``, ``cmpl-``); choice
    ``i > 0`` is recorded as ``{response_id}-{i}``. ``user`` names the
    production session when no ``X-Session-Id`` header does. ``model`` is
    the name asked for; ``<name>@v<N>`` asks for version N (admin token).
    """

    input: ChatInput | TextInput
    sampling: Sampling
    id_prefix: str
    logprobs: bool = False
    top_logprobs: int = 0
    user: str | None = None
    model: str | None = None


def assistant_message(parsed: ParsedOutput) -> AssistantReply:
    """The canonical (OpenAI-shaped) assistant message for a parsed reply."""
    message: AssistantReply = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    return message
