"""OpenAI request bodies (``api.schemas``) to canonical requests.

The OpenAI-specific checks live here (``response_format``, ``echo``,
``suffix``, ``top_logprobs`` without ``logprobs``); what is common to every
API (context window, ``n``, sessions) is checked by the service.
"""

from __future__ import annotations

from proxima.proxy.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from proxima.proxy.chat import normalize_messages
from proxima.proxy.errors import BadRequest
from proxima.proxy.service.canonical import CanonicalRequest, ChatInput, Sampling, TextInput
from proxima.proxy.tools import resolve_tool_choice


def chat_request(req: ChatCompletionRequest) -> CanonicalRequest:
    if req.response_format is not None and req.response_format.type != "text":
        raise BadRequest(
            f"response_format '{req.response_format.type}' is not supported by this "
            "backend; ask for JSON in the prompt instead.",
            param="response_format",
        )
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
    messages = normalize_messages(req.messages)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    tool_choice = (
        req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
    )
    return CanonicalRequest(
        input=ChatInput(messages, tools, resolve_tool_choice(tool_choice, tools)),
        sampling=_sampling(req, req.max_completion_tokens or req.max_tokens),
        id_prefix="chatcmpl-",
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        user=req.user,
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
    )
