"""The default output cap: a request that sends no budget gets ``--default-max-tokens``.

On every surface alike (Chat Completions without ``max_tokens``, Responses without
``max_output_tokens``: Codex CLI never sends one), capped by what the context leaves, and
recorded with the completion as ``sampling["max_tokens_default"]``; a budget the request asked
for is kept and recorded without that mark. (Completions has OpenAI's own default, 16, in its
schema; Messages requires ``max_tokens``.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from proxima.proxy.config import Settings
from proxima.proxy.service.canonical import CanonicalRequest, ChatInput
from proxima.proxy.service.prepare import Prepared, PromptPreparer
from proxima.proxy.surfaces.chat.schema import ChatCompletionRequest
from proxima.proxy.surfaces.chat.translate import chat_request
from proxima.proxy.surfaces.completions.schema import CompletionRequest
from proxima.proxy.surfaces.completions.translate import completion_request
from proxima.proxy.surfaces.responses import translate as responses_translate
from proxima.proxy.surfaces.responses.schema import ResponsesRequest
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer
from proxima.proxy.tools import get_tool_parser

CONTEXT = 512
USER = [{"role": "user", "content": "2+2?"}]


def preparer(default_max_tokens: int) -> PromptPreparer:
    defaults = {n: f.default for n, f in Settings.model_fields.items() if n != "model"}
    settings = Settings.model_construct(
        **{**defaults, "default_max_tokens": default_max_tokens}, model=Path("tiny")
    )
    return PromptPreparer(
        settings=settings,
        tokenizer=build_tiny_tokenizer(),
        context_length=CONTEXT,
        tool_parser=get_tool_parser("hermes"),
    )


def prepare(p: PromptPreparer, request: CanonicalRequest) -> Prepared:
    async def run() -> Prepared:
        if isinstance(request.input, ChatInput):
            return await p.chat(request, request.input, None, [])
        ids = await p.text_prompt(request.input.prompt)
        return p.text(request, ids, None, [])

    try:
        return asyncio.run(run())
    finally:
        p.close()


def requests(budget: int | None) -> dict[str, CanonicalRequest]:
    """The same ask on the OpenAI surfaces that may leave the budget out, with ``budget`` or
    none."""
    chat: dict[str, Any] = {"model": "tiny", "messages": USER}
    responses: dict[str, Any] = {"model": "tiny", "input": "2+2?"}
    if budget is not None:
        chat["max_tokens"] = responses["max_output_tokens"] = budget
    return {
        "chat": chat_request(ChatCompletionRequest.model_validate(chat)),
        "responses": responses_translate.canonical_request(
            ResponsesRequest.model_validate(responses)
        ),
    }


def test_every_surface_without_a_budget_gets_the_default_cap_recorded_as_such() -> None:
    for surface, request in requests(None).items():
        prepared = prepare(preparer(default_max_tokens=64), request)
        assert prepared.params.max_new_tokens == 64, surface
        assert prepared.sampling["max_tokens"] == 64, surface
        assert prepared.sampling["max_tokens_default"] is True, surface


def test_the_default_cap_is_capped_by_what_the_context_leaves() -> None:
    for surface, request in requests(None).items():
        prepared = prepare(preparer(default_max_tokens=10_000), request)
        left = CONTEXT - len(prepared.prompt_ids)
        assert prepared.params.max_new_tokens == left == prepared.sampling["max_tokens"], surface
        assert prepared.sampling["max_tokens_default"] is True, surface


def test_completions_keeps_openais_own_default() -> None:
    request = completion_request(CompletionRequest.model_validate({"model": "t", "prompt": "2+"}))
    prepared = prepare(preparer(default_max_tokens=64), request)
    assert prepared.params.max_new_tokens == 16
    assert "max_tokens_default" not in prepared.sampling


def test_a_budget_the_request_asks_for_is_kept_without_the_default_mark() -> None:
    for surface, request in requests(200).items():
        prepared = prepare(preparer(default_max_tokens=64), request)
        assert prepared.params.max_new_tokens == 200, surface
        assert prepared.sampling["max_tokens"] == 200, surface
        assert "max_tokens_default" not in prepared.sampling, surface
