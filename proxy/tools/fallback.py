"""Tools and chat templates that do not render them: a declared fallback format, or a 400.

Some chat templates ignore the ``tools`` they are given (SmolLM2's, for one):
rendered as is, a request's tools would add no token to the prompt, and the
model would be asked to call functions it was never shown. That is never done
silently. At start-up the proxy renders a probe tool through the template
(``template_renders_tools``); if its name does not appear, a request with
tools is answered with a 400 naming ``tools``, unless the server was started
with ``--tool-fallback FORMAT``. Then the tools are written into the system
prompt in that format (``FALLBACKS``), the template renders that system
prompt, and each completion's ``sampling["tool_format"]`` records that the
fallback was used, next to the prompt tokens it produced.

One format is defined: ``hermes``, the ``<tools>`` / ``<tool_call>`` layout
the hermes parser reads (what Qwen2.5 and NousHermes templates write): the
functions' JSON signatures, one a line, and how to call one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from proxima.proxy.rendering.canonical_message import CanonicalMessage as Message

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


def hermes_tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """The tools as a system-prompt section in hermes' format."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions. Their signatures are within <tools></tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments "
        "within <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


FALLBACKS: dict[str, Callable[[Sequence[dict[str, Any]]], str]] = {"hermes": hermes_tools_text}


def with_tools_in_system(
    messages: Sequence[Message], tools: Sequence[dict[str, Any]], fallback: str
) -> list[Message]:
    """``messages`` whose system prompt carries ``tools`` in the ``fallback`` format.

    The leading system message gets the tools section after its text (a blank
    line between); without one, a system message holding only the section
    leads the conversation.
    """
    section = FALLBACKS[fallback](tools)
    out = [m.copy() for m in messages]
    if out and out[0].get("role") == "system":
        text = out[0].get("content") or ""
        out[0]["content"] = f"{text}\n\n{section}" if text else section
    else:
        out.insert(0, {"role": "system", "content": section})
    return out
