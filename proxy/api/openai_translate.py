"""OpenAI request bodies (``api.schemas``) to canonical requests.

The OpenAI-specific checks live here (``echo``,
``suffix``, ``top_logprobs`` without ``logprobs``); what is common to every
API (context window, ``n``, sessions) is checked by the service.

Unknown fields are accepted (clients send ``store``, ``metadata``,
``service_tier``... that change nothing generated), except the ones that
would change the reply and that Proxima does not implement
(:data:`UNSUPPORTED`): those are a 400 naming the field, never silently
ignored.
"""

from __future__ import annotations

from typing import Any

from proxima.proxy.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from proxima.proxy.chat import RESERVED_TEMPLATE_KWARGS, normalize_messages
from proxima.proxy.errors import BadRequest
from proxima.proxy.service.canonical import CanonicalRequest, ChatInput, Sampling, TextInput
from proxima.proxy.tools import resolve_tool_choice
from proxima.proxy.unicode import InvalidString
from pydantic import ValidationError

UNSUPPORTED: dict[str, str] = {
    "functions": "the legacy 'functions' parameter is not supported; use 'tools'.",
    "function_call": "the legacy 'function_call' parameter is not supported; use 'tool_choice'.",
    "audio": "audio output is not supported.",
    "web_search_options": "web search is not supported.",
    "repetition_penalty": "repetition_penalty is not supported; use presence_penalty or "
    "frequency_penalty.",
    "min_tokens": "min_tokens is not supported.",
    "best_of": "best_of is not supported; use n.",
    "guided_json": "guided_json is not supported; use response_format.",
    "guided_regex": "guided_regex is not supported.",
}


def refuse_unsupported(req: SamplingFields) -> None:
    """A 400 for a field that would change the reply but is not implemented."""
    extra = req.model_extra or {}
    for name, why in UNSUPPORTED.items():
        if extra.get(name) is not None:
            raise BadRequest(f"Unsupported parameter '{name}': {why}", param=name)
    modalities = extra.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise BadRequest(
            "Unsupported parameter 'modalities': only ['text'] output is supported.",
            param="modalities",
        )


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
        sampling=_sampling(req, req.max_completion_tokens or req.max_tokens),
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


def completion_request(req: CompletionRequest) -> CanonicalRequest:
    refuse_unsupported(req)
    if req.echo:
        raise BadRequest("echo is not supported.", param="echo")
    if req.suffix:
        raise BadRequest("suffix is not supported.", param="suffix")
    return CanonicalRequest(
        input=TextInput(req.prompt),
        sampling=_sampling(req, req.max_tokens),
        id_prefix="cmpl-",
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        user=req.user,
        model=req.model,
    )


def _sampling(req: SamplingFields, max_tokens: int | None) -> Sampling:
    return Sampling(
        n=req.n,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        stop=req.stop_list,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias=req.logit_bias,
    )


def chat_request_of(body: dict[str, Any], params: dict[str, str]) -> CanonicalRequest:
    """The canonical request of a chat body that another API's translation built.

    Other API surfaces (Responses, Messages) translate into a Chat Completions
    body so that every chat rule applies to them too; ``params`` renames chat
    parameters to theirs in the 400s.
    """
    try:
        return chat_request(ChatCompletionRequest.model_validate(body))
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidString):  # a lone surrogate somewhere in the body
            raise BadRequest(str(cause), param=cause.param) from exc
        param = ".".join(str(p) for p in first.get("loc", ()))
        raise BadRequest(
            f"Invalid value for '{params.get(param, param)}': {first.get('msg')}.",
            param=params.get(param, param),
        ) from exc
    except BadRequest as exc:
        if exc.param in params:
            exc.param = params[exc.param]
        raise
