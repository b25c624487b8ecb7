"""Many policies behind one endpoint, through a real ``proxima serve`` and the official SDKs.

The backend is the fake SGLang with LoRA enabled (SGLang 0.5.23's adapter registry: the
proxy's ``lora_path`` names must be loaded, an unload waits for running requests). Two
adapters and the base are served at once; every completion records its adapter and every
token its adapter's version; a push of one adapter interrupts only that adapter's streams;
``model`` may name the caller's policy but no other.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.store import Store
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy

Setup = tuple[LiveProxy, FakeBackend, Path]


@pytest.fixture(scope="module")
def lora_proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    fake = FakeBackend(tokens_per_s=200, enable_lora=True, record_bodies=True)
    work = tmp_path_factory.mktemp("adapters")
    with ThreadedServer(create_fake_app(fake)) as server:
        proxy = LiveProxy(
            tiny_model_dir,
            db_url=f"sqlite:///{work / 'store.db'}",
            log_path=work / "serve.log",
            extra_args=["--backend", server.url],
        )
        proxy.start()
        try:
            yield proxy, fake, work
        finally:
            proxy.stop()


def _adapter_dir(root: Path, name: str) -> str:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def _push(proxy: LiveProxy, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        proxy.url + "/admin/weights", json=body, headers=proxy.admin_headers(), timeout=60
    )


def _chat(proxy: LiveProxy, key: str, model: str, max_tokens: int = 6) -> Any:
    client = OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
    )


def test_two_adapters_and_the_base_are_served_and_recorded_apart(lora_proxy: Setup) -> None:
    proxy, fake, work = lora_proxy
    a = proxy.new_session(adapter="tenant-a")
    b = proxy.new_session(adapter="tenant-b")
    base = proxy.new_session()
    pushed = _push(proxy, {"version": 1, "path": _adapter_dir(work, "a1"), "adapter": "tenant-a"})
    assert pushed.status_code == 200, pushed.text
    assert pushed.json()["adapter"] == "tenant-a" and pushed.json()["version"] == 1
    again = _push(proxy, {"version": 1, "path": _adapter_dir(work, "a1"), "adapter": "tenant-a"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "version_not_newer"
    for session in (a, b, base):
        _chat(proxy, session["api_key"], proxy.model_name)
    seen = {}
    for name, session in (("tenant-a", a), ("tenant-b", b), (None, base)):
        trajectory = proxy.trajectory(session["session_id"])
        assert trajectory["adapter"] == name
        (completion,) = trajectory["completions"]
        assert completion["adapter"] == name
        seen[name] = set(completion["output_versions"])
    # tenant-a's tokens are its version 1; tenant-b was never pushed (its version 0 is
    # the base weights with no adapter); the base is at version 0.
    assert seen == {"tenant-a": {1}, "tenant-b": {0}, None: {0}}
    loras = {body.get("lora_path") for body in fake.bodies}
    assert "tenant-a@v1" in loras and None in loras
    assert fake.lora is not None and set(fake.lora.loaded()) == {"tenant-a@v1"}


def test_model_may_name_the_callers_policy_and_no_other(lora_proxy: Setup) -> None:
    proxy, _, _ = lora_proxy
    key = proxy.new_session(adapter="tenant-a")["api_key"]
    served = proxy.model_name
    assert _chat(proxy, key, f"{served}:tenant-a").choices[0].message is not None
    client = OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
    other = f"{served}:tenant-b"
    with pytest.raises(openai.BadRequestError) as chat:
        _chat(proxy, key, other)
    assert chat.value.param == "model" and "tenant-b" in chat.value.message
    with pytest.raises(openai.BadRequestError) as text:
        client.completions.create(model=other, prompt="Once", max_tokens=4)
    assert text.value.param == "model"
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model=other, input="hi", max_output_tokens=16)
    assert responses.value.param == "model"
    claude = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="tenant-b"):
        claude.messages.create(
            model=other, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    base_key = proxy.new_session()["api_key"]
    with pytest.raises(openai.BadRequestError) as base:
        _chat(proxy, base_key, f"{served}:tenant-a")
    assert base.value.param == "model" and "base" in base.value.message


def test_a_session_of_an_invalid_adapter_name_is_refused(lora_proxy: Setup) -> None:
    proxy, _, _ = lora_proxy
    for name in ("Tenant-A", "a b", "-x", "a" * 65):
        resp = httpx.post(
            proxy.url + "/rl/sessions",
            json={"adapter": name},
            headers=proxy.admin_headers(),
            timeout=30,
        )
        assert resp.status_code == 400, (name, resp.text)
        assert "adapter" in resp.text


def test_a_session_of_another_policy_cannot_join_a_group(lora_proxy: Setup) -> None:
    """A group is one policy's sessions: another policy's session in it is a 409."""
    proxy, _, _ = lora_proxy
    proxy.new_session(adapter="tenant-a", group_id="shared-group")
    for other in ({"adapter": "tenant-b"}, {}):
        resp = httpx.post(
            proxy.url + "/rl/sessions",
            json={"group_id": "shared-group", **other},
            headers=proxy.admin_headers(),
            timeout=30,
        )
        assert resp.status_code == 409, resp.text
        error = resp.json()["error"]
        assert error["param"] == "group_id" and error["code"] == "group_of_another_policy"
        assert "tenant-a" in error["message"]
    assert proxy.new_session(adapter="tenant-a", group_id="shared-group")["session_id"]


def test_a_push_mid_stream_interrupts_and_resumes_only_that_adapter(lora_proxy: Setup) -> None:
    proxy, fake, work = lora_proxy
    sessions = {name: proxy.new_session(adapter=name) for name in ("tenant-a", "tenant-b")}
    sessions["base"] = proxy.new_session()
    current = httpx.get(proxy.url + "/health", timeout=30).json()
    assert current["status"] == "ok"

    async def main() -> dict[str, str]:
        counts = dict.fromkeys(sessions, 0)
        texts = dict.fromkeys(sessions, "")

        async def stream(name: str) -> None:
            client = AsyncOpenAI(
                base_url=proxy.base_url, api_key=sessions[name]["api_key"], max_retries=0
            )
            reply = await client.chat.completions.create(
                model=proxy.model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=120,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in reply:
                if chunk.choices and chunk.choices[0].delta.content:
                    counts[name] += 1
                    texts[name] += chunk.choices[0].delta.content
            await client.close()

        tasks = [asyncio.create_task(stream(name)) for name in sessions]
        while min(counts.values()) < 5:
            await asyncio.sleep(0.02)
            if any(t.done() for t in tasks):
                break
        assert all(not t.done() for t in tasks), "every stream was still running at the push"
        async with httpx.AsyncClient() as http:
            pushed = await http.post(
                proxy.url + "/admin/weights",
                json={"version": 2, "path": _adapter_dir(work, "a2"), "adapter": "tenant-a"},
                headers=proxy.admin_headers(),
                timeout=60,
            )
        assert pushed.status_code == 200, pushed.text
        await asyncio.gather(*tasks)
        return texts

    asyncio.run(main())
    versions = {}
    for name, session in sessions.items():
        (completion,) = proxy.trajectory(session["session_id"])["completions"]
        assert len(completion["output_ids"]) == 120
        versions[name] = completion["output_versions"]
    a = versions["tenant-a"]
    assert a[0] == 1 and a[-1] == 2 and a == sorted(a)  # v1 tokens, then v2 tokens
    assert set(versions["tenant-b"]) == {0} and set(versions["base"]) == {0}
    assert not fake.paused
    assert fake.lora is not None and "tenant-a@v1" not in fake.lora.loaded()
    assert "tenant-a@v2" in fake.lora.loaded()


def test_a_production_key_is_served_and_recorded_as_its_adapter(lora_proxy: Setup) -> None:
    """``proxima keys create --adapter tenant-b``: its traffic is tenant-b's, recorded so."""
    proxy, fake, work = lora_proxy
    created = subprocess.run(
        [sys.executable, "-m", "proxima.cli", "keys", "create", "--name", "b-prod"]
        + ["--adapter", "tenant-b", "--db", f"sqlite:///{work / 'store.db'}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    fields = dict(line.split(": ", 1) for line in created.stdout.splitlines())
    assert fields["adapter"] == "tenant-b"
    pushed = _push(proxy, {"version": 1, "path": _adapter_dir(work, "b1"), "adapter": "tenant-b"})
    assert pushed.status_code == 200, pushed.text
    client = OpenAI(
        base_url=proxy.base_url,
        api_key=fields["key"],
        max_retries=0,
        default_headers={"X-Session-Id": "conversation-1"},
    )
    reply = client.chat.completions.create(
        model=f"{proxy.model_name}:tenant-b",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
    )
    assert fake.bodies[-1]["lora_path"] == "tenant-b@v1"
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(proxy, fields["key"], f"{proxy.model_name}:tenant-a")
    assert caught.value.param == "model" and reply.choices

    async def recorded() -> list[tuple[str | None, list[int]]]:
        store = await Store.open(f"sqlite:///{work / 'store.db'}")
        try:
            key = next(k for k in await store.list_api_keys() if k.name == "b-prod")
            session = await store.get_or_create_production_session(
                api_key_id=key.id, external_id="conversation-1"
            )
            assert session.adapter == "tenant-b"
            return [
                (c.adapter, c.output_versions)
                for c in await store.list_completions(session_id=session.id)
            ]
        finally:
            await store.close()

    assert asyncio.run(recorded()) == [("tenant-b", [1] * 5)]


class _AnswerLost(httpx.AsyncBaseTransport):
    """Sends every request; the answer to the first ``POST /admin/weights`` is lost on the way
    back (a read timeout after the proxy loaded and recorded the push)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.lost = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path == "/admin/weights" and not self.lost:
            await response.aread()
            self.lost += 1
            raise httpx.ReadTimeout("answer lost", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_health_lists_each_adapters_version_from_the_store(lora_proxy: Setup) -> None:
    """``/health``'s ``adapters`` is the store's (what another replica recorded shows at once)."""
    proxy, _, work = lora_proxy

    async def record_elsewhere() -> None:
        store = await Store.open(f"sqlite:///{work / 'store.db'}")
        try:  # as a replica on the same database would, after loading it on its backends
            await store.record_policy_version(
                version=4, path=_adapter_dir(work, "d4"), adapter="tenant-d"
            )
        finally:
            await store.close()

    asyncio.run(record_elsewhere())
    adapters = httpx.get(proxy.url + "/health", timeout=30).json()["adapters"]
    assert adapters["tenant-d"] == 4
    assert all(isinstance(v, int) and v >= 1 for v in adapters.values())


def test_a_retried_adapter_push_that_already_landed_is_a_success(lora_proxy: Setup) -> None:
    """The trainer's push of tenant-c v1 lands but its answer is lost; the retry is answered
    409 (not newer), and ``/health``'s ``adapters`` says v1 is served: the push succeeded.
    A 409 for a version that is not the served one stays an error."""
    from proxima.trainer.weights import ProxyWeightSink, WeightPushError

    proxy, fake, work = lora_proxy

    async def main() -> None:
        sink = ProxyWeightSink(proxy.url, admin_token=proxy.admin_token, timeout_s=60)
        transport = _AnswerLost()
        await sink._client.aclose()
        sink._client = httpx.AsyncClient(
            transport=transport, headers=proxy.admin_headers(), timeout=60
        )
        try:
            result = await sink.push(
                version=1, path=Path(_adapter_dir(work, "c1")), adapter="tenant-c"
            )
            assert transport.lost == 1 and result.version == 1
            assert await sink.served_version(adapter="tenant-c") == 1
            pushed = await sink.push(
                version=2, path=Path(_adapter_dir(work, "c2")), adapter="tenant-c"
            )
            assert pushed.version == 2 and pushed.proxy_seconds > 0  # answered 200
            with pytest.raises(WeightPushError, match="it serves version 2"):
                await sink.push(version=1, path=Path(_adapter_dir(work, "c1")), adapter="tenant-c")
        finally:
            await sink.aclose()

    asyncio.run(main())
    assert fake.lora is not None and "tenant-c@v2" in fake.lora.loaded()
    assert "tenant-c@v1" not in fake.lora.loaded()
