"""/generate on the tiny model: equivalence with transformers, batching, stopping, limits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import PROMPTS, Reference, generate, logprobs_of, serve_in_process
from proxima.proxy.embedded.engine import Engine


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


async def test_greedy_matches_transformers_generate(
    client: httpx.AsyncClient, reference: Reference
) -> None:
    for prompt in PROMPTS[:3]:
        prompt_ids = reference.encode(prompt)
        expected_ids, expected_logprobs = reference.greedy(prompt_ids, max_new_tokens=24)
        reply = await generate(
            client,
            input_ids=prompt_ids,
            sampling_params={"temperature": 0, "max_new_tokens": 24},
            return_logprob=True,
        )
        assert reply["output_ids"] == expected_ids
        # KV-cached decoding vs transformers' generate: another summation order (~1e-6).
        assert logprobs_of(reply) == pytest.approx(expected_logprobs, abs=1e-4)
        assert reply["meta_info"]["prompt_tokens"] == len(prompt_ids)
        assert reply["meta_info"]["completion_tokens"] == len(expected_ids)
        assert reply["meta_info"]["weight_version"] == "0"
        assert reply["text"] == reference.tokenizer.decode(expected_ids, skip_special_tokens=True)


async def test_sampled_logprobs_are_log_softmax_at_temperature(
    client: httpx.AsyncClient, reference: Reference
) -> None:
    prompt_ids = reference.encode(PROMPTS[0])
    params = {"temperature": 0.7, "max_new_tokens": 20, "sampling_seed": 11, "ignore_eos": True}
    reply = await generate(
        client, input_ids=prompt_ids, sampling_params=params, return_logprob=True
    )
    output_ids = reply["output_ids"]
    assert len(output_ids) == 20
    assert len(set(output_ids)) > 3  # really sampled, not a repeated argmax
    expected = reference.scored(prompt_ids, output_ids, temperature=0.7)
    assert torch.allclose(torch.tensor(logprobs_of(reply)), expected, atol=1e-4)
    again = await generate(client, input_ids=prompt_ids, sampling_params=params)
    assert again["output_ids"] == output_ids  # same seed, same tokens


async def test_batched_equals_alone(
    client: httpx.AsyncClient, engine: Engine, reference: Reference
) -> None:
    bodies = [
        {
            "input_ids": reference.encode(prompt),
            "sampling_params": {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
            "return_logprob": True,
        }
        for prompt in PROMPTS
    ]
    bodies.append(
        {
            **bodies[0],
            "sampling_params": {"temperature": 0.9, "max_new_tokens": 40, "sampling_seed": 3},
        }
    )
    alone = [await generate(client, **body) for body in bodies]
    assert engine.stats.peak_batch_size == 1
    batched = await asyncio.gather(*(generate(client, **body) for body in bodies))
    assert engine.stats.peak_batch_size >= 4
    for one, many in zip(alone, batched, strict=True):
        assert many["output_ids"] == one["output_ids"]
        assert logprobs_of(many) == pytest.approx(logprobs_of(one), abs=1e-4)  # padded shapes


async def test_stop_token_ids_stop_with_the_token_included(
    client: httpx.AsyncClient, reference: Reference
) -> None:
    body = {"input_ids": reference.encode(PROMPTS[1]), "return_logprob": True}
    params = {"temperature": 1.0, "max_new_tokens": 30, "sampling_seed": 5, "ignore_eos": True}
    full = (await generate(client, **body, sampling_params=params))["output_ids"]
    stop_id = full[6]
    cut = full.index(stop_id) + 1
    reply = await generate(client, **body, sampling_params={**params, "stop_token_ids": [stop_id]})
    assert reply["output_ids"] == full[:cut]
    assert len(reply["meta_info"]["output_token_logprobs"]) == cut
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


async def test_eos_stops_unless_ignored(eos_model_dir: Path) -> None:
    eos_ids = Reference(eos_model_dir).model.generation_config.eos_token_id
    async with serve_in_process(eos_model_dir) as client:
        body = {"text": "hi", "return_logprob": True}
        reply = await generate(
            client, **body, sampling_params={"temperature": 0, "max_new_tokens": 8}
        )
        [token] = reply["output_ids"]
        assert token in eos_ids
        assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
        assert len(reply["meta_info"]["output_token_logprobs"]) == 1
        assert reply["text"] == ""
        visible = await generate(
            client,
            **body,
            sampling_params={"temperature": 0, "max_new_tokens": 8, "skip_special_tokens": False},
        )
        assert visible["text"] in ("<|im_end|>", "<|endoftext|>")
        ignored = await generate(
            client,
            **body,
            sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        )
        assert ignored["output_ids"] == [token] * 8
        assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


async def test_stop_string_truncates_text(client: httpx.AsyncClient, reference: Reference) -> None:
    body = {"input_ids": reference.encode(PROMPTS[3])}
    params = {"temperature": 1.0, "max_new_tokens": 40, "sampling_seed": 2, "ignore_eos": True}
    full = (await generate(client, **body, sampling_params=params))["output_ids"]
    decode = reference.tokenizer.decode
    full_text = decode(full, skip_special_tokens=True)
    start = next(
        i
        for i in range(len(full_text) // 3, len(full_text) - 1)
        if full_text[i : i + 2].isascii() and full_text[i : i + 2].isprintable()
    )
    stop = full_text[start : start + 2]
    n = next(
        n for n in range(1, len(full) + 1) if stop in decode(full[:n], skip_special_tokens=True)
    )
    reply = await generate(
        client, **body, sampling_params={**params, "stop": [stop, "never-matches"]}
    )
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert reply["output_ids"] == full[:n]
    assert reply["text"] == full_text[: full_text.find(stop)]


async def test_max_new_tokens_finishes_with_length(client: httpx.AsyncClient) -> None:
    params = {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True}
    reply = await generate(client, text="hello", sampling_params=params)
    assert len(reply["output_ids"]) == 7
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert reply["meta_info"]["prompt_tokens"] == 5
    assert "output_token_logprobs" not in reply["meta_info"]
    empty = await generate(client, text="hello", sampling_params={**params, "max_new_tokens": 0})
    assert empty["output_ids"] == []
    assert empty["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_top_logprobs_are_sorted_and_contain_greedy_token(client: httpx.AsyncClient) -> None:
    params = {"temperature": 0, "max_new_tokens": 4}
    reply = await generate(
        client, text="hello", sampling_params=params, return_logprob=True, top_logprobs_num=3
    )
    tops = reply["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(reply["output_ids"])
    for token, logprob, top in zip(reply["output_ids"], logprobs_of(reply), tops, strict=True):
        assert [entry[1] for entry in top][0] == token
        assert top[0][0] == pytest.approx(logprob)
        assert [entry[0] for entry in top] == sorted((entry[0] for entry in top), reverse=True)


async def test_too_long_prompt_is_rejected(client: httpx.AsyncClient, engine: Engine) -> None:
    response = await client.post("/generate", json={"input_ids": [65] * engine.context_length})
    assert response.status_code == 400
    assert "context length" in response.json()["error"]["message"]


async def test_invalid_requests_are_rejected(client: httpx.AsyncClient) -> None:
    bad_bodies = [
        {"text": "hi", "sampling_params": {"temperature": -1}},
        {"text": "hi", "input_ids": [1]},
        {"input_ids": []},
        {"input_ids": [10**6]},
    ]
    for body in bad_bodies:
        response = await client.post("/generate", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["message"]


async def test_generation_stops_at_the_end_of_the_context(short_context_model_dir: Path) -> None:
    async with serve_in_process(short_context_model_dir) as client:
        params = {"temperature": 0, "max_new_tokens": 100, "ignore_eos": True}
        reply = await generate(client, input_ids=[65] * 20, sampling_params=params)
        assert len(reply["output_ids"]) == 12
        assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        response = await client.post("/generate", json={"input_ids": [65] * 32})
        assert response.status_code == 400
