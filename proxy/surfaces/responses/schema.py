"""The Responses request body (``POST /v1/responses``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Options that only concern OpenAI's hosted service (storage, caching, billing, built-in
# tools); accepted and without effect on what is generated. Any other unknown field is a 400.
ACCEPTED_WITHOUT_EFFECT = frozenset(
    {
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
        "stream_options",
        "max_tool_calls",
        "access_programs",
        "image",
        "background_options",
        # Codex CLI: its session, thread and turn ids (tracing only).
        "client_metadata",
    }
)


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (types checked; the rest in ``translate.canonical_request``)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    stream: bool = False
    user: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])
