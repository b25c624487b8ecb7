"""Request and response schemas of SGLang's native HTTP API, as served by the engine.

SGLang is not a dependency, so the subset of its protocol that Proxima uses is
declared here. Field names and defaults follow SGLang (``sampling_params``,
``return_logprob``, ``rid``, ``meta_info.finish_reason`` ...). Unknown fields are
ignored, as SGLang accepts many options this engine does not implement.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (argmax), as in SGLang."""


class SamplingParams(BaseModel):
    """Per-request sampling options (SGLang's ``sampling_params``)."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int = Field(128, ge=0, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Keep the k most likely tokens; -1 (or 0) keeps all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    stop: str | list[str] | None = Field(None, description="Stop strings (excluded from text).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    ignore_eos: bool = Field(False, description="Do not stop at the model's eos tokens.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from `text`.")
    seed: int | None = Field(None, description="Seed of this request's sampling generator.")

    @model_validator(mode="after")
    def _check_top_k(self) -> SamplingParams:
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        return self

    @property
    def is_greedy(self) -> bool:
        """Whether this request takes the argmax instead of sampling."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (empty strings dropped)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


class GenerateRequest(BaseModel):
    """Body of ``POST /generate`` (single request; SGLang's batched form is not served)."""

    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, description="Top alternatives per output token.")
    rid: str | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self


class AbortRequest(BaseModel):
    """Body of ``POST /abort_request``."""

    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


class PauseGenerationRequest(BaseModel):
    """Body of ``POST /pause_generation``."""

    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "in_place"] = "abort"


class UpdateWeightsFromDiskRequest(BaseModel):
    """Body of ``POST /update_weights_from_disk``."""

    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False


class UpdateWeightsResponse(BaseModel):
    """Reply of ``POST /update_weights_from_disk`` (HTTP 400 when ``success`` is false)."""

    success: bool
    message: str
    num_paused_requests: int = 0


class ModelInfo(BaseModel):
    """Reply of ``GET /get_model_info``."""

    model_path: str
    tokenizer_path: str
    is_generation: bool = True
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str
    max_context_length: int


class StatusResponse(BaseModel):
    """Reply of ``/pause_generation`` and ``/continue_generation``."""

    message: str
    status: str = "ok"
