"""The Completions request body (``POST /v1/completions``): a raw prompt."""

from __future__ import annotations

from proxima.proxy.surfaces.openai_common import OpenAIGenerationBody
from pydantic import Field


class CompletionRequest(OpenAIGenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
