"""Reasoning parsers: the split of a reply, and the same split when streamed."""

from __future__ import annotations

import itertools

import pytest
from jinja2 import Template
from proxima.proxy.rendering.reasoning import (
    ReasoningDelta,
    ReasoningSplit,
    detect_reasoning_parser,
    get_reasoning_parser,
    known_reasoning_parsers,
)
from proxima.proxy.testing.tiny_model import THINKING_CHAT_TEMPLATE
from proxima.proxy.tools import get_tool_parser

QWEN3 = get_reasoning_parser("qwen3")
R1 = get_reasoning_parser("deepseek-r1")
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "in_reasoning", "expected"),
    [
        (
            "<think>\n1 plus 2 is 3.\n</think>\n\nThe answer is 3.",
            False,
            ReasoningSplit("1 plus 2 is 3.", "The answer is 3.", closed=True),
        ),
        (
            "<think>1 plus 2 is 3.</think>The answer is 3.",
            False,
            ReasoningSplit("1 plus 2 is 3.", "The answer is 3.", closed=True),
        ),
        ("  \n<think>a</think>b", False, ReasoningSplit("a", "b", closed=True)),
        ("The answer is 3.", False, ReasoningSplit(None, "The answer is 3.")),
        ("Not <think>here</think>", False, ReasoningSplit(None, "Not <think>here</think>")),
        ("<think>\nstill thinking\n", False, ReasoningSplit("still thinking", "", closed=False)),
        ("<think>\n\n</think>\n\nHi", False, ReasoningSplit("", "Hi", closed=True)),
        # The prompt opened the reasoning (or the family always thinks).
        (
            "1 plus 2 is 3.\n</think>\n\nThe answer is 3.",
            True,
            ReasoningSplit("1 plus 2 is 3.", "The answer is 3.", closed=True),
        ),
        ("\n<think>\nR\n</think>\nA", True, ReasoningSplit("R", "A", closed=True)),
        ("cut while thinking", True, ReasoningSplit("cut while thinking", "", closed=False)),
        ("a </think> b </think> c", True, ReasoningSplit("a ", " b </think> c", closed=True)),
    ],
)
def test_parse(text: str, in_reasoning: bool, expected: ReasoningSplit) -> None:
    assert QWEN3 is not None
    assert QWEN3.parse(text, in_reasoning=in_reasoning) == expected


def _streamed(text: str, cuts: tuple[int, ...], in_reasoning: bool) -> tuple[str, str, bool]:
    assert QWEN3 is not None
    stream = QWEN3.stream(in_reasoning=in_reasoning)
    bounds = [0, *cuts, len(text)]
    pieces = []
    for a, b in itertools.pairwise(bounds):
        pieces += stream.feed(text[a:b])
    pieces += stream.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
    content = "".join(p for p in pieces if isinstance(p, str))
    assert all(p for p in pieces if isinstance(p, str))  # no empty pieces
    return reasoning, content, stream.saw_reasoning


@pytest.mark.parametrize(
    ("text", "in_reasoning"),
    [
        ("<think>\n1 plus 2 is 3.\n</think>\n\nThe answer is 3.", False),
        ("\n<think>\nR\n\n</think>\n\n\nA\n", False),
        ("The answer is 3.", False),
        (" <thinx>no</think>", False),
        ("<think>\ncut\n\n", False),
        ("<thi", False),
        ("\n", False),
        ("1 plus 2\n\nis 3.\n</think>\n\nThe answer.", True),
        ("\n<think>\nR</think>A", True),
        ("R </thi nk> </think>", True),
        ("<thi", True),
        (f"<think>\nI should add.\n</think>\n\n{CALL}", False),
    ],
)
def test_streaming_matches_parse_for_every_split(text: str, in_reasoning: bool) -> None:
    """Markers and newlines split across deltas anywhere: the same reasoning and content."""
    assert QWEN3 is not None
    whole = QWEN3.parse(text, in_reasoning=in_reasoning)
    expected = (whole.reasoning or "", whole.content, whole.reasoning is not None)
    positions = range(1, len(text))
    splits = [(), *((i,) for i in positions), *itertools.combinations(positions, 2)]
    for cuts in splits[:2000]:
        assert _streamed(text, cuts, in_reasoning) == expected, cuts
    # One character at a time.
    assert _streamed(text, tuple(positions), in_reasoning) == expected


def test_tool_calls_after_the_reasoning_are_parsed() -> None:
    assert QWEN3 is not None
    split = QWEN3.parse(f"<think>\nI should add.\n</think>\n\n{CALL}", in_reasoning=False)
    assert split.reasoning == "I should add."
    parsed = get_tool_parser("hermes").parse(split.content)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("add", '{"a": 1}')]


def test_a_call_inside_the_reasoning_is_reasoning() -> None:
    assert QWEN3 is not None
    split = QWEN3.parse(f"<think>maybe {CALL}</think>No call.", in_reasoning=False)
    assert split.reasoning == f"maybe {CALL}"
    assert get_tool_parser("hermes").parse(split.content).tool_calls == []


def test_deepseek_r1_always_thinks() -> None:
    assert R1 is not None
    assert R1.starts_in_reasoning("<｜Assistant｜>")
    assert R1.parse("R</think>A", in_reasoning=True) == ReasoningSplit("R", "A", closed=True)
    assert QWEN3 is not None
    assert not QWEN3.starts_in_reasoning("<|im_start|>assistant\n")
    assert QWEN3.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    # Qwen3 with enable_thinking=False: the prompt holds an empty, closed think block.
    assert not QWEN3.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# DeepSeek-R1's first release (and its distills), user and assistant turns: earlier replies
# lose everything up to ``</think>``, and nothing writes ``<think>`` (the model opens it).
R1_FIRST_RELEASE_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def test_a_template_that_only_strips_think_end_is_a_reasoning_model() -> None:
    assert "<think>" not in R1_FIRST_RELEASE_TEMPLATE
    name = detect_reasoning_parser(R1_FIRST_RELEASE_TEMPLATE)
    assert name == "qwen3"
    parser = get_reasoning_parser(name)
    assert parser is not None
    prompt = Template(R1_FIRST_RELEASE_TEMPLATE).render(
        bos_token="<｜begin▁of▁sentence｜>",
        messages=[
            {"role": "user", "content": "1 + 2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n3"},
            {"role": "user", "content": "times 2?"},
        ],
        add_generation_prompt=True,
    )
    assert "add" not in prompt and prompt.endswith("<｜User｜>times 2?<｜Assistant｜>")
    # The generation prompt opens nothing: the model writes ``<think>`` itself.
    in_reasoning = parser.starts_in_reasoning(prompt[-40:])
    assert not in_reasoning
    reply = "<think>\n2 times 3 is 6.\n</think>\n\n6"
    assert parser.parse(reply, in_reasoning=in_reasoning) == ReasoningSplit(
        "2 times 3 is 6.", "6", closed=True
    )
    # A reply that skips the reasoning is all content, not unclosed reasoning.
    assert parser.parse("6", in_reasoning=in_reasoning) == ReasoningSplit(None, "6")
    # R1's later template opens the block in the generation prompt: both markers, DeepSeek.
    later = R1_FIRST_RELEASE_TEMPLATE.replace(
        "'<｜Assistant｜>' }}{% endif %}", "'<｜Assistant｜><think>\\n' }}{% endif %}"
    )
    assert later != R1_FIRST_RELEASE_TEMPLATE
    assert detect_reasoning_parser(later) == "deepseek-r1"


def test_detection_and_names() -> None:
    assert detect_reasoning_parser(THINKING_CHAT_TEMPLATE) == "qwen3"
    assert detect_reasoning_parser("{{ '<｜Assistant｜><think>' }}{{ '</think>' }}") == (
        "deepseek-r1"
    )
    assert detect_reasoning_parser("{{ messages }}") == "none"
    assert detect_reasoning_parser(None) == "none"
    assert known_reasoning_parsers() == ["deepseek-r1", "none", "qwen3"]
    assert get_reasoning_parser("none") is None
    with pytest.raises(ValueError, match="known parsers: deepseek-r1, none, qwen3"):
        get_reasoning_parser("gpt-oss")


def test_an_unknown_reasoning_parser_is_a_settings_error(tmp_path: object) -> None:
    from proxima.proxy.config import Settings
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="unknown reasoning parser 'gpt-oss'"):
        Settings(model=tmp_path, reasoning_parser="gpt-oss")  # type: ignore[arg-type]
