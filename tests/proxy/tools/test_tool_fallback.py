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
from proxima.proxy.rendering.chat_messages import normalize_messages
from proxima.proxy.rendering.chat_template import ChatRenderer
from proxima.proxy.service.canonical import ChatInput
from proxima.proxy.service.prepare import PromptPreparer
from proxima.proxy.store.records import CompletionRecord
from proxima.proxy.surfaces.chat.schema import ChatCompletionRequest
from proxima.proxy.surfaces.chat.translate import chat_request
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer
from proxima.proxy.tools import get_tool_parser
from proxima.proxy.tools.fallback import (
    fallback_messages,
    hermes_tools_text,
    template_renders_tools,
    with_tools_in_system,
)

from tests.proxy.recorded_turns import recorded_turn

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


# ------------------------------------------------------------ the template extension

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}


def test_calls_and_results_are_written_in_the_declared_layout() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "user", "content": "Thanks"},
    ]
    out = fallback_messages(messages, [TOOL], "hermes")
    assert out[0]["role"] == "system" and out[0]["content"] == hermes_tools_text([TOOL])
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[2] == {"role": "assistant", "content": f"Checking.\n{block}\n{block}"}
    # Both results, in order, in one user turn; the section says so.
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>",
    }
    assert "<tool_response></tool_response>" in out[0]["content"]
    assert out[4] == messages[4] and len(out) == 5
    # What the hermes parser reads back from the written turn is the turn.
    parsed = get_tool_parser("hermes").parse(out[2]["content"])
    assert (
        parsed.content == "Checking." and [c.name for c in parsed.tool_calls] == ["get_weather"] * 2
    )
    # A recorded reply is written as generated, whatever the canonical layout.
    raw = (
        'Checking.\n<tool_call>\n{"arguments":{"city":"Paris"},"name":"get_weather"}\n</tool_call>'
    )
    assert fallback_messages(messages, [TOOL], "hermes", {1: raw})[2]["content"] == raw
    # Calls and results are written even when the request no longer declares tools.
    assert fallback_messages(messages, None, "hermes") == out[1:]


def _record(
    renderer: ChatRenderer, plan: Any, messages: list[Any], reply_text: str, n: int
) -> CompletionRecord:
    """What the proxy records when the model generates ``reply_text`` and stops."""
    return recorded_turn(
        renderer,
        messages,
        plan,
        reply_text,
        tools=[TOOL],
        cid=f"cmpl-{n}",
        response_text=reply_text,
    )


def _as_client_sends(record: CompletionRecord) -> dict[str, Any]:
    """The reply as a framework sends it back: arguments re-serialized its own way."""
    reply = dict(record.response_message or {})
    reply["tool_calls"] = [
        {
            **c,
            "function": {
                **c["function"],
                "arguments": json.dumps(json.loads(c["function"]["arguments"]), indent=1),
            },
        }
        for c in reply.get("tool_calls", [])
    ]
    return reply


@pytest.mark.parametrize("kept", [True, False], ids=["parent-text-kept", "rendered-again"])
def test_a_tool_loop_through_the_fallback_is_one_token_exact_chain(kept: bool) -> None:
    tok = tokenizer(NO_TOOLS_TEMPLATE)
    renderer = ChatRenderer(tok, tool_fallback="hermes")
    # Spaced and ordered unlike json.dumps: only the recorded text renders it back.
    calls = [
        'I will look.\n<tool_call>\n{"name":"get_weather", "arguments": {"city":"Paris"}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Rome"},  "name": "get_weather"}\n</tool_call>',
    ]
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris, then Rome?"}]
    history: list[CompletionRecord] = []
    for turn, reply in enumerate([*calls, "Sunny in Paris, rain in Rome."]):
        canonical = normalize_messages(messages)
        plan = renderer.build_prompt(canonical, [TOOL], history)
        if history:
            parent = history[-1]
            assert plan.parent_id == parent.id
            assert plan.prompt_ids[: len(parent.prompt_ids) + len(parent.output_ids)] == [
                *parent.prompt_ids,
                *parent.output_ids,
            ]
            # The new tokens are the results' user turn and the generation prompt only.
            appended = tok.decode(plan.appended_ids)
            assert appended.startswith("\n<|im_start|>user\n<tool_response>\n")
            assert appended.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        else:
            assert plan.parent_id is None
        # The whole conversation rendered fresh is the same text: one rendering, no drift.
        assert tok.decode(plan.prompt_ids) == plan.text
        if kept:
            renderer.rendered.add([f"cmpl-{turn}"], plan.text)
        record = _record(renderer, plan, canonical, reply, turn)
        history.append(record)
        messages += [
            _as_client_sends(record),
            {"role": "tool", "tool_call_id": "call_x", "content": ["sunny", "rain"][min(turn, 1)]},
        ]
    assert [r.parent_id for r in history] == [None, "cmpl-0", "cmpl-1"]


def test_without_the_recorded_text_a_respaced_call_starts_a_new_branch() -> None:
    """Why the generated text is kept: the canonical layout of the same call differs."""
    tok = tokenizer(NO_TOOLS_TEMPLATE)
    renderer = ChatRenderer(tok, tool_fallback="hermes")
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    plan = renderer.build_prompt(normalize_messages(messages), [TOOL], [])
    reply = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    record = _record(renderer, plan, normalize_messages(messages), reply, 0)
    messages += [
        _as_client_sends(record),
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    canonical = normalize_messages(messages)
    assert renderer.build_prompt(canonical, [TOOL], [record]).parent_id == record.id
    renderer.generated_replies = lambda parent, history: None  # type: ignore[method-assign]
    assert renderer.build_prompt(canonical, [TOOL], [record]).parent_id is None
