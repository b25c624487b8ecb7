"""Every ``/generate`` body the proxy sends passes SGLang 0.5.23's own JSON contract.

SGLang's HTTP server refuses a ``/generate`` body with 400 when its generated
decoder (``sglang/api/v1/api_types.py``, ``GenerateRequest.from_json_value``,
called by ``entrypoints/api_contract.py``) rejects it; ``sampling_params``
rejects unknown keys there. That module needs only ``msgspec``, so it is
loaded from the installed wheel (``pip install --no-deps sglang==0.5.23``)
by file path: importing the ``sglang`` package itself would pull its GPU
stack (its ``__init__`` imports ``sglang.srt.utils``, which needs pybase64,
zmq and more).

The proxy runs in front of the fake SGLang (incremental streaming), which
records every body and aborts requests every few tokens (so resumed bodies are
checked too).

LoRA: the load/unload bodies and reply are compared field by field with
SGLang's own structs (read from its source), and the client drives the fake's
copy of SGLang's adapter behaviour (errors, the unload that waits for running
requests, the implicit reload of an unloaded name).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from proxima.proxy.backends.errors import BackendOperationFailed, BackendRejected
from proxima.proxy.backends.protocol import (
    GenerateRequest,
    LoadLoRAAdapterBody,
    LoRAUpdateResponse,
    ModelCard,
    SamplingParams,
    UnloadLoRAAdapterBody,
    lora_name,
    parse_lora_name,
)
from proxima.proxy.backends.sglang import SGLangClient
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.lora import write_peft_adapter
from pydantic import BaseModel

SGLANG_VERSION = "0.5.23"


def _sglang_api_types() -> ModuleType:
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations, (
        f"install SGLang's wheel: pip install --no-deps sglang=={SGLANG_VERSION}"
    )
    from importlib.metadata import version

    assert version("sglang") == SGLANG_VERSION
    path = Path(next(iter(spec.submodule_search_locations))) / "api" / "v1" / "api_types.py"
    module_spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


API = _sglang_api_types()


def test_sglang_contract_is_the_real_one() -> None:
    """The loaded decoder refuses what real SGLang refuses (the proxy's old bug among them)."""
    good = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 1}}
    API.GenerateRequest.from_json_value(good)
    with pytest.raises(API.JsonContractError, match="unknown field `seed`"):
        API.GenerateRequest.from_json_value(
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "seed": 1}}
        )


@pytest.fixture(scope="module")
def recording_proxy(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveProxy, FakeBackend]]:
    # Incremental chunks, as compose launches SGLang (cumulative: test_backends, production).
    fake = FakeBackend(
        tokens_per_s=500,
        chunk_tokens=2,
        incremental=True,
        record_bodies=True,
        abort_at=frozenset(range(0, 4096, 9)),
    )
    work = tmp_path_factory.mktemp("contract")
    with ThreadedServer(create_fake_app(fake)) as server:
        proxy = LiveProxy(
            tiny_model_dir,
            db_url=f"sqlite:///{work / 'store.db'}",
            log_path=work / "serve.log",
            extra_args=["--backend", server.url],
        )
        proxy.start()
        try:
            yield proxy, fake
        finally:
            proxy.stop()


def _requests(client: OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Say something."}]
    common: dict[str, Any] = {"model": model, "max_tokens": 20}
    for stream in (False, True):
        for extra in (
            {},
            {"seed": 7, "temperature": 0.8, "top_p": 0.9},
            {"stop": ["zz", "\n\n"]},
            {"logprobs": True, "top_logprobs": 3, "temperature": 0.0},
            {"frequency_penalty": 0.5, "presence_penalty": 0.2},
            {"response_format": {"type": "json_object"}},
        ):
            reply = client.chat.completions.create(
                messages=messages, stream=stream, **common, **extra
            )
            if stream:
                list(reply)  # type: ignore[arg-type]
        for extra in ({}, {"seed": 3, "stop": "x", "logprobs": 2}):
            reply = client.completions.create(prompt="Once", stream=stream, **common, **extra)
            if stream:
                list(reply)  # type: ignore[arg-type]


def test_every_body_the_proxy_sends_passes_sglangs_contract(
    recording_proxy: tuple[LiveProxy, FakeBackend],
) -> None:
    proxy, fake = recording_proxy
    client = OpenAI(base_url=proxy.base_url, api_key=proxy.new_session()["api_key"], max_retries=0)
    _requests(client, proxy.model_name)
    bodies = list(fake.bodies)
    resumed = [b for b in bodies if len(b["input_ids"]) % 9 == 0]
    assert len(bodies) > 16 and resumed, "every kind of body (16 requests), resumed ones too"
    seen_keys: set[str] = set()
    for body in bodies:
        parsed = API.GenerateRequest.from_json_value(json.loads(json.dumps(body)))
        assert parsed.input_ids == body["input_ids"]
        seen_keys |= set(body["sampling_params"])
    # The interesting fields did reach the wire (and passed).
    assert {"sampling_seed", "stop", "frequency_penalty", "presence_penalty"} <= seen_keys
    assert seen_keys & {"json_schema", "regex", "ebnf", "structural_tag"}
    assert any(b.get("top_logprobs_num") == 3 for b in bodies)


def test_scheduler_error_in_the_stream_is_an_openai_400(
    recording_proxy: tuple[LiveProxy, FakeBackend],
) -> None:
    """A prompt over SGLang's input limit: ``finish_reason.status_code`` 400, not a resume."""
    proxy, fake = recording_proxy
    session = proxy.new_session()
    client = OpenAI(base_url=proxy.base_url, api_key=session["api_key"], max_retries=0)
    fake.max_input_tokens = 5
    requests_before = fake.requests
    try:
        messages: Any = [{"role": "user", "content": "A prompt longer than five tokens."}]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=proxy.model_name, messages=messages, max_tokens=8)
        assert caught.value.status_code == 400
        assert caught.value.code == "context_length_exceeded"
        assert "exceeds the maximum allowed length" in caught.value.message
        # Streamed: the stream has begun, so the error arrives as its error event.
        with pytest.raises(openai.APIError, match="exceeds the maximum allowed length"):
            list(
                client.chat.completions.create(
                    model=proxy.model_name, messages=messages, max_tokens=8, stream=True
                )
            )
    finally:
        fake.max_input_tokens = None
    assert fake.requests - requests_before == 2  # one backend request each: never resumed
    assert proxy.trajectory(session["session_id"])["completions"] == []


def test_a_null_sampled_logprob_is_refused_and_never_stored(
    recording_proxy: tuple[LiveProxy, FakeBackend],
) -> None:
    proxy, fake = recording_proxy
    session = proxy.new_session()
    client = OpenAI(base_url=proxy.base_url, api_key=session["api_key"], max_retries=0)
    fake.null_logprob_at = frozenset({2})  # NaN or -inf for the third token: JSON null
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model=proxy.model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
            )
    finally:
        fake.null_logprob_at = frozenset()
    assert caught.value.status_code == 503
    assert "non-finite logprob" in caught.value.message
    assert proxy.trajectory(session["session_id"])["completions"] == []


# ---- LoRA adapters ------------------------------------------------------------------

SGLANG_DIR = Path(API.__file__).parents[2]


def _struct_fields(relative: str, cls_name: str) -> dict[str, bool]:
    """``field -> required`` of a class in SGLang's source, read with ``ast`` (importing
    ``io_struct`` would pull SGLang's GPU stack); ``BaseReq``'s IPC fields included."""
    tree = ast.parse((SGLANG_DIR / relative).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    fields = {
        stmt.target.id: stmt.value is None
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }
    if any(isinstance(b, ast.Name) and b.id == "BaseReq" for b in cls.bases):
        fields |= {"rid": False, "http_worker_ipc": False}
    return fields


def _required(model: type[BaseModel]) -> dict[str, bool]:
    return {name: field.is_required() for name, field in model.model_fields.items()}


def test_lora_bodies_are_sglangs() -> None:
    """Our LoRA bodies are SGLang 0.5.23's structs, field for field (less the fields SGLang
    fills in itself: the IPC ``rid``/``http_worker_ipc`` and the ``lora_id`` it mints)."""
    internal = {"rid", "http_worker_ipc", "lora_id"}
    io_struct = "srt/managers/io_struct.py"
    for ours, theirs in (
        (LoadLoRAAdapterBody, "LoadLoRAAdapterReqInput"),
        (UnloadLoRAAdapterBody, "UnloadLoRAAdapterReqInput"),
    ):
        fields = _struct_fields(io_struct, theirs)
        assert _required(ours) == {k: v for k, v in fields.items() if k not in internal}
    reply = _struct_fields(io_struct, "LoRAUpdateOutput")
    assert set(LoRAUpdateResponse.model_fields) == set(reply) - {"rid", "http_worker_ipc"}
    card = _struct_fields("srt/entrypoints/openai/protocol.py", "ModelCard")
    assert set(ModelCard.model_fields) == set(card)
    # The field /generate names the adapter with is in SGLang's JSON contract.
    parsed = API.GenerateRequest.from_json_value(
        GenerateRequest(input_ids=[1], lora_path=lora_name("tenant-a", 3)).wire(stream=False)
    )
    assert parsed.lora_path == "tenant-a@v3"


def test_lora_names_round_trip() -> None:
    assert lora_name("tenant-a", 3) == "tenant-a@v3"
    assert parse_lora_name("tenant-a@v3") == ("tenant-a", 3)
    assert parse_lora_name(lora_name("a_b-9", 120)) == ("a_b-9", 120)
    for bad in ("Tenant", "-a", "a" * 65, "a b", "a@v1"):
        with pytest.raises(ValueError, match="adapter name"):
            lora_name(bad, 1)
    for bad in ("tenant-a", "tenant-a@3", "tenant-a@v", "tenant-a@v01", "A@v1", "a@v1@v2"):
        with pytest.raises(ValueError, match="not a Proxima LoRA name"):
            parse_lora_name(bad)


@pytest.fixture
def adapter_dirs(tmp_path: Path) -> dict[str, Path]:
    shapes = {"model.layers.0.self_attn.q_proj": (8, 8)}
    return {
        "r4": write_peft_adapter(tmp_path / "r4", shapes, rank=4),
        "r4b": write_peft_adapter(tmp_path / "r4b", shapes, rank=4, seed=1),
        "r16": write_peft_adapter(tmp_path / "r16", shapes, rank=16),
        "dora": write_peft_adapter(tmp_path / "dora", shapes, extra_config={"use_dora": True}),
        "empty": tmp_path / "empty",
    }


@asynccontextmanager
async def _fake_client(fake: FakeBackend) -> AsyncIterator[SGLangClient]:
    with ThreadedServer(create_fake_app(fake)) as server:
        async with httpx.AsyncClient() as http:
            client = SGLangClient(server.url, http=http)
            try:
                yield client
            finally:
                client.close()


def _request(lora: str | None, *, stream: bool = False, tokens: int = 6) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=tokens, sampling_seed=5)
    return GenerateRequest(input_ids=[1, 2, 3], sampling_params=params, lora_path=lora)


async def test_fake_lora_load_list_generate_unload(adapter_dirs: dict[str, Path]) -> None:
    """The client against the fake's copy of SGLang's LoRA wire, every error included."""
    (adapter_dirs["empty"]).mkdir()
    fake = FakeBackend(enable_lora=True, max_lora_rank=8, record_bodies=True)
    async with _fake_client(fake) as client:
        assert await client.loaded_lora_adapters() == set()
        reply = await client.load_lora_adapter("a@v1", str(adapter_dirs["r4"]))
        assert reply.success and reply.error_message == ""
        assert reply.loaded_adapters == {"a@v1": str(adapter_dirs["r4"])}
        await client.load_lora_adapter("b@v1", str(adapter_dirs["r4b"]))
        assert await client.loaded_lora_adapters() == {"a@v1", "b@v1"}

        for name, path, error in (
            ("a@v1", adapter_dirs["r4b"], "because it is already loaded"),
            ("c@v1", adapter_dirs["r16"], "with rank 16 is incompatible"),
            ("c@v1", adapter_dirs["dora"], "doesn't support DoRA"),
            ("c@v1", adapter_dirs["empty"], "No such file or directory"),
            ("c@v1", "/no/such/adapter", "Repo id must be in the form"),
        ):
            with pytest.raises(BackendOperationFailed, match=error):
                await client.load_lora_adapter(name, str(path))
        assert await client.loaded_lora_adapters() == {"a@v1", "b@v1"}

        # Each adapter generates its own tokens; the body passes SGLang's contract.
        base = await client.generate(_request(None))
        with_a = await client.generate(_request("a@v1"))
        with_b = await client.generate(_request("b@v1"))
        assert len({tuple(r.output_ids) for r in (base, with_a, with_b)}) == 3
        sent = fake.bodies[-1]
        assert sent["lora_path"] == "b@v1"
        assert API.GenerateRequest.from_json_value(sent).lora_path == "b@v1"

        # A name never loaded: refused before any token, streamed or not.
        with pytest.raises(BackendRejected, match="never been loaded: c@v1") as caught:
            await client.generate(_request("c@v1"))
        assert caught.value.backend_status == 400
        with pytest.raises(BackendRejected, match="never been loaded: c@v1"):
            [d async for d in client.generate_stream(_request("c@v1", stream=True))]

        reply = await client.unload_lora_adapter("a@v1")
        assert reply.loaded_adapters == {"b@v1": str(adapter_dirs["r4b"])}
        assert await client.loaded_lora_adapters() == {"b@v1"}
        with pytest.raises(BackendOperationFailed, match="LoRA with name a@v1 does not exist"):
            await client.unload_lora_adapter("a@v1")
        # SGLang's trap: a request naming an unloaded adapter loads it again from its path.
        assert fake.lora is not None
        loads = fake.lora.loads
        again = await client.generate(_request("a@v1"))
        assert again.output_ids == with_a.output_ids
        assert fake.lora.loads == loads + 1
        assert await client.loaded_lora_adapters() == {"a@v1", "b@v1"}


async def test_fake_unload_waits_for_the_requests_running_with_the_adapter(
    adapter_dirs: dict[str, Path],
) -> None:
    fake = FakeBackend(enable_lora=True, tokens_per_s=50)
    async with _fake_client(fake) as client:
        await client.load_lora_adapter("a@v1", str(adapter_dirs["r4"]))
        await client.load_lora_adapter("b@v1", str(adapter_dirs["r4b"]))
        request = _request("a@v1", stream=True, tokens=10_000)
        request.rid = "long-a"
        stream = client.generate_stream(request)
        await anext(stream)  # running with a@v1
        unload = asyncio.create_task(client.unload_lora_adapter("a@v1"))
        await asyncio.sleep(0.5)
        assert not unload.done()  # blocked by the running request
        assert await client.loaded_lora_adapters() == {"b@v1"}  # but unregistered at once
        # Other adapters serve meanwhile.
        assert (await client.generate(_request("b@v1", tokens=3))).output_ids
        await client.abort_request(rid="long-a")
        deltas = [d async for d in stream]
        assert deltas[-1].finish_reason is not None and deltas[-1].finish_reason.type == "abort"
        reply = await asyncio.wait_for(unload, 10)
        assert reply.success and reply.loaded_adapters == {"b@v1": str(adapter_dirs["r4b"])}


async def test_fake_without_enable_lora_refuses_adapters(adapter_dirs: dict[str, Path]) -> None:
    async with _fake_client(FakeBackend()) as client:
        with pytest.raises(BackendOperationFailed, match="LoRA is not enabled"):
            await client.load_lora_adapter("a@v1", str(adapter_dirs["r4"]))
        with pytest.raises(BackendOperationFailed, match="LoRA is not enabled"):
            await client.unload_lora_adapter("a@v1")
        assert await client.loaded_lora_adapters() == set()
        with pytest.raises(BackendRejected, match="but LoRA is not enabled"):
            await client.generate(_request("a@v1"))
        assert (await client.generate(_request(None))).output_ids
