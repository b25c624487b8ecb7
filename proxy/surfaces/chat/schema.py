"""The Chat Completions request body (``POST /v1/chat/completions``).

Strict types and limits as OpenAI's (see ``proxima.proxy.api.schemas``);
unknown fields are allowed and judged in ``openai_common.refuse_unsupported``.
"""

from __future__ import annotations

from typing import Any, Literal

from proxima.proxy.api.schemas import (
    OPENAI_TOOL_NAME,
    OpenBody,
    check_tool_names,
)
from proxima.proxy.surfaces.openai_common import OpenAIGenerationBody
from pydantic import (
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)


class FunctionDef(OpenBody):
    name: str  # checked by ChatCompletionRequest (check_tool_names)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(OpenBody):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(OpenBody):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ResponseFormat(OpenBody):
    type: Literal["text", "json_object", "json_schema"] = "text"


class ChatCompletionRequest(OpenAIGenerationBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # SGLang's and vLLM's extension
    reasoning_budget: int | None = Field(None, ge=1)  # Proxima's: Messages' budget_tokens
    _tool_dicts: list[dict[str, Any]] | None = PrivateAttr(None)

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        # OpenAI's rule (``^[a-zA-Z0-9_-]{1,64}$``), each name once: ``InvalidString``.
        named = ((f"tools[{i}].function.name", t.function.name) for i, t in enumerate(v or []))
        check_tool_names(named, OPENAI_TOOL_NAME)
        return v

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw_tools(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        request = handler(data)
        if isinstance(data, dict) and request.tools:
            request._tool_dicts = data["tools"]
        return request

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """``tools`` exactly as the client sent them (key order, nulls), for the template.

        Templates write tools with ``tojson``, which keeps key order, so the
        prompt is rendered from these, not from a re-serialized model.
        """
        return self._tool_dicts
