"""OpenAI Responses API requests -> the canonical request the proxy serves.

``POST /v1/responses`` translates its body straight into the canonical
request: the conversation as canonical chat messages, function tools, the
tool choice, sampling. The chat template renders it exactly as a
``/v1/chat/completions`` conversation, so a Responses conversation is stored,
reused token-exactly and trained exactly like a chat one, and a session may
mix the two. Every 400 names the Responses field (``input[2].arguments``,
``text.format``, ``max_output_tokens``).

Items of ``input`` and what they become::

    "text"                                   -> user message
    {"role": r, "content": str | parts}      -> r message ("developer" -> system)
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text"}...]} -> assistant message
    {"type": "function_call", "call_id",
     "name", "arguments"}                    -> a tool call of the assistant message
    {"type": "function_call_output",
     "call_id", "output"}                    -> tool message
    {"type": "reasoning", ...}               -> reasoning_content of the assistant
                                                message that follows it

Consecutive assistant items (a message and the function calls that follow it)
are one assistant turn, as the model produced them: their texts are joined
with nothing between them and their calls collected in order. ``instructions``
is the leading system message.

Tools: ``function`` tools, and the function tools of a ``namespace`` tool
(its calls carry ``namespace`` back), are offered to the model; ``web_search``
is accepted and not offered (nothing here can search; Codex CLI declares it on
every request); other built-in tools are a 400. Reasoning options are judged
in ``surfaces.reasoning_options`` (no-ops for a model that does not think).

Everything else is refused with a 400 naming the parameter: built-in tools
(file search, computer use, ...), images and files, server-side
conversations and prompts, and the options that would change generation in a
way this server does not implement.
"""

from __future__ import annotations

import json
from typing import Any

from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering.chat_messages import parse_tool_arguments
from proxima.proxy.rendering.reasoning_seal import ReasoningSeal
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.service.canonical import CanonicalRequest
from proxima.proxy.surfaces import reasoning_options
from proxima.proxy.surfaces.conversation import (
    chat_input,
    check_function_name,
    check_strings,
    check_user,
    function_tool,
)
from proxima.proxy.surfaces.responses.schema import ACCEPTED_WITHOUT_EFFECT, ResponsesRequest

Message = dict[str, Any]


def _refuse_unsupported(req: ResponsesRequest) -> None:
    extra = req.model_extra or {}
    if extra.get("moderation") is not None:
        raise BadRequest("Output moderation is not supported.", param="moderation")
    unknown = sorted(set(extra) - ACCEPTED_WITHOUT_EFFECT - {"moderation"})
    if unknown:
        raise BadRequest(f"Unrecognized request argument supplied: {unknown[0]}.", param=unknown[0])
    if req.background:
        raise BadRequest(
            "background responses are not supported; call without 'background'.",
            param="background",
        )
    if req.conversation is not None:
        raise BadRequest(
            "Server-side conversations are not supported; send the history in 'input' "
            "or use 'previous_response_id'.",
            param="conversation",
        )
    if req.prompt is not None:
        raise BadRequest("Stored prompt templates are not supported.", param="prompt")
    if req.context_management:
        raise BadRequest("context_management is not supported.", param="context_management")
    if req.truncation not in (None, "disabled"):
        raise BadRequest(
            f"truncation {req.truncation!r} is not supported: this server never drops input "
            "items; use 'disabled'.",
            param="truncation",
        )
    reasoning_options.check_responses_reasoning(req.reasoning)
    if req.text and req.text.get("verbosity") is not None:
        raise BadRequest("text.verbosity is not supported with this model.", param="text.verbosity")


# ----------------------------------------------------------------------------- tools


# Built-in tools of OpenAI's hosted service that are accepted but not offered to the model:
# nothing here can run a web search, and Codex CLI declares one on every request. The model
# answers as a hosted model that chose not to search does; forcing the tool is a 400.
NOT_OFFERED_TOOLS = frozenset(
    {"web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11"}
)


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """One Responses function tool (flat) in the canonical shape."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name must be a non-empty string.", param=f"{where}.name")
    check_function_name(name, f"{where}.name")
    return function_tool(
        name,
        tool.get("description"),
        tool.get("parameters"),
        strict=bool(tool.get("strict")),
        where=where,
    )


def _refuse_tool(kind: Any, where: str) -> BadRequest:
    return BadRequest(
        f"Tool type {kind!r} ({where}) is not supported: this server runs no built-in tools "
        "(file search, computer use, code interpreter, MCP, ...); declare a 'function' tool "
        "and run it in your agent.",
        param=f"{where}.type",
    )


def translate_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses tools -> canonical function tools, in order.

    A ``namespace`` tool's function tools are function tools (its calls carry the
    namespace back: ``tool_namespaces``); ``web_search`` tools are accepted and not
    offered (:data:`NOT_OFFERED_TOOLS`); other built-in tools are a 400.
    """
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    seen: dict[str, str] = {}

    def add(tool: dict[str, Any], where: str) -> None:
        function = _function_tool(tool, where)
        name = function["function"]["name"]
        if name in seen:
            raise BadRequest(
                f"Tool name {name!r} ({where}) is declared twice (first at {seen[name]}); "
                "function names must be unique, namespaces included.",
                param=f"{where}.name",
            )
        seen[name] = where
        out.append(function)

    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            add(tool, where)
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(inner, list):
                raise BadRequest(
                    f"{where}: a namespace tool needs a string 'name' and a list 'tools'.",
                    param=where,
                )
            for j, member in enumerate(inner):
                at = f"{where}.tools[{j}]"
                member_kind = member.get("type") if isinstance(member, dict) else None
                if member_kind != "function":
                    raise _refuse_tool(member_kind, at)
                add(member, at)
        elif kind in NOT_OFFERED_TOOLS:
            continue
        else:
            raise _refuse_tool(kind, where)
    return out or None


def tool_namespaces(tools: list[dict[str, Any]] | None) -> dict[str, str]:
    """Function name -> namespace, for the functions of ``namespace`` tools."""
    return {
        member["name"]: tool["name"]
        for tool in tools or []
        if isinstance(tool, dict) and tool.get("type") == "namespace"
        for member in tool.get("tools") or []
        if isinstance(member, dict) and isinstance(member.get("name"), str)
    }


def translate_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses ``tool_choice`` -> the canonical one (OpenAI chat's spelling)."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(
        f"tool_choice {json.dumps(choice)} is not supported: use 'none', 'auto', 'required' "
        "or {'type': 'function', 'name': ...}.",
        param="tool_choice",
    )


def translate_text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` -> the canonical ``response_format`` (OpenAI chat's shape: a json_schema
    moves under ``json_schema``)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest(
            "text.format must be {'type': 'text' | 'json_object' | 'json_schema', ...}.",
            param="text.format",
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": schema}


# ----------------------------------------------------------------------------- input


def _parts_text(content: Any, where: str, *, assistant: bool) -> str:
    """The text of a message's ``content`` (a string or a list of text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list.", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text")
        elif kind == "refusal":
            text = part.get("refusal")
        else:
            raise BadRequest(
                f"Content part type {kind!r} in {where}.content[{j}] is not supported: this "
                "model reads text only.",
                param=f"{where}.content[{j}].type",
            )
        if not isinstance(text, str):
            raise BadRequest(
                f"{where}.content[{j}] has no text.", param=f"{where}.content[{j}].text"
            )
        texts.append(text)
    # Pieces of one reply are joined as generated; separate input parts as chat joins them.
    return ("" if assistant else "\n").join(texts)


class _Conversation:
    """Accumulates canonical chat messages, merging one assistant turn's items."""

    def __init__(self, messages: list[Message]) -> None:
        self.messages = messages
        self._open_assistant = False
        # A reasoning item's text and place: it starts the assistant turn that follows it.
        self._reasoning: tuple[str | None, str] | None = None

    def add(self, message: Message) -> None:
        self.check_no_reasoning()
        self.messages.append(message)
        self._open_assistant = message["role"] == "assistant"

    def assistant(self) -> Message:
        if self._reasoning is not None:
            text, _ = self._reasoning
            self._reasoning = None
            self.add({"role": "assistant", "content": ""})
            if text is not None:
                self.messages[-1]["reasoning_content"] = text
        elif not self._open_assistant:
            self.add({"role": "assistant", "content": ""})
        return self.messages[-1]

    def reasoning(self, text: str | None, where: str) -> None:
        if self._reasoning is not None:
            previous, _ = self._reasoning
            if text is not None:
                text = (previous or "") + text
            elif previous is not None:
                text = previous
        self._reasoning = (text, where)

    def check_no_reasoning(self) -> None:
        """A reasoning item must be followed by the assistant output it came with."""
        if self._reasoning is not None:
            where = self._reasoning[1]
            raise BadRequest(
                f"{where}: a reasoning item must be followed by the assistant message or "
                "function_call it came with.",
                param=f"{where}.type",
            )


def _reasoning_text(item: dict[str, Any], where: str, seal: ReasoningSeal | None) -> str | None:
    """A reasoning item's text: its verified ``encrypted_content``, else its ``content``.

    An item with neither (a summary only) says nothing of the tokens; it
    still opens the assistant turn it belongs to.
    """
    encrypted = item.get("encrypted_content")
    if encrypted is not None:
        if seal is None:
            raise BadRequest(
                f"{where}.encrypted_content cannot be read here.",
                param=f"{where}.encrypted_content",
            )
        return seal.open(encrypted, param=f"{where}.encrypted_content").reasoning
    content = item.get("content")
    if not content:
        return None
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a list.", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        text = part.get("text") if isinstance(part, dict) else None
        if (
            not isinstance(part, dict)
            or part.get("type") != "reasoning_text"
            or not isinstance(text, str)
        ):
            raise BadRequest(
                f"{where}.content[{j}] must be {{'type': 'reasoning_text', 'text': ...}}.",
                param=f"{where}.content[{j}]",
            )
        texts.append(text)
    return "".join(texts)


def _add_item(
    conv: _Conversation, item: Any, where: str, seal: ReasoningSeal | None = None
) -> None:
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an object.", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise BadRequest(
                f"Invalid role {role!r} in {where}; expected user, system, developer or assistant.",
                param=f"{where}.role",
            )
        if "content" not in item:
            raise BadRequest(f"{where} is missing 'content'.", param=f"{where}.content")
        text = _parts_text(item["content"], where, assistant=role == "assistant")
        if role == "assistant":
            turn = conv.assistant()
            turn["content"] += text
        else:
            conv.add({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
            if not isinstance(value, str) or (field != "arguments" and not value):
                raise BadRequest(
                    f"{where}.{field} must be a{' non-empty' if field != 'arguments' else ''} "
                    "string.",
                    param=f"{where}.{field}",
                )
        assert isinstance(arguments, str)  # checked above
        turn = conv.assistant()
        parsed = parse_tool_arguments(arguments, f"{where}.arguments")
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
        )
    elif kind == "reasoning":
        # A reasoning item starts an assistant turn: the reply it came with follows it.
        conv.reasoning(_reasoning_text(item, where, seal), where)
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(
                f"{where}.call_id must be a non-empty string.", param=f"{where}.call_id"
            )
        if "output" not in item:
            raise BadRequest(f"{where} is missing 'output'.", param=f"{where}.output")
        output = item["output"]
        content = output if isinstance(output, str) else _parts_text(output, where, assistant=False)
        conv.add({"role": "tool", "tool_call_id": call_id, "content": content})
    else:
        raise BadRequest(
            f"Input item type {kind!r} ({where}) is not supported: send messages, "
            "reasoning, function_call and function_call_output items.",
            param=f"{where}.type",
        )


def input_messages(
    req: ResponsesRequest, previous: list[Message] | None = None, seal: ReasoningSeal | None = None
) -> list[Message]:
    """The conversation as canonical chat messages.

    ``previous`` is the conversation of ``previous_response_id`` (its request
    messages and its reply); the new input follows it. ``instructions``, when
    given, is the leading system message (it replaces the previous one's).
    """
    if not isinstance(req.input, str | list):
        raise BadRequest("'input' is required: a string or a list of input items.", param="input")
    messages: list[Message] = [dict(m) for m in previous or []]
    if req.instructions is not None:
        if messages and messages[0]["role"] == "system":
            messages = messages[1:]
        messages.insert(0, {"role": "system", "content": req.instructions})
    conv = _Conversation(messages)
    if isinstance(req.input, str):
        conv.add({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(conv, item, f"input[{i}]", seal)
        conv.check_no_reasoning()
    if not messages or all(m["role"] == "system" for m in messages):
        raise BadRequest("'input' must contain at least one item.", param="input")
    return messages


def canonical_request(
    req: ResponsesRequest,
    previous: list[Message] | None = None,
    seal: ReasoningSeal | None = None,
    *,
    thinks: bool = False,
) -> CanonicalRequest:
    """``req`` as the service's canonical request (recorded under a ``resp_`` id).

    ``previous``: the conversation of ``previous_response_id``; ``seal``
    verifies reasoning items' ``encrypted_content``; ``thinks``: the served
    model may think (``reasoning.effort: "none"`` then turns it off).
    """
    _refuse_unsupported(req)
    messages = input_messages(req, previous, seal)
    tools = translate_tools(req.tools)
    tool_choice = translate_tool_choice(req.tool_choice)
    response_format = translate_text_format(req.text)
    template_kwargs = reasoning_options.reasoning_effort_kwargs(req.reasoning, thinks=thinks)
    check_strings(req)
    check_user(req.user, "user")
    return CanonicalRequest(
        input=chat_input(
            messages,
            tools,
            tool_choice,
            response_format=response_format,
            parallel_tool_calls=req.parallel_tool_calls,
            template_kwargs=template_kwargs,
        ),
        sampling=Sampling.asked(
            max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p
        ),
        id_prefix="resp_",
        logprobs=bool(req.wants_logprobs or req.top_logprobs),
        top_logprobs=req.top_logprobs or 0,
        user=req.user,
        model=req.model,
        # No max_output_tokens (Codex CLI never sends one): the server's default_max_tokens
        # (service.prepare), so a reply that never ends cannot hold a harness for minutes.
    )


def echoed_settings(req: ResponsesRequest) -> dict[str, Any]:
    """The request settings every ``response`` object repeats."""
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": (req.model_extra or {}).get("store", True) is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
    }
