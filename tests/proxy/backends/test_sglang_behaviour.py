"""The proxy against SGLang as it really behaves (issue 9, section 2), through the fake.

Each test drives the client, the pool or the generation loop against a fake
that copies one awkward behaviour of SGLang 0.5.23 (see ``fake_sglang.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import string
from typing import Any

import httpx
import pytest
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.errors import BackendUnavailable, BadRequest, ContextTooLong
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.service.attempt import backend_rid
from proxima.proxy.service.generation import GenerationResult, generate
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app

from tests.proxy.servers import served

LETTERS = string.ascii_lowercase


def _text(ids: list[int]) -> str:
    return "".join(LETTERS[t % 26] for t in ids)


def _ids(text: str) -> list[int]:
    return [LETTERS.index(c) for c in text]


def _client(fakes: dict[str, FakeBackend]) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        mounts={u: httpx.ASGITransport(app=create_fake_app(f)) for u, f in fakes.items()}
    )


async def _run(pool: BackendPool, params: Sampling, **kw: Any) -> GenerationResult:
    result = GenerationResult()
    async for _ in generate(
        pool, prompt_ids=kw.pop("prompt", [1, 2]), params=params, result=result, **kw
    ):
        pass
    return result


async def test_long_weight_update_ejects_no_backend_and_moves_no_session() -> None:
    """SGLang's /health generates and blocks while paused, then answers 503 by itself."""
    fakes = {
        u: FakeBackend(weight_load_s=1.5, health_timeout_s=0.3, health_poll_s=0.05)
        for u in ("http://a", "http://b")
    }
    async with _client(fakes) as http:
        pool = BackendPool(list(fakes), http=http)
        pinned = pool.choose("session-1")
        pool.start_health_checks(0.05)
        try:
            await asyncio.sleep(0.3)  # idle probes pass: the fake generates a token
            assert all(b.healthy for b in pool.backends)
            assert sum(f.health_probes for f in fakes.values()) > 0
            update = await pool.update_weights(version=1, path="/w/v1")
            await asyncio.sleep(0.3)
        finally:
            await pool.close()
        assert update.seconds > 1.5 > fakes["http://a"].health_timeout_s
        # Never taken out, not even for a moment (a later probe would have put it back).
        assert all(b.healthy and b.failures == 0 and b.version == 1 for b in pool.backends)
        assert pool.choose("session-1") is pinned


async def test_health_generates_and_a_paused_backend_answers_503_by_itself() -> None:
    """Served by uvicorn (uvloop's clock ticks in milliseconds), as the fake runs in CI."""
    fake = FakeBackend(health_timeout_s=0.5, health_poll_s=0.05)
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            client = BackendPool([server.url], http=http).backends[0].client
            assert await client.health()
            assert fake.generated_tokens == 1  # the probe generated one token
            await client.pause_generation(mode="abort")
            assert not await client.health()  # SGLang's own verdict while paused
            await client.continue_generation()
            assert await client.health()


async def test_abort_with_status_is_an_error_at_once() -> None:
    fake = FakeBackend(max_input_tokens=4)
    async with served({"a": create_fake_app(fake)}) as (http, urls):
        pool = BackendPool([urls["a"]], http=http)
        with pytest.raises(ContextTooLong, match="exceeds the maximum allowed length"):
            await _run(pool, Sampling(max_tokens=5), prompt=[1, 2, 3, 4, 5])
        assert fake.requests == 1  # not resumed


@pytest.mark.parametrize("status", [400, 422, 503])
def test_abort_status_maps_to_openai_errors(status: int) -> None:
    from proxima.proxy.backends.protocol import FinishReason
    from proxima.proxy.service.attempt import abort_error

    finish = FinishReason(type="abort", status_code=status, message="bad", err_type="X")
    assert finish.is_error
    error = abort_error(finish)
    assert isinstance(error, BadRequest if status < 500 else BackendUnavailable)
    assert error.status_code == (400 if status < 500 else 503)
    assert not FinishReason(type="abort", status_code=None, message="Abort").is_error


@pytest.mark.parametrize("incremental", [False, True])
async def test_abort_of_a_retracted_request_duplicates_no_token(incremental: bool) -> None:
    """Incremental mode: the abort echo repeats the last token with the full count."""
    fake = FakeBackend(incremental=incremental, tokens_per_s=300, script=list(range(200)))
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            params = Sampling(max_tokens=40, ignore_eos=True)
            task = asyncio.create_task(_run(pool, params, prompt=[0, 1]))
            while not fake.generated_tokens >= 10:
                await asyncio.sleep(0.005)
            (rid,) = fake.running
            fake.retract(rid)
            fake.abort(rid)
            result = await task
    # The script makes token == position: one unbroken count from the prompt's end.
    assert result.output_ids == list(range(2, 42))
    assert len(result.logprobs) == 40 and result.interruptions == 1


async def test_dp_list_of_paused_requests_is_a_success() -> None:
    fake = FakeBackend(dp_size=2)
    async with _client({"http://a": fake}) as http:
        pool = BackendPool(["http://a"], http=http)
        update = await pool.update_weights(version=3, path="/w/v3")
        assert update.backends == ["http://a"] and pool.version == 3
        assert fake.weight_version == "3"


async def test_null_top_logprobs_are_floored_and_a_null_chosen_one_is_refused() -> None:
    async with served(
        {
            "a": create_fake_app(FakeBackend()),
            "b": create_fake_app(FakeBackend(null_logprob_at=frozenset({3}))),
        }
    ) as (http, urls):
        greedy = Sampling(max_tokens=6, temperature=0.0, top_logprobs=3, ignore_eos=True)
        result = await _run(BackendPool([urls["a"]], http=http), greedy)
        assert all(len(top) == 3 for top in result.top_logprobs)
        # Alternatives of a greedy request have logprob -inf: JSON null, shown as OpenAI's floor.
        assert {lp for top in result.top_logprobs for _, lp in top[1:]} == {-9999.0}
        with pytest.raises(BackendUnavailable, match="non-finite logprob"):
            await _run(BackendPool([urls["b"]], http=http), greedy)


async def test_stop_string_split_by_an_interruption_still_stops() -> None:
    """SGLang matches stop strings in its own output only; the proxy joins the boundary."""
    script = _ids("xxabcdhelloqrstuvwxyz" * 3)
    # Sequence length 9 = prompt (2) + "abcdhel": the interruption splits "hello".
    fake = FakeBackend(script=script, abort_at=frozenset({9}), text_of=_text)
    async with served({"a": create_fake_app(fake)}) as (http, urls):
        pool = BackendPool([urls["a"]], http=http)
        params = Sampling(max_tokens=20, stop=["hello"], decode=_text)
        result = await _run(pool, params, prompt=script[:2])
        assert result.interruptions == 1
        assert _text(result.output_ids) == "abcdhello"
        assert (result.finish_reason, result.matched_stop) == ("stop", "hello")
        assert len(result.logprobs) == len(result.versions) == 9
        # Without a decoder the loop cannot see it: the fake alone misses the stop.
        fake.abort_at = {9}
        blind = await _run(pool, Sampling(max_tokens=20, stop=["hello"]), prompt=script[:2])
        assert blind.finish_reason == "length"


def test_backend_rids_are_never_prefixes_of_each_other() -> None:
    bases = ["c", "c-1", "c-1-0", "c#", "c-1#", "chatcmpl-x", "chatcmpl-x-1", ""]
    rids = [backend_rid(b, a) for b in bases for a in (0, 1, 10, 11)]
    assert len(set(rids)) == len(rids)
    for one, other in itertools.permutations(rids, 2):
        assert not other.startswith(one), (one, other)


async def test_aborting_one_completion_leaves_its_neighbour_running() -> None:
    """Choice 0 (id ``c``) on its second attempt and choice 1 (id ``c-1``) run together."""
    fake = FakeBackend(tokens_per_s=200, abort_at=frozenset({5}))
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            params = Sampling(max_tokens=60, ignore_eos=True)
            first = asyncio.create_task(_run(pool, params, prompt=[1, 2], request_id="c"))
            while fake.requests < 2:  # choice 0 was interrupted once and resumed
                await asyncio.sleep(0.005)
            second_result = GenerationResult()

            async def second() -> None:
                async for _ in generate(
                    pool, prompt_ids=[7] * 10, params=params, result=second_result, request_id="c-1"
                ):
                    pass

            other = asyncio.create_task(second())
            while len(second_result.output_ids) < 3:
                await asyncio.sleep(0.005)
            first.cancel()  # the client went away: the proxy aborts choice 0's request
            with pytest.raises(asyncio.CancelledError):
                await first
            await other
    assert second_result.interruptions == 0
    assert second_result.finish_reason == "length" and len(second_result.output_ids) == 60
