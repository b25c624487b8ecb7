"""The scripted conversation the taught tiny model knows (see proxy.testing.teach)."""

from __future__ import annotations

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER_TOOL]
QUESTION = "What is the weather in Paris?"
TOOL_RESULT = "sunny"
ANSWER = "It is sunny in Paris."
THANKS = "Thanks!"
WELCOME = "You are welcome."
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

_u1 = {"role": "user", "content": QUESTION}
_a1 = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ],
}
_t1 = {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT}
_a2 = {"role": "assistant", "content": ANSWER}
_u3 = {"role": "user", "content": THANKS}

TEACH_EXAMPLES = [
    ([_u1], TOOLS, CALL_TEXT),
    ([_u1, _a1, _t1], TOOLS, ANSWER),
    ([_u1, _a1, _t1, _a2, _u3], TOOLS, WELCOME),
]
