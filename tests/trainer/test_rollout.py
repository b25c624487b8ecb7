"""The rollout controller against a live proxy with the tiny model.

Agents here are written like user code: they create their own OpenAI /
LangChain clients with a placeholder key, and the controller binds them to
their sessions. Every reward is checked in the store through the proxy.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI, OpenAI
from proxima.proxy.store import Store
from proxima.proxy.testing.live import LiveProxy
from proxima.trainer.rollout.agents import AgentError, AgentReward, RolloutError, parse_reward
from proxima.trainer.rollout.controller import RolloutController, item_id
from proxima.trainer.rollout.sessions import open_session
from pydantic import SecretStr

SHORT = {"max_tokens": 8, "temperature": 1.0}


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("rollout-proxy")
    live = LiveProxy(
        tiny_model_dir, db_url=f"sqlite:///{work / 'store.db'}", log_path=work / "serve.log"
    )
    live.start()
    yield live
    live.stop()


def controller(proxy: LiveProxy, agent: Any, **kw: Any) -> RolloutController:
    kw.setdefault("timeout_s", 60.0)
    return RolloutController(proxy.url, proxy.admin_token, agent, model=proxy.model_name, **kw)


def expected_reward(item: dict[str, Any]) -> float:
    return float(item["n"]) / 4


async def sdk_agent(data: dict[str, Any]) -> float:
    """An async user agent: its own client, a placeholder key, the proxy's /v1 from ``data``."""
    client = AsyncOpenAI(base_url=data["base_url"], api_key="not-a-real-key", max_retries=0)
    await client.chat.completions.create(
        model=data["model"], messages=[{"role": "user", "content": data["question"]}], **SHORT
    )
    await client.close()
    return expected_reward(data)


# --------------------------------------------------------------------------- unit


def test_parse_reward_shapes() -> None:
    assert parse_reward(1) == AgentReward(final=1.0, per_completion={})
    assert parse_reward(True) == AgentReward(final=1.0, per_completion={})
    assert parse_reward(0.25).total == 0.25
    mixed = parse_reward({"chatcmpl-a": 0.5, "chatcmpl-a-1": -0.5, "final": 2})
    assert mixed == AgentReward(final=2.0, per_completion={"chatcmpl-a": 0.5, "chatcmpl-a-1": -0.5})
    assert mixed.total == 2.0
    assert parse_reward({"chatcmpl-b": 1.0}).final is None
    for bad in (None, "1.0", float("nan"), float("inf"), {}, {"final": "x"}, {1: 1.0}, [1.0]):
        with pytest.raises(AgentError):
            parse_reward(bad)


def test_item_ids_and_constructor_checks(tiny_model_dir: Path) -> None:
    assert item_id({"id": 7}, 3) == "7"
    assert item_id({"data_id": "q-1"}, 3) == "q-1"
    assert item_id({"question": "?"}, 3) == "3"
    with pytest.raises(ValueError, match="group_size"):
        RolloutController("http://x", "t", sdk_agent, group_size=0)
    with pytest.raises(ValueError, match="mode"):
        RolloutController("http://x", "t", sdk_agent, mode="threads")  # type: ignore[arg-type]
    with pytest.raises(RolloutError, match="module:function"):
        RolloutController("http://x", "t", "no_colon_here")
    with pytest.raises(RolloutError, match="cannot import"):
        RolloutController("http://x", "t", "no_such_module_xyz:run")
    with pytest.raises(RolloutError, match="importable"):
        RolloutController("http://x", "t", lambda d: 1.0, mode="subprocess")
    with pytest.raises(ValueError, match="not an adapter name"):
        RolloutController("http://x", "t", sdk_agent, adapter="Tenant A")


# --------------------------------------------------------------------------- live


async def test_items_times_group_every_reward_reaches_the_store(
    proxy: LiveProxy, tmp_path: Path
) -> None:
    items = [{"id": f"item-{i}", "question": f"What is {i} + 1?", "n": i} for i in range(3)]
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(item) + "\n" for item in items))

    report = await controller(proxy, sdk_agent, group_size=2, max_concurrency=3).run(dataset)

    assert (report.items, report.sessions_started, report.sessions_rewarded) == (3, 6, 6)
    assert (report.sessions_failed, report.timeouts, report.waits_429) == (0, 0, 0)
    assert report.mean_reward == pytest.approx(sum(expected_reward(i) for i in items) / 3)
    assert report.elapsed_s > 0
    by_item = {item["id"]: item for item in items}
    groups: dict[str, set[str]] = {}
    for run in report.runs:
        stored = proxy.trajectory(run.session_id)
        item = by_item[stored["data_id"]]
        assert stored["status"] == "finished"
        assert stored["reward"] == run.reward == expected_reward(item)
        assert stored["group_id"] == run.group_id
        assert len(stored["completions"]) == 1  # the agent's request carried this session's key
        groups.setdefault(stored["group_id"], set()).add(stored["data_id"])
    assert len(groups) == 3 and all(len(ids) == 1 for ids in groups.values())
    assert sorted(run.sample for run in report.runs) == [0, 0, 0, 1, 1, 1]


async def test_raising_hanging_and_invalid_agents_fail_only_their_sessions(
    proxy: LiveProxy,
) -> None:
    async def agent(data: dict[str, Any]) -> Any:
        kind = data["kind"]
        await sdk_agent({**data, "n": 0})
        if kind == "raise":
            raise ValueError("agent bug")
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "invalid":
            return "yes"
        return 1.0

    items = [
        {"id": kind, "kind": kind, "question": "hi"}
        for kind in ("ok", "raise", "hang", "invalid", "ok2")
    ]
    started = time.monotonic()
    report = await controller(proxy, agent, timeout_s=3.0, max_concurrency=5).run(items)
    assert time.monotonic() - started < 30

    assert (report.sessions_started, report.sessions_rewarded) == (5, 2)
    assert (report.sessions_failed, report.timeouts) == (3, 1)
    assert report.mean_reward == 1.0
    runs = {run.data_id: run for run in report.runs}
    assert "ValueError: agent bug" in (runs["raise"].error or "")
    assert runs["hang"].timed_out and "timed out" in (runs["hang"].error or "")
    assert "must be a number" in (runs["invalid"].error or "")
    for kind, run in runs.items():
        stored = proxy.trajectory(run.session_id)
        want = "finished" if kind.startswith("ok") else "failed"
        assert stored["status"] == run.status == want
        assert stored["reward"] == (1.0 if want == "finished" else None)
        assert len(stored["completions"]) == 1  # failed runs keep their record, untrained


async def test_per_completion_rewards_and_async_iterable_dataset(proxy: LiveProxy) -> None:
    async def agent(data: dict[str, Any]) -> dict[str, float]:
        client = AsyncOpenAI(base_url=data["base_url"], api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Count."}]
        first = await client.chat.completions.create(
            model=data["model"], messages=messages, n=2, **SHORT
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "Again."},
        ]
        second = await client.chat.completions.create(
            model=data["model"], messages=messages, **SHORT
        )
        await client.close()
        return {first.id: 0.5, f"{first.id}-1": -0.5, second.id: 0.25, "final": 1.0}

    async def items() -> AsyncIterator[dict[str, Any]]:
        for i in range(2):
            yield {"id": f"turns-{i}"}

    report = await controller(proxy, agent).run(items())
    assert report.sessions_rewarded == 2 and report.sessions_failed == 0
    for run in report.runs:
        assert run.reward == pytest.approx(1.25)
        stored = proxy.trajectory(run.session_id)
        assert stored["reward"] == 1.0
        rewards = sorted(c["reward"] for c in stored["completions"])
        assert rewards == [-0.5, 0.25, 0.5]


async def test_unknown_completion_id_fails_the_run(proxy: LiveProxy) -> None:
    report = await controller(proxy, lambda data: {"chatcmpl-unknown": 1.0}).run([{"id": "bad-id"}])
    (run,) = report.runs
    assert run.status == "failed" and "rejected (404)" in (run.error or "")
    assert proxy.trajectory(run.session_id)["status"] == "failed"


def _sync_langchain_and_sdk_agent(proxy_v1: str) -> Any:
    def agent(data: dict[str, Any]) -> float:
        # Runs in a worker thread; both clients are built here with a placeholder key.
        OpenAI(base_url=proxy_v1, api_key="dummy", max_retries=0).chat.completions.create(
            model=data["model"], messages=[{"role": "user", "content": "sync sdk"}], **SHORT
        )
        llm = ChatOpenAI(
            model=data["model"],
            base_url=proxy_v1,
            api_key=SecretStr("dummy"),
            max_retries=0,
            max_tokens=8,
        )
        llm.invoke("sync langchain")
        return 1.0

    return agent


def _async_langchain_and_sdk_agent(proxy_v1: str) -> Any:
    async def agent(data: dict[str, Any]) -> float:
        client = AsyncOpenAI(base_url=proxy_v1, api_key="dummy", max_retries=0)
        await client.chat.completions.create(
            model=data["model"], messages=[{"role": "user", "content": "async sdk"}], **SHORT
        )
        await client.close()
        llm = ChatOpenAI(
            model=data["model"],
            base_url=proxy_v1,
            api_key=SecretStr("dummy"),
            max_retries=0,
            max_tokens=8,
        )
        # A task the agent spawns itself inherits the binding too.
        await asyncio.create_task(llm.ainvoke("async langchain"))
        return 1.0

    return agent


@pytest.mark.parametrize(
    "make_agent", [_sync_langchain_and_sdk_agent, _async_langchain_and_sdk_agent]
)
async def test_inprocess_binding_of_clients_created_inside_the_agent(
    proxy: LiveProxy, make_agent: Any
) -> None:
    agent = make_agent(proxy.base_url)
    report = await controller(proxy, agent, group_size=3, max_concurrency=3).run([{"id": "bind"}])
    assert report.sessions_rewarded == 3, [r.error for r in report.runs]
    prompts = set()
    for run in report.runs:
        completions = proxy.trajectory(run.session_id)["completions"]
        assert len(completions) == 2  # each run's two requests landed in its own session
        prompts.update(c["request_messages"][-1]["content"] for c in completions)
    assert len(prompts) == 2
    # Outside a bound run the placeholder key is just a bad key.
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=proxy.base_url, api_key="dummy", max_retries=0).chat.completions.create(
            model=proxy.model_name, messages=[{"role": "user", "content": "unbound"}], **SHORT
        )


async def test_inprocess_binding_of_an_anthropic_agent(proxy: LiveProxy) -> None:
    """An Anthropic SDK agent (key in x-api-key, base URL the proxy root) is bound too."""

    async def agent(data: dict[str, Any]) -> float:
        root = data["base_url"].removesuffix("/v1")
        client = anthropic.AsyncAnthropic(base_url=root, api_key="placeholder", max_retries=0)
        await client.messages.create(
            model=data["model"], max_tokens=8, messages=[{"role": "user", "content": "claude"}]
        )
        return 1.0

    report = await controller(proxy, agent, group_size=2, max_concurrency=2).run([{"id": "msg"}])
    assert report.sessions_rewarded == 2, [r.error for r in report.runs]
    for run in report.runs:
        [completion] = proxy.trajectory(run.session_id)["completions"]
        assert completion["id"].startswith("msg_")  # served by /v1/messages, in its own session


SUBPROCESS_AGENTS = textwrap.dedent('''
    import time
    from openai import OpenAI

    def from_env(data):
        """Reads OPENAI_* / ANTHROPIC_* variables, like most scripts do."""
        import os
        import anthropic
        print("agent chatter on stdout must not break the protocol")
        OpenAI(max_retries=0).chat.completions.create(
            model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": data["question"]}],
            max_tokens=8,
        )
        anthropic.Anthropic(max_retries=0).messages.create(
            model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": data["question"]}],
            max_tokens=8,
        )
        return 0.75

    async def boom(data):
        raise RuntimeError("subprocess agent bug")

    def hang(data):
        time.sleep(600)
''')


async def test_subprocess_mode(proxy: LiveProxy, tmp_path: Path) -> None:
    (tmp_path / "sub_agents.py").write_text(SUBPROCESS_AGENTS)
    env = {"PYTHONPATH": f"{tmp_path}:{Path.cwd()}"}
    with pytest.raises(RolloutError, match="cannot find agent module"):
        controller(proxy, "sub_agents:from_env", mode="subprocess")  # not on any path without env
    ok = controller(proxy, "sub_agents:from_env", mode="subprocess", env=env, group_size=2)
    report = await ok.run([{"id": "sub", "question": "What is 2 + 2?"}])
    assert report.sessions_rewarded == 2, [r.error for r in report.runs]
    for run in report.runs:
        stored = proxy.trajectory(run.session_id)
        # One chat completion, one Anthropic message: both found the session from the env.
        assert stored["reward"] == 0.75 and len(stored["completions"]) == 2

    started = time.monotonic()
    failing = [
        await controller(proxy, spec, mode="subprocess", env=env, timeout_s=5.0).run([{"id": spec}])
        for spec in ("sub_agents:boom", "sub_agents:hang")
    ]
    assert time.monotonic() - started < 40  # the hanging process was killed at its timeout
    boom, hang = (r.runs[0] for r in failing)
    assert boom.status == "failed" and "subprocess agent bug" in (boom.error or "")
    assert hang.status == "failed" and hang.timed_out
    for run in (boom, hang):
        assert proxy.trajectory(run.session_id)["status"] == "failed"


async def test_bad_admin_token_stops_the_rollout(proxy: LiveProxy) -> None:
    ctl = RolloutController(proxy.url, "wrong-token", sdk_agent, max_concurrency=2)
    with pytest.raises(RolloutError, match="answered 401"):
        await ctl.run([{"id": i, "question": "hi", "n": 0} for i in range(4)])
    assert ctl.progress.sessions_started == 0


async def test_staleness_429s_are_waited_out(tiny_model_dir: Path, tmp_path: Path) -> None:
    """eta = 0, B = 2: two sessions per policy version; a stand-in trainer bumps the version."""
    live = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=["--max-staleness", "0", "--train-batch-size", "2"],
    ).start()
    try:
        ctl = controller(live, sdk_agent, group_size=2, max_concurrency=4)
        items = [{"id": f"s-{i}", "question": "hi", "n": 1} for i in range(3)]
        rollout = asyncio.create_task(ctl.run(items))
        versions = []
        async with httpx.AsyncClient(
            base_url=live.url, headers=live.admin_headers(), timeout=120
        ) as client:
            version, deadline = 0, time.monotonic() + 120
            while not rollout.done() and time.monotonic() < deadline:
                # The trainer: once a batch of B finished sessions exists, train on it and push.
                if ctl.progress.sessions_rewarded >= (version + 1) * 2 and version < 2:
                    version += 1
                    resp = await client.post(
                        "/admin/weights", json={"version": version, "path": str(tiny_model_dir)}
                    )
                    assert resp.status_code == 200, resp.text
                    versions.append(version)
                await asyncio.sleep(0.1)
        ctl.stop()  # a no-op when every run completed; ends the waiting otherwise
        report = await asyncio.wait_for(rollout, timeout=60)
    finally:
        live.stop()
    assert versions == [1, 2]
    assert report.waits_429 > 0 and report.wait_seconds_429 > 0
    assert (report.sessions_started, report.sessions_rewarded, report.sessions_failed) == (6, 6, 0)


class LosesFirstAnswers(httpx.AsyncBaseTransport):
    """Forwards every request to the proxy; of each ``Idempotency-Key``'s first
    ``POST /rl/sessions`` it drops the answer and raises ``ReadTimeout``, as a client
    whose 60 s ran out while the proxy (slowed by load) was still creating the session."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.posts: dict[str, list[int]] = {}  # key -> status of each POST the proxy answered

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method != "POST" or request.url.path != "/rl/sessions":
            return response
        key = request.headers["idempotency-key"]
        answered = self.posts.setdefault(key, [])
        answered.append(response.status_code)
        if len(answered) > 1:
            return response
        await response.aread()
        await response.aclose()
        raise httpx.ReadTimeout("timed out reading the answer (dropped)", request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_session_open_lost_in_transport_is_retried_with_its_key(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every session's first create is answered too late; the run still completes with one
    session per run, each admitted once. (A proxy that ignored the key opens a second
    session per retry, which joins its admitted group: 4 sessions, 4 admitted, 2 never
    finished, and their groups never claimed.)"""
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    live = LiveProxy(tiny_model_dir, db_url=db_url, log_path=tmp_path / "serve.log").start()
    transport = LosesFirstAnswers()
    try:
        ctl = controller(live, sdk_agent, max_concurrency=2, transport=transport)
        items = [{"id": f"lost-{i}", "question": "hi", "n": 1} for i in range(2)]
        report = await asyncio.wait_for(ctl.run(items), timeout=120)
        store = await Store.open(db_url)
        try:
            admitted = (await store.admission_state()).admitted
            sessions = await store.count_sessions()
        finally:
            await store.close()
        trajectories = [live.trajectory(run.session_id) for run in report.runs]
    finally:
        live.stop()
    assert (report.sessions_started, report.sessions_rewarded, report.sessions_failed) == (2, 2, 0)
    assert report.waits_429 == 0
    assert sorted(transport.posts.values()) == [[200, 200], [200, 200]]  # one key per session
    assert (sessions, admitted) == (2, 2)
    assert len({run.session_id for run in report.runs}) == 2
    for stored in trajectories:
        assert stored["status"] == "finished" and stored["reward"] == expected_reward(items[0])
        assert len(stored["completions"]) == 1  # the agent's turn carried the reissued key


async def test_open_session_retries_transport_losses_with_one_key_then_gives_up() -> None:
    seen: list[tuple[str, str]] = []
    script: list[Any] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers["idempotency-key"], json.loads(request.content)["group_id"]))
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        return httpx.Response(step, json={"session_id": "s", "api_key": "k", "base_url": "u"})

    async def open_one(**kw: Any) -> dict[str, Any] | None:
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(answer), base_url="http://proxy"
        ) as client:
            return await open_session(
                client,
                asyncio.Event(),
                lambda s: None,
                group_id="g",
                data_id="d",
                metadata={},
                backoff_s=0.01,
                **kw,
            )

    request = httpx.Request("POST", "http://proxy/rl/sessions")
    script[:] = [httpx.ReadTimeout("t", request=request), httpx.ConnectError("c"), 503, 504, 200]
    assert await open_one(window_s=10) == {"session_id": "s", "api_key": "k", "base_url": "u"}
    assert len(seen) == 5 and len({key for key, _ in seen}) == 1
    assert seen[0][0].startswith("rollout-")

    first_key = seen[0][0]
    seen.clear()
    script[:] = [502, 200]
    with pytest.raises(
        RolloutError, match=r"1 tries with one Idempotency-Key in 0s\): answered 502"
    ):
        await open_one(window_s=0)  # no retry window: the first "not now" ends it
    assert len(seen) == 1 and {key for key, _ in seen} != {first_key}  # a new session, a new key

    seen.clear()
    script[:] = [400]
    with pytest.raises(RolloutError, match="answered 400"):  # the proxy's answer: no retry
        await open_one()
    assert len(seen) == 1
