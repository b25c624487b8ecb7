"""The inspector's session view and charts, on hand-built records and the tiny model's tokenizer.

A session's tree (roots, forks, branches back, and why each chain starts), the tokens of each
turn (decoded one by one, escaped, a mark where the policy version changed), the returns and
advantages it shows; and the SVG charts (escaped, an empty chart says so).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from proxima.proxy.inspector.charts import MAX_DOTS, Chart, Series, line_chart
from proxima.proxy.inspector.session_view import build_turns, output_html, token_texts
from proxima.proxy.store.records import CompletionRecord
from transformers import AutoTokenizer

T0 = datetime(2026, 1, 1, tzinfo=UTC)
U1 = {"role": "user", "content": "weather?"}
A1 = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}  # fmt: skip
T1 = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def record(cid: str, n: int, prompt: list[int], output: list[int], messages: list[dict[str, Any]],
           parent: str | None = None, versions: list[int] | None = None,
           reply: dict[str, Any] | None = None, reward: float | None = None) -> CompletionRecord:  # fmt: skip
    return CompletionRecord(
        id=cid,
        session_id="s1",
        parent_id=parent,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.1 * (k + 1) for k in range(len(output))],
        output_versions=versions or [0] * len(output),
        finish_reason="stop",
        created_at=T0 + timedelta(seconds=n),
        request_messages=messages,
        response_message=reply or {"role": "assistant", "content": f"reply {cid}"},
        reward=reward,
    )


def test_the_tree_tells_how_each_turn_attaches(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello <b>world</b>\n", add_special_tokens=False)
    c1 = record("c1", 1, ids, [40, 41], [U1], reply=A1)
    # c2 and c3 both extend c1: a fork (the second after a retry with another tool result).
    c2 = record("c2", 2, [*ids, 40, 41, 50], [42, 43, 44], [U1, A1, T1], "c1", [0, 0, 1])
    c3 = record("c3", 3, [*ids, 40, 41, 51], [45], [U1, A1, {**T1, "content": "rain"}], "c1")
    # c4: messages extend c2's and its reply, tokens not reused (the template re-rendered).
    c4 = record("c4", 4, [1, 2, 3], [46], [U1, A1, T1, c2.response_message or {}, U1])
    # c5: history edited (A1 rewritten): departs from the turns before at message 2.
    c5 = record("c5", 5, [1, 2], [47], [U1, {"role": "assistant", "content": "hm"}, U1])
    # c6 goes back to extend c2 after c4 and c5: a branch back.
    c6 = record("c6", 6, [*c2.prompt_ids, 42, 43, 44, 52], [48], [U1, A1, T1, {}, U1], "c2")
    turns = build_turns([c1, c2, c3, c4, c5, c6], tokenizer, reward=1.0, group_rewards=[1.0, 0.0])
    by_id = {t.record.id: t for t in turns}
    # Depth-first from each root, children in creation order.
    assert [(t.record.id, t.depth) for t in turns] == [
        ("c1", 0), ("c2", 1), ("c6", 2), ("c3", 1), ("c4", 0), ("c5", 0)
    ]  # fmt: skip
    assert by_id["c1"].relation == "root" and by_id["c1"].note == "first turn of the session"
    assert by_id["c2"].relation == by_id["c3"].relation == "fork"
    assert "extends c1 token-exactly" in by_id["c2"].note and "one of 2" in by_id["c2"].note
    assert by_id["c6"].relation == "branch" and "latest turn before it was c5" in by_id["c6"].note
    assert "template renders that reply otherwise" in by_id["c4"].note and "c2" in by_id["c4"].note
    assert "depart from" in by_id["c5"].note and "message 2" in by_id["c5"].note
    # A child shows only what it adds: the new prompt tokens and messages.
    assert by_id["c2"].shared_tokens == len(ids) + 2 and by_id["c2"].new_messages == [T1]
    assert by_id["c2"].earlier_messages == 2
    assert str(by_id["c2"].prompt).count('class="t"') == 1
    assert str(by_id["c1"].prompt).count('class="t"') == len(ids)
    assert "&lt;" in str(by_id["c1"].prompt) and ">&lt;</span>" in str(by_id["c1"].prompt)
    assert "\u21b5" in str(by_id["c1"].prompt)  # a newline token is visible
    # The interrupted completion: a mark between its tokens of versions 0 and 1.
    assert by_id["c2"].version_changes == [(2, 0, 1)] and by_id["c2"].versions == "0\u20131"
    assert str(by_id["c2"].output).count('class="vchg"') == 1
    # Returns at discount 1 (final reward 1 on the last turn), advantages against the group.
    assert all(t.turn_return == 1.0 for t in turns)
    assert all(t.advantage == pytest.approx(1.0) for t in turns)  # (1 - 0.5) / 0.5


def test_per_turn_rewards_add_to_the_returns(tokenizer: Any) -> None:
    c1 = record("c1", 1, [1], [2], [U1], reward=0.5)
    c2 = record("c2", 2, [1, 2, 3], [4], [U1, {}, U1], "c1")
    turns = build_turns([c1, c2], tokenizer, reward=None, group_rewards=[])
    assert [t.turn_return for t in turns] == [0.5, 0.0]
    assert [t.advantage for t in turns] == [None, None]  # no group to compare with


def test_tokens_carry_their_id_logprob_and_version(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab", add_special_tokens=False)
    texts = token_texts(tokenizer, [*ids, 10**7])
    assert texts[10**7] == f"<{10**7}?>"  # outside the vocabulary: shown, not raised
    html = str(output_html(ids, [-0.5, -3.0], [2, 2], texts))
    assert f'data-i="{ids[0]}" data-l="-0.5000" data-v="2"' in html
    assert f"--p:{math.exp(-0.5):.3f}" in html and "vchg" not in html


def test_charts_escape_and_say_when_empty() -> None:
    svg = str(line_chart(Chart("<r>", [Series("a<script>", [(0, 1), (1, 2), (2, 0)])])))
    assert svg.startswith("<svg") and "<script>" not in svg and "a&lt;script&gt;" in svg
    assert svg.count("<circle") == 3 and "<polyline" in svg
    many = str(line_chart(Chart("m", [Series("m", [(k, k % 7) for k in range(MAX_DOTS + 1)])])))
    assert "<polyline" in many and "<circle" not in many
    empty = str(line_chart(Chart("Reward", [Series("r", [])])))
    assert "no data yet" in empty and "<svg" not in empty
    timed = str(
        line_chart(Chart("t", [Series("x", [(1.7e9, 1.0)])], x_time=True, marks=[(1.7e9, "v1")]))
    )
    assert "stroke-dasharray" in timed and "v1" in timed
