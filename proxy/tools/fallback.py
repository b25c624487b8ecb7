"""Tools and chat templates that do not render them: a declared fallback format, or a 400.

Some chat templates ignore the ``tools`` they are given (SmolLM2's, for one):
rendered as is, a request's tools would add no token to the prompt, and the
model would be asked to call functions it was never shown. That is never done
silently. At start-up the proxy renders a probe tool through the template
(``template_renders_tools``); if its name does not appear, a request with
tools is answered with a 400 naming ``tools``, unless the server was started
with ``--tool-fallback FORMAT``.

Then the fallback extends the template with the whole tool protocol, in that
format (``FALLBACKS``), before the template renders plain messages
(``fallback_messages``):

- the tools: a section after the system prompt's text (a system message
  holding only the section leads a conversation that has none), which shows
  the functions, how to call one (a worked example) and how results come back;
- an assistant turn's tool calls: its content, then the calls as the format
  writes them. When the turn is the reply of a completion the session
  recorded, it is the text the model generated for it, byte for byte
  (``generated``), so the next turn's prompt starts with that completion's
  prompt and output tokens and the tool loop is one token-exact chain;
- tool results: the results that follow an assistant turn, in one user turn,
  in the layout the section declares.

Each completion's ``sampling["tool_format"]`` records that the fallback was
used, next to the prompt tokens it produced.

One format is defined: ``hermes``, the ``<tools>`` / ``<tool_call>`` /
``<tool_response>`` layout the hermes parser reads (what Qwen2.5's and
NousHermes' templates write): the functions' JSON signatures, one a line, a
call ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, and the
results ``<tool_response>\\n...\\n</tool_response>``, one after the other.
The section's wording was chosen by measuring the demo model's well-formed
calls (``bench/tool_call_rate.py``; the figures are in ``docs/reference.md``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxima.proxy.rendering.canonical_message import CanonicalMessage as Message
from proxima.proxy.rendering.canonical_message import CanonicalToolCall

_PROBE_NAME = "proxima_probe_tool_renders"
_PROBE = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object"}},
}


def template_renders_tools(
    render: Callable[[Sequence[Message], Sequence[dict[str, Any]] | None], str],
) -> bool:
    """Whether a template's rendering shows a tool it is given (its name appears)."""
    try:
        text = render([{"role": "user", "content": "hi"}], [_PROBE])
    except Exception:  # a template that raises on tools renders none
        return False
    return _PROBE_NAME in text


@dataclass(frozen=True, slots=True)
class FallbackFormat:
    """One format's three pieces: the tools section, a turn's calls, a turn of results."""

    name: str
    section: Callable[[Sequence[dict[str, Any]]], str]
    calls: Callable[[str, Sequence[CanonicalToolCall]], str]
    results: Callable[[Sequence[str]], str]


def _hermes_call(call: CanonicalToolCall) -> str:
    function = call["function"]
    body = json.dumps(
        {"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False
    )
    return f"<tool_call>\n{body}\n</tool_call>"


def hermes_calls_text(content: str, calls: Sequence[CanonicalToolCall]) -> str:
    """An assistant turn with calls as a model writes them in hermes' format: the content, a
    line break, then each call's block, one a line (what the hermes parser reads back as
    that content and those calls)."""
    blocks = "\n".join(_hermes_call(call) for call in calls)
    return f"{content}\n{blocks}" if content else blocks


def hermes_results_text(results: Sequence[str]) -> str:
    """The results of one turn's calls, in order, as the section declares them."""
    return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)


# A placeholder of each JSON type, for the worked example's arguments.
_PLACEHOLDERS: dict[str, Any] = {
    "string": "...",
    "integer": 0,
    "number": 0,
    "boolean": True,
    "array": [],
    "object": {},
}


def example_arguments(tool: dict[str, Any]) -> dict[str, Any]:
    """Placeholder arguments of a function tool: its required parameters (all of them when
    none is required), each a placeholder of its JSON type (``"..."`` when untyped)."""
    parameters = tool.get("function", {}).get("parameters") or {}
    properties = parameters.get("properties")
    if not isinstance(properties, dict):
        return {}
    required = parameters.get("required")
    names = [n for n in required if n in properties] if isinstance(required, list) else []
    out: dict[str, Any] = {}
    for name in names or list(properties):
        kind = properties[name].get("type") if isinstance(properties[name], dict) else None
        out[name] = _PLACEHOLDERS.get(kind, "...") if isinstance(kind, str) else "..."
    return out


def hermes_tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """The tools as a system-prompt section in hermes' format, with a worked example: a call
    of the first tool with placeholder arguments, and how its result comes back."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    first = tools[0].get("function", {})
    example: CanonicalToolCall = {
        "id": "",
        "type": "function",
        "function": {"name": str(first.get("name", "")), "arguments": example_arguments(tools[0])},
    }
    return (
        "# Tools\n\n"
        "You may call one or more functions. Their signatures are within <tools></tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        f"For example, a reply that calls {example['function']['name']}:\n"
        f"{_hermes_call(example)}\n"
        "Each result comes back in the next user turn within <tool_response></tool_response> "
        "tags.\n\n"
        "When you use a function, reply with only a <tool_call> block like this one."
    )


FALLBACKS: dict[str, FallbackFormat] = {
    "hermes": FallbackFormat("hermes", hermes_tools_text, hermes_calls_text, hermes_results_text)
}


def with_tools_in_system(
    messages: Sequence[Message], tools: Sequence[dict[str, Any]], fallback: str
) -> list[Message]:
    """``messages`` whose system prompt carries ``tools`` in the ``fallback`` format.

    The leading system message gets the tools section after its text (a blank
    line between); without one, a system message holding only the section
    leads the conversation.
    """
    section = FALLBACKS[fallback].section(tools)
    out = [m.copy() for m in messages]
    if out and out[0].get("role") == "system":
        text = out[0].get("content") or ""
        out[0]["content"] = f"{text}\n\n{section}" if text else section
    else:
        out.insert(0, {"role": "system", "content": section})
    return out


def fallback_messages(
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
    fallback: str,
    generated: Mapping[int, str] | None = None,
) -> list[Message]:
    """``messages`` with the tool protocol written in, for a template that renders none.

    ``generated`` maps the index of an assistant message with tool calls to the
    text the model generated for it (a recorded completion's reply); other such
    messages are written in the format's canonical layout. Tool messages become
    one user turn per run of consecutive results. Everything else is unchanged.
    """
    fmt = FALLBACKS[fallback]
    out: list[Message] = []
    results: list[str] = []
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            results.append(message["content"])
            continue
        if results:
            out.append({"role": "user", "content": fmt.results(results)})
            results = []
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            text = (generated or {}).get(index)
            written: Message = {k: v for k, v in message.items() if k != "tool_calls"}  # type: ignore[assignment]
            written["content"] = text if text is not None else fmt.calls(message["content"], calls)
            out.append(written)
        else:
            out.append(message)
    if results:
        out.append({"role": "user", "content": fmt.results(results)})
    return with_tools_in_system(out, tools, fallback) if tools else out
