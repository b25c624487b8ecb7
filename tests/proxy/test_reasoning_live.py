"""A thinking model through the real SDKs: reasoning apart from the answer on every surface.

The tiny model is taught, under a Qwen3-style template (earlier turns'
reasoning dropped from the history), to answer "What is 1 plus 2?" with
``<think>\\n1 plus 2 is 3.\\n</think>\\n\\nThe answer is 3.`` and, on the
template's own rendering of the second turn, "And 2 plus 2?" with its own
reasoning and "The answer is 4.".
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
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
    final = CACHE / f"thinking-{digest}" / "tiny-thinking"
    if (final / "model.safetensors").exists():
        return final
    staging = Path(tempfile.mkdtemp(dir=CACHE.mkdir(exist_ok=True) or CACHE)) / "tiny-thinking"
    teach(build_tiny_model(staging, thinking=True), EXAMPLES, steps=200)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, final)
    return final


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
