"""Anthropic Messages API requests -> the canonical request the proxy serves.

``POST /v1/messages`` translates its body straight into the canonical
request, which the chat template renders exactly as a ``/v1/chat/completions``
conversation: the session, the token-exact reuse of earlier turns and the
recorded tokens are the same whichever API a turn came in. Every 400 names
the Messages field (``stop_sequences``, ``output_config.format``,
``metadata.user_id``).

What becomes what::

    system (string or text blocks)          -> leading system message
    {"role": "system"} mid-conversation      -> a system message at that place
    user: text blocks                        -> user message (blocks joined by "\\n")
    user: tool_result blocks                 -> one tool message each, in order
    assistant: text blocks                   -> assistant content (joined as generated)
    assistant: tool_use blocks               -> the assistant message's tool_calls
    assistant: thinking blocks               -> its reasoning_content (signature verified)
    tools [{name, description, input_schema}] -> function tools (input_schema as parameters)
    tool_choice auto / any / tool / none     -> "auto" / "required" / the named function / "none"
    max_tokens, stop_sequences, temperature, top_p, top_k -> the same sampling settings
    metadata.user_id                         -> user (names a production session)

Images, documents, server tools (web search, bash, text editor, computer use,
...) are refused with a 400 in Anthropic's error shape; so is ``thinking:
{"type": "enabled"}`` for a model that does not think (for one that does, see
``reasoning_options.messages_thinking``). ``thinking: adaptive``,
``output_config.effort`` and ``context_management`` clear-thinking edits are
accepted as no-ops (``surfaces.reasoning_options``); ``cache_control`` on blocks,
``metadata.user_id`` (it names a production session, as ``user`` does) and the
``anthropic-beta`` header change nothing generated. ``tool_result`` with
``is_error`` keeps its text (templates have no error flag).
"""

from __future__ import annotations

import json
from typing import Any

from proxima.proxy.api.schemas import check_stop_sequences
from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering.reasoning_seal import ReasoningSeal
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.service.canonical import CanonicalRequest
from proxima.proxy.surfaces import reasoning_options
from proxima.proxy.surfaces.conversation import (
    chat_input,
    check_strings,
    check_user,
    function_tool,
)
from proxima.proxy.surfaces.messages.schema import ACCEPTED_WITHOUT_EFFECT, MessagesRequest

Message = dict[str, Any]


def _text_of_blocks(blocks: Any, where: str, separator: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise BadRequest(f"{where} must be a string or a list of blocks.", param=where)
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise BadRequest(
                f"{where}[{j}]: only text blocks are supported here (got {kind!r}).",
                param=f"{where}[{j}].type",
            )
        texts.append(block["text"])
    return separator.join(texts)


def _user_turn(content: Any, where: str) -> list[Message]:
    """A user message's blocks: tool results become tool messages, text a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise BadRequest(
            f"{where}.content must be a string or a non-empty list of blocks.",
            param=f"{where}.content",
        )
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(
                    f"{at}.tool_use_id must be a non-empty string.", param=f"{at}.tool_use_id"
                )
            result = _text_of_blocks(block.get("content", ""), f"{at}.content", "\n")
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise BadRequest(
                f"Content block type {kind!r} in {at} is not supported in a user message: "
                "send text and tool_result blocks (this model reads text only).",
                param=f"{at}.type",
            )
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(content: Any, where: str, seal: ReasoningSeal | None = None) -> Message:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content must be a string or a list of blocks.", param=f"{where}.content"
        )
    text, calls, thinking = "", [], None
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text += block["text"]
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking = (thinking or "") + _verified_thinking(block, at, seal)
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise BadRequest(f"{at} needs a string 'id' and 'name'.", param=at)
            if not isinstance(args, dict):
                raise BadRequest(f"{at}.input must be an object.", param=f"{at}.input")
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        elif kind == "redacted_thinking":
            raise BadRequest(
                f"{at} is a redacted_thinking block, which this server never produces: send "
                "back the thinking blocks its replies carried, as they came.",
                param=f"{at}.type",
            )
        else:
            raise BadRequest(
                f"Content block type {kind!r} in {at} is not supported in an assistant "
                "message: send text, thinking and tool_use blocks.",
                param=f"{at}.type",
            )
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    if thinking is not None:
        message["reasoning_content"] = thinking
    return message


def _verified_thinking(block: dict[str, Any], at: str, seal: ReasoningSeal | None) -> str:
    """A thinking block's text, if its ``signature`` is the one this server gave it."""
    if seal is None:
        raise BadRequest(f"{at}: thinking blocks cannot be read here.", param=f"{at}.type")
    sealed = seal.open(block.get("signature"), param=f"{at}.signature")
    if sealed.reasoning != block["thinking"]:
        raise BadRequest(
            f"{at}.signature does not match the block's thinking: thinking blocks must be "
            "sent back unmodified.",
            param=f"{at}.signature",
        )
    return sealed.reasoning


def conversation(req: MessagesRequest, seal: ReasoningSeal | None = None) -> list[Message]:
    """The conversation as canonical chat messages."""
    messages: list[Message] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text_of_blocks(req.system, "system", "\n")})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if "content" not in message:
            raise BadRequest(f"{where} is missing 'content'.", param=f"{where}.content")
        if role == "user":
            messages += _user_turn(message["content"], where)
        elif role == "assistant":
            messages.append(_assistant_turn(message["content"], where, seal))
        elif role == "system":
            # A system message mid-conversation (the mid-conversation-system beta Claude Code
            # sends): a system message at that place, as the chat template renders one.
            text = _text_of_blocks(message["content"], f"{where}.content", "\n")
            messages.append({"role": "system", "content": text})
        else:
            raise BadRequest(
                f"Invalid role {role!r} in {where}: expected 'user', 'assistant' or 'system'.",
                param=f"{where}.role",
            )
    return messages


def translate_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic client tools -> canonical function tools; server tools are a 400."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise BadRequest(
                f"Tool type {tool.get('type')!r} (tools[{i}]) is not supported: this server "
                "runs no server tools (web search, code execution, bash, text editor, computer "
                "use, ...); declare a client tool with 'input_schema'.",
                param=f"tools[{i}].type",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{i}].name must be a non-empty string.", param=f"tools[{i}]")
        if not isinstance(schema, dict):
            raise BadRequest(
                f"tools[{i}].input_schema must be an object.", param=f"tools[{i}].input_schema"
            )
        where = f"tools[{i}]"
        out.append(
            function_tool(
                name, tool.get("description"), schema, strict=bool(tool.get("strict")), where=where
            )
        )
    return out


def translate_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic ``tool_choice`` -> (the canonical one, in OpenAI chat's spelling, and
    ``parallel_tool_calls``)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise BadRequest(
        f"tool_choice {json.dumps(choice)} is not supported: use {{'type': 'auto' | 'any' | "
        "'none'}} or {'type': 'tool', 'name': ...}.",
        param="tool_choice",
    )


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_config.format`` (structured output) -> the canonical ``response_format``;
    ``output_config.effort`` is judged in ``surfaces.reasoning_options``."""
    if not output_config:
        return None
    reasoning_options.check_messages_effort(output_config.get("effort"))
    unknown = sorted(
        k for k, v in output_config.items() if k not in ("format", "effort") and v is not None
    )
    if unknown:
        raise BadRequest(
            f"output_config.{unknown[0]} is not supported with this model.",
            param=f"output_config.{unknown[0]}",
        )
    fmt = output_config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise BadRequest(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}.",
            param="output_config.format",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def canonical_request(
    req: MessagesRequest, *, thinks: bool = False, seal: ReasoningSeal | None = None
) -> CanonicalRequest:
    """``req`` as the service's canonical request (recorded under a ``msg_`` id).

    ``thinks``: the served model may think (its reasoning parser is not
    ``none``); ``seal`` verifies thinking blocks sent back.
    """
    unknown = sorted(set(req.model_extra or {}) - ACCEPTED_WITHOUT_EFFECT)
    if unknown:
        raise BadRequest(
            f"{unknown[0]}: not supported by this server (extra inputs are not permitted).",
            param=unknown[0],
        )
    template_kwargs, budget = reasoning_options.messages_thinking(
        req.thinking, thinks=thinks, max_tokens=req.max_tokens
    )
    reasoning_options.check_messages_context_management(req.context_management)
    tool_choice, parallel = translate_tool_choice(req.tool_choice)
    messages = conversation(req, seal)
    tools = translate_tools(req.tools)
    response_format = _response_format(req.output_config)
    check_strings(req)
    stop = list(req.stop_sequences or [])
    try:
        check_stop_sequences(stop)
    except ValueError as exc:
        raise BadRequest(
            f"Invalid value for 'stop_sequences': {exc}.", param="stop_sequences"
        ) from None
    user = (req.metadata or {}).get("user_id")
    user = user if isinstance(user, str) else None
    check_user(user, "metadata.user_id")
    return CanonicalRequest(
        input=chat_input(
            messages,
            tools,
            tool_choice,
            response_format=response_format,
            parallel_tool_calls=parallel,
            template_kwargs=template_kwargs,
            reasoning_budget=budget,
        ),
        sampling=Sampling.asked(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=stop,
        ),
        id_prefix="msg_",
        user=user,
        model=req.model,
    )
