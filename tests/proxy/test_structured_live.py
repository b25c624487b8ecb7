"""Structured outputs, forced tool calls and the other sampling parameters, through a live proxy.

The real OpenAI SDK against ``proxima serve`` on the tiny model: whatever the
(barely trained) model prefers, the grammar makes the reply parse and
validate, and the stored completion says it was constrained.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import anthropic
import jsonschema
import openai
import pytest
from openai import OpenAI
from proxima.proxy.testing.live import LiveProxy
from pydantic import BaseModel
from transformers import AutoTokenizer

from tests.proxy.scripts import QUESTION, TOOLS, WEATHER_TOOL

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}, "seconds": {"type": "boolean"}},
            "required": ["zone", "seconds"],
            "additionalProperties": False,
        },
    },
}


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool
    degrees: int


def _client(proxy: LiveProxy) -> tuple[OpenAI, str]:
    session = proxy.new_session()
    return OpenAI(base_url=proxy.base_url, api_key=session["api_key"]), session["session_id"]


def _stored(proxy: LiveProxy, session_id: str) -> list[dict[str, Any]]:
    completions: list[dict[str, Any]] = proxy.trajectory(session_id)["completions"]
    return completions


def test_parse_helper_with_a_pydantic_model(live_proxy: LiveProxy) -> None:
    client, session_id = _client(live_proxy)
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=live_proxy.model_name,
            messages=[{"role": "user", "content": "Forecast for Paris as JSON."}],
            response_format=Forecast,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Forecast)
        assert Forecast.model_validate_json(choice.message.content or "") == choice.message.parsed
    stored = _stored(live_proxy, session_id)
    assert len(stored) == 3
    for c in stored:
        assert c["sampling"]["logit_transforms"] == ["grammar:json_schema"]
        assert len(c["output_logprobs"]) == len(c["output_ids"]) == len(c["output_versions"])


def test_json_object_streamed(live_proxy: LiveProxy) -> None:
    client, _ = _client(live_proxy)
    stream = client.chat.completions.create(
        model=live_proxy.model_name,
        messages=[{"role": "user", "content": "Any JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=400,
        seed=3,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert isinstance(json.loads(text), dict)


def test_truncated_structured_output_reports_length(live_proxy: LiveProxy) -> None:
    client, _ = _client(live_proxy)
    completion = client.chat.completions.create(
        model=live_proxy.model_name,
        messages=[{"role": "user", "content": "Forecast."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "forecast", "schema": Forecast.model_json_schema()},
        },
        max_tokens=4,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length"  # cut mid-object: the content is a JSON prefix
    assert (choice.message.content or "").startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content or "")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_produces_valid_calls(live_proxy: LiveProxy, stream: bool) -> None:
    client, session_id = _client(live_proxy)
    schemas = {
        t["function"]["name"]: t["function"]["parameters"] for t in [WEATHER_TOOL, TIME_TOOL]
    }
    kwargs: dict[str, Any] = {
        "model": live_proxy.model_name,
        "messages": [{"role": "user", "content": "Hello there."}],  # no reason to call a tool
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": "required",
        "max_tokens": 300,
        "seed": 5,
    }
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        found = list(calls.values())
    else:
        completion = client.chat.completions.create(**kwargs)
        finish = completion.choices[0].finish_reason
        found = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in completion.choices[0].message.tool_calls or []
        ]
    assert finish == "tool_calls"
    assert found
    for call in found:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    [stored] = _stored(live_proxy, session_id)
    assert stored["sampling"]["logit_transforms"] == ["grammar:structural_tag"]


def test_named_tool_choice_calls_that_function_once(live_proxy: LiveProxy) -> None:
    client, _ = _client(live_proxy)
    completion = client.chat.completions.create(
        model=live_proxy.model_name,
        messages=[{"role": "user", "content": QUESTION}],  # the taught model would call get_weather
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=300,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])


def test_tool_call_and_structured_answer_turns_stay_token_exact(live_proxy: LiveProxy) -> None:
    # A forced call, its result, then a plain turn: the recorded prompts extend each other.
    client, session_id = _client(live_proxy)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=live_proxy.model_name,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    message = first.choices[0].message
    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": (message.tool_calls or [])[0].id, "content": "sunny"},
    ]
    client.chat.completions.create(
        model=live_proxy.model_name, messages=messages, tools=TOOLS, max_tokens=30, temperature=0
    )
    c1, c2 = _stored(live_proxy, session_id)
    assert c2["prompt_ids"][: len(c1["prompt_ids"]) + len(c1["output_ids"])] == (
        c1["prompt_ids"] + c1["output_ids"]
    )
    assert c2["parent_id"] == c1["id"]
    assert "logit_transforms" not in c2["sampling"]


def test_logit_bias_and_penalties_are_honoured(live_proxy: LiveProxy) -> None:
    client, session_id = _client(live_proxy)
    tokenizer = AutoTokenizer.from_pretrained(live_proxy.model_dir)
    [q] = tokenizer.encode("Q")
    kwargs: dict[str, Any] = {
        "model": live_proxy.model_name,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
    }
    biased = client.chat.completions.create(logit_bias={str(q): 100}, **kwargs)
    assert biased.choices[0].message.content == "Q" * 8
    plain = client.chat.completions.create(**kwargs)
    penalised = client.chat.completions.create(
        presence_penalty=2.0, frequency_penalty=2.0, **kwargs
    )
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    stored = {
        c["id"]: c["sampling"].get("logit_transforms") for c in _stored(live_proxy, session_id)
    }
    assert stored[biased.id] == ["logit_bias"]
    assert stored[plain.id] is None
    assert stored[penalised.id] == ["frequency_penalty", "presence_penalty"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_structured_parameters_are_400(
    live_proxy: LiveProxy, body: dict[str, Any], param: str
) -> None:
    client, _ = _client(live_proxy)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=live_proxy.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body=body,
        )
    assert info.value.body["param"].startswith(param)  # type: ignore[index]


def test_min_p_is_honoured(live_proxy: LiveProxy) -> None:
    # min_p = 1 keeps only the most likely token: sampling at T = 1 is then greedy.
    client, session_id = _client(live_proxy)
    kwargs: dict[str, Any] = {
        "model": live_proxy.model_name,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 12,
    }
    greedy = client.chat.completions.create(temperature=0, **kwargs)
    for seed in range(2):
        truncated = client.chat.completions.create(
            temperature=1.0, seed=seed, extra_body={"min_p": 1.0}, **kwargs
        )
        assert truncated.choices[0].message.content == greedy.choices[0].message.content
    stored = _stored(live_proxy, session_id)
    assert stored[-1]["sampling"]["min_p"] == 1.0
    assert "logit_transforms" not in stored[-1]["sampling"]  # truncation keeps logprobs trainable


def test_fields_that_change_nothing_generated_are_accepted(live_proxy: LiveProxy) -> None:
    client, _ = _client(live_proxy)
    completion = client.chat.completions.create(
        model=live_proxy.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        store=False,
        metadata={"run": "x"},
        service_tier="auto",
        extra_body={"modalities": ["text"]},
    )
    assert completion.choices[0].message.content is not None


def test_models_retrieve(live_proxy: LiveProxy) -> None:
    client, _ = _client(live_proxy)
    model = client.models.retrieve(live_proxy.model_name)
    assert model.id == live_proxy.model_name and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-17")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_context_length_above_the_models_is_refused_at_start_up(
    taught_model_dir: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxima.cli",
            "serve",
            "--model",
            str(taught_model_dir),
            "--db",
            f"sqlite:///{tmp_path / 'store.db'}",
            "--port",
            "0",
            "--context-length",
            "4096",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--context-length 4096 exceeds the backend's context length 2048" in proc.stderr


# ------------------------------------------------- the Responses and Messages APIs


def test_responses_parse_with_text_format(live_proxy: LiveProxy) -> None:
    session = live_proxy.new_session()
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    response = client.responses.parse(
        model=live_proxy.model_name,
        input="Forecast for Rome.",
        text_format=Forecast,
        max_output_tokens=300,
        temperature=1.0,
    )
    assert isinstance(response.output_parsed, Forecast)
    [stored] = _stored(live_proxy, session["session_id"])
    assert stored["sampling"]["logit_transforms"] == ["grammar:json_schema"]


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [
        ({"type": "any"}, {"get_weather", "get_time"}),
        ({"type": "tool", "name": "get_time"}, {"get_time"}),
    ],
)
def test_anthropic_forced_tool_use(
    live_proxy: LiveProxy, tool_choice: dict[str, Any], names: set[str]
) -> None:
    session = live_proxy.new_session()
    client = anthropic.Anthropic(
        base_url=session["base_url"].removesuffix("/v1"), api_key=session["api_key"]
    )
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in (WEATHER_TOOL, TIME_TOOL)
    ]
    message = client.messages.create(
        model=live_proxy.model_name,
        max_tokens=300,
        messages=[{"role": "user", "content": "Hello there."}],
        tools=tools,
        tool_choice=tool_choice,
    )
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and {u.name for u in uses} <= names
    schemas = {t["name"]: t["input_schema"] for t in tools}
    for use in uses:
        jsonschema.validate(use.input, schemas[use.name])
