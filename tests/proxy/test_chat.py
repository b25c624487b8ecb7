"""Messages -> token ids: normalization, and token-exact reuse across turns."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering.chat_messages import (
    InvalidMessages,
    Message,
    messages_equivalent,
    normalize_messages,
)
from proxima.proxy.rendering.chat_template import ChatRenderer, PromptPlan
from proxima.proxy.rendering.parents import RenderedTexts
from proxima.proxy.store.records import CompletionRecord
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer

from tests.proxy.recorded_turns import recorded_turn

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> ChatRenderer:
    return ChatRenderer(tokenizer)


def generate(
    renderer: ChatRenderer,
    messages: list[Message],
    plan: PromptPlan,
    reply_text: str,
    *,
    tools: list[dict[str, Any]] | None = TOOLS,
    finished: bool = True,
) -> CompletionRecord:
    """What the proxy records for one turn: the model "generates" ``reply_text``.

    The response message is built the way the proxy builds it (hermes parser,
    string arguments), and ``finished=False`` is a reply cut at ``max_tokens``.
    """
    return recorded_turn(renderer, messages, plan, reply_text, tools=tools, finished=finished)


def echo(record: CompletionRecord) -> dict[str, Any]:
    """The assistant message as an OpenAI SDK client sends it back."""
    assert record.response_message is not None
    return {**record.response_message, "refusal": None, "function_call": None}


def first_turn() -> list[Message]:
    return normalize_messages(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
        ]
    )


# -------------------------------------------------------------------------- normalize


def test_normalize_canonical_form() -> None:
    messages = normalize_messages(
        [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "ann",
            },
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": [1, 2]}'},
                    },
                    {"id": "call_2", "function": {"name": "g", "arguments": "not json"}},
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "done", "tool_calls": []},
        ]
    )
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"x": [1, 2]}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "g", "arguments": "not json"},
                },
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "done"},
    ]
    assert normalize_messages(messages) == messages  # idempotent


@pytest.mark.parametrize(
    "messages, param, words",
    [
        ([], "messages", "at least one"),
        ({"role": "user"}, "messages", "list"),
        (["hi"], "messages[0]", "object"),
        ([{"role": "robot", "content": "x"}], "messages[0].role", "robot"),
        ([{"content": "x"}], "messages[0].role", "role"),
        ([{"role": "user"}], "messages[0].content", "missing"),
        ([{"role": "user", "content": 3}], "messages[0].content", "string"),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    ],
                }
            ],
            "messages[0].content[1].type",
            "image_url",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "messages[0].content[0].text",
            "string",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}],
            "messages[1].tool_call_id",
            "tool_call_id",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": {"id": "x"}}],
            "messages[0].tool_calls",
            "list",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function.name",
            "name",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}],
            "messages[0].tool_calls[0].function.arguments",
            "JSON string",
        ),
        (
            [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
            "messages[0].tool_calls",
            "assistant",
        ),
        ([{"role": "user", "content": "x", "name": 7}], "messages[0].name", "string"),
    ],
)
def test_normalize_errors_name_the_param(messages: Any, param: str, words: str) -> None:
    with pytest.raises(InvalidMessages) as info:
        normalize_messages(messages)
    assert info.value.param == param
    assert words in str(info.value)
    assert isinstance(info.value, BadRequest)  # one error tree: a 400, not a ValueError
    assert info.value.status_code == 400


def test_messages_equivalent() -> None:
    [call_a, call_b, no_id, other_id, spaced] = normalize_messages(
        [
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a":1}'}}],
            },
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            {
                "role": "assistant",
                "tool_calls": [{"id": "c2", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            {
                "role": "assistant",
                "content": " ",
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
        ]
    )
    assert messages_equivalent(call_a, call_b)  # arguments compared parsed
    assert messages_equivalent(call_a, no_id)  # an id missing on one side is not compared
    assert not messages_equivalent(call_a, other_id)
    assert not messages_equivalent(call_a, spaced)  # content is exact
    tool_1, tool_2 = normalize_messages(
        [
            {"role": "tool", "content": "r", "tool_call_id": "c1"},
            {"role": "tool", "content": "r", "tool_call_id": "c2"},
        ]
    )
    assert not messages_equivalent(tool_1, tool_2)


# ------------------------------------------------------------------------ token-exact


def test_second_turn_reuses_the_first_turns_tokens(renderer: ChatRenderer, tokenizer: Any) -> None:
    turn1 = first_turn()
    plan1 = renderer.build_prompt(turn1, TOOLS, [])
    assert plan1.parent_id is None
    assert plan1.prompt_ids == plan1.appended_ids
    assert tokenizer.decode(plan1.prompt_ids) == renderer.render_text(
        turn1, TOOLS, add_generation_prompt=True
    )
    c1 = generate(renderer, turn1, plan1, TOOL_REPLY)
    assert c1.response_message is not None and c1.response_message["content"] == "Let me check."

    call_id = c1.response_message["tool_calls"][0]["id"]
    turn2 = normalize_messages(
        [
            *turn1,
            echo(c1),
            {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 21}'},
            {"role": "user", "content": "Thanks! And tomorrow?"},
        ]
    )
    plan2 = renderer.build_prompt(turn2, TOOLS, [c1])

    prefix = c1.prompt_ids + c1.output_ids
    assert plan2.parent_id == c1.id
    assert plan2.prompt_ids[: len(prefix)] == prefix
    assert plan2.prompt_ids[len(prefix) :] == plan2.appended_ids
    fresh = renderer.render_text(turn2, TOOLS, add_generation_prompt=True)
    assert tokenizer.decode(plan2.prompt_ids) == fresh
    assert tokenizer.decode(plan2.appended_ids).startswith("\n<|im_start|>user\n<tool_response>")

    # A third turn chains onto the second, not the first.
    c2 = generate(renderer, turn2, plan2, "Probably sunny.")
    turn3 = normalize_messages([*turn2, echo(c2), {"role": "user", "content": "Thanks."}])
    plan3 = renderer.build_prompt(turn3, TOOLS, [c1, c2])
    assert plan3.parent_id == c2.id
    assert (
        plan3.prompt_ids[: len(c2.prompt_ids) + len(c2.output_ids)] == c2.prompt_ids + c2.output_ids
    )
    assert tokenizer.decode(plan3.prompt_ids) == renderer.render_text(
        turn3, TOOLS, add_generation_prompt=True
    )


def test_reply_echoed_without_ids_still_extends(renderer: ChatRenderer) -> None:
    turn1 = first_turn()
    c1 = generate(renderer, turn1, renderer.build_prompt(turn1, TOOLS, []), TOOL_REPLY)
    reply = echo(c1)
    reply["tool_calls"] = [
        {"type": "function", "function": call["function"]} for call in reply["tool_calls"]
    ]
    turn2 = normalize_messages(
        [*turn1, reply, {"role": "tool", "tool_call_id": "x", "content": "sunny"}]
    )
    assert renderer.build_prompt(turn2, TOOLS, [c1]).parent_id == c1.id


def test_length_truncated_reply_gets_its_end_marker(renderer: ChatRenderer, tokenizer: Any) -> None:
    turn1 = normalize_messages([{"role": "user", "content": "Tell me a story."}])
    c1 = generate(
        renderer,
        turn1,
        renderer.build_prompt(turn1, None, []),
        "Once upon a ti",
        tools=None,
        finished=False,
    )
    turn2 = normalize_messages([*turn1, echo(c1), {"role": "user", "content": "Go on."}])
    plan = renderer.build_prompt(turn2, None, [c1])

    assert plan.parent_id == c1.id
    assert (
        plan.prompt_ids[: len(c1.prompt_ids) + len(c1.output_ids)] == c1.prompt_ids + c1.output_ids
    )
    assert plan.appended_ids[0] == renderer.end_of_turn_id
    assert (
        tokenizer.decode(plan.appended_ids)
        == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(plan.prompt_ids) == renderer.render_text(
        turn2, None, add_generation_prompt=True
    )


def test_edited_history_renders_fresh(renderer: ChatRenderer) -> None:
    turn1 = first_turn()
    c1 = generate(renderer, turn1, renderer.build_prompt(turn1, TOOLS, []), "It is sunny.")
    edited = normalize_messages(
        [
            turn1[0],
            {"role": "user", "content": "Weather in Lyon?"},
            echo(c1),
            {"role": "user", "content": "And tomorrow?"},
        ]
    )
    plan = renderer.build_prompt(edited, TOOLS, [c1])
    assert plan.parent_id is None
    assert plan.prompt_ids == renderer.encode(
        renderer.render_text(edited, TOOLS, add_generation_prompt=True)
    )

    rewritten_reply = normalize_messages(
        [
            *turn1,
            {"role": "assistant", "content": "It is rainy."},
            {"role": "user", "content": "Sure?"},
        ]
    )
    assert renderer.build_prompt(rewritten_reply, TOOLS, [c1]).parent_id is None


def test_different_tools_render_fresh(renderer: ChatRenderer) -> None:
    turn1 = first_turn()
    c1 = generate(renderer, turn1, renderer.build_prompt(turn1, TOOLS, []), "It is sunny.")
    turn2 = normalize_messages([*turn1, echo(c1), {"role": "user", "content": "Thanks."}])
    more_tools = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    assert renderer.build_prompt(turn2, more_tools, [c1]).parent_id is None
    assert renderer.build_prompt(turn2, None, [c1]).parent_id is None
    assert renderer.build_prompt(turn2, TOOLS, [c1]).parent_id == c1.id


def test_messages_must_strictly_extend(renderer: ChatRenderer) -> None:
    turn1 = first_turn()
    c1 = generate(renderer, turn1, renderer.build_prompt(turn1, TOOLS, []), "It is sunny.")
    same = normalize_messages(
        [*turn1, echo(c1)]
    )  # an assistant prefill, nothing new after the reply
    assert renderer.build_prompt(same, TOOLS, [c1]).parent_id is None
    assert renderer.build_prompt(turn1, TOOLS, [c1]).parent_id is None  # a retry of turn 1


def test_parent_is_the_matching_sibling_then_the_longest_then_the_newest(
    renderer: ChatRenderer,
) -> None:
    turn1 = first_turn()
    plan1 = renderer.build_prompt(turn1, TOOLS, [])
    sunny = generate(renderer, turn1, plan1, "Sunny.")
    rainy = generate(renderer, turn1, plan1, "Rainy.")
    sunny_again = generate(renderer, turn1, plan1, "Sunny.")
    turn2 = normalize_messages([*turn1, echo(sunny), {"role": "user", "content": "Tomorrow?"}])
    assert renderer.build_prompt(turn2, TOOLS, [sunny, rainy]).parent_id == sunny.id
    assert (
        renderer.build_prompt(turn2, TOOLS, [sunny, rainy, sunny_again]).parent_id == sunny_again.id
    )

    c2 = generate(renderer, turn2, renderer.build_prompt(turn2, TOOLS, [sunny]), "Cloudy.")
    turn3 = normalize_messages([*turn2, echo(c2), {"role": "user", "content": "Thanks."}])
    assert renderer.build_prompt(turn3, TOOLS, [c2, sunny_again]).parent_id == c2.id


def test_records_without_a_chat_reply_are_ignored(renderer: ChatRenderer) -> None:
    turn1 = first_turn()
    c1 = generate(renderer, turn1, renderer.build_prompt(turn1, TOOLS, []), "Sunny.")
    turn2 = normalize_messages([*turn1, echo(c1), {"role": "user", "content": "Tomorrow?"}])
    text_completion = CompletionRecord(
        id="raw",
        session_id="s",
        parent_id=None,
        prompt_ids=[1],
        output_ids=[2],
        output_logprobs=[0.0],
        output_versions=[0],
        finish_reason="stop",
        created_at=datetime.now(UTC),
    )
    no_reply = CompletionRecord(
        id="pending",
        session_id="s",
        parent_id=None,
        prompt_ids=[1],
        output_ids=[],
        output_logprobs=[],
        output_versions=[],
        finish_reason="length",
        created_at=datetime.now(UTC),
        request_messages=turn1,
        request_tools=TOOLS,
    )
    assert renderer.build_prompt(turn2, TOOLS, [c1, text_completion, no_reply]).parent_id == c1.id


_LOOP_HEAD = "{% for m in messages %}<|im_start|>{{ m.role }}\n"
_LOOP_TAIL = "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


@pytest.mark.parametrize(
    "template",
    [
        # Like Qwen3 dropping old reasoning: earlier assistant turns render differently.
        _LOOP_HEAD
        + "{% if m.role == 'assistant' and not loop.last %}(earlier){% else %}{{ m.content }}"
        + "{% endif %}<|im_end|>\n"
        + _LOOP_TAIL,
        # Assistant turns without an end-of-turn marker: nowhere to cut.
        _LOOP_HEAD
        + "{{ m.content }}{% if m.role != 'assistant' %}<|im_end|>{% endif %}\n"
        + _LOOP_TAIL,
    ],
    ids=["rewrites-history", "no-end-marker"],
)
def test_templates_that_cannot_be_extended_render_fresh(template: str) -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    renderer = ChatRenderer(tokenizer)
    turn1 = normalize_messages([{"role": "user", "content": "Hi"}])
    c1 = generate(renderer, turn1, renderer.build_prompt(turn1, None, []), "Hello!", tools=None)
    turn2 = normalize_messages([*turn1, echo(c1), {"role": "user", "content": "Bye"}])
    plan = renderer.build_prompt(turn2, None, [c1])
    assert plan.parent_id is None
    assert tokenizer.decode(plan.prompt_ids) == renderer.render_text(
        turn2, None, add_generation_prompt=True
    )


def test_only_the_chosen_parent_is_rendered(
    renderer: ChatRenderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages = first_turn()
    history: list[CompletionRecord] = []
    for turn in range(30):
        plan = renderer.build_prompt(messages, TOOLS, history)
        record = generate(renderer, messages, plan, f"Answer {turn}.")
        history.append(record)
        messages = normalize_messages(
            [*messages, echo(record), {"role": "user", "content": f"Q{turn}"}]
        )

    calls: list[int] = []
    original = renderer.render_text

    def counting(*args: Any, **kwargs: Any) -> str:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(renderer, "render_text", counting)
    plan = renderer.build_prompt(messages, TOOLS, history)
    assert plan.parent_id == history[-1].id
    assert len(calls) == 2  # the parent's request, and the new conversation
    assert plan.text == original(messages, TOOLS, add_generation_prompt=True)

    # The proxy keeps each completion's prompt text (the committer does this): the
    # conversation is then rendered once, to the same prompt.
    renderer.rendered.add([history[-1].id], original(history[-1].request_messages, TOOLS,
                                                     add_generation_prompt=True))  # fmt: skip
    calls.clear()
    kept = renderer.build_prompt(messages, TOOLS, history)
    assert len(calls) == 1 and kept == plan
    # Not when the request differs from the parent's, even only in key order.
    reordered = [dict(reversed(m.items())) if m["role"] == "user" else m for m in messages]
    calls.clear()
    other = renderer.build_prompt(reordered, TOOLS, history)
    assert len(calls) == 2 and other.parent_id == history[-1].id


def test_template_errors_are_invalid_messages() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(InvalidMessages, match="must alternate"):
        ChatRenderer(tokenizer).render_text(first_turn(), None, add_generation_prompt=True)


def test_renderer_needs_a_chat_template() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        ChatRenderer(tokenizer)


def test_a_template_refusing_a_trailing_reply_still_extends() -> None:
    """Extension never renders the conversation ending with the reply: a template that
    refuses one (no assistant prefill) extends token-exactly to its own text."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[-1].role == 'assistant' %}{{ raise_exception('no prefill') }}{% endif %}"
        + _LOOP_HEAD
        + "{{ m.content }}<|im_end|>\n"
        + _LOOP_TAIL
    )
    renderer = ChatRenderer(tokenizer)
    turn1 = normalize_messages([{"role": "user", "content": "Hi"}])
    c1 = generate(renderer, turn1, renderer.build_prompt(turn1, None, []), "Hello!", tools=None)
    turn2 = normalize_messages([*turn1, echo(c1), {"role": "user", "content": "Bye"}])
    plan = renderer.build_prompt(turn2, None, [c1])
    assert plan.parent_id == c1.id
    assert plan.prompt_ids[: len(c1.prompt_ids) + len(c1.output_ids)] == [
        *c1.prompt_ids,
        *c1.output_ids,
    ]
    assert tokenizer.decode(plan.prompt_ids) == renderer.render_text(
        turn2, None, add_generation_prompt=True
    )


def test_kept_prompt_texts_are_bounded_in_characters() -> None:
    kept = RenderedTexts(max_chars=10)
    kept.add(["a-0", "a-1"], "abcd")  # two choices of one request: one string, 8 characters
    assert kept.get("a-0") == kept.get("a-1") == ("abcd", None)
    kept.add(["b"], "efgh")  # 12 > 10: the oldest entry goes
    assert kept.get("a-0") is None and kept.get("a-1") == ("abcd", None)
    assert kept.get("b") == ("efgh", None)
    kept.add(["c"], "x" * 11)  # longer than the bound alone: nothing is kept
    assert [kept.get(k) for k in ("a-1", "b", "c")] == [None, None, None]
