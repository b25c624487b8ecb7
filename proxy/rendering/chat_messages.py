"""Chat messages in canonical form: validated, normalized, and compared turn by turn.

``normalize_messages`` validates OpenAI chat messages and brings them to one canonical
form, used both for rendering (``proxima.proxy.rendering.chat_template``) and for comparing
the turns of a session (``messages_equivalent``). Bad input is an ``InvalidMessages`` (a
400 naming the offending field).

Canonical message (typed as ``CanonicalMessage``,
``proxima.proxy.rendering.canonical_message``)::

    {"role": "system" | "user" | "assistant" | "tool",
     "content": str,                          # "" for None; text parts joined
     "tool_calls": [{"id": str, "type": "function",
                     "function": {"name": str, "arguments": dict | str}}],
                                              # assistant only, when non-empty
     "reasoning_content": str,                # assistant only, when given
     "tool_call_id": str,                     # tool only
     "name": str}                             # when given

``arguments`` is the parsed JSON object, or the raw string when it is not one
(templates render objects with ``tojson``). ``developer`` messages become
``system``. Records' ``request_messages`` should be stored canonical; they
are re-normalized when compared, which is idempotent.
"""

from __future__ import annotations

import json
from typing import Any

from proxima.proxy import errors
from proxima.proxy.rendering.canonical_message import CanonicalMessage, CanonicalToolCall, Role
from proxima.proxy.rendering.unicode import InvalidString, check_unicode

Message = CanonicalMessage

_ROLES = ("system", "developer", "user", "assistant", "tool")
# The canonical role of each: ``developer`` messages are system prompts.
_CANONICAL_ROLE: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
# Text parts of a list ``content`` are joined like this (as vLLM does).
_PART_SEPARATOR = "\n"


class InvalidMessages(errors.BadRequest):
    """``messages`` cannot be served; ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str = "messages") -> None:
        super().__init__(message, param=param)


def normalize_messages(messages: Any) -> list[Message]:
    """Validate OpenAI chat messages and return them in canonical form.

    Raises ``InvalidMessages`` (a 400) naming the field, for an empty list,
    an unknown role, a non-text content part, a tool message without
    ``tool_call_id``, or a field of the wrong type. Unknown fields (``refusal``,
    ``audio``, ``annotations``, a null ``function_call``) are dropped.
    """
    if not isinstance(messages, list):
        raise InvalidMessages("'messages' must be a list of message objects.")
    if not messages:
        raise InvalidMessages("'messages' must contain at least one message.")
    return [normalize_message(message, index) for index, message in enumerate(messages)]


def normalize_message(message: Any, index: int = 0) -> Message:
    """One message in canonical form; ``index`` places it in error messages."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidMessages(f"{where} must be an object.", param=where)
    given = message.get("role")
    role = _CANONICAL_ROLE.get(given) if isinstance(given, str) else None
    if role is None:
        raise InvalidMessages(
            f"Invalid role {given!r} in {where}; expected one of: {', '.join(_ROLES)}.",
            param=f"{where}.role",
        )
    if "content" not in message and role != "assistant":
        raise InvalidMessages(f"{where} ({role}) is missing 'content'.", param=f"{where}.content")
    out: Message = {"role": role, "content": _text_content(message.get("content"), where)}
    if role == "assistant":
        tool_calls = _tool_calls(message.get("tool_calls"), where)
        if tool_calls:
            out["tool_calls"] = tool_calls
        reasoning = _reasoning_content(message, where)
        if reasoning is not None:
            out["reasoning_content"] = reasoning
    elif message.get("tool_calls"):
        raise InvalidMessages(
            f"{where}: only assistant messages may have 'tool_calls'.",
            param=f"{where}.tool_calls",
        )
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidMessages(
                f"{where} (tool) must have a non-empty string 'tool_call_id'.",
                param=f"{where}.tool_call_id",
            )
        out["tool_call_id"] = call_id
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidMessages(f"{where}.name must be a string.", param=f"{where}.name")
        out["name"] = name
    return out


def _reasoning_content(message: dict[str, Any], where: str) -> str | None:
    """An assistant message's reasoning: ``reasoning_content`` (DeepSeek, SGLang) or
    ``reasoning`` (newer vLLM), a string; None when absent or null."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidMessages(f"{where}.{key} must be a string.", param=f"{where}.{key}")
        return value
    return None


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidMessages(
            f"{where}.content must be a string, null, or a list of text parts.",
            param=f"{where}.content",
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise InvalidMessages(f"{param} must be an object.", param=param)
        kind = part.get("type")
        if kind != "text":
            raise InvalidMessages(
                f"Unsupported content part type {kind!r} in {param}: only 'text' parts "
                "are supported by this model.",
                param=f"{param}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidMessages(f"{param}.text must be a string.", param=f"{param}.text")
        texts.append(text)
    return _PART_SEPARATOR.join(texts)


def _tool_calls(tool_calls: Any, where: str) -> list[CanonicalToolCall]:
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise InvalidMessages(f"{where}.tool_calls must be a list.", param=f"{where}.tool_calls")
    return [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(tool_calls)]


def _tool_call(call: Any, where: str) -> CanonicalToolCall:
    if not isinstance(call, dict):
        raise InvalidMessages(f"{where} must be an object.", param=where)
    if call.get("type", "function") != "function":
        raise InvalidMessages(
            f"Unsupported tool call type {call.get('type')!r} in {where}; expected 'function'.",
            param=f"{where}.type",
        )
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise InvalidMessages(f"{where}.id must be a string.", param=f"{where}.id")
    function = call.get("function")
    if not isinstance(function, dict):
        raise InvalidMessages(f"{where}.function must be an object.", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidMessages(
            f"{where}.function.name must be a non-empty string.", param=f"{where}.function.name"
        )
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = parse_tool_arguments(arguments, f"{where}.function.arguments")
    elif not isinstance(arguments, dict):
        raise InvalidMessages(
            f"{where}.function.arguments must be a JSON string.",
            param=f"{where}.function.arguments",
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_arguments(arguments: str, param: str) -> dict[str, Any] | str:
    """A tool call's ``arguments`` in canonical form: the JSON object the string holds, or
    the string itself if it holds none. JSON escapes may decode to a lone surrogate: an
    ``InvalidMessages`` naming ``param`` (and the key inside it)."""
    try:
        loaded: Any = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        loaded = arguments
    parsed: dict[str, Any] | str = loaded if isinstance(loaded, dict) else arguments
    try:
        check_unicode(parsed, param)
    except InvalidString as exc:
        raise InvalidMessages(str(exc), param=exc.param) from exc
    return parsed


def messages_equivalent(a: Message, b: Message) -> bool:
    """Whether two canonical messages are the same turn.

    Role, content, ``tool_call_id`` and each call's name and parsed arguments
    must match exactly; call ids, ``name`` and ``reasoning_content`` are
    compared only when both sides have them (clients echo our ids and the
    reasoning back, or drop them).
    """
    if a["role"] != b["role"] or a["content"] != b["content"]:
        return False
    if a.get("tool_call_id") != b.get("tool_call_id"):
        return False
    if "name" in a and "name" in b and a["name"] != b["name"]:
        return False
    if (
        "reasoning_content" in a
        and "reasoning_content" in b
        and a["reasoning_content"] != b["reasoning_content"]
    ):
        return False
    calls_a, calls_b = a.get("tool_calls", []), b.get("tool_calls", [])
    if len(calls_a) != len(calls_b):
        return False
    for call_a, call_b in zip(calls_a, calls_b, strict=True):
        if call_a["id"] and call_b["id"] and call_a["id"] != call_b["id"]:
            return False
        if call_a["function"] != call_b["function"]:
            return False
    return True
