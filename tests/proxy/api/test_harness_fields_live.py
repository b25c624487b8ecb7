"""The fields Codex CLI and Claude Code send, against a live proxy (the taught tiny model).

Raw HTTP, as the harnesses send it (``test_harness_requests`` has their bodies):
``HEAD /``, ``POST /v1/messages?beta=true`` with ``anthropic-beta`` and every
thinking option, a ``max_tokens`` over the context (Anthropic's 400, or clamped
with ``--clamp-max-tokens``), and a Responses request without
``max_output_tokens`` (the server's default output cap, recorded as such).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxima.proxy.testing.live import LiveProxy

from tests.proxy.api.test_harness_requests import CLAUDE_TURN_1, CODEX_TURN_1
from tests.proxy.scripts import CALL_TEXT, QUESTION, WEATHER_TOOL

FUNCTION = WEATHER_TOOL["function"]
BETAS = "claude-code-20250219,context-management-2025-06-27,mid-conversation-system-2026-04-07"


def claude_body(model: str, **fields: Any) -> dict[str, Any]:
    """Claude Code's first request, asking the scripted question with the scripted tool."""
    return {
        **CLAUDE_TURN_1,
        "model": model,
        "system": None,
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        "tools": [
            {
                "name": FUNCTION["name"],
                "description": FUNCTION["description"],
                "input_schema": FUNCTION["parameters"],
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "stream": False,
        "temperature": 0,
        **fields,
    }


def post_messages(proxy: LiveProxy, session: dict[str, Any], body: dict[str, Any]) -> Any:
    return httpx.post(
        f"{proxy.url}/v1/messages?beta=true",
        json=body,
        headers={
            "x-api-key": session["api_key"],
            "anthropic-version": "2023-06-01",
            "anthropic-beta": BETAS,
        },
        timeout=60,
    )


def test_root_answers_head_and_get(live_proxy: LiveProxy) -> None:
    head = httpx.head(live_proxy.url + "/", timeout=10)
    assert head.status_code == 200
    assert httpx.get(live_proxy.url + "/", timeout=10).json() == {
        "service": "proxima",
        "api": "/v1",
    }


def test_claude_code_request_with_every_option_is_served(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="claude-fields")
    r = post_messages(live_proxy, s, claude_body(live_proxy.model_name, max_tokens=80))
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["stop_reason"] == "tool_use"
    assert message["content"][-1]["input"] == {"city": "Paris"}
    (stored,) = live_proxy.trajectory(s["session_id"])["completions"]
    assert stored["response_text"] == CALL_TEXT


def test_max_tokens_over_the_context_is_anthropics_400(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="claude-too-long")
    r = post_messages(live_proxy, s, claude_body(live_proxy.model_name))  # max_tokens 32000
    assert r.status_code == 400
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("input length and `max_tokens` exceed context")
    assert " + 32000 > 2048," in error["error"]["message"]
    assert live_proxy.trajectory(s["session_id"])["completions"] == []


def test_responses_without_max_output_tokens_get_the_default_cap(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="codex-fields")
    body = {
        **CODEX_TURN_1,
        "model": live_proxy.model_name,
        "input": QUESTION,
        # Codex's own web_search tool beside the scripted function (accepted, not offered).
        "tools": [{"type": "function", **FUNCTION}, CODEX_TURN_1["tools"][-1]],
        "stream": False,
        "temperature": 0,
    }
    r = httpx.post(
        f"{live_proxy.base_url}/responses",
        json=body,
        headers={"Authorization": f"Bearer {s['api_key']}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "completed"
    (stored,) = live_proxy.trajectory(s["session_id"])["completions"]
    assert stored["response_text"] == CALL_TEXT
    # No max_output_tokens: the server's default_max_tokens (1024, under the 2048 context's
    # room), recorded as the default.
    assert 2048 - len(stored["prompt_ids"]) > 1024
    assert stored["sampling"]["max_tokens"] == 1024
    assert stored["sampling"]["max_tokens_default"] is True


@pytest.fixture(scope="module")
def clamping_proxy(
    taught_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("clamp")
    proxy = LiveProxy(
        taught_model_dir,
        db_url=f"sqlite:///{work / 'store.db'}",
        log_path=work / "serve.log",
        extra_args=["--clamp-max-tokens"],
    )
    yield proxy.start()
    proxy.stop()


def test_clamp_max_tokens_lowers_a_fixed_max_tokens(clamping_proxy: LiveProxy) -> None:
    s = clamping_proxy.new_session(group_id="claude-clamped")
    r = post_messages(clamping_proxy, s, claude_body(clamping_proxy.model_name))
    assert r.status_code == 200, r.text
    (stored,) = clamping_proxy.trajectory(s["session_id"])["completions"]
    assert stored["response_text"] == CALL_TEXT
    assert stored["sampling"]["max_tokens"] == 2048 - len(stored["prompt_ids"])
    assert "max_tokens_default" not in stored["sampling"]  # asked for, then clamped


def test_a_reply_cut_inside_a_tool_call_returns_its_text_and_no_call(
    live_proxy: LiveProxy,
) -> None:
    """The README's decision, on each surface: no call for the unfinished block, its text as
    generated in the content, and the reply marked as cut."""
    s = live_proxy.new_session(group_id="cut-call")
    auth = {"Authorization": f"Bearer {s['api_key']}"}
    chat = httpx.post(
        f"{live_proxy.base_url}/chat/completions",
        json={
            "model": live_proxy.model_name,
            "messages": [{"role": "user", "content": QUESTION}],
            "tools": [WEATHER_TOOL],
            "max_tokens": 12,
            "temperature": 0,
        },
        headers=auth,
        timeout=60,
    ).json()
    (choice,) = chat["choices"]
    cut_text = choice["message"]["content"]
    assert choice["finish_reason"] == "length" and choice["message"].get("tool_calls") is None
    assert CALL_TEXT.startswith(cut_text) and cut_text.startswith("<tool_call>")

    responses = httpx.post(
        f"{live_proxy.base_url}/responses",
        json={
            "model": live_proxy.model_name,
            "input": QUESTION,
            "tools": [{"type": "function", **FUNCTION}],
            "max_output_tokens": 12,
            "temperature": 0,
        },
        headers=auth,
        timeout=60,
    ).json()
    assert responses["status"] == "incomplete"
    assert responses["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = responses["output"]
    assert (item["type"], item["content"][0]["text"]) == ("message", cut_text)

    r = post_messages(live_proxy, s, claude_body(live_proxy.model_name, max_tokens=12))
    message = r.json()
    assert message["stop_reason"] == "max_tokens"
    assert [(b["type"], b.get("text")) for b in message["content"]] == [("text", cut_text)]
