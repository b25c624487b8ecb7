"""SGLang's native HTTP API, declared by the project (sglang is not imported).

These pydantic models are the wire format of the backend protocol: the proxy's
client sends them to a real SGLang server or to the embedded engine, which
speak the same API. Field names are SGLang's own.

Streaming ``/generate`` answers Server-Sent Events ``data: {GenerateResponse}``
ending with ``data: [DONE]``. SGLang's default stream chunks are cumulative
(full ``output_ids`` and ``output_token_logprobs`` so far); with
``--incremental-streaming-output`` they carry only the new tokens. The client
accepts both (see ``SGLangClient.generate_stream``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: str | None = None
    stream: bool = False


class FinishReason(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"] | str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    # [[logprob, token_id, token_text | None], ...]
    output_token_logprobs: list[list[Any]] | None = None
    # per output token: [[logprob, token_id, text], ...] for the top-k alternatives
    output_top_logprobs: list[list[list[Any]] | None] | None = None


class GenerateResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str | None = None
    output_ids: list[int] = Field(default_factory=list)
    meta_info: MetaInfo


class AbortRequestBody(BaseModel):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationBody(BaseModel):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class UpdateWeightsFromDiskBody(BaseModel):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    success: bool
    message: str = ""
    num_paused_requests: int = 0
