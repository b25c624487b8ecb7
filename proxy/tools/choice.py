"""``tool_choice``: validation against ``tools``, and what it does to parsing.

``"none"`` turns parsing off; ``"auto"``, ``"required"`` and a named function
turn it on. ``"required"`` and a named function are enforced by constrained
decoding (``proxy/rendering/structured.py``); a reply cut at ``max_tokens`` mid-call may
still hold no call, and ``apply_tool_choice`` then returns what was produced.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxima.proxy.errors import BadRequest
from proxima.proxy.tools.calls import ParsedOutput, ToolCallParser
from proxima.proxy.tools.formats import NoToolParser

logger = logging.getLogger(__name__)


class InvalidToolChoice(BadRequest):
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
