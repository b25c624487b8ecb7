"""Tools and a chat template that does not render them: a 400, or the declared fallback format.

SmolLM2's template ignores ``tools``; here a tiny tokenizer gets a template
that likewise renders messages only. Without ``--tool-fallback`` a request
with tools is a 400 naming ``tools``; with ``--tool-fallback hermes`` the tools
are in the prompt's system message, in hermes' layout, and the completion's
sampling record says so. A template that renders tools is left alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from proxima.proxy.config import Settings
from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering.chat_template import ChatRenderer
from proxima.proxy.service.canonical import ChatInput
from proxima.proxy.service.prepare import PromptPreparer
from proxima.proxy.surfaces.chat.schema import ChatCompletionRequest
from proxima.proxy.surfaces.chat.translate import chat_request
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer
from proxima.proxy.tools import get_tool_parser
from proxima.proxy.tools.fallback import template_renders_tools, with_tools_in_system

# Messages only, as SmolLM2's template (which also ignores `tools`).
NO_TOOLS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
BODY = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ],
    "tools": [TOOL],
}


def tokenizer(template: str | None = None) -> Any:
    tok = build_tiny_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


def preparer(tok: Any, fallback: str | None) -> PromptPreparer:
    settings = Settings.model_construct(
        **{
            n: f.default
            for n, f in Settings.model_fields.items()
            if n not in ("model", "tool_fallback")
        },
        model=Path("tiny"),
        tool_fallback=fallback,
    )
    return PromptPreparer(
        settings=settings, tokenizer=tok, context_length=4096, tool_parser=get_tool_parser("hermes")
    )


def render(tok: Any) -> Any:
    renderer = ChatRenderer(tok)
    return lambda m, t: renderer.render_text(m, t, add_generation_prompt=True)


def test_the_probe_tells_which_templates_render_tools() -> None:
    assert template_renders_tools(render(tokenizer()))
    assert not template_renders_tools(render(tokenizer(NO_TOOLS_TEMPLATE)))


def test_hermes_fallback_goes_after_the_system_prompt_or_leads() -> None:
    with_system = with_tools_in_system(BODY["messages"], [TOOL], "hermes")
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(TOOL) in with_system[0]["content"]
    assert with_system[1:] == BODY["messages"][1:]
    alone = with_tools_in_system(BODY["messages"][1:], [TOOL], "hermes")
    assert alone[0]["role"] == "system" and alone[0]["content"].startswith("# Tools\n")
    assert alone[1:] == BODY["messages"][1:]


async def test_tools_the_template_drops_are_a_400_without_a_fallback() -> None:
    p = preparer(tokenizer(NO_TOOLS_TEMPLATE), None)
    request = chat_request(ChatCompletionRequest.model_validate(BODY))
    assert isinstance(request.input, ChatInput)
    with pytest.raises(BadRequest) as info:
        await p.chat(request, request.input, None, [])
    assert info.value.param == "tools"
    assert "--tool-fallback" in info.value.message
    # Without tools the same model serves the request.
    plain = chat_request(ChatCompletionRequest.model_validate({**BODY, "tools": None}))
    assert isinstance(plain.input, ChatInput)
    assert (await p.chat(plain, plain.input, None, [])).prompt_ids
    p.close()


async def test_the_hermes_fallback_puts_the_tools_in_the_prompt_and_records_it() -> None:
    tok = tokenizer(NO_TOOLS_TEMPLATE)
    p = preparer(tok, "hermes")
    request = chat_request(ChatCompletionRequest.model_validate(BODY))
    assert isinstance(request.input, ChatInput)
    prepared = await p.chat(request, request.input, None, [])
    text = tok.decode(prepared.prompt_ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOL) in text and "<tool_call>" in text
    assert prepared.sampling["tool_format"] == "hermes (--tool-fallback)"
    # What the client sent is what is recorded as the request; the tokens are what rendered.
    assert prepared.messages == request.input.messages and prepared.tools == [TOOL]
    p.close()


async def test_a_template_that_renders_tools_ignores_the_fallback() -> None:
    tok = tokenizer()
    p = preparer(tok, "hermes")
    request = chat_request(ChatCompletionRequest.model_validate(BODY))
    assert isinstance(request.input, ChatInput)
    prepared = await p.chat(request, request.input, None, [])
    assert "tool_format" not in prepared.sampling
    expected = ChatRenderer(tok).render_text(
        request.input.messages, [TOOL], add_generation_prompt=True
    )
    assert tok.decode(prepared.prompt_ids) == expected
    p.close()
