"""What the OpenAI surfaces (Chat Completions, Completions, Responses) share.

The fields every OpenAI generation body has, with OpenAI's types and limits
(``OpenAIGenerationBody``, the base of the Chat Completions and Completions
request schemas), the parameters OpenAI's APIs have and Proxima refuses
(:data:`UNSUPPORTED`), their sampling fields as the one ``Sampling``
(``sampling_of``), OpenAI's logprobs object, and the header that names a
recorded request's session.
"""

from __future__ import annotations

from typing import Any

from proxima.proxy.api.schemas import (
    INT64_MAX,
    INT64_MIN,
    MAX_ID_LENGTH,
    MAX_TOP_K,
    OpenBody,
    StrictBody,
    check_identifier,
    check_stop_sequences,
)
from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.service.events import TokenLogprob
from proxima.proxy.store.records import SessionRecord
from pydantic import Field, field_validator

MAX_TOKEN_ID = 2**31 - 1
"""The largest token id a ``logit_bias`` key may name (token ids are 32-bit integers)."""


class StreamOptions(OpenBody):
    include_usage: bool = False


class OpenAIGenerationBody(OpenBody, StrictBody):
    """Chat Completions' and Completions' common fields: the model, ``n``, streaming,
    sampling and ``user`` (a request schema: ``sampling_of`` makes its ``Sampling``)."""

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension (vLLM/SGLang)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    user: str | None = Field(None, max_length=MAX_ID_LENGTH)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # extension (as in vLLM/SGLang): keep generating past the end token

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return check_identifier(v, "user")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            check_stop_sequences(v)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            # ASCII digits only: str.isdigit takes "²" and "①", which int() refuses.
            if not (
                key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= MAX_TOKEN_ID
            ):
                raise ValueError(
                    f"logit_bias keys must be token ids (0 to {MAX_TOKEN_ID} in ASCII digits), "
                    f"got {key!r}"
                )
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return v

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


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


def refuse_unsupported(req: OpenAIGenerationBody) -> None:
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


def sampling_of(req: OpenAIGenerationBody, max_tokens: int | None) -> Sampling:
    """What ``req`` asks of sampling; ``max_tokens`` is the surface's own budget field."""
    return Sampling.asked(
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


def logprob_content(logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: each token with its bytes and top alternatives."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": list(lp.token.encode("utf-8")),
            "top_logprobs": [
                {"token": t, "logprob": tl, "bytes": list(t.encode("utf-8"))} for t, tl in lp.top
            ],
        }
        for lp in logprobs or []
    ]


def session_header(session: SessionRecord | None) -> dict[str, str]:
    """Recorded requests name their session, so production traffic can be rewarded later."""
    return {"X-Proxima-Session-Id": session.id} if session is not None else {}
