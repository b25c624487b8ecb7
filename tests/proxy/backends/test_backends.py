"""SGLang client and backend pool against SGLang-protocol fakes (no model)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from proxima.proxy.backends.errors import (
    BackendConnectionError,
    BackendOperationFailed,
    BackendRejected,
)
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.backends.protocol import GenerateRequest, SamplingParams
from proxima.proxy.backends.sglang import SGLangClient
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.service.generation import GenerationResult, generate
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app

from tests.proxy.servers import served


def _client(apps: dict[str, Any]) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        mounts={url: httpx.ASGITransport(app=app) for url, app in apps.items()}
    )


def _incremental_app() -> FastAPI:
    """Speaks SGLang's --incremental-streaming-output mode: chunks carry only new tokens."""
    app = FastAPI()

    @app.post("/generate")
    async def gen(request: Request) -> StreamingResponse:
        body = json.loads(await request.body())
        n = body["sampling_params"]["max_new_tokens"]

        async def events():  # type: ignore[no-untyped-def]
            for i in range(n):
                meta = {
                    "id": "r",
                    "completion_tokens": i + 1,
                    "prompt_tokens": 3,
                    "weight_version": "7",
                    "finish_reason": {"type": "length", "length": n} if i == n - 1 else None,
                    "output_token_logprobs": [[-0.5, 100 + i, None]],
                }
                yield f"data: {json.dumps({'text': 'x', 'output_ids': [100 + i], 'meta_info': meta})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def test_stream_accepts_cumulative_and_incremental_chunks() -> None:
    req = GenerateRequest(
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_new_tokens=5, ignore_eos=True),
        return_logprob=True,
    )
    async with served({"cum": create_fake_app(FakeBackend(seed=1)), "inc": _incremental_app()}) as (
        http,
        urls,
    ):
        for url in urls.values():
            deltas = [d async for d in SGLangClient(url, http=http).generate_stream(req)]
            ids = [t for d in deltas for t in d.token_ids]
            assert len(ids) == 5 == sum(len(d.logprobs) for d in deltas)
            assert (
                deltas[-1].finish_reason is not None and deltas[-1].finish_reason.type == "length"
            )
        assert ids == [100, 101, 102, 103, 104]
        assert deltas[0].weight_version == "7"


async def test_client_errors_are_typed() -> None:
    app = FastAPI()

    @app.post("/generate")
    async def bad() -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)

    @app.post("/update_weights_from_disk")
    async def refuse() -> dict[str, Any]:
        return {"success": False, "message": "no such dir"}

    async with served({"b": app}) as (http, urls):
        client = SGLangClient(urls["b"], http=http)
        with pytest.raises(BackendRejected, match="prompt too long"):
            await client.generate(GenerateRequest(input_ids=[1]))
        with pytest.raises(BackendOperationFailed, match="no such dir"):
            await client.update_weights_from_disk(model_path="/x", weight_version="1")
        with pytest.raises(BackendConnectionError):
            await SGLangClient("http://127.0.0.1:1", http=http).flush_cache()


async def test_pool_sticky_and_least_loaded() -> None:
    async with _client({"http://a": create_fake_app(), "http://b": create_fake_app()}) as http:
        pool = BackendPool(["http://a", "http://b"], http=http)
        twin = BackendPool(["http://b", "http://a"], http=http)  # another replica, other order
        keys = [f"session-{i}" for i in range(200)]
        chosen = {k: pool.choose(k) for k in keys}
        # Rendezvous hashing: every replica picks the same backend for a key, and the
        # keys spread over both backends.
        assert all(twin.choose(k).url == chosen[k].url for k in keys)
        assert 60 < sum(b.url == "http://a" for b in chosen.values()) < 140
        first = chosen["session-1"]
        with pool.lease(first):
            # Without a key: the least loaded backend...
            other = pool.choose()
            assert other is not first
            # ...but session-1 stays where its prefix cache is.
            assert pool.choose("session-1") is first
        pool.mark_failed(first, RuntimeError("down"))
        assert pool.choose("session-1") is other  # failover
        # Only the failed backend's keys moved.
        assert all(pool.choose(k) is chosen[k] for k in keys if chosen[k] is other)
        await pool.check_health()  # the fake answers /health: it rejoins
        assert first.healthy


async def test_weight_update_interrupts_and_generation_resumes() -> None:
    fake = FakeBackend(tokens_per_s=400, seed=3)
    # A real loopback server: ASGITransport would buffer the stream.
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            result = GenerationResult()
            params = Sampling(max_tokens=60, ignore_eos=True)

            async def run() -> None:
                async for _ in generate(pool, prompt_ids=[1, 2], params=params, result=result):
                    pass

            task = asyncio.create_task(run())
            while len(result.output_ids) < 10:
                await asyncio.sleep(0.01)
            update = await pool.update_weights(version=1, path="/weights/v1")
            await task
            assert update.version == pool.version == 1
            assert len(result.output_ids) == len(result.versions) == len(result.logprobs) == 60
            assert result.versions[0] == 0 and result.versions[-1] == 1
            assert result.interruptions >= 1 and result.finish_reason == "length"


async def _generate_versions(pool: BackendPool, n: int = 8) -> list[int]:
    result = GenerationResult()
    params = Sampling(max_tokens=n, ignore_eos=True)
    async for _ in generate(pool, prompt_ids=[1, 2], params=params, result=result):
        pass
    assert len(result.output_ids) == n
    return result.versions


async def test_backend_restarted_between_probes_is_reloaded_before_it_serves() -> None:
    """A backend that restarts between two health checks comes back with its start-up
    weights (it reports version 0); the next generation must not be served by them."""
    fakes = [FakeBackend(seed=1), FakeBackend(seed=2)]
    with (
        ThreadedServer(create_fake_app(fakes[0])) as a,
        ThreadedServer(create_fake_app(fakes[1])) as b,
    ):
        async with httpx.AsyncClient() as http:
            pool = BackendPool([a.url, b.url], http=http)
            await pool.update_weights(version=1, path="/weights/v1")
            assert [f.weight_version for f in fakes] == ["1", "1"]
            fakes[0].weight_version = "0"  # restarted: it serves the model it started with
            for session in range(6):  # every new session, wherever it is routed
                versions = await _generate_versions(pool)
                assert set(versions) == {1}, f"session {session} got tokens of {set(versions)}"
            # The stale backend was taken out by the first of its tokens, and a health
            # check loads the current weights on it before it serves again.
            await pool.check_health()
            assert fakes[0].weight_version == "1"
            assert all(backend.healthy and backend.version == 1 for backend in pool.backends)


async def test_health_check_reloads_an_idle_restarted_backend() -> None:
    fake = FakeBackend(seed=1)
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            await pool.update_weights(version=3, path="/weights/v3")
            fake.weight_version = "default"  # SGLang's own label when started without one
            await pool.check_health()
            assert fake.weight_version == "3"
            (backend,) = pool.backends
            assert backend.healthy and backend.version == 3
            assert set(await _generate_versions(pool)) == {3}


async def test_single_restarted_backend_is_reloaded_by_generation_itself() -> None:
    """With one backend, the stale one is taken out, reloaded and serves the current version."""
    fake = FakeBackend(seed=1)
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            await pool.update_weights(version=2, path="/weights/v2")
            fake.weight_version = "0"
            assert set(await _generate_versions(pool)) == {2}
            assert fake.weight_version == "2"


async def test_backend_that_refuses_a_push_is_kept_out() -> None:
    """A backend that answers but refuses new weights still serves old ones: out of the pool."""
    fakes = [FakeBackend(seed=1), FakeBackend(seed=2)]
    with (
        ThreadedServer(create_fake_app(fakes[0])) as a,
        ThreadedServer(create_fake_app(fakes[1])) as b,
    ):
        async with httpx.AsyncClient() as http:
            pool = BackendPool([a.url, b.url], http=http)
            refusing = pool.backends[1]

            async def refuse(**_: Any) -> None:
                raise BackendOperationFailed("cannot load", url=refusing.url)

            real_update = refusing.client.update_weights_from_disk
            refusing.client.update_weights_from_disk = refuse  # type: ignore[method-assign]
            update = await pool.update_weights(version=1, path="/weights/v1")
            assert update.backends == [a.url]
            assert not refusing.healthy and refusing.version == 0
            for _ in range(4):
                assert set(await _generate_versions(pool)) == {1}
            refusing.client.update_weights_from_disk = real_update  # type: ignore[method-assign]
            await pool.check_health()  # it can load now: back at the current version
            assert refusing.healthy and fakes[1].weight_version == "1"


async def test_a_replica_behind_a_rollback_does_not_load_its_old_version_back() -> None:
    """Replicas A and B share a production backend at v1. B rolls it back to v0 and records
    that; before A follows the store, A's health check finds the backend at v0, behind A's v1.
    A must not load v1 back on it (that undid the rollback for the whole fleet): it reads the
    store's version under the fleet lock, leaves the backend out, and adopts it on follow."""
    fake = FakeBackend(seed=1)
    fleet_lock = asyncio.Lock()  # the store's publish lock of the fleet, in one process here
    recorded = {"version": 1}  # the production version the store holds

    async def stored_version() -> int | None:
        return recorded["version"]

    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            a, b = (BackendPool([server.url], http=http) for _ in range(2))
            for pool in (a, b):
                pool.fleet_lock = lambda: fleet_lock
                pool.fleet_version = stored_version
            await a.update_weights(version=1, path="/weights/v1")
            assert await b.follow(1, "/weights/v1")  # B adopts what A loaded
            async with fleet_lock:  # B's rollback: load v0 and record it, under the lock
                await b.update_weights(version=0, path="/base")
                recorded["version"] = 0
            await a.check_health()
            assert fake.weight_version == "0", "A loaded its stale v1 over the rollback"
            (backend,) = a.backends
            assert not backend.healthy and backend.version == 0
            assert backend.last_error == "the store serves version 0, this replica 1"
            assert await a.follow(0, "/base")  # A's follower catches up: the backend is adopted
            assert fake.weight_version == "0"
            assert backend.healthy and backend.version == 0 and a.version == 0
            assert set(await _generate_versions(a)) == {0}


async def test_a_restarted_backend_is_loaded_when_the_store_cannot_say_its_version() -> None:
    """With the store out of reach, a replica brings a restarted backend back to its own
    version (serving again comes first), as a single proxy does."""
    fake = FakeBackend(seed=1)

    async def store_down() -> int | None:
        raise ConnectionError("the store is out of reach")

    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            pool.fleet_version = store_down
            await pool.update_weights(version=1, path="/weights/v1")
            fake.weight_version = "0"  # restarted with its start-up model
            await pool.check_health()
            assert fake.weight_version == "1"
            (backend,) = pool.backends
            assert backend.healthy and backend.version == 1
