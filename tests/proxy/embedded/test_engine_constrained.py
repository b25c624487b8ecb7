"""/generate with grammars, penalties and logit bias on the tiny model (random weights).

Random weights make the model's own preference worthless, so every valid
output here is the grammar's doing.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from engine_helpers import PROMPTS, Reference, generate, logprobs_of
from proxima.proxy.embedded.engine import Engine
from proxima.proxy.rendering.structured import enforceable_schema
from proxima.proxy.tools import HermesToolParser

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer"},
        "sure": {"type": "boolean"},
        "unit": {"enum": ["cm", "m", "km"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["answer", "sure", "unit", "tags"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


def tool_calls_tag(functions: dict[str, dict[str, Any]], *, single: bool) -> str:
    """A structural tag for hermes tool calls of ``functions`` (as proxy/rendering/structured.py builds)."""
    tags = [
        {
            "type": "tag",
            "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "}\n</tool_call>",
        }
        for name, schema in functions.items()
    ]
    fmt = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": single,
    }
    return json.dumps({"type": "structural_tag", "format": fmt})


async def test_json_schema_output_always_parses_and_validates(
    client: httpx.AsyncClient, reference: Reference
) -> None:
    prompt_ids = reference.encode(PROMPTS[0])
    params = {"temperature": 1.0, "max_new_tokens": 400, "json_schema": json.dumps(SCHEMA)}
    replies = await asyncio.gather(
        *(
            generate(
                client, input_ids=prompt_ids, sampling_params={**params, "sampling_seed": seed}
            )
            for seed in range(8)
        )
    )
    for reply in replies:
        assert reply["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(reply["text"]), SCHEMA)
    assert len({r["text"] for r in replies}) > 1  # sampled, not one forced string


async def test_json_object_regex_and_ebnf(client: httpx.AsyncClient) -> None:
    anything = await generate(
        client,
        text="hi",
        sampling_params={"json_schema": "$$ANY$$", "max_new_tokens": 300, "sampling_seed": 1},
    )
    assert anything["meta_info"]["finish_reason"]["type"] == "stop"
    json.loads(anything["text"])
    regex = await generate(
        client,
        text="hi",
        sampling_params={"regex": "(yes|no)-[0-9]{2}", "max_new_tokens": 20, "sampling_seed": 2},
    )
    assert regex["text"][:3] in ("yes", "no-") and len(regex["text"]) in (6, 5)
    assert regex["meta_info"]["finish_reason"]["type"] == "stop"
    ebnf = await generate(
        client,
        text="hi",
        sampling_params={
            "ebnf": 'root ::= "say " ("hello" | "bye") "!"',
            "max_new_tokens": 20,
            "temperature": 0,
        },
    )
    assert ebnf["text"] in ("say hello!", "say bye!")


async def test_forced_tool_calls_parse_into_valid_calls(client: httpx.AsyncClient) -> None:
    functions = {"get_weather": WEATHER, "ping": {"type": "object", "properties": {}}}
    parser = HermesToolParser()
    for seed, single in [(0, True), (1, False), (2, False)]:
        reply = await generate(
            client,
            text="<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n",
            sampling_params={
                "structural_tag": tool_calls_tag(functions, single=single),
                "max_new_tokens": 400,
                "sampling_seed": seed,
                "skip_special_tokens": False,
            },
        )
        assert reply["meta_info"]["finish_reason"]["type"] == "stop"
        text = reply["text"].removesuffix("<|im_end|>").removesuffix("<|endoftext|>")
        parsed = parser.parse(text)
        assert parsed.content is None and parsed.tool_calls
        if single:
            assert len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), functions[call.name])


async def test_length_limited_strings_as_patterns_stay_valid_json(
    client: httpx.AsyncClient,
) -> None:
    # xgrammar 0.2.7 lets raw control characters into minLength/maxLength strings (invalid
    # JSON); the proxy sends such strings as an equivalent pattern (proxy/rendering/structured.py).
    raw = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 6}},
        "required": ["a"],
        "additionalProperties": False,
    }

    async def texts(schema: dict[str, Any]) -> list[str]:
        replies = await asyncio.gather(
            *(
                generate(
                    client,
                    text="hi",
                    sampling_params={
                        "json_schema": json.dumps(schema),
                        "max_new_tokens": 300,
                        "sampling_seed": seed,
                    },
                )
                for seed in range(12)
            )
        )
        assert all(r["meta_info"]["finish_reason"]["type"] == "stop" for r in replies)
        return [r["text"] for r in replies]

    for text in await texts(enforceable_schema(raw, "response_format")):
        value = json.loads(text)["a"]
        # Length in characters; a byte-level model may emit invalid UTF-8 that decodes
        # to U+FFFD replacement characters, which do not count as the bytes it held.
        assert "\ufffd" in value or len(value) <= 6
    unpatched = await texts(raw)
    assert any(_not_json(t) for t in unpatched)  # the xgrammar bug the rewrite avoids


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return True
    return False


async def test_truncation_mid_json_ends_with_length(client: httpx.AsyncClient) -> None:
    reply = await generate(
        client,
        text="hi",
        sampling_params={"json_schema": json.dumps(SCHEMA), "max_new_tokens": 5},
    )
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert reply["text"].startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply["text"])  # the budget ended mid-object: a prefix, not JSON


async def test_constrained_logprobs_are_those_of_the_masked_distribution(
    client: httpx.AsyncClient, reference: Reference
) -> None:
    # The first token of "(x|y)z" is x or y: the engine samples from the model's
    # distribution renormalised over {x, y} and reports that logprob (as SGLang does),
    # which is NOT the unmasked logprob the trainer recomputes.
    prompt_ids = reference.encode("hello")
    reply = await generate(
        client,
        input_ids=prompt_ids,
        sampling_params={"regex": "(x|y)z", "temperature": 0.8, "sampling_seed": 4},
        return_logprob=True,
    )
    first, second, *_ = reply["output_ids"]
    with torch.no_grad():
        logits = reference.model(torch.tensor([prompt_ids])).logits[0, -1] / 0.8  # (V,)
    x, y = reference.encode("x")[0], reference.encode("y")[0]
    masked = logits[first] - torch.logsumexp(logits[[x, y]], dim=-1)
    unmasked = torch.log_softmax(logits, dim=-1)[first]
    first_lp, second_lp = logprobs_of(reply)[:2]
    assert first_lp == pytest.approx(float(masked), abs=1e-4)
    assert first_lp > float(unmasked) + 1.0  # the mask removed most of the mass
    assert second == reference.encode("z")[0]
    assert second_lp == pytest.approx(0.0, abs=1e-5)  # forced: the only allowed token


async def test_batch_mixing_constrained_and_plain_rows(
    client: httpx.AsyncClient, engine: Engine, reference: Reference
) -> None:
    plain = {
        "input_ids": reference.encode(PROMPTS[1]),
        "sampling_params": {"temperature": 0.9, "max_new_tokens": 30, "sampling_seed": 7},
        "return_logprob": True,
    }
    alone = await generate(client, **plain)
    constrained = {
        "input_ids": reference.encode(PROMPTS[2]),
        "sampling_params": {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 400},
    }
    mixed = await asyncio.gather(generate(client, **plain), generate(client, **constrained))
    assert engine.stats.peak_batch_size >= 2
    assert mixed[0]["output_ids"] == alone["output_ids"]  # a plain row is unaffected
    assert logprobs_of(mixed[0]) == pytest.approx(logprobs_of(alone), abs=1e-4)
    jsonschema.validate(json.loads(mixed[1]["text"]), SCHEMA)


async def test_logit_bias(client: httpx.AsyncClient, reference: Reference) -> None:
    prompt_ids = reference.encode("hello")
    target = reference.encode("Q")[0]
    forced = await generate(
        client,
        input_ids=prompt_ids,
        sampling_params={"temperature": 0, "max_new_tokens": 6, "logit_bias": {str(target): 100}},
        return_logprob=True,
    )
    assert forced["output_ids"] == [target] * 6
    assert all(lp > -1e-3 for lp in logprobs_of(forced))  # the biased distribution's logprob
    plain = await generate(
        client, input_ids=prompt_ids, sampling_params={"temperature": 0, "max_new_tokens": 1}
    )
    banned = plain["output_ids"][0]
    avoided = await generate(
        client,
        input_ids=prompt_ids,
        sampling_params={"temperature": 0, "max_new_tokens": 1, "logit_bias": {str(banned): -100}},
    )
    assert avoided["output_ids"][0] != banned


async def test_penalties_match_a_step_by_step_reference(
    client: httpx.AsyncClient, reference: Reference
) -> None:
    prompt_ids = reference.encode(PROMPTS[3])
    penalties = {"frequency_penalty": 0.7, "presence_penalty": 1.3}
    reply = await generate(
        client,
        input_ids=prompt_ids,
        sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, **penalties},
        return_logprob=True,
    )
    output: list[int] = []
    expected_logprobs = []
    with torch.no_grad():
        for _ in range(12):
            logits = reference.model(torch.tensor([prompt_ids + output])).logits[0, -1]  # (V,)
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(logits))
            logits = logits - counts * 0.7 - (counts > 0).float() * 1.3
            token = int(logits.argmax())
            expected_logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            output.append(token)
    assert reply["output_ids"] == output
    assert logprobs_of(reply) == pytest.approx(expected_logprobs, abs=1e-4)
    unpenalised = await generate(
        client,
        input_ids=prompt_ids,
        sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    )
    assert unpenalised["output_ids"] != output


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"json_schema": '{"type": "objec"}'}, 'Unsupported type \\"objec\\"'),
        ({"regex": "(", "ebnf": 'root ::= "a"'}, "Only one of json_schema, regex, ebnf"),
        ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "uniqueItems cannot be"),
        ({"logit_bias": {"999999": 1.0}}, "logit_bias must have keys in"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias keys must be token ids"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ],
)
async def test_bad_params_are_400(
    client: httpx.AsyncClient, params: dict[str, Any], message: str
) -> None:
    response = await client.post("/generate", json={"text": "hi", "sampling_params": params})
    assert response.status_code == 400
    assert message.replace("\\", "") in response.json()["error"]["message"]


async def test_top_logprobs_of_forbidden_tokens_stay_finite(client: httpx.AsyncClient) -> None:
    # After "x" only "z" is allowed: the other top alternatives have probability 0;
    # their -inf is reported as float32's minimum, so the reply stays strict JSON.
    response = await client.post(
        "/generate",
        json={
            "text": "hi",
            "sampling_params": {"regex": "xz", "max_new_tokens": 5},
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    )
    assert "Infinity" not in response.text and "NaN" not in response.text
    tops = response.json()["meta_info"]["output_top_logprobs"][1]
    assert tops[0][0] == pytest.approx(0.0, abs=1e-5)  # the only allowed token
    assert all(math.isfinite(lp) and lp < -1e37 for lp, *_ in tops[1:])
