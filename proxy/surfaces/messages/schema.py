"""The Anthropic Messages request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Options that only concern Anthropic's hosted service (caching, routing, billing, tracing);
# accepted and without effect on what is generated. Any other unknown field is a 400.
ACCEPTED_WITHOUT_EFFECT = frozenset(
    {
        "cache_control",
        "service_tier",
        "inference_geo",
        "speed",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
    }
)


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages`` (types checked; the rest in ``translate.canonical_request``)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)  # past the vocabulary: keeps every token
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """The body of ``POST /v1/messages/count_tokens``: a message request without ``max_tokens``."""

    max_tokens: int = Field(1, ge=1)
