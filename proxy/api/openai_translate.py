"""OpenAI request bodies (``api.schemas``) to canonical requests.

The OpenAI-specific checks live here (``echo``,
``suffix``, ``top_logprobs`` without ``logprobs``); what is common to every
API (context window, ``n``, sessions) is checked by the service.
"""

from __future__ import annotations

from typing import Any

from proxima.proxy.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from proxima.proxy.chat import normalize_messages
from proxima.proxy.errors import BadRequest
from proxima.proxy.service.canonical import CanonicalRequest, ChatInput, Sampling, TextInput
from proxima.proxy.tools import resolve_tool_choice
from proxima.proxy.unicode import InvalidString
from pydantic import ValidationError


def chat_request(req: ChatCompletionRequest) -> CanonicalRequest:
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
    messages = normalize_messages(req.messages)
    tools = req.tool_dicts  # as sent: the template keeps their key order
    tool_choice = (
        req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
    )
    return CanonicalRequest(
        input=ChatInput(
            messages,
            tools,
            resolve_tool_choice(tool_choice, tools),
            response_format=req.response_format.model_dump() if req.response_format else None,
            parallel_tool_calls=req.parallel_tool_calls,
        ),
        sampling=_sampling(req, req.max_completion_tokens or req.max_tokens),
        id_prefix="chatcmpl-",
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        user=req.user,
        model=req.model,
    )


def completion_request(req: CompletionRequest) -> CanonicalRequest:
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
