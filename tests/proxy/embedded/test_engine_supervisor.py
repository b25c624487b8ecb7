"""The supervisor of the embedded engines: a SIGKILLed engine is reaped, restarted, and rejoins
the pool at the pool's current version with every current adapter; while every engine is
restarting a request gets a quick 503 with ``Retry-After``, never the pool's 30 s wait.

The engines here are real processes on 127.0.0.1 that speak SGLang's HTTP API (the fake
SGLang server, which starts in a second or two), launched by an ``EngineProcess`` whose
command is that server's; the pool, its health checks and rejoin are the proxy's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from proxima.proxy.backends.errors import BackendUnavailable
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.backends.protocol import lora_name
from proxima.proxy.embedded.launcher import EngineProcess
from proxima.proxy.embedded.supervisor import EngineSupervisor
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.service.generation import GenerationResult, generate


class FakeEngine(EngineProcess):
    """An ``EngineProcess`` whose process is the fake SGLang server (LoRA enabled, 50 tokens
    a second); the first ``fail_starts`` restarts exit at once with status 3."""

    def __init__(self, root: Path, *, fail_starts: int = 0) -> None:
        super().__init__(root / "model")
        self.fail_starts = fail_starts

    def start(self) -> None:
        if self.starts and self.fail_starts:
            self.fail_starts -= 1
            cmd = [sys.executable, "-c", "raise SystemExit(3)"]
        else:
            cmd = [sys.executable, "-m", "proxima.proxy.testing.fake_sglang"]
            cmd += ["--port", str(self.port), "--enable-lora", "--tokens-per-s", "50"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0
        )
        self.starts += 1


def _process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``Z``: a zombie), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


async def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


async def _started(engines: list[FakeEngine]) -> None:
    for engine in engines:
        engine.start()
    for engine in engines:
        await engine.wait_healthy(timeout=60)


def _generating(pool: BackendPool, key: str) -> tuple[asyncio.Task[None], GenerationResult]:
    """A completion of 60 tokens (1.2 s at the fake's pace) for session ``key``, running."""
    result = GenerationResult()
    params = Sampling(max_tokens=60, ignore_eos=True)

    async def run() -> None:
        stream = generate(pool, prompt_ids=[1, 2], params=params, result=result, sticky_key=key)
        async for _ in stream:
            pass

    return asyncio.create_task(run()), result


async def test_a_killed_engine_is_reaped_restarted_and_rejoins_at_the_current_version(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    engines = [FakeEngine(tmp_path), FakeEngine(tmp_path)]
    try:
        await _started(engines)
        pool = BackendPool([e.url for e in engines], http=http, version=0)
        await pool.update_weights(version=3, path=str(tmp_path / "v3"))
        adapter = tmp_path / "adapter"
        adapter.mkdir()
        config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        (adapter / "adapter_config.json").write_text(json.dumps(config))
        await pool.update_adapter(adapter="tenant", version=2, path=str(adapter))
        supervisor = EngineSupervisor(pool, engines, interval=0.05)
        supervisor.start()
        killed, other = pool.backends
        key = next(f"session-{i}" for i in range(100) if pool.choose(f"session-{i}") is killed)
        running, result = _generating(pool, key)
        await _until(lambda: len(result.output_ids) >= 5, 10, "the completion is under way")
        old_pid = engines[0].pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)

        # The completion in flight resumes on the live engine and ends whole.
        await asyncio.wait_for(running, 10)
        assert len(result.output_ids) == 60 and result.finish_reason == "length"
        assert result.interruptions >= 1 and result.backend == other.url
        await _until(lambda: not killed.healthy, 10, "the dead engine is taken out")
        # Requests fail over to the live engine meanwhile, whatever their session.
        assert {pool.choose(f"session-{i}").url for i in range(20)} == {other.url}
        await _until(lambda: killed.healthy, 60, "the restarted engine rejoins")

        assert _process_state(old_pid) is None, "the dead process was reaped (no zombie)"
        assert engines[0].pid != old_pid and engines[0].starts == 2
        assert supervisor.restarts == 1 and not killed.restarting
        # It serves the pool's current version and adapter, loaded by rejoin, not at start.
        assert killed.version == 3
        assert (await killed.client.model_info()).weight_version == "3"
        assert lora_name("tenant", 2) in await killed.client.loaded_lora_adapters()
        await supervisor.stop()
        await pool.close()
    finally:
        for engine in engines:
            engine.stop()


async def test_while_every_engine_restarts_a_request_gets_a_quick_503(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    engine = FakeEngine(tmp_path, fail_starts=1)  # its first restart dies: tried again
    try:
        await _started([engine])
        pool = BackendPool([engine.url], http=http, version=0)
        supervisor = EngineSupervisor(pool, [engine], interval=0.05)
        supervisor.start()
        (backend,) = pool.backends
        running, result = _generating(pool, "session")
        await _until(lambda: len(result.output_ids) >= 5, 10, "the completion is under way")
        old_pid = engine.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)

        # The completion in flight, with no engine left, ends within a second or so (it
        # lost its stream before the supervisor saw the death), with a Retry-After.
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as refused:
            await asyncio.wait_for(running, 10)
        assert time.monotonic() - started < 1.5
        assert refused.value.status_code == 503
        assert refused.value.headers() == {"Retry-After": "2"}
        assert backend.restarting
        # So does a new request while the engine restarts.
        with pytest.raises(BackendUnavailable):
            await asyncio.wait_for(pool.wait_for_healthy(30.0), 1.0)

        await _until(lambda: backend.healthy, 60, "the engine is back after a failed restart")
        assert engine.starts == 3 and supervisor.restarts == 1
        assert _process_state(old_pid) is None
        await pool.wait_for_healthy(1.0)

        # Once stopped (the deployment closes), a dead engine is left dead.
        await supervisor.stop()
        engine.stop()
        await asyncio.sleep(0.3)
        assert engine.starts == 3 and engine.poll() is not None
        await pool.close()
    finally:
        engine.stop()
