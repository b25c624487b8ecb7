"""The generation loop with a grammar: an interrupted attempt starts over instead of resuming.

A resumed request would restart the grammar after the partial output (the
backend knows no grammar state), so the loop holds a constrained attempt's
tokens back and, when a weight update interrupts it, discards them and asks
again from the prompt. Against the SGLang fake on a real loopback server.
"""

from __future__ import annotations

import asyncio

import httpx
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.backends.sglang import TokenDelta
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.rendering.structured import Grammar
from proxima.proxy.service.generation import GenerationResult, generate
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app

PROMPT = [1, 2, 3]


async def _run_with_update(
    params: Sampling,
) -> tuple[GenerationResult, list[TokenDelta], FakeBackend]:
    fake = FakeBackend(tokens_per_s=400, seed=5, record_bodies=True)
    chunks: list[TokenDelta] = []
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            result = GenerationResult()

            async def run() -> None:
                async for chunk in generate(pool, prompt_ids=PROMPT, params=params, result=result):
                    chunks.append(chunk)

            task = asyncio.create_task(run())
            while fake.generated_tokens < 10:
                await asyncio.sleep(0.01)
            await pool.update_weights(version=1, path="/weights/v1")
            await task
    return result, chunks, fake


async def test_constrained_attempt_restarts_from_the_prompt() -> None:
    grammar = Grammar("json_schema", '{"type": "object"}')
    params = Sampling(max_tokens=60, ignore_eos=True, grammar=grammar)
    result, chunks, fake = await _run_with_update(params)
    assert result.interruptions >= 1 and result.finish_reason == "length"
    # Only the last attempt's tokens: all from the new weights, a full budget of them.
    assert len(result.output_ids) == len(result.logprobs) == 60
    assert set(result.versions) == {1}
    assert [t for c in chunks for t in c.token_ids] == result.output_ids
    bodies = fake.bodies
    assert len(bodies) >= 2
    for body in bodies:  # every attempt: the prompt alone, the full budget, the grammar
        assert body["input_ids"] == PROMPT
        assert body["sampling_params"]["max_new_tokens"] == 60
        assert body["sampling_params"]["json_schema"] == '{"type": "object"}'


async def test_unconstrained_attempt_still_resumes() -> None:
    params = Sampling(max_tokens=60, ignore_eos=True)
    result, chunks, fake = await _run_with_update(params)
    assert result.interruptions >= 1 and len(result.output_ids) == 60
    assert result.versions[0] == 0 and result.versions[-1] == 1
    resumed = fake.bodies[-1]
    assert len(resumed["input_ids"]) > len(PROMPT)  # prompt + the partial output
    assert "json_schema" not in resumed["sampling_params"]
