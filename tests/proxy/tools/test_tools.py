"""Tool-call parsing: formats, malformed input, and streaming == non-streaming."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from proxima.proxy.errors import BadRequest
from proxima.proxy.testing.tiny_model import CHAT_TEMPLATE
from proxima.proxy.tools import (
    ContentDelta,
    InvalidToolChoice,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    apply_tool_choice,
    detect_tool_parser,
    finish_reason_for,
    get_tool_parser,
    known_tool_parsers,
    parser_for_choice,
    resolve_tool_choice,
)


def hermes_block(name: str, arguments: dict[str, Any]) -> str:
    """A call exactly as the Qwen template renders it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


WEATHER = hermes_block("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = hermes_block("get_time", {"tz": "Europe/Paris"})

HERMES_CORPUS = [
    WEATHER,
    "Let me check.\n" + WEATHER,
    "Let me check.\n" + WEATHER + "\n" + TIME,
    WEATHER + "\nDone, see above.\n",
    "a " + WEATHER + " \n " + TIME + " b " + WEATHER + " ",
    "no tools here, just <tool text> and a < sign",
    "<tool_call>\nnot json\n</tool_call>",
    "before <tool_call>{bad}</tool_call> middle " + TIME + "  after \n",
    WEATHER + " <tool_call>{}</tool_call> " + TIME,
    'cut short <tool_call>\n{"name": "get_weather", "arguments": {"ci',
    "ends with a partial marker <tool_",
    "<tool_call><tool_call>" + '{"name": "x"}' + "</tool_call>",
    '<tool_call>{"name": "noargs"}</tool_call>',
    '<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>',
    '<tool_call>{"arguments": {"a": 1}, "name": "reordered"}</tool_call>',
    "unicode: caf\u00e9 \u4f60\u597d " + hermes_block("echo", {"text": "\u00fcber"}),
    # Arguments that mention the end marker (a forced call sampled at temperature 1 did).
    hermes_block("get_weather", {"city": "geat_w.</tool_call></tool_call>.v"}) + " after",
    hermes_block("say", {"a": 'q\\"</tool_call>', "b": "<tool_call>"}) + TIME,
    # An odd quote in a block that is not JSON: the first marker ends it, as content.
    'odd <tool_call>it"s</tool_call> then ' + TIME,
    '<tool_call>"a</tool_call> <tool_call>"b</tool_call> tail',
    '<tool_call>x"</tool_call> <tool_call>{"name": "y"}',
    "",
    "   \n",
]

LLAMA3_CORPUS = [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [1, 2]}}',
    '  {"name": "a", "parameters": {}} ; ',
    "The weather is nice.",
    '{"not": "a call"}',
    '{"name": "a", "parameters": {"x": 1}} trailing words',
    "<|python_ta",
    "<|python_tag|>",
    "",
]


def assemble(events: list[StreamEvent]) -> tuple[str, list[tuple[str, str, str]]]:
    """Concatenated content and ``(id, name, arguments)`` per call, as a client rebuilds them."""
    content = ""
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
            continue
        if event.id is not None:
            assert event.index not in calls, "a call's header must come once"
            assert event.id.startswith("call_") and event.name
            calls[event.index] = [event.id, event.name, ""]
        calls[event.index][2] += event.arguments
    assert sorted(calls) == list(range(len(calls))), "call indexes are 0, 1, 2, ..."
    return content, [(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))]


def check_stream(parser: ToolCallParser, chunks: list[str], parsed: ParsedOutput) -> None:
    """Streaming ``chunks`` gives what ``parse`` gave for their concatenation.

    The client's reassembled deltas match (ids aside), and ``result()`` is
    ``parsed`` with the streamed ids.
    """
    stream = parser.stream()
    events: list[StreamEvent] = []
    for chunk in chunks:
        events.extend(stream.feed(chunk))
    events.extend(stream.finish())
    content, calls = assemble(events)
    assert content == (parsed.content or ""), chunks
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in parsed.tool_calls]
    result = stream.result()
    assert result.content == parsed.content, chunks
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == calls


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# ----------------------------------------------------------------------------- hermes


def test_hermes_single_call_without_content() -> None:
    parsed = get_tool_parser("hermes").parse(WEATHER)
    assert parsed.content is None
    [call] = parsed.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert call.arguments == '{"city": "Paris", "unit": "celsius"}'
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24


def test_hermes_multiple_calls_with_surrounding_content() -> None:
    parsed = get_tool_parser("hermes").parse(
        "Let me check.\n" + WEATHER + "\n" + TIME + "\nI will report back."
    )
    assert parsed.content == "Let me check.\nI will report back."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_plain_text_is_content_verbatim() -> None:
    text = "Paris is sunny.\n"
    assert get_tool_parser("hermes").parse(text) == ParsedOutput(content=text, tool_calls=[])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>["f"]</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": ',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
        # Escapes of lone surrogates: no UTF-8 form, the response could not be encoded.
        '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>',
        '<tool_call>{"name": "f\\udc00", "arguments": {}}</tool_call>',
    ],
)
def test_hermes_malformed_call_stays_content(text: str) -> None:
    assert get_tool_parser("hermes").parse(text) == ParsedOutput(content=text, tool_calls=[])


def test_hermes_malformed_block_beside_valid_call() -> None:
    parsed = get_tool_parser("hermes").parse("see <tool_call>oops</tool_call> " + TIME)
    assert parsed.content == "see <tool_call>oops</tool_call>"
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


def test_hermes_arguments_may_hold_the_end_marker() -> None:
    arguments = {"city": "geat_w.</tool_call></tool_call>.v", "note": 'a \\" </tool_call>'}
    parsed = get_tool_parser("hermes").parse("hi " + hermes_block("get_weather", arguments))
    assert parsed.content == "hi"
    [call] = parsed.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", arguments)


def test_hermes_block_with_an_odd_quote_ends_at_its_first_marker() -> None:
    parsed = get_tool_parser("hermes").parse('odd <tool_call>it"s</tool_call> then ' + TIME)
    assert parsed.content == 'odd <tool_call>it"s</tool_call> then'
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


def test_hermes_accepts_string_arguments_and_missing_arguments() -> None:
    parser = get_tool_parser("hermes")
    [stringified] = parser.parse(
        '<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>'
    ).tool_calls
    assert stringified.arguments == '{"q": 1}'
    [bare] = parser.parse('<tool_call>{"name": "ping"}</tool_call>').tool_calls
    assert bare.arguments == "{}"


def test_hermes_keeps_non_ascii_arguments_readable() -> None:
    [call] = get_tool_parser("hermes").parse(hermes_block("echo", {"t": "caf\u00e9"})).tool_calls
    assert call.arguments == '{"t": "caf\u00e9"}'


# ------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "none"])
def test_stream_equals_parse_for_every_single_split(name: str) -> None:
    parser = get_tool_parser(name)
    for text in HERMES_CORPUS + LLAMA3_CORPUS:
        parsed = parser.parse(text)
        for cut in range(len(text) + 1):
            check_stream(parser, [text[:cut], text[cut:]], parsed)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "none"])
def test_stream_equals_parse_for_random_chunkings(name: str) -> None:
    parser = get_tool_parser(name)
    rng = random.Random(1234)
    for text in HERMES_CORPUS + LLAMA3_CORPUS:
        parsed = parser.parse(text)
        check_stream(parser, list(text), parsed)  # character by character
        if len(text) < 2:
            continue
        for _ in range(60):
            check_stream(parser, random_chunks(text, rng), parsed)


def test_stream_holds_back_only_possible_markers() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hello") == [ContentDelta("Hello")]
    assert stream.feed(" ") == []  # whitespace could precede a call
    assert stream.feed("wor") == [ContentDelta(" wor")]
    assert stream.feed("ld <tool") == [ContentDelta("ld")]
    assert stream.feed("_cal") == []
    assert stream.feed("ibrate") == [ContentDelta(" <tool_calibrate")]
    assert stream.finish() == []


def test_stream_emits_openai_shaped_call_deltas_when_the_block_closes() -> None:
    stream = get_tool_parser("hermes").stream()
    head, tail = WEATHER[:30], WEATHER[30:]
    assert stream.feed("Checking.\n") == [ContentDelta("Checking.")]
    assert stream.feed(head) == []
    header, arguments = stream.feed(tail)
    assert isinstance(header, ToolCallDelta) and isinstance(arguments, ToolCallDelta)
    assert header.to_openai() == {
        "index": 0,
        "id": header.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert arguments.to_openai() == {
        "index": 0,
        "function": {"arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    second = stream.feed("\n" + TIME)
    assert [d.index for d in second if isinstance(d, ToolCallDelta)] == [1, 1]
    assert stream.finish() == []


def test_unclosed_block_is_released_as_content_at_finish() -> None:
    text = 'x <tool_call>\n{"name": "f", "argu'
    stream = get_tool_parser("hermes").stream()
    assert stream.feed(text) == [ContentDelta("x")]
    assert stream.finish() == [ContentDelta(" " + text[2:])]


# ----------------------------------------------------------------------------- llama3


def test_llama3_python_tag_and_parameters() -> None:
    parsed = get_tool_parser("llama3_json").parse(LLAMA3_CORPUS[0])
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]


def test_llama3_several_calls_separated_by_semicolons() -> None:
    parsed = get_tool_parser("llama3_json").parse(LLAMA3_CORPUS[1])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("a", {"x": 1}),
        ("b", {"y": [1, 2]}),
    ]


@pytest.mark.parametrize("text", LLAMA3_CORPUS[3:])
def test_llama3_non_calls_are_content(text: str) -> None:
    assert get_tool_parser("llama3_json").parse(text) == ParsedOutput(content=text, tool_calls=[])


def test_llama3_stream_passes_content_through_once_decided() -> None:
    stream = get_tool_parser("llama3_json").stream()
    assert stream.feed("  ") == []
    assert stream.feed("The") == [ContentDelta("  The")]
    assert stream.feed(" end") == [ContentDelta(" end")]
    assert stream.finish() == []


def test_none_parser_keeps_calls_as_text() -> None:
    assert get_tool_parser("none").parse(WEATHER) == ParsedOutput(content=WEATHER, tool_calls=[])


# --------------------------------------------------------------------------- registry


def test_unknown_parser_lists_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        get_tool_parser("mistral")
    for name in known_tool_parsers():
        assert name in str(info.value)


def test_detect_tool_parser() -> None:
    assert detect_tool_parser(CHAT_TEMPLATE) == "hermes"
    assert detect_tool_parser("{{ '<|python_tag|>' }}{{ messages }}") == "llama3_json"
    assert detect_tool_parser("{{ messages }}") == "hermes"
    assert detect_tool_parser(None) == "hermes"


# ------------------------------------------------------------------------ tool_choice

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
]


def test_tool_choice_none_turns_parsing_off() -> None:
    choice = resolve_tool_choice("none", TOOLS)
    parser = parser_for_choice(get_tool_parser("hermes"), choice)
    assert parser.parse(WEATHER) == ParsedOutput(content=WEATHER, tool_calls=[])


@pytest.mark.parametrize(
    "tool_choice",
    ["auto", "required", None, {"type": "function", "function": {"name": "get_weather"}}],
)
def test_tool_choice_that_parses(tool_choice: str | dict[str, Any] | None) -> None:
    choice = resolve_tool_choice(tool_choice, TOOLS)
    parser = parser_for_choice(get_tool_parser("hermes"), choice)
    assert [c.name for c in parser.parse(WEATHER).tool_calls] == ["get_weather"]


def test_without_tools_nothing_is_parsed_by_default() -> None:
    assert not resolve_tool_choice(None, None).parses_tool_calls
    assert not resolve_tool_choice("auto", []).parses_tool_calls


@pytest.mark.parametrize(
    "tool_choice, tools",
    [
        ("sometimes", TOOLS),
        ("required", None),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS),
        ({"type": "function"}, TOOLS),
        ({"type": "retrieval", "function": {"name": "get_weather"}}, TOOLS),
    ],
)
def test_invalid_tool_choice(
    tool_choice: str | dict[str, Any], tools: list[dict[str, Any]] | None
) -> None:
    with pytest.raises(InvalidToolChoice) as info:
        resolve_tool_choice(tool_choice, tools)
    assert info.value.param == "tool_choice"
    assert isinstance(info.value, BadRequest)  # one error tree: a 400, not a ValueError


def test_required_tool_choice_returns_what_the_model_produced() -> None:
    choice = resolve_tool_choice("required", TOOLS)
    plain = ParsedOutput(content="I would rather not.", tool_calls=[])
    assert not choice.is_satisfied_by(plain)
    assert apply_tool_choice(plain, choice) is plain
    named = resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    other = ParsedOutput(content=None, tool_calls=[ToolCall("call_1", "other", "{}")])
    assert not named.is_satisfied_by(other)
    assert apply_tool_choice(other, named) is other


def test_finish_reason_for_tool_calls() -> None:
    calls = get_tool_parser("hermes").parse(WEATHER)
    assert finish_reason_for("stop", calls) == "tool_calls"
    assert finish_reason_for("length", calls) == "length"
    assert finish_reason_for("stop", ParsedOutput(content="hi", tool_calls=[])) == "stop"
