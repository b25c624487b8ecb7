"""What the conversation surfaces share in building their ``CanonicalRequest``.

Responses and Messages each translate their own body straight into the
canonical request; the pieces here know no wire shape and name whatever field
the surface passes them:

- ``check_strings``: every string of a body valid Unicode (a lone surrogate
  can be neither tokenized nor stored), a 400 naming the body's own field;
- ``check_user``: the id a request names its production session by fits the
  store's column;
- ``function_tool``: one tool in the canonical shape (OpenAI's function tool,
  what chat templates render), its description and schema type-checked;
- ``check_function_name``: a tool name the prompt and a forced call's grammar
  can hold;
- ``chat_input``: the canonical messages (``normalize_messages``), the tools and
  the tool choice resolved against them (``resolve_tool_choice``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxima.proxy.api.schemas import (
    ANTHROPIC_TOOL_NAME,
    MAX_ID_LENGTH,
    check_identifier,
    check_tool_names,
)
from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering.chat_messages import normalize_messages
from proxima.proxy.rendering.unicode import InvalidString, check_unicode
from proxima.proxy.service.canonical import ChatInput
from proxima.proxy.tools import resolve_tool_choice
from pydantic import BaseModel


def check_strings(body: BaseModel) -> None:
    """A 400 naming the first string of ``body`` (its extra fields included) that holds a
    lone UTF-16 surrogate, as ``input[0].content[1].text``."""
    try:
        check_unicode(dict(body), "")
    except InvalidString as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def check_user(user: str | None, param: str) -> None:
    """``user`` (a production session's name) fits its column: no NUL, at most 200 characters."""
    if user is None:
        return
    if len(user) > MAX_ID_LENGTH:
        raise BadRequest(
            f"Invalid value for '{param}': String should have at most {MAX_ID_LENGTH} characters.",
            param=param,
        )
    try:
        check_identifier(user, param)
    except InvalidString as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def function_tool(
    name: str, description: Any, parameters: Any, *, strict: bool, where: str
) -> dict[str, Any]:
    """A tool as chat templates render it: ``{"type": "function", "function": {...}}``.

    ``where`` is the tool's place in the surface's body (``tools[0]``); a
    description that is not a string or parameters that are not an object is a
    400 naming ``{where}.description`` or ``{where}.parameters``. ``strict`` is
    written only when true (false is the default).
    """
    function: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise BadRequest(
                f"Invalid value for '{where}.description': Input should be a valid string.",
                param=f"{where}.description",
            )
        function["description"] = description
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise BadRequest(
                f"Invalid value for '{where}.parameters': Input should be a valid dictionary.",
                param=f"{where}.parameters",
            )
        function["parameters"] = parameters
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def check_function_name(name: str, param: str) -> None:
    """A 400 unless ``name`` matches Anthropic's rule, the loosest of the APIs'
    (``^[a-zA-Z0-9_-]{1,128}$``): no markup a prompt or a forced call's grammar would
    read as its own."""
    try:
        check_tool_names([(param, name)], ANTHROPIC_TOOL_NAME)
    except InvalidString as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def chat_input(
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    *,
    response_format: dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    template_kwargs: dict[str, Any] | None = None,
    reasoning_budget: int | None = None,
) -> ChatInput:
    """The conversation part of a canonical request.

    ``messages`` in OpenAI's chat shape (normalized here), ``tools`` in the
    shape :func:`function_tool` builds, ``tool_choice`` as OpenAI's chat API
    spells it (``"auto"``, ``{"type": "function", "function": {"name": ...}}``).
    """
    tool_list = list(tools) if tools else None
    return ChatInput(
        normalize_messages(messages),
        tool_list,
        resolve_tool_choice(tool_choice, tool_list),
        response_format=response_format,
        parallel_tool_calls=parallel_tool_calls,
        template_kwargs=template_kwargs or None,
        reasoning_budget=reasoning_budget,
    )
