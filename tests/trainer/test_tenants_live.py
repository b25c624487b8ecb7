"""Two tenants' adapters and the base behind one real ``proxima serve``, trained by the real trainer.

The proxy runs the embedded engine (the tiny model) with ``--enable-lora`` and a second
embedded engine for production (``--production-engine``); agents are the OpenAI SDK; the
trainer is :class:`~proxima.trainer.adapter_loop.AdapterTrainers` (tenant-a and tenant-b on
one frozen base) pushing through ``ProxyWeightSink``. Issue 22's "done when":

1. Only tenant-a has rewarded sessions: the trainer steps tenant-a alone, twice; the base's
   and tenant-b's tensors in the trainer are bit-identical afterwards, and so are the
   engine's logprobs of the base and of tenant-b (same prompt, greedy); tenant-a's moved.
2. tenant-a's first push lands while a stream of each policy is running: only tenant-a's is
   interrupted (one interruption in all) and resumed on the new version; tenant-b's and the
   base's streams carry one version each; every completion records its adapter and every
   token its adapter's version.
3. Promoting and rolling back tenant-a in production leaves tenant-b's production version
   (and what its production key is served, bit for bit) alone; ``proxima eval --adapter``
   scores tenant-a's versions (wherever they are served) for its eval gate only.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI, OpenAI
from proxima.proxy.auth import PRODUCTION_KEY_PREFIX, hash_key, new_key
from proxima.proxy.store import SessionStatus, Store
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.lora import linear_shapes, write_peft_adapter
from proxima.trainer.adapter_loop import AdapterTrainers
from proxima.trainer.config import TrainerConfig
from proxima.trainer.weights import ProxyWeightSink, PushResult
from transformers import AutoModelForCausalLM

A, B = "tenant-a", "tenant-b"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the trainer's default target modules
RANK, ALPHA = 4, 8.0
PROBE = [{"role": "user", "content": "Name a colour."}]
STREAM_TOKENS = 600


@pytest.fixture
def lora_proxy(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LiveProxy]:
    live = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=["--enable-lora", "--production-engine", "--train-batch-size", "2"],
    )
    live.start()
    yield live
    live.stop()


def probe(proxy: LiveProxy, key: str) -> tuple[list[str], list[float]]:
    """The greedy reply to ``PROBE`` and the engine's logprob of each of its tokens."""
    return probe_session(proxy, key)[0]


def probe_session(proxy: LiveProxy, key: str) -> tuple[tuple[list[str], list[float]], str]:
    """``probe``, and the id of the session that recorded it."""
    client = OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=proxy.model_name,
        messages=PROBE,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    content = raw.parse().choices[0].logprobs
    assert content is not None and content.content is not None
    tokens = [t.token for t in content.content], [t.logprob for t in content.content]
    return tokens, raw.headers.get("X-Proxima-Session-Id", "")


def run_group(proxy: LiveProxy, adapter: str | None, group: str) -> list[str]:
    """Two agent runs of ``adapter`` in one group, rewarded 1 and 0, finished."""
    ids = []
    for reward in (1.0, 0.0):
        body: dict[str, Any] = {"group_id": group}
        if adapter is not None:
            body["adapter"] = adapter
        session = proxy.new_session(**body)
        client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        client.chat.completions.create(
            model=proxy.model_name,
            messages=[{"role": "user", "content": f"Count to three ({group})."}],
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        sid, auth = session["session_id"], {"Authorization": f"Bearer {session['api_key']}"}
        url = f"{proxy.url}/rl/sessions/{sid}"
        httpx.post(url + "/reward", json={"reward": reward}, headers=auth).raise_for_status()
        httpx.post(url + "/finish", headers=auth).raise_for_status()
        ids.append(sid)
    return ids


def interruptions(proxy: LiveProxy) -> float:
    text = httpx.get(proxy.url + "/metrics", timeout=30).text
    found = re.search(r"^proxima_generation_interruptions_total (\S+)$", text, re.MULTILINE)
    assert found is not None, "the interruption counter is exported"
    return float(found.group(1))


def admin(proxy: LiveProxy, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    resp = httpx.request(
        method, proxy.url + path, headers=proxy.admin_headers(), timeout=120, **kwargs
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


class PushMidStream:
    """The real ``ProxyWeightSink``; before its first push, ``before_first`` runs (it starts
    the streams the push must interrupt, and returns once they are generating)."""

    def __init__(self, sink: ProxyWeightSink, before_first: Callable[[], Awaitable[None]]):
        self.sink = sink
        self.before_first: Callable[[], Awaitable[None]] | None = before_first
        self.pushed: list[tuple[str | None, int]] = []

    async def push(self, *, version: int, path: Path, adapter: str | None = None) -> PushResult:
        if self.before_first is not None:
            before, self.before_first = self.before_first, None
            await before()
        result = await self.sink.push(version=version, path=path, adapter=adapter)
        self.pushed.append((adapter, version))
        return result

    async def aclose(self) -> None:
        await self.sink.aclose()


async def test_tenant_a_trains_pushes_and_promotes_alone(
    lora_proxy: LiveProxy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    proxy = lora_proxy
    # tenant-b's v1: a random adapter of the trainer's shape, pushed by its own team.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    b1 = write_peft_adapter(
        tmp_path / "b1", linear_shapes(model, TARGETS), rank=RANK, alpha=ALPHA, seed=7, std=0.2
    )
    del model
    pushed = admin(
        proxy, "POST", "/admin/weights", json={"version": 1, "path": str(b1), "adapter": B}
    )
    assert pushed["adapter"] == B

    probes = {
        policy: proxy.new_session(**({"adapter": policy} if policy else {}))
        for policy in (A, B, None)
    }
    keys = {policy: s["api_key"] for policy, s in probes.items()}
    before = {policy: await asyncio.to_thread(probe, proxy, key) for policy, key in keys.items()}
    assert before[A] == before[None]  # tenant-a's version 0 is the bare base
    assert before[B][1] != before[None][1]  # tenant-b's adapter changes the model

    a_groups = [await asyncio.to_thread(run_group, proxy, A, f"a{i}") for i in range(2)]
    base_group = await asyncio.to_thread(run_group, proxy, None, "base")

    # ------------------------------------------------------------ tenant-a trains, alone
    streams: dict[str | None, dict[str, Any]] = {
        policy: proxy.new_session(**({"adapter": policy} if policy else {}))
        for policy in (A, B, None)
    }
    counts = dict.fromkeys(streams, 0)
    tasks: list[asyncio.Task[None]] = []
    interrupted_before = await asyncio.to_thread(interruptions, proxy)

    async def stream(policy: str | None) -> None:
        client = AsyncOpenAI(
            base_url=proxy.base_url, api_key=streams[policy]["api_key"], max_retries=0
        )
        reply = await client.chat.completions.create(
            model=proxy.model_name,
            messages=[{"role": "user", "content": "Tell a long story."}],
            max_tokens=STREAM_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in reply:
            if chunk.choices and chunk.choices[0].delta.content:
                counts[policy] += 1
        await client.close()

    async def start_streams() -> None:
        tasks.extend(asyncio.create_task(stream(policy)) for policy in streams)
        while min(counts.values()) < 5 and not any(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        assert not any(t.done() for t in tasks), "every stream is running at the push"

    cfg = TrainerConfig.model_validate(
        {
            "batch_size": 2,
            "output_dir": str(tmp_path / "trainer"),
            "optim": {"lr": 1e-2},
            "lora": {"adapters": [A, B], "rank": RANK, "alpha": ALPHA, "target_modules": TARGETS},
            "loop": {"poll_interval_s": 0.05, "trainer_id": "tenants"},
            "connection": {
                "proxy_url": proxy.url,
                "db_url": proxy.db_url,
                "model_dir": str(tiny_model_dir),
                "admin_token": proxy.admin_token,
            },
        }
    )
    store = await Store.open(proxy.db_url)
    sink = PushMidStream(ProxyWeightSink(proxy.url, admin_token=proxy.admin_token), start_streams)
    try:
        trainers = await AdapterTrainers.start(cfg, store=store, sink=sink, console=False)
        backend = trainers.backend
        base_before = {n: p.detach().clone() for n, p in backend.base_parameters()}
        b_before = [p.detach().clone() for p in backend.adapter_parameters(B)]
        assert any(p.abs().sum() > 0 for p in b_before), "tenant-b resumed from its pushed v1"
        a_before = [p.detach().clone() for p in backend.adapter_parameters(A)]
        try:
            first = await asyncio.wait_for(trainers.step(), 300)
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
            second = await asyncio.wait_for(trainers.step(), 300)
        finally:
            await trainers.close()
        assert first is not None and second is not None
        assert sink.pushed == [(A, 1), (A, 2)]
        for name, param in backend.base_parameters():
            assert torch.equal(param, base_before[name]), name
        b_after = backend.adapter_parameters(B)
        assert all(torch.equal(x, y) for x, y in zip(b_after, b_before, strict=True))
        a_after = backend.adapter_parameters(A)
        assert not all(torch.equal(x, y) for x, y in zip(a_after, a_before, strict=True))

        assert await store.current_policy_version(adapter=A) == 2
        assert await store.current_policy_version(adapter=B) == 1
        assert await store.current_policy_version() == 0
        for sid in (s for group in a_groups for s in group):
            session = await store.get_session(session_id=sid)
            assert session is not None and session.status == SessionStatus.TRAINED
        for sid in base_group:  # nobody trains the base here
            session = await store.get_session(session_id=sid)
            assert session is not None and session.status == SessionStatus.FINISHED
    finally:
        await sink.aclose()
        await store.close()

    # ------------------------------------- only tenant-a's stream was interrupted and resumed
    assert await asyncio.to_thread(interruptions, proxy) - interrupted_before == 1
    recorded = {}
    for policy, session in streams.items():
        (completion,) = proxy.trajectory(session["session_id"])["completions"]
        assert completion["adapter"] == policy
        assert len(completion["output_ids"]) == STREAM_TOKENS
        recorded[policy] = completion["output_versions"]
    a_versions = recorded[A]
    assert a_versions[0] == 0 and a_versions[-1] == 1 and a_versions == sorted(a_versions)
    assert set(recorded[B]) == {1} and set(recorded[None]) == {0}
    health = httpx.get(proxy.url + "/health", timeout=30).json()
    assert health["version"] == 0 and health["adapters"] == {A: 2, B: 1}

    # ----------------------------------- the base and tenant-b serve exactly as before
    after = {policy: await asyncio.to_thread(probe, proxy, key) for policy, key in keys.items()}
    assert after[None] == before[None]
    assert after[B] == before[B]
    assert after[A][1] != before[A][1]  # tenant-a's v2 is what its sessions get now

    # ------------------------- production: tenant-a's promote/rollback leaves tenant-b alone
    prod_keys = {}
    opened = await Store.open(proxy.db_url)
    try:
        for policy in (A, B):
            key = new_key(PRODUCTION_KEY_PREFIX)
            await opened.create_api_key(
                name=f"{policy}-app", key_hash=hash_key(key), record=True, adapter=policy
            )
            prod_keys[policy] = key
    finally:
        await opened.close()

    def production_version(policy: str) -> int:
        return int(admin(proxy, "GET", "/admin/production", params={"adapter": policy})["version"])

    admin(proxy, "POST", "/admin/production", json={"version": 1, "adapter": B})
    b_served = await asyncio.to_thread(probe, proxy, prod_keys[B])
    assert b_served == before[B]  # production's engine serves tenant-b v1 like training's
    for step in ({"version": 1}, {"version": 2}, None):
        if step is None:
            admin(proxy, "POST", "/admin/production/rollback", params={"adapter": A})
        else:
            admin(proxy, "POST", "/admin/production", json={**step, "adapter": A})
        assert production_version(B) == 1
        assert await asyncio.to_thread(probe, proxy, prod_keys[B]) == b_served
    assert production_version(A) == 1  # rolled back from 2
    assert admin(proxy, "GET", "/admin/production")["version"] == 0  # the base's: untouched
    served = {}
    for policy in (A, B):
        served[policy] = await asyncio.to_thread(probe_session, proxy, prod_keys[policy])
    assert served[A][0][1] != before[A][1]  # tenant-a's v1, not the bare base
    opened = await Store.open(proxy.db_url)
    try:
        for policy, (_, session_id) in served.items():
            (completion,) = await opened.list_completions(session_id=session_id)
            assert completion.adapter == policy
            assert completion.output_versions == [1] * 8, policy
    finally:
        await opened.close()

    # ------------- the eval gate per adapter: `proxima eval --adapter` scores tenant-a's versions
    config = tmp_path / "eval.toml"
    config.write_text(
        f'[model]\npath = "{tiny_model_dir}"\n'
        f'[proxy]\nurl = "{proxy.url}"\nadmin_token = "{proxy.admin_token}"\n'
        "[data]\ntest_items = 2\n"
        "[rollout.item_fields]\nmax_turns = 1\nmax_tokens = 4\n"
    )
    for version in (1, 2):  # production serves tenant-a's v1, training its v2
        command = ["eval", "--config", str(config), "--version", str(version), "--adapter", A]
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "proxima.cli", *command],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr
        assert f"first-try accuracy of version {version} of adapter {A}" in out.stdout
    rows = admin(proxy, "GET", "/admin/versions", params={"adapter": A})["versions"]
    scores = {r["version"]: r["eval"]["score"] for r in rows if r["eval"] is not None}
    assert sorted(scores) == [1, 2]
    for other in ({}, {"adapter": B}):  # the base's and tenant-b's registries got no score
        assert all(
            r["eval"] is None
            for r in admin(proxy, "GET", "/admin/versions", params=other)["versions"]
        )
    gated = httpx.post(
        proxy.url + "/admin/production",
        json={"version": 2, "adapter": A, "require_eval": True},
        headers=proxy.admin_headers(),
        timeout=120,
    )
    if scores[2] >= scores[1]:
        assert gated.status_code == 200 and production_version(A) == 2, gated.text
    else:
        assert gated.json()["error"]["code"] == "eval_below_production"
    missing = httpx.post(
        proxy.url + "/admin/production",
        json={"version": 1, "adapter": B, "require_eval": True},
        headers=proxy.admin_headers(),
        timeout=120,
    )
    assert missing.status_code == 409 and missing.json()["error"]["code"] == "eval_missing"
    assert production_version(B) == 1
