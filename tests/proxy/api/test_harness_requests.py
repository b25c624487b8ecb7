"""The request bodies Codex CLI and Claude Code send, translated (no server).

The bodies are the harnesses' own, as captured from Codex CLI 0.169.0
(``codex exec``, a custom provider with ``wire_api = "responses"``) and Claude
Code 2.1.197 (``claude -p``), with long texts shortened. Every field they send
must be accepted; the live runs of both binaries are in ``test_harnesses_live``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from proxima.proxy.errors import BadRequest, ContextTooLong
from proxima.proxy.service.canonical import ChatInput
from proxima.proxy.surfaces.messages import translate as messages_translate
from proxima.proxy.surfaces.messages.errors import error_of
from proxima.proxy.surfaces.messages.schema import MessagesRequest
from proxima.proxy.surfaces.responses import translate as responses_translate
from proxima.proxy.surfaces.responses.events import ResponseHead, output_items
from proxima.proxy.surfaces.responses.schema import ResponsesRequest
from proxima.proxy.surfaces.responses.translate import tool_namespaces
from proxima.proxy.tools import ParsedOutput, ToolCall

EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY, returning output or a session ID.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string", "description": "Shell command to execute."}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
CLOSE_AGENT = {
    "type": "function",
    "name": "close_agent",
    "description": "Close an agent.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
}
CODEX_TURN_1: dict[str, Any] = {
    "model": "tiny",
    "stream": True,
    "input": [
        {
            "type": "message",
            "id": "msg_266d3c65",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are a coding agent."}],
        },
        {
            "type": "message",
            "id": "msg_01a20f9e",
            "role": "user",
            "content": [{"type": "input_text", "text": "<environment_context>\n</env>"}],
        },
        {
            "type": "message",
            "id": "msg_01a20f9f",
            "role": "user",
            "content": [{"type": "input_text", "text": "Create a file named done.txt"}],
        },
    ],
    "tools": [
        EXEC_COMMAND,
        {
            "type": "namespace",
            "name": "multi_agent_v1",
            "description": "Tools for spawning and managing sub-agents.",
            "tools": [CLOSE_AGENT],
        },
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a20f9e-8048-7553-b61b-d2c640e4d48f",
    "client_metadata": {
        "x-codex-window-id": "01a20f9e-8048-7553-b61b-d2c640e4d48f:0",
        "turn_id": "01a20f9e-8057-77a1-bdf0-b3e3be98246e",
        "x-codex-turn-metadata": '{"session_id":"01a20f9e"}',
    },
}

BASH = {
    "name": "Bash",
    "description": "execute shell commands",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"command": {"description": "The command to execute", "type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
    },
}
CLAUDE_TURN_1: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>\nToday's date is 2026-11-24.\n"},
                {
                    "type": "text",
                    "text": "Create a file named done.txt",
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
        {"role": "system", "content": "Available agent types for the Agent tool: ..."},
    ],
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.c3b;"},
        {
            "type": "text",
            "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
            "cache_control": {"type": "ephemeral"},
        },
        {"type": "text", "text": "You run shell commands.", "cache_control": {"type": "ephemeral"}},
    ],
    "tools": [BASH],
    "metadata": {"user_id": '{"device_id":"510c","account_uuid":"","session_id":"029d"}'},
    "max_tokens": 32000,
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "stream": True,
}


def test_codex_first_request_is_accepted_whole() -> None:
    req = ResponsesRequest.model_validate(CODEX_TURN_1)
    canonical = responses_translate.canonical_request(req)
    chat = canonical.input
    assert isinstance(chat, ChatInput) and chat.tools is not None
    assert [m["role"] for m in chat.messages] == ["system", "user", "user"]
    assert chat.messages[2]["content"] == "Create a file named done.txt"
    # The namespace's function is a function tool; web_search is not offered to the model.
    assert [t["function"]["name"] for t in chat.tools] == ["exec_command", "close_agent"]
    assert chat.tools[1]["function"]["parameters"] == CLOSE_AGENT["parameters"]
    # No max_output_tokens: the server's default output cap applies (service.prepare).
    assert canonical.sampling.max_tokens is None


def test_a_namespaced_call_names_its_namespace_in_the_output_item() -> None:
    namespaces = tool_namespaces(CODEX_TURN_1["tools"])
    assert namespaces == {"close_agent": "multi_agent_v1"}
    head = ResponseHead("resp_1", 0, "tiny", {}, namespaces)
    parsed = ParsedOutput(
        content="",
        tool_calls=[
            ToolCall("call_1", "close_agent", "{}"),
            ToolCall("call_2", "exec_command", "{}"),
        ],
    )
    items = output_items(head, parsed, "tool_calls")
    assert [(i["name"], i.get("namespace")) for i in items] == [
        ("close_agent", "multi_agent_v1"),
        ("exec_command", None),
    ]


def test_codex_second_request_round_trips_the_call_with_its_item_ids() -> None:
    body = json.loads(json.dumps(CODEX_TURN_1))
    body["input"] += [
        {
            "type": "function_call",
            "id": "fc_1",
            "name": "exec_command",
            "namespace": None,
            "arguments": '{"cmd": "touch done.txt"}',
            "call_id": "call_1",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Process exited 0"},
    ]
    canonical = responses_translate.canonical_request(ResponsesRequest.model_validate(body))
    assistant, tool = canonical.input.messages[-2:]
    assert assistant["tool_calls"][0]["function"]["name"] == "exec_command"
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "Process exited 0"}


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([EXEC_COMMAND, EXEC_COMMAND], "tools[1].name"),
        (
            [CLOSE_AGENT, {"type": "namespace", "name": "n", "tools": [CLOSE_AGENT]}],
            "tools[1].tools[0].name",
        ),
        ([{"type": "namespace", "name": "n"}], "tools[0]"),
    ],
)
def test_namespaced_names_must_stay_unique(tools: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        responses_translate.translate_tools(tools)
    assert info.value.param == param


def test_forcing_web_search_stays_a_400() -> None:
    body = {**CODEX_TURN_1, "tool_choice": {"type": "web_search"}}
    with pytest.raises(BadRequest) as info:
        responses_translate.canonical_request(ResponsesRequest.model_validate(body))
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize(
    "reasoning",
    [{"summary": "auto"}, {"effort": "high", "summary": "detailed"}, {"effort": None}],
)
def test_reasoning_options_are_no_ops_for_a_model_that_does_not_think(
    reasoning: dict[str, Any],
) -> None:
    body = {**CODEX_TURN_1, "reasoning": reasoning}
    plain = {k: v for k, v in CODEX_TURN_1.items() if k not in ("reasoning", "include")}
    as_sent = responses_translate.canonical_request(ResponsesRequest.model_validate(body))
    without = responses_translate.canonical_request(ResponsesRequest.model_validate(plain))
    assert as_sent == without


def test_claude_code_first_request_is_accepted_whole() -> None:
    canonical = messages_translate.canonical_request(MessagesRequest.model_validate(CLAUDE_TURN_1))
    chat = canonical.input
    assert isinstance(chat, ChatInput) and chat.tools is not None
    system, user, mid_system = chat.messages
    assert system == {
        "role": "system",
        "content": "x-anthropic-billing-header: cc_version=2.1.197.c3b;\n"
        "You are a Claude agent, built on Anthropic's Claude Agent SDK.\n"
        "You run shell commands.",
    }
    assert user["role"] == "user" and user["content"].endswith("\nCreate a file named done.txt")
    assert mid_system == {"role": "system", "content": CLAUDE_TURN_1["messages"][1]["content"]}
    assert canonical.sampling.max_tokens == 32000
    assert chat.tools[0]["function"]["name"] == "Bash"
    # Nothing of thinking, effort or context_management reaches generation.
    plain = {
        k: v
        for k, v in CLAUDE_TURN_1.items()
        if k not in ("thinking", "context_management", "output_config")
    }
    assert canonical == messages_translate.canonical_request(MessagesRequest.model_validate(plain))


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("thinking", {"type": "enabled", "budget_tokens": 2048}, "thinking"),
        ("output_config", {"effort": "extreme"}, "output_config.effort"),
        ("context_management", {"edits": [{"type": "clear_tool_uses_20250919"}]}, None),
        ("context_management", {"edits": "all"}, "context_management"),
    ],
)
def test_what_thinking_cannot_do_stays_a_400(field: str, value: Any, param: str | None) -> None:
    body = {**CLAUDE_TURN_1, field: value}
    with pytest.raises(BadRequest) as info:
        messages_translate.canonical_request(MessagesRequest.model_validate(body))
    assert info.value.param == (param or "context_management.edits[0].type")


def test_max_tokens_over_the_context_is_worded_as_anthropic_words_it() -> None:
    exc = ContextTooLong(
        "x", param="max_tokens", prompt_tokens=1200, max_tokens=32000, context_length=2048
    )
    assert error_of(exc) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "input length and `max_tokens` exceed context limit: 1200 + 32000 > "
            "2048, decrease input length or `max_tokens` and try again (or serve with "
            "--clamp-max-tokens)",
        },
    }
