"""A Completions body -> the canonical request (a text prompt)."""

from __future__ import annotations

from proxima.proxy.errors import BadRequest
from proxima.proxy.service.canonical import CanonicalRequest, TextInput
from proxima.proxy.surfaces.completions.schema import CompletionRequest
from proxima.proxy.surfaces.openai_common import refuse_unsupported, sampling_of


def completion_request(req: CompletionRequest) -> CanonicalRequest:
    refuse_unsupported(req)
    if req.echo:
        raise BadRequest("echo is not supported.", param="echo")
    if req.suffix:
        raise BadRequest("suffix is not supported.", param="suffix")
    return CanonicalRequest(
        input=TextInput(req.prompt),
        sampling=sampling_of(req, req.max_tokens),
        id_prefix="cmpl-",
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        user=req.user,
        model=req.model,
    )
