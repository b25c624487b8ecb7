"""proxy/rendering/structured.py: canonical request fields -> the one backend grammar, and its 400s."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from proxima.proxy.embedded.schema_rules import unenforceable_schema_reason
from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering import structured
from proxima.proxy.rendering.structured import (
    enforceable_schema,
    output_grammar,
    response_format_schema,
)
from proxima.proxy.tools import ToolChoice, get_tool_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, NOARGS]


def grammar(**kwargs: Any) -> tuple[str, Any] | None:
    args: dict[str, Any] = {
        "response_format": None,
        "tool_choice": ToolChoice("none"),
        "tools": None,
        "tool_parser": "hermes",
    }
    args.update(kwargs)
    g = output_grammar(**args)
    return None if g is None else (g.kind, json.loads(g.value))


def test_unconstrained_requests_get_no_grammar() -> None:
    assert grammar() is None
    assert grammar(response_format={"type": "text"}) is None
    assert grammar(tool_choice=ToolChoice("auto"), tools=TOOLS) is None


def test_response_formats() -> None:
    assert grammar(response_format={"type": "json_object"}) == ("json_schema", {"type": "object"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert grammar(response_format=spec) == ("json_schema", schema)
    # json_schema without a schema: any object, as OpenAI treats it.
    assert response_format_schema({"type": "json_schema", "json_schema": {"name": "x"}}) == {
        "type": "object"
    }


def test_required_is_one_or_more_calls_in_the_parsers_format() -> None:
    kind, tag = grammar(tool_choice=ToolChoice("required"), tools=TOOLS) or ("", None)
    assert kind == "structural_tag"
    fmt = tag["format"]
    assert fmt["type"] == "tags_with_separator"
    assert fmt["at_least_one"] is True and fmt["stop_after_first"] is False
    begins = [t["begin"] for t in fmt["tags"]]
    assert begins == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "ping", "arguments": ',
    ]
    assert {t["end"] for t in fmt["tags"]} == {"}\n</tool_call>"}
    # A function without parameters takes an empty object.
    assert fmt["tags"][1]["content"]["json_schema"] == {"type": "object", "properties": {}}
    # What the grammar writes is what the hermes parser reads back as a call.
    text = fmt["tags"][0]["begin"] + '{"city": "Paris"}' + fmt["tags"][0]["end"]
    [call] = get_tool_parser("hermes").parse(text).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


def test_named_function_and_parallel_tool_calls() -> None:
    _, tag = grammar(tool_choice=ToolChoice("function", "ping"), tools=TOOLS) or ("", None)
    assert [t["begin"] for t in tag["format"]["tags"]] == [
        '<tool_call>\n{"name": "ping", "arguments": '
    ]
    assert tag["format"]["stop_after_first"] is True
    _, tag = grammar(
        tool_choice=ToolChoice("required"), tools=TOOLS, parallel_tool_calls=False
    ) or (
        "",
        None,
    )
    assert tag["format"]["stop_after_first"] is True


def test_llama3_json_format() -> None:
    _, tag = grammar(
        tool_choice=ToolChoice("required"), tools=TOOLS, tool_parser="llama3_json"
    ) or (
        "",
        None,
    )
    first = tag["format"]["tags"][0]
    assert first["begin"] == '{"name": "get_weather", "parameters": '
    text = first["begin"] + '{"city": "Rome"}' + first["end"]
    [call] = get_tool_parser("llama3_json").parse(text).tool_calls
    assert call.name == "get_weather"


def test_auto_with_a_response_format_allows_calls_or_the_answer() -> None:
    kind, tag = grammar(
        response_format={"type": "json_object"}, tool_choice=ToolChoice("auto"), tools=TOOLS
    ) or ("", None)
    assert kind == "structural_tag"
    calls, answer = tag["format"]["elements"]
    assert calls["type"] == "tags_with_separator"
    assert answer == {"type": "json_schema", "json_schema": {"type": "object"}}


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format", "Unknown response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            "response_format",
            'Unsupported type "objec"',
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "uniqueItems cannot be enforced",
        ),
        (
            {"tool_choice": ToolChoice("required"), "tools": TOOLS, "tool_parser": "none"},
            "tool_choice",
            "tool parser 'none' has no tool-call format",
        ),
    ],
)
def test_refusals_are_400s(kwargs: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        grammar(**kwargs)
    assert info.value.param == param
    assert ".cc:" not in info.value.message


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "integer", "multipleOf": 3}, "/: keyword(s) multipleOf"),
        (
            {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
            "/properties/a: keyword(s) not",
        ),
        ({"type": "string", "format": "colour"}, "string format 'colour'"),
        ({"type": "string", "pattern": "a+", "maxLength": 3}, "pattern and minLength/maxLength"),
        ({"anyOf": [{"type": "string", "format": "email", "pattern": "x"}]}, "/anyOf/0: format"),
        # A property merely *named* like a keyword is fine.
        ({"type": "object", "properties": {"not": {"type": "string"}}}, None),
        ({"type": "string", "format": "date-time"}, None),
    ],
)
def test_unenforceable_schema_reason(schema: dict[str, Any], reason: str | None) -> None:
    found = unenforceable_schema_reason(schema)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found


def test_string_lengths_become_patterns() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 5},
            "b": {"type": "string", "minLength": 2},
            "c": {"type": "string", "pattern": "^x+$"},
            "d": {"type": "array", "maxLength": 3},
        },
    }
    out = enforceable_schema(schema, "response_format")
    props = out["properties"]
    assert props["a"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{0,5}$'}
    assert props["b"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{2,}$'}
    assert props["c"] == schema["properties"]["c"] and props["d"] == schema["properties"]["d"]
    assert schema["properties"]["a"] == {"type": "string", "maxLength": 5}  # input unchanged
    assert unenforceable_schema_reason(out) is None


# ``sglang/srt/sampling/sampling_params.py`` of SGLang 0.5.23 (its API-facing fields), read
# from the wheel: every field the proxy sends must be one of them, or SGLang answers 400.
SGLANG_0_5_23_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "beam_width", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
    "logit_bias", "sampling_seed", "custom_params", "watermark",
}  # fmt: skip


def test_protocol_sampling_fields_are_sglangs() -> None:
    from proxima.proxy.backends.protocol import SamplingParams

    assert set(SamplingParams.model_fields) <= SGLANG_0_5_23_SAMPLING_FIELDS
    for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
        assert kind in SamplingParams.model_fields


def _nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        (_nested_arrays(400), "nested too deep"),
        ({"enum": list(range(1001))}, "1001 enum values"),
        ({"anyOf": [{"const": i} for i in range(1001)]}, "1001 enum values"),
        ({"type": "string", "description": "x" * (512 * 1024)}, "characters long"),
    ],
)
def test_schemas_past_the_bounds_are_400s_before_compiling(schema: Any, words: str) -> None:
    """Issue 19, 2.4: such schemas compiled for seconds (a minute for a 100k enum)."""
    for kwargs, param in (
        ({"response_format": _format(schema)}, "response_format"),
        (
            {
                "tool_choice": ToolChoice("required"),
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            },
            "tool_choice",
        ),
    ):
        with pytest.raises(BadRequest) as info:
            grammar(**kwargs)
        assert info.value.param == param and words in info.value.message
    assert grammar(response_format=_format(_nested_arrays(60))) is not None  # within


async def test_compiling_runs_off_the_event_loop_and_is_bounded_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 19, 2.4: the check compile ran on the event loop, stalling every request.

    Past the depth bound (lifted here) a schema 300 arrays deep compiles for
    about a second: the loop keeps ticking meanwhile, and a compile over the
    time limit is a 400.
    """
    monkeypatch.setattr(structured, "MAX_SCHEMA_DEPTH", 10_000)
    slow = {
        "response_format": _format(_nested_arrays(300)),
        "tool_choice": ToolChoice("none"),
        "tools": None,
        "tool_parser": "hermes",
    }
    ticks = 0
    compiling = asyncio.ensure_future(structured.checked_output_grammar(**slow))
    while not compiling.done():
        await asyncio.sleep(0.001)
        ticks += 1
    assert compiling.result() is not None
    assert ticks > 10  # the loop ran while xgrammar compiled
    with pytest.raises(BadRequest) as info:
        await structured.checked_output_grammar(**slow, timeout=0.01)
    assert info.value.param == "response_format" and "to compile" in info.value.message
    none = {**slow, "response_format": None}
    assert await structured.checked_output_grammar(**none) is None


@pytest.mark.parametrize("bad", [None, "abc", [], 2.7, -1, True, 2**31])
def test_string_lengths_that_are_not_lengths_are_400s(bad: Any) -> None:
    """Issue 19, 2.2: ``int(None)`` and friends escaped as a 500."""
    for keyword in ("minLength", "maxLength"):
        schema = {"type": "string", keyword: bad}
        with pytest.raises(BadRequest) as info:
            enforceable_schema(schema, "response_format")
        assert info.value.param == "response_format" and keyword in info.value.message
    with pytest.raises(BadRequest, match="above maxLength"):
        enforceable_schema({"type": "string", "minLength": 3, "maxLength": 2}, "tool_choice")
