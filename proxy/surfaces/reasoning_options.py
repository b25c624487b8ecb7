"""What a request asks about reasoning ("thinking"), judged for a model that does not think.

Codex CLI and Claude Code send reasoning options on every request, whatever
the model: Codex ``reasoning: {"summary": "auto"}`` and ``include:
["reasoning.encrypted_content"]``; Claude Code ``thinking: {"type":
"adaptive"}``, ``output_config: {"effort": "high"}`` and ``context_management:
{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}``. For a model
that writes no reasoning, each of these asks for nothing that could change the
tokens it samples, so they are accepted and have no effect:

- ``reasoning.summary`` (Responses): a summary of reasoning there is none of;
- ``reasoning.effort`` (Responses) and ``output_config.effort`` (Messages):
  how long to think, for a model that never does;
- ``include: ["reasoning.encrypted_content"]``: there are no reasoning items to
  return, encrypted or not;
- ``thinking: {"type": "adaptive"}``: the model decides whether to think, and
  this one does not; ``{"type": "disabled"}`` likewise;
- ``context_management`` edits ``clear_thinking_*``: clearing thinking blocks
  from the history, which holds none (thinking blocks in the input are
  refused where the input is read).

What would change the reply and cannot be done stays a 400 naming the field:
``thinking: {"type": "enabled"}`` (it demands thinking), a ``context_management``
edit that clears anything else (e.g. ``clear_tool_uses_*`` rewrites the prompt),
values the real APIs reject.

Every surface calls the functions here, so this module is the one place that
decides what reasoning options mean. For a model that does think (a reasoning
parser other than ``none``), ``messages_thinking`` decides instead: thinking
enabled (with its budget), adaptive, or disabled (the template's
``enable_thinking: false``); ``reasoning_effort`` maps Responses' effort
``none`` to the same switch.
"""

from __future__ import annotations

from typing import Any

from proxima.proxy.errors import BadRequest

# Values the hosted APIs accept (a value outside them is a 400 there too).
RESPONSES_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
RESPONSES_SUMMARIES = frozenset({"auto", "concise", "detailed"})
MESSAGES_EFFORTS = frozenset({"low", "medium", "high", "xhigh", "max"})
# Context-management edits that only clear thinking blocks.
CLEAR_THINKING_PREFIX = "clear_thinking_"


def check_responses_reasoning(reasoning: dict[str, Any] | None) -> None:
    """Responses ``reasoning``: ``effort`` and ``summary`` are no-ops; anything else a 400."""
    if not reasoning:
        return
    for key, value in reasoning.items():
        if value is None:
            continue
        if key == "effort":
            allowed = RESPONSES_EFFORTS
        elif key in ("summary", "generate_summary"):
            allowed = RESPONSES_SUMMARIES
        else:
            raise BadRequest(f"Unrecognized reasoning option '{key}'.", param=f"reasoning.{key}")
        if value not in allowed:
            raise BadRequest(
                f"Invalid value for 'reasoning.{key}': {value!r}; expected one of "
                f"{', '.join(sorted(allowed))}.",
                param=f"reasoning.{key}",
            )


def reasoning_effort_kwargs(
    reasoning: dict[str, Any] | None, *, thinks: bool
) -> dict[str, Any] | None:
    """Responses ``reasoning.effort`` ``none`` turns a thinking model's thinking off."""
    if thinks and reasoning and reasoning.get("effort") == "none":
        return {"enable_thinking": False}
    return None


def check_messages_thinking(thinking: dict[str, Any] | None) -> None:
    """Messages ``thinking``: ``adaptive`` and ``disabled`` are no-ops; ``enabled`` a 400."""
    if not thinking:
        return
    kind = thinking.get("type")
    if kind in ("adaptive", "disabled"):
        return
    if kind == "enabled":
        raise BadRequest(
            "Extended thinking is not supported with this model: it does not think. Send "
            "thinking {'type': 'adaptive'} or {'type': 'disabled'}, or leave it out.",
            param="thinking",
        )
    raise BadRequest(
        f"thinking.type {kind!r} is not one of 'enabled', 'adaptive', 'disabled'.",
        param="thinking.type",
    )


# Anthropic's smallest thinking budget.
MIN_BUDGET_TOKENS = 1024


def messages_thinking(
    thinking: dict[str, Any] | None, *, thinks: bool, max_tokens: int
) -> tuple[dict[str, Any] | None, int | None]:
    """Messages ``thinking`` for a model that may think: ``(template kwargs, budget)``.

    ``enabled`` and ``adaptive`` let the model think as its template does;
    ``disabled`` turns the template's own switch off (``enable_thinking:
    false``, Qwen3's). ``enabled`` needs ``budget_tokens`` of at least 1024 and
    below ``max_tokens`` (Anthropic's rules); the reasoning is then cut at that
    many tokens and closed. A model that does not think: ``check_messages_thinking``.
    """
    if not thinks:
        check_messages_thinking(thinking)
        return None, None
    if not thinking:
        return None, None
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}, None
    if kind == "adaptive":
        return None, None
    if kind != "enabled":
        raise BadRequest(
            f"thinking.type {kind!r} is not one of 'enabled', 'adaptive', 'disabled'.",
            param="thinking.type",
        )
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_BUDGET_TOKENS:
        raise BadRequest(
            f"thinking.budget_tokens: Input should be an integer greater than or equal to "
            f"{MIN_BUDGET_TOKENS}.",
            param="thinking.budget_tokens",
        )
    if budget >= max_tokens:
        raise BadRequest(
            "`max_tokens` must be greater than `thinking.budget_tokens`.",
            param="thinking.budget_tokens",
        )
    return None, budget


def check_messages_effort(effort: Any) -> None:
    """Messages ``output_config.effort``: a valid effort is a no-op."""
    if effort is not None and effort not in MESSAGES_EFFORTS:
        raise BadRequest(
            f"output_config.effort {effort!r} is not one of {', '.join(sorted(MESSAGES_EFFORTS))}.",
            param="output_config.effort",
        )


def check_messages_context_management(context_management: Any) -> None:
    """Messages ``context_management``: clearing thinking is a no-op; other edits a 400."""
    if context_management is None:
        return
    if not isinstance(context_management, dict):
        raise BadRequest("context_management must be an object.", param="context_management")
    unknown = sorted(k for k in context_management if k != "edits")
    if unknown:
        raise BadRequest(
            f"context_management.{unknown[0]}: not supported by this server.",
            param=f"context_management.{unknown[0]}",
        )
    edits = context_management.get("edits") or []
    if not isinstance(edits, list):
        raise BadRequest("context_management.edits must be a list.", param="context_management")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if isinstance(kind, str) and kind.startswith(CLEAR_THINKING_PREFIX):
            continue
        raise BadRequest(
            f"context_management.edits[{i}]: edit type {kind!r} is not supported: this "
            "server never rewrites the conversation it was sent (only clear_thinking edits, "
            "which have nothing to clear for a model that does not think, are accepted).",
            param=f"context_management.edits[{i}].type",
        )
