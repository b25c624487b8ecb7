"""The backend pool with LoRA adapters, against the fake SGLang (its adapter registry is
SGLang 0.5.23's: names, refusals, unload waiting for running requests, implicit reloads).

A push of adapter A loads ``a@v<N>`` beside the old version, interrupts and resumes only A's
generations, never pauses the backends, and unloads the old name; a backend that restarts
gets every adapter's current version back before it serves again.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.service.generation import GenerationResult, generate
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app


def _adapter_dir(root: Path, name: str) -> str:
    """A peft adapter directory (the fake reads its ``adapter_config.json``, as SGLang does)."""
    path = root / name
    path.mkdir(parents=True)
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


async def _run(
    pool: BackendPool, adapter: str | None, n: int, sticky: str | None = None
) -> GenerationResult:
    result = GenerationResult()
    params = Sampling(max_tokens=n, ignore_eos=True)
    async for _ in generate(
        pool, prompt_ids=[1, 2], params=params, result=result, adapter=adapter, sticky_key=sticky
    ):
        pass
    assert len(result.output_ids) == len(result.versions) == len(result.logprobs) == n
    return result


def _restart(fake: FakeBackend, *, max_lora_rank: int | None = None) -> None:
    """The backend process restarted: no adapter loaded, none ever loaded (in place: the
    fake app's routes hold the registry's methods)."""
    assert fake.lora is not None
    fake.lora.registry, fake.lora.ever_loaded, fake.lora.users = {}, {}, {}
    fake.lora.max_lora_rank = max_lora_rank


async def test_an_adapter_before_its_first_push_is_the_bare_base(tmp_path: Path) -> None:
    fake = FakeBackend(seed=1, enable_lora=True, record_bodies=True)
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            result = await _run(pool, "tenant-a", 6)
            assert result.versions == [0] * 6
            assert "lora_path" not in fake.bodies[-1]
            await pool.update_adapter(
                adapter="tenant-a", version=1, path=_adapter_dir(tmp_path, "a1")
            )
            result = await _run(pool, "tenant-a", 6)
            assert result.versions == [1] * 6
            assert fake.bodies[-1]["lora_path"] == "tenant-a@v1"
            assert (await _run(pool, None, 4)).versions == [0] * 4  # the base: no adapter
            assert "lora_path" not in fake.bodies[-1]


async def test_a_push_interrupts_and_resumes_only_that_adapters_generations(
    tmp_path: Path,
) -> None:
    fake = FakeBackend(tokens_per_s=300, seed=3, enable_lora=True, record_bodies=True)
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            await pool.update_adapter(adapter="a", version=1, path=_adapter_dir(tmp_path, "a1"))
            await pool.update_adapter(adapter="b", version=1, path=_adapter_dir(tmp_path, "b1"))
            pauses = 0
            real_pause = pool.backends[0].client.pause_generation

            async def counted_pause(**kwargs: str) -> None:
                nonlocal pauses
                pauses += 1
                await real_pause(**kwargs)

            pool.backends[0].client.pause_generation = counted_pause  # type: ignore[method-assign]
            results = {name: GenerationResult() for name in ("base", "a", "b")}
            params = Sampling(max_tokens=60, ignore_eos=True)

            async def run(name: str) -> None:
                adapter = None if name == "base" else name
                async for _ in generate(
                    pool, prompt_ids=[1, 2], params=params, result=results[name], adapter=adapter
                ):
                    pass

            tasks = [asyncio.create_task(run(name)) for name in results]
            while min(len(r.output_ids) for r in results.values()) < 10:
                await asyncio.sleep(0.01)
            update = await pool.update_adapter(
                adapter="a", version=2, path=_adapter_dir(tmp_path, "a2")
            )
            await asyncio.gather(*tasks)
            assert update.adapter == "a" and update.backends == [server.url]
            a, b, base = results["a"], results["b"], results["base"]
            assert a.versions[0] == 1 and a.versions[-1] == 2 and a.interruptions >= 1
            assert sorted(set(a.versions)) == [1, 2]
            assert a.versions == sorted(a.versions)  # v1 tokens, then v2 tokens
            assert b.versions == [1] * 60 and b.interruptions == 0
            assert base.versions == [0] * 60 and base.interruptions == 0
            assert pauses == 0 and not fake.paused  # nothing else ever paused
            assert fake.lora is not None
            assert set(fake.lora.loaded()) == {"a@v2", "b@v1"}  # the old name is unloaded
            a_bodies = [body.get("lora_path") for body in fake.bodies]
            assert a_bodies.count("a@v2") >= 1 and "a@v1" in a_bodies
            assert pool.policy("a") == (2, "a@v2") and pool.policy("b") == (1, "b@v1")


async def test_a_restarted_backend_gets_every_adapter_back_before_it_serves(
    tmp_path: Path,
) -> None:
    fakes = [FakeBackend(seed=1, enable_lora=True), FakeBackend(seed=2, enable_lora=True)]
    with (
        ThreadedServer(create_fake_app(fakes[0])) as first,
        ThreadedServer(create_fake_app(fakes[1])) as second,
    ):
        async with httpx.AsyncClient() as http:
            pool = BackendPool([first.url, second.url], http=http)
            await pool.update_adapter(adapter="a", version=1, path=_adapter_dir(tmp_path, "a1"))
            await pool.update_adapter(adapter="b", version=1, path=_adapter_dir(tmp_path, "b1"))
            await pool.update_adapter(adapter="b", version=2, path=_adapter_dir(tmp_path, "b2"))
            _restart(fakes[0])
            # Every session of A, wherever it is routed, is served by A's current version:
            # the restarted backend refuses the name, is taken out, and the turn resumes.
            for session in range(8):
                result = await _run(pool, "a", 6, sticky=f"session-{session}")
                assert set(result.versions) == {1}
            await pool.check_health()
            for fake in fakes:
                assert fake.lora is not None and set(fake.lora.loaded()) == {"a@v1", "b@v2"}
            assert all(backend.healthy for backend in pool.backends)


async def test_an_idle_restarted_backend_is_kept_out_until_its_adapters_are_loaded(
    tmp_path: Path,
) -> None:
    fake = FakeBackend(seed=1, enable_lora=True)
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            path = _adapter_dir(tmp_path, "a1")
            await pool.update_adapter(adapter="a", version=1, path=path)
            _restart(fake, max_lora_rank=4)  # it came back unable to load rank 8
            await pool.check_health()
            (backend,) = pool.backends
            assert not backend.healthy and "a@v1" in (backend.last_error or "")
            _restart(fake)
            await pool.check_health()
            assert backend.healthy and fake.lora is not None
            assert set(fake.lora.loaded()) == {"a@v1"}
            assert set((await _run(pool, "a", 4)).versions) == {1}


async def test_a_push_no_backend_can_load_changes_nothing(tmp_path: Path) -> None:
    fake = FakeBackend(seed=1, enable_lora=True)
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([server.url], http=http)
            await pool.update_adapter(adapter="a", version=1, path=_adapter_dir(tmp_path, "a1"))
            with pytest.raises(Exception, match="adapter_config.json"):
                await pool.update_adapter(adapter="a", version=2, path=str(tmp_path))
            assert pool.policy("a") == (1, "a@v1")
            assert pool.backends[0].healthy
            assert set((await _run(pool, "a", 4)).versions) == {1}
