"""A Chat Completions body -> the canonical request.

Its own checks live here (``top_logprobs`` without ``logprobs``, the chat
template's reserved variables); OpenAI's unsupported parameters are refused by
``openai_common.refuse_unsupported``; what is common to every API (context
window, ``n``, sessions) is checked by the service.
"""

from __future__ import annotations

from typing import Any

from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering.chat_messages import normalize_messages
from proxima.proxy.rendering.chat_template import RESERVED_TEMPLATE_KWARGS
from proxima.proxy.service.canonical import CanonicalRequest, ChatInput
from proxima.proxy.surfaces.chat.schema import ChatCompletionRequest, NamedToolChoice
from proxima.proxy.surfaces.openai_common import refuse_unsupported, sampling_of
from proxima.proxy.tools import resolve_tool_choice


def chat_request(req: ChatCompletionRequest) -> CanonicalRequest:
    refuse_unsupported(req)
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
    messages = normalize_messages(req.messages)
    tools = req.tool_dicts  # as sent: the template keeps their key order
    tool_choice = (
        req.tool_choice.model_dump()
        if isinstance(req.tool_choice, NamedToolChoice)
        else req.tool_choice
    )
    return CanonicalRequest(
        input=ChatInput(
            messages,
            tools,
            resolve_tool_choice(tool_choice, tools),
            response_format=req.response_format.model_dump() if req.response_format else None,
            parallel_tool_calls=req.parallel_tool_calls,
            template_kwargs=_template_kwargs(req.chat_template_kwargs),
            reasoning_budget=req.reasoning_budget,
        ),
        sampling=sampling_of(req, req.max_completion_tokens or req.max_tokens),
        id_prefix="chatcmpl-",
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        user=req.user,
        model=req.model,
    )


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` (``{"enable_thinking": false}``), the renderer's own names refused."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise BadRequest(
                f"chat_template_kwargs may not set '{key}': it is set from the request.",
                param=f"chat_template_kwargs.{key}",
            )
    return kwargs or None
