"""A thinking model through the real SDKs: reasoning apart from the answer on every surface.

The tiny model is taught, under a Qwen3-style template (earlier turns'
reasoning dropped from the history), to answer "What is 1 plus 2?" with
``<think>\\n1 plus 2 is 3.\\n</think>\\n\\nThe answer is 3.`` and, on the
template's own rendering of the second turn, "And 2 plus 2?" with its own
reasoning and "The answer is 4.".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from proxima.proxy.testing.cache import built_once
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.teach import teach
from proxima.proxy.testing.tiny_model import build_tiny_model
from transformers import AutoTokenizer

CACHE = Path(__file__).resolve().parents[2] / ".cache"
Q1, Q2 = "What is 1 plus 2?", "And 2 plus 2?"
R1, A1 = "1 plus 2 is 3.", "The answer is 3."
R2, A2 = "2 plus 2 is 4.", "The answer is 4."
REPLY1 = f"<think>\n{R1}\n</think>\n\n{A1}"
REPLY2 = f"<think>\n{R2}\n</think>\n\n{A2}"
EXAMPLES = [
    ([{"role": "user", "content": Q1}], None, REPLY1),
    (
        [
            {"role": "user", "content": Q1},
            {"role": "assistant", "content": REPLY1},
            {"role": "user", "content": Q2},
        ],
        None,
        REPLY2,
    ),
]


@pytest.fixture(scope="module")
def thinking_model_dir() -> Path:
    """The tiny thinking model, taught ``EXAMPLES`` (cached under ``.cache/``)."""
    import proxima.proxy.testing.teach as teach_mod
    import proxima.proxy.testing.tiny_model as tiny_mod

    digest = hashlib.sha256(
        Path(tiny_mod.__file__).read_bytes()
        + Path(teach_mod.__file__).read_bytes()
        + repr(EXAMPLES).encode()
    ).hexdigest()[:16]
    return built_once(
        CACHE / f"thinking-{digest}" / "tiny-thinking",
        lambda staging: teach(build_tiny_model(staging, thinking=True), EXAMPLES, steps=200),
        "model.safetensors",
    )


@pytest.fixture(scope="module")
def proxy(
    thinking_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("thinking")
    live = LiveProxy(
        thinking_model_dir, db_url=f"sqlite:///{work / 'store.db'}", log_path=work / "serve.log"
    )
    live.start()
    yield live
    live.stop()


def check_turns(proxy: LiveProxy, session_id: str, sent: list[list[dict[str, Any]]]) -> None:
    """Every generated token recorded; each prompt is the template's rendering of its request."""
    tokenizer = AutoTokenizer.from_pretrained(proxy.model_dir)
    completions = proxy.trajectory(session_id)["completions"]
    assert len(completions) == len(sent) == 2
    for c, messages, reply in zip(completions, sent, [REPLY1, REPLY2], strict=True):
        assert tokenizer.decode(c["output_ids"], skip_special_tokens=True) == reply
        assert c["output_ids"][-1] == tokenizer.eos_token_id
        assert len(c["output_logprobs"]) == len(c["output_versions"]) == len(c["output_ids"])
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(c["prompt_ids"]) == prompt
        assert R1 not in tokenizer.decode(completions[1]["prompt_ids"])  # dropped, as taught


def test_chat_completions(proxy: LiveProxy) -> None:
    s = proxy.new_session(group_id="chat")
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    kw: dict[str, Any] = {"model": proxy.model_name, "temperature": 0, "max_tokens": 80}
    messages: list[dict[str, Any]] = [{"role": "user", "content": Q1}]
    r1 = client.chat.completions.create(messages=messages, **kw)
    message = r1.choices[0].message
    assert (message.content, message.reasoning_content) == (A1, R1)  # type: ignore[attr-defined]
    # <think>, "\n1 plus 2 is 3.\n" (a byte a token), </think>: the reasoning's 18 tokens.
    assert r1.usage is not None and r1.usage.completion_tokens_details is not None
    assert r1.usage.completion_tokens_details.reasoning_tokens == 18
    sent = [list(messages)]
    # The SDK's message, sent back as is (reasoning_content included).
    messages += [message.model_dump(exclude_none=True), {"role": "user", "content": Q2}]
    sent.append(list(messages))
    stream = client.chat.completions.create(messages=messages, stream=True, **kw)
    reasoning, content, kinds = "", "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        if piece:
            reasoning += piece
            kinds.append("r")
        if delta.content:
            content += delta.content
            kinds.append("c")
    assert (reasoning, content) == (R2, A2)
    assert kinds == sorted(kinds, reverse=True) and len(kinds) > 2  # reasoning, then the answer
    check_turns(proxy, s["session_id"], sent)


def test_responses(proxy: LiveProxy) -> None:
    """Reasoning items with reasoning_text and encrypted_content; sent back as Codex does."""
    s = proxy.new_session(group_id="responses")
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    kw: dict[str, Any] = {
        "model": proxy.model_name,
        "temperature": 0,
        "max_output_tokens": 80,
        "include": ["reasoning.encrypted_content"],
        "store": False,
    }
    items: list[Any] = [{"role": "user", "content": Q1}]
    r1 = client.responses.create(input=items, **kw)
    reasoning, message = r1.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert [c.text for c in reasoning.content or []] == [R1]
    assert reasoning.encrypted_content and reasoning.summary == []
    assert r1.output_text == A1
    assert r1.usage is not None and r1.usage.output_tokens_details.reasoning_tokens == 18
    sent = [[{"role": "user", "content": Q1}]]

    # Codex keeps only the encrypted reasoning; a tampered one is refused.
    back = [item.model_dump(exclude_none=True) for item in r1.output]
    back[0].pop("content")
    tampered = {**back[0], "encrypted_content": back[0]["encrypted_content"][:-2] + "AA"}
    with pytest.raises(Exception, match="was not issued by this server"):
        client.responses.create(input=[*items, tampered, back[1]], **kw)
    items += [*back, {"role": "user", "content": Q2}]
    sent.append(
        [
            {"role": "user", "content": Q1},
            {"role": "assistant", "content": A1, "reasoning_content": R1},
            {"role": "user", "content": Q2},
        ]
    )
    types, reasoning_text = [], ""
    with client.responses.stream(input=items, **kw) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.reasoning_text.delta":
                reasoning_text += event.delta
        final = stream.get_final_response()
    assert reasoning_text == R2
    assert final.output_text == A2
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].encrypted_content
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 18
    for kind in ("response.reasoning_text.done", "response.output_text.done"):
        assert kind in types
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    check_turns(proxy, s["session_id"], sent)


def test_messages(proxy: LiveProxy) -> None:
    """Thinking blocks with signature deltas; sent back as Claude Code does, then verified."""
    import anthropic

    s = proxy.new_session(group_id="messages")
    client = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key=s["api_key"])
    kw: dict[str, Any] = {
        "model": proxy.model_name,
        "max_tokens": 80,
        "extra_body": {"temperature": 0},  # this SDK's create() has no temperature argument
        "thinking": {"type": "adaptive"},
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": Q1}]
    m1 = client.messages.create(messages=messages, **kw)  # type: ignore[arg-type]
    thinking, text = m1.content
    assert thinking.type == "thinking" and thinking.thinking == R1 and thinking.signature
    assert text.type == "text" and text.text == A1
    sent = [[{"role": "user", "content": Q1}]]
    back = [block.model_dump() for block in m1.content]
    forged = {**back[0], "thinking": "I made this up."}
    with pytest.raises(anthropic.BadRequestError, match="signature"):
        client.messages.create(  # type: ignore[call-overload]
            messages=[*messages, {"role": "assistant", "content": [forged, back[1]]}], **kw
        )
    messages += [{"role": "assistant", "content": back}, {"role": "user", "content": Q2}]
    sent.append(
        [
            {"role": "user", "content": Q1},
            {"role": "assistant", "content": A1},
            {"role": "user", "content": Q2},
        ]
    )
    with client.messages.stream(messages=messages, **kw) as stream:  # type: ignore[arg-type]
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == R2 and final.content[1].text == A2  # type: ignore[union-attr]
    assert final.content[0].signature  # type: ignore[union-attr]
    assert "thinking_delta" in deltas and "signature_delta" in deltas
    assert deltas.index("signature_delta") < deltas.index("text_delta")
    check_turns(proxy, s["session_id"], sent)


def test_thinking_disabled_and_budget(proxy: LiveProxy) -> None:
    """``enable_thinking: false`` reaches the template; a budget closes the reasoning."""
    import anthropic

    s = proxy.new_session(group_id="switches")
    client = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key=s["api_key"])
    m = client.messages.create(
        model=proxy.model_name,
        max_tokens=20,
        extra_body={"temperature": 0},
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": Q1}],
    )
    assert all(block.type == "text" for block in m.content)
    tokenizer = AutoTokenizer.from_pretrained(proxy.model_dir)
    (c,) = proxy.trajectory(s["session_id"])["completions"]
    assert tokenizer.decode(c["prompt_ids"]).endswith("<think>\n\n</think>\n\n")

    import httpx

    s = proxy.new_session(group_id="budget")
    http_kw = {"headers": {"Authorization": f"Bearer {s['api_key']}"}, "timeout": 60}
    body = {
        "model": proxy.model_name,
        "messages": [{"role": "user", "content": Q1}],
        "temperature": 0,
        "max_tokens": 30,
        "reasoning_budget": 4,
    }
    r = httpx.post(f"{s['base_url']}/chat/completions", json=body, **http_kw).json()
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] == "1 "  # <think> \n 1 space: four tokens
    (c,) = proxy.trajectory(s["session_id"])["completions"]
    close = tokenizer.encode("\n</think>\n\n", add_special_tokens=False)
    assert c["output_ids"][4 : 4 + len(close)] == close
    assert c["output_logprobs"][4 : 4 + len(close)] == [0.0] * len(close)
    assert c["sampling"]["logit_transforms"] == ["reasoning_budget"]
    assert len(c["output_ids"]) == len(c["output_logprobs"]) == len(c["output_versions"])


def test_a_constrained_answer_starts_after_the_reasoning(proxy: LiveProxy) -> None:
    """JSON output is enforced on the answer only: the model still thinks as taught."""
    s = proxy.new_session(group_id="constrained")
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    r = client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": Q1}],
        temperature=0,
        max_tokens=40,
        response_format={"type": "json_object"},
    )
    message = r.choices[0].message
    assert message.reasoning_content == R1  # type: ignore[attr-defined]
    assert (message.content or "").startswith("{")  # the grammar holds from the answer on
    (c,) = proxy.trajectory(s["session_id"])["completions"]
    assert c["sampling"]["logit_transforms"] == ["grammar:structural_tag"]
