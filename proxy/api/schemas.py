"""Request and response schemas of the HTTP API (not ORM models).

OpenAI clients send fields we do not act on (``store``, ``metadata``,
``parallel_tool_calls``...): requests allow extra fields, and the fields that
change what is generated are validated with limits that give clear 400s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: dict[str, str]


class StreamOptions(_Open):
    include_usage: bool = False


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"] = "text"


class SamplingFields(_Open):
    model: str = Field(min_length=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # extension (as in vLLM/SGLang): keep generating past the end token

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return v

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class CreateSessionRequest(_Open):
    group_id: str | None = Field(None, max_length=256)
    data_id: str | None = Field(None, max_length=256)
    metadata: dict[str, Any] | None = None


class CreateSessionResponse(BaseModel):
    session_id: str
    api_key: str
    base_url: str


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False)
    completion_id: str | None = None


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: Literal["finished", "failed"] = "finished"


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Per-token versions are stored as int32.
    version: int = Field(ge=0, le=2**31 - 1)
    path: str = Field(min_length=1)
