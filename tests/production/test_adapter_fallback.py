"""A served adapter version that yields non-finite logprobs: its tenant falls back to the last
good version, the push is marked failed (``/admin/versions``, ``/metrics``), on SQLite and
PostgreSQL.

The backend is the fake SGLang with LoRA enabled whose listed adapter versions answer null
logprobs (orjson's NaN), as an engine serving a broken adapter does; a real ``proxima
serve`` runs on it. Before the fall-back, every chat of the tenant after the bad push was a
503 ("the backend returned a non-finite logprob").
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from proxima.proxy.backends.protocol import GenerateRequest
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy

from tests.pg import POSTGRES_PARAM, create_test_database


class BrokenLoRA(FakeBackend):
    """The fake SGLang; requests of the lora names in ``broken`` (``None``: the base) get a
    null logprob for every token."""

    def __init__(self) -> None:
        super().__init__(tokens_per_s=400, enable_lora=True)
        self.broken: set[str | None] = set()
        self.nulls = 0  # null logprobs answered (the breakage did happen)

    def _logprob_entry(
        self, rng: random.Random, token: int, position: int, request: GenerateRequest
    ) -> tuple[list[Any], list[list[Any]]]:
        entry, top = super()._logprob_entry(rng, token, position, request)
        if request.lora_path in self.broken:
            self.nulls += 1
            entry = [None, *entry[1:]]
        return entry, top


Setup = tuple[LiveProxy, BrokenLoRA, Path]


@pytest.fixture(scope="module", params=["sqlite", POSTGRES_PARAM])
def served(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("fallback")
    if request.param == POSTGRES_PARAM:
        db_url = create_test_database(request)
    else:
        db_url = f"sqlite:///{work / 'store.db'}"
    fake = BrokenLoRA()
    with ThreadedServer(create_fake_app(fake)) as server:
        proxy = LiveProxy(
            tiny_model_dir,
            db_url=db_url,
            log_path=work / "serve.log",
            extra_args=["--backend", server.url],
        )
        proxy.start()
        try:
            yield proxy, fake, work
        finally:
            proxy.stop()


def _push(proxy: LiveProxy, work: Path, adapter: str, version: int) -> httpx.Response:
    path = work / f"{adapter}-v{version}"
    path.mkdir(exist_ok=True)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    body = {"version": version, "path": str(path), "adapter": adapter}
    return httpx.post(
        proxy.url + "/admin/weights", json=body, headers=proxy.admin_headers(), timeout=60
    )


def _chat(proxy: LiveProxy, adapter: str) -> tuple[Any, list[int]]:
    """A chat of a new session of ``adapter``: the reply and its tokens' versions."""
    session = proxy.new_session(adapter=adapter)
    client = OpenAI(base_url=proxy.base_url, api_key=session["api_key"], max_retries=0)
    reply = client.chat.completions.create(
        model=proxy.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    (completion,) = proxy.trajectory(session["session_id"])["completions"]
    return reply, completion["output_versions"]


def _versions(proxy: LiveProxy, adapter: str) -> dict[int, Any]:
    listed = httpx.get(
        f"{proxy.url}/admin/versions?adapter={adapter}", headers=proxy.admin_headers(), timeout=30
    ).json()
    return {row["version"]: row["failed"] for row in listed["versions"]}


def _fallbacks(proxy: LiveProxy, adapter: str) -> float:
    text = httpx.get(proxy.url + "/metrics", headers=proxy.admin_headers(), timeout=30).text
    found = re.search(
        rf'^proxima_adapter_fallbacks_total{{adapter="{adapter}"}} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


def test_a_broken_version_falls_back_to_the_last_good_one(served: Setup) -> None:
    proxy, fake, work = served
    assert _push(proxy, work, "tenant-a", 1).status_code == 200
    fake.broken.add("tenant-a@v2")
    assert _push(proxy, work, "tenant-a", 2).status_code == 200  # it loads; it is broken
    reply, versions = _chat(proxy, "tenant-a")  # resumed on version 1, not a 503
    assert fake.nulls > 0 and reply.choices[0].message is not None
    assert set(versions) == {1}
    assert httpx.get(proxy.url + "/health", timeout=30).json()["adapters"]["tenant-a"] == 1
    failed = _versions(proxy, "tenant-a")
    assert failed[1] is None and failed[2] is not None
    assert "non-finite logprob" in failed[2]["reason"]
    assert _fallbacks(proxy, "tenant-a") == 1.0
    assert set(_chat(proxy, "tenant-a")[1]) == {1}  # and from then on
    # The failed number stays taken: the next push is version 3.
    assert _push(proxy, work, "tenant-a", 2).status_code == 409
    assert _push(proxy, work, "tenant-a", 3).status_code == 200
    assert set(_chat(proxy, "tenant-a")[1]) == {3}
    assert _fallbacks(proxy, "tenant-a") == 1.0


def test_a_broken_first_version_falls_back_to_the_bare_base(served: Setup) -> None:
    proxy, fake, work = served
    fake.broken.add("tenant-c@v1")
    assert _push(proxy, work, "tenant-c", 1).status_code == 200
    assert set(_chat(proxy, "tenant-c")[1]) == {0}
    assert "tenant-c" not in httpx.get(proxy.url + "/health", timeout=30).json()["adapters"]
    assert _versions(proxy, "tenant-c")[1] is not None
    assert _fallbacks(proxy, "tenant-c") == 1.0


def test_a_broken_base_is_not_the_adapters_fault(served: Setup) -> None:
    """The base yields non-finite logprobs on the same prompt too: the adapter is not marked
    failed and the request is a 503, as before."""
    proxy, fake, work = served
    assert _push(proxy, work, "tenant-b", 1).status_code == 200
    fake.broken.update({"tenant-b@v1", None})
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            _chat(proxy, "tenant-b")
        assert caught.value.status_code == 503 and "non-finite logprob" in caught.value.message
    finally:
        fake.broken -= {"tenant-b@v1", None}
    assert _versions(proxy, "tenant-b")[1] is None
    assert httpx.get(proxy.url + "/health", timeout=30).json()["adapters"]["tenant-b"] == 1
    assert _fallbacks(proxy, "tenant-b") == 0.0
    assert set(_chat(proxy, "tenant-b")[1]) == {1}
