"""Retryable failures of the rollout's and the trainer's calls are waited out, the others are not.

Before, a 503 from ``POST /rl/sessions`` (the proxy's answer while its PostgreSQL restarts)
was a ``RolloutError`` that ended ``proxima train``, a 503 from a weight push a
``WeightPushError``, an agent's 503 a failed session, and the trainer's own store reads
raised ``StoreUnavailable`` out of the step. Here each is retried within its window, and an
answer that may come from a first try that landed (a claim, a mark, a reward) counts as the
first try's.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from proxima.proxy.serving import ThreadedServer, free_port
from proxima.proxy.store import SessionStatus, Store, ensure_schema
from proxima.proxy.store.errors import Conflict, StoreUnavailable
from proxima.trainer import retry
from proxima.trainer.batch_claims import BatchClaims
from proxima.trainer.config import TrainerConfig
from proxima.trainer.proxy_settings import ProxySettingsError, fetch_proxy_settings
from proxima.trainer.retry import Backoff, retrying
from proxima.trainer.rollout.agents import AgentError, AgentReward, RolloutError
from proxima.trainer.rollout.binding import SessionBinding, bind_session
from proxima.trainer.rollout.sessions import finish_session, post_rewards
from proxima.trainer.store_retry import RetryingStore
from proxima.trainer.weights import ProxyWeightSink, WeightPushError

from tests.pg import POSTGRES_PARAM, PostgresCluster, find_pg_bin

Script = list[Any]  # statuses (with Retry-After: 0 for 503/429) or exceptions, in order


def _transport(script: Script, seen: list[httpx.Request]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        status, body = step if isinstance(step, tuple) else (step, {"ok": True})
        headers = {"Retry-After": "0"} if status in (502, 503, 429) else {}
        return httpx.Response(status, json=body, headers=headers)

    return httpx.MockTransport(answer)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waits of 10 ms where no ``Retry-After`` says otherwise (0.5 s in a run)."""
    monkeypatch.setattr(retry, "FIRST_DELAY_S", 0.01)


@pytest.fixture
def answers() -> Iterator[tuple[Script, list[httpx.Request], httpx.AsyncClient]]:
    script: Script = []
    seen: list[httpx.Request] = []
    client = httpx.AsyncClient(transport=_transport(script, seen), base_url="http://proxy")
    yield script, seen, client


def test_backoff_honours_retry_after_doubles_otherwise_and_ends_with_its_window() -> None:
    backoff = Backoff(10.0, first_s=0.5)
    assert [backoff.delay(), backoff.delay(), backoff.delay(3.0), backoff.delay()] == [
        0.5,
        1.0,
        3.0,
        4.0,
    ]
    assert Backoff(0.0).delay() is None


async def test_a_reward_whose_first_try_was_lost_and_landed_is_posted_once(
    answers: tuple[Script, list[httpx.Request], httpx.AsyncClient],
) -> None:
    script, seen, client = answers
    already = (409, {"error": {"code": "reward_already_set", "message": "set"}})
    script[:] = [503, httpx.ConnectError("reset"), already]
    await post_rewards(client, "s1", AgentReward(final=1.0, per_completion={}), window_s=5)
    assert [r.url.path for r in seen] == ["/rl/sessions/s1/reward"] * 3

    # Without a lost try, "already set" is the agent's mistake, not a retry's echo.
    script[:] = [already]
    with pytest.raises(AgentError, match="rejected"):
        await post_rewards(client, "s1", AgentReward(final=1.0, per_completion={}), window_s=5)


async def test_finishing_waits_out_503s_and_gives_up_after_its_window(
    answers: tuple[Script, list[httpx.Request], httpx.AsyncClient],
) -> None:
    script, seen, client = answers
    script[:] = [503, 503, 200]
    await finish_session(client, "s1", "finished", window_s=5)
    assert len(seen) == 3
    script[:] = [503, 200]
    with pytest.raises(RolloutError, match="answered 503"):
        await finish_session(client, "s1", "finished", window_s=0)
    script[:] = [500]
    with pytest.raises(RolloutError, match="answered 500"):  # not a "not now": at once
        await finish_session(client, "s1", "finished", window_s=5)


@pytest.mark.parametrize("sync", [False, True])
async def test_a_bound_agent_request_is_sent_again_while_the_proxy_says_not_now(sync: bool) -> None:
    script: Script = []
    seen: list[httpx.Request] = []
    transport = _transport(script, seen)

    def get(url: str) -> int:
        with httpx.Client(transport=transport) as client:
            return client.get(url).status_code

    async def fetch(url: str) -> int:
        if sync:
            return await asyncio.to_thread(get, url)  # the binding follows into the thread
        async with httpx.AsyncClient(transport=transport) as client:
            return (await client.get(url)).status_code

    retrying_binding = SessionBinding("s", "key", "http://proxy/v1", retry_window_s=5.0)
    with bind_session(retrying_binding):
        script[:] = [503, httpx.ConnectError("refused"), (429, {}), 200]
        assert await fetch("http://proxy/v1/models") == 200
        assert len(seen) == 4 and seen[-1].headers["Authorization"] == "Bearer key"
        script[:] = [400]
        assert await fetch("http://proxy/v1/models") == 400  # the agent's own mistake
        script[:] = [503]
        assert await fetch("http://elsewhere/v1/models") == 503  # not the session's API
    with bind_session(SessionBinding("s", "key", "http://proxy/v1")):  # no retry window
        script[:] = [503]
        assert await fetch("http://proxy/v1/models") == 503
    assert not script


async def test_a_weight_push_waits_out_503s_and_fails_at_once_on_a_refusal(tmp_path: Path) -> None:
    script: Script = []
    seen: list[httpx.Request] = []
    sink = ProxyWeightSink("http://proxy", admin_token="t", retry_window_s=5)
    await sink._client.aclose()
    sink._client = httpx.AsyncClient(transport=_transport(script, seen))
    try:
        pushed = (200, {"version": 1, "seconds": 0.5})
        script[:] = [503, httpx.ConnectError("refused"), 502, pushed]
        result = await sink.push(version=1, path=tmp_path)
        assert result.version == 1 and result.proxy_seconds == 0.5 and len(seen) == 4
        script[:] = [(400, {"error": {"message": "bad path"}})]
        with pytest.raises(WeightPushError, match="answered 400"):
            await sink.push(version=2, path=tmp_path)
    finally:
        await sink.aclose()


# --------------------------------------------------------------------------- the store


class _LosesFirstAnswers(Store):
    """A store whose first claim and first mark commit, then raise ``StoreUnavailable`` (the
    connection lost after the commit: the caller cannot tell it landed)."""

    lost: set[str]

    async def claim_groups(self, **kw: Any) -> Any:
        claimed = await super().claim_groups(**kw)
        return self._lose("claim", claimed)

    async def mark_sessions(self, **kw: Any) -> None:
        await super().mark_sessions(**kw)
        self._lose("mark", None)

    def _lose(self, what: str, result: Any) -> Any:
        if what not in self.lost:
            self.lost.add(what)
            raise StoreUnavailable()
        return result


class FlakyStore(RetryingStore, _LosesFirstAnswers):
    """``RetryingStore`` over a store that loses its first answers (MRO: the retries wrap
    the loss)."""


@pytest.fixture
async def flaky(tmp_path: Path) -> AsyncIterator[FlakyStore]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await FlakyStore.open_retrying(url, window_s=10)
    assert isinstance(store, FlakyStore)
    store.lost = set()
    try:
        yield store
    finally:
        await store.close()


async def _finished_group(store: Store, group: str, size: int = 2) -> list[str]:
    ids = []
    for i in range(size):
        session = await store.create_session(
            api_key_hash=hashlib.sha256(uuid.uuid4().bytes).hexdigest(), group_id=group
        )
        await store.set_session_reward(session_id=session.id, reward=float(i))
        await store.finish_session(session_id=session.id)
        ids.append(session.id)
    return ids


async def test_a_claim_whose_answer_was_lost_is_adopted_not_left_claimed(
    flaky: FlakyStore,
) -> None:
    first = await _finished_group(flaky, "g1")
    second = await _finished_group(flaky, "g2")
    cfg = TrainerConfig.model_validate(
        {"batch_size": 4, "advantage": {"zero_signal": "keep"}, "loop": {"retry_window_s": 10}}
    )
    claims = BatchClaims(cfg, flaky, trainer_id="t", adapter=None, vocab_size=None)
    await claims.top_up(version=0)
    # The lost claim took g1 (or both); the retry took the rest: all held, none hidden.
    assert sorted(s.id for s in claims.held) == sorted(first + second)
    assert claims.ready and "claim" in flaky.lost


async def test_a_mark_whose_answer_was_lost_is_a_success_and_a_real_conflict_is_not(
    flaky: FlakyStore,
) -> None:
    ids = await _finished_group(flaky, "g1")
    await Store.claim_groups(flaky, min_sessions=2, trainer_id="t")  # no loss injected
    await flaky.mark_sessions(session_ids=ids, status=SessionStatus.TRAINED, trained_version=1)
    for sid in ids:
        session = await flaky.get_session(session_id=sid)
        assert session is not None and session.status is SessionStatus.TRAINED
    with pytest.raises(Conflict):  # not claimed, and no lost try: refused as before
        await flaky.mark_sessions(session_ids=ids, status=SessionStatus.DROPPED)


@pytest.fixture(params=[POSTGRES_PARAM])
def cluster() -> Iterator[PostgresCluster]:
    bin_dir = find_pg_bin()
    assert bin_dir is not None  # deselected without PostgreSQL (tests.pg)
    own = PostgresCluster.start(bin_dir)  # its own: this test stops it
    try:
        yield own
    finally:
        own.stop()


async def test_the_trainers_store_calls_wait_out_a_postgres_restart(
    cluster: PostgresCluster,
) -> None:
    url = cluster.url(cluster.create_database())
    await ensure_schema(url)
    store = await RetryingStore.open_retrying(url, window_s=60)
    try:
        ids = await _finished_group(store, "g1")
        await asyncio.to_thread(cluster.pause)
        with pytest.raises(StoreUnavailable):  # the proxy's own store: a 503 at once
            await Store.claimed_sessions(store, trainer_id="t")
        started = time.monotonic()
        cfg = TrainerConfig.model_validate(
            {"batch_size": 2, "advantage": {"zero_signal": "keep"}, "loop": {"retry_window_s": 60}}
        )
        claims = BatchClaims(cfg, store, trainer_id="t", adapter=None, vocab_size=None)
        claiming = asyncio.create_task(claims.top_up(version=0))
        reading = asyncio.create_task(store.list_completions(session_id=ids[0]))
        await asyncio.sleep(2.0)
        assert not claiming.done() and not reading.done()
        await asyncio.to_thread(cluster.resume)
        await asyncio.wait_for(asyncio.gather(claiming, reading), 30)
        assert time.monotonic() - started >= 2.0
        assert sorted(s.id for s in claims.held) == sorted(ids)
        await store.mark_sessions(session_ids=ids, status=SessionStatus.DROPPED)
    finally:
        await store.close()


async def test_retrying_raises_what_is_not_an_outage_at_once() -> None:
    calls: list[int] = []

    def failing(exc: Exception) -> Callable[[], Any]:
        async def call() -> None:
            calls.append(1)
            raise exc

        return call

    with pytest.raises(ValueError):
        await retrying(failing(ValueError("bug")), "x", window_s=10)
    assert calls == [1]
    with pytest.raises(StoreUnavailable):
        await retrying(failing(StoreUnavailable()), "x", window_s=0.3)
    assert len(calls) >= 2  # tried again until the window closed


async def test_the_proxys_settings_are_read_once_it_stops_saying_not_now() -> None:
    answers = [503, 503, 200]

    async def config() -> JSONResponse:
        status = answers.pop(0)
        body = {"train_batch_size": 4, "max_staleness": 1} if status == 200 else {}
        return JSONResponse(body, status_code=status, headers={"Retry-After": "0"})

    app = FastAPI()
    app.add_api_route("/admin/config", config)
    with ThreadedServer(app) as server:
        with pytest.raises(ProxySettingsError, match="answered 503"):
            await fetch_proxy_settings(server.url, admin_token="t")  # no window: at once
        settings = await fetch_proxy_settings(server.url, admin_token="t", retry_window_s=5)
    assert (settings.train_batch_size, settings.max_staleness) == (4, 1) and not answers
    with pytest.raises(ProxySettingsError, match="cannot read"):  # refused: a wrong URL
        await fetch_proxy_settings(
            f"http://127.0.0.1:{free_port()}", admin_token="t", retry_window_s=5
        )
