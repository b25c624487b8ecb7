"""LoRA adapters in the engine: merged-model logprobs, mixed batches, SGLang's load/unload wire.

The reference for an adapter is the tiny model with ``scale * B @ A`` added to
each target weight (computed here from the safetensors file, not by the
engine's code), scored by one full forward pass.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import PROMPTS, Reference
from proxima.proxy.backends.errors import BackendOperationFailed, BackendRejected
from proxima.proxy.backends.protocol import GenerateRequest, SamplingParams
from proxima.proxy.backends.sglang import SGLangClient
from proxima.proxy.embedded.engine import Engine, GenerationState
from proxima.proxy.embedded.live import EngineServer
from proxima.proxy.embedded.lora import AdapterLoadError, all_finite, read_adapter
from proxima.proxy.testing.lora import LLAMA_TARGETS, linear_shapes, write_peft_adapter
from proxima.proxy.testing.tiny_model import build_tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter A: every linear, rank 8; B: q/v/down only, rank 4, rsLoRA scaling;
    "wide": rank 16; "narrow": made for a 32-wide model (does not fit)."""
    root = tmp_path_factory.mktemp("adapters")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    narrow = build_tiny_model(root / "narrow-model", hidden_size=32)
    narrow_model = AutoModelForCausalLM.from_pretrained(narrow)
    some = ("q_proj", "v_proj", "down_proj")
    return {
        "a": write_peft_adapter(root / "a", linear_shapes(model, LLAMA_TARGETS), rank=8, seed=1),
        "b": write_peft_adapter(
            root / "b",
            linear_shapes(model, some),
            rank=4,
            alpha=8,
            seed=2,
            extra_config={"use_rslora": True},
        ),
        "wide": write_peft_adapter(root / "wide", linear_shapes(model, ("q_proj",)), rank=16),
        "narrow": write_peft_adapter(root / "narrow", linear_shapes(narrow_model, ("q_proj",))),
    }


def merged_reference(model_dir: Path, adapter_dir: Path) -> Reference:
    """The base model with ``s * B @ A`` added to every target weight (peft's merge)."""
    reference = Reference(model_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank = config["r"]
    scale = config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    modules = dict(reference.model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace("lora_A", "lora_B")]
                modules[name].weight += scale * (b @ a)  # (out, r) @ (r, in)
    return reference


@asynccontextmanager
async def running_engine(model_dir: Path, **kwargs: object) -> AsyncIterator[Engine]:
    engine = await asyncio.to_thread(Engine, model_dir, num_threads=1, **kwargs)  # type: ignore[arg-type]
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def run_together(
    engine: Engine, rows: list[tuple[str, str | None]], params: SamplingParams = GREEDY
) -> list[GenerationState]:
    """Submit every (prompt, adapter name) while paused, so all rows start in one batch."""
    await engine.pause("in_place")
    handles = []
    for prompt, name in rows:
        adapter = await engine.resolve_adapter(name) if name else None
        handles.append(engine.submit(engine.encode(prompt), params, adapter=adapter))
    await engine.resume()
    return [await h.result() for h in handles]


async def test_adapter_logprobs_equal_the_merged_model(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    async with running_engine(tiny_model_dir, enable_lora=True) as engine:
        for name in ("a", "b"):
            assert (await engine.load_lora_adapter(name, str(adapters[name]))).success
        for name in ("a", "b"):
            reference = merged_reference(tiny_model_dir, adapters[name])
            base = Reference(tiny_model_dir)
            for prompt in PROMPTS[:3]:
                (state,) = await run_together(engine, [(prompt, name)])
                prompt_ids, output = engine.encode(prompt), list(state.output_ids)
                expected = reference.scored(prompt_ids, output, 1.0)
                got = torch.tensor(state.output_logprobs)
                assert torch.allclose(got, expected, atol=1e-4), (name, prompt)
                # The adapter matters: the base model scores these tokens differently.
                assert not torch.allclose(got, base.scored(prompt_ids, output, 1.0), atol=1e-2)


async def test_a_mixed_batch_gives_each_row_what_it_gets_alone(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    rows = [(PROMPTS[0], None), (PROMPTS[1], "a"), (PROMPTS[2], "b"), (PROMPTS[3], "a")]
    rows += [(PROMPTS[0], "b"), (PROMPTS[1], None)]
    async with running_engine(tiny_model_dir, enable_lora=True) as engine:
        for name in ("a", "b"):
            await engine.load_lora_adapter(name, str(adapters[name]))
        together = await run_together(engine, rows)
        assert engine.stats.peak_batch_size == len(rows)
        for row, mixed in zip(rows, together, strict=True):
            (alone,) = await run_together(engine, [row])
            assert mixed.output_ids == alone.output_ids, row
            assert mixed.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-4)
        # Same prompt, two policies: different numbers.
        scores = {row: s.output_logprobs for row, s in zip(rows, together, strict=True)}
        assert scores[(PROMPTS[0], None)] != pytest.approx(scores[(PROMPTS[0], "b")], abs=1e-3)


async def test_base_rows_are_bit_identical_with_and_without_adapters(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """A base row beside adapter rows gets exactly the numbers it gets in an engine without
    LoRA, beside base rows: nothing is added to it (same batch shapes, so same kernels)."""
    prompts = PROMPTS[3:6]  # finished together (ignore_eos): the batch shape never differs
    async with running_engine(tiny_model_dir) as plain:
        without = await run_together(plain, [(p, None) for p in prompts])
    async with running_engine(tiny_model_dir, enable_lora=True) as engine:
        for name in ("a", "b"):
            await engine.load_lora_adapter(name, str(adapters[name]))
        mixed = await run_together(engine, list(zip(prompts, (None, "a", "b"), strict=True)))
        base_only = await run_together(engine, [(p, None) for p in prompts])
    assert mixed[0].output_ids == without[0].output_ids
    assert mixed[0].output_logprobs == without[0].output_logprobs  # exact, not approx
    assert [s.output_logprobs for s in base_only] == [s.output_logprobs for s in without]
    assert mixed[1].output_logprobs != without[1].output_logprobs


async def test_max_loras_per_batch_holds_other_adapters_back(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    async with running_engine(tiny_model_dir, enable_lora=True, max_loras_per_batch=1) as engine:
        for name in ("a", "b"):
            await engine.load_lora_adapter(name, str(adapters[name]))
        rows = [(PROMPTS[0], "a"), (PROMPTS[1], "b"), (PROMPTS[2], None), (PROMPTS[3], "a")]
        together = await run_together(engine, rows)
        # a, base and a run at once; b waits for a slot of its own.
        assert engine.stats.peak_batch_size == 3
        (alone,) = await run_together(engine, [rows[1]])
        assert together[1].output_ids == alone.output_ids


# ---- the wire, through SGLang's client ------------------------------------------------


@pytest.fixture(scope="module")
def lora_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny model's architecture with a 64k context: a long row cannot end by length
    while a test needs it running, however slow or fast the machine."""
    model = build_tiny_model(
        tmp_path_factory.mktemp("long") / "tiny-64k", max_position_embeddings=65536
    )
    with EngineServer(model, num_threads=1, enable_lora=True, max_lora_rank=8) as server:
        yield server.url


@asynccontextmanager
async def sglang_client(url: str) -> AsyncIterator[SGLangClient]:
    async with httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        try:
            yield client
        finally:
            client.close()


def _request(name: str | None, *, tokens: int = 4, rid: str | None = None) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(input_ids=[5, 6, 7], sampling_params=params, lora_path=name, rid=rid)


def _with_inf(adapter: Path, out: Path) -> Path:
    """A copy of ``adapter`` with one inf in one lora_B."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = sorted(k for k in tensors if k.endswith("lora_B.weight"))[3]
    tensors[key].view(-1)[5] = float("inf")
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    return out


def test_all_finite_finds_any_nan_or_inf() -> None:
    a, b = torch.randn(8, 64), torch.randn(64, 8)
    assert all_finite(a, b) and all_finite(torch.full((4, 4), 3e38))  # large, not overflowing
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = b.clone().to(dtype)
            x[5, 3] = bad
            assert not all_finite(a, x), (bad, dtype)


def test_read_adapter_names_the_non_finite_module_and_the_overflowing_one(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """One fused norm screens the whole adapter; a failure (an inf, or finite values whose
    norm overflows) is then checked module by module, which names the module: finite values
    too large to compute with are refused as an inf is."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    with pytest.raises(AdapterLoadError, match=r"non-finite values \(NaN or inf\) in model\."):
        read_adapter(_with_inf(adapters["a"], tmp_path / "inf"), "i", linears)
    tensors = load_file(adapters["a"] / "adapter_model.safetensors")
    key = sorted(k for k in tensors if k.endswith("lora_B.weight"))[3]
    tensors[key].view(-1)[:4] = 1e30  # finite; its squares overflow float32
    assert not torch.isfinite(torch.stack(torch._foreach_norm([tensors[key]]))).all()
    huge = tmp_path / "huge"
    huge.mkdir()
    save_file(tensors, str(huge / "adapter_model.safetensors"))
    (huge / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    module = key.removeprefix("base_model.model.").removesuffix(".lora_B.weight")
    with pytest.raises(AdapterLoadError, match=f"{module}: lora_B .* has norm 4e\\+30"):
        read_adapter(huge, "h", linears)
    adapter = read_adapter(adapters["a"], "a", linears)
    assert len(adapter.weights) == len(linear_shapes(model, LLAMA_TARGETS))


async def test_load_and_unload_errors_are_sglangs(
    lora_url: str, adapters: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    async with sglang_client(lora_url) as client:
        reply = await client.load_lora_adapter("a@v1", str(adapters["a"]))
        assert reply.success and reply.loaded_adapters == {"a@v1": str(adapters["a"])}
        for name, path, error in (
            ("a@v1", adapters["b"], "because it is already loaded"),
            ("w@v1", adapters["wide"], "with rank 16 is incompatible"),
            ("n@v1", adapters["narrow"], r"do not fit a \(64, 64\) layer"),
            ("e@v1", tmp_path / "empty", "no adapter_config.json"),
            ("x@v1", tmp_path / "missing", "is not a directory"),
            ("i@v1", _with_inf(adapters["a"], tmp_path / "inf"), r"non-finite values"),
        ):
            with pytest.raises(BackendOperationFailed, match=error):
                await client.load_lora_adapter(name, str(path))
        assert await client.loaded_lora_adapters() == {"a@v1"}

        with pytest.raises(BackendRejected, match="never been loaded: b@v1") as caught:
            await client.generate(_request("b@v1"))
        assert caught.value.backend_status == 400
        with pytest.raises(BackendRejected, match="never been loaded: b@v1"):
            [d async for d in client.generate_stream(_request("b@v1"))]

        served = await client.generate(_request("a@v1"))
        reply = await client.unload_lora_adapter("a@v1")
        assert reply.success and reply.loaded_adapters == {}
        with pytest.raises(BackendOperationFailed, match="LoRA with name a@v1 does not exist"):
            await client.unload_lora_adapter("a@v1")
        # SGLang's reload of an unloaded name, from its old path: same adapter, same tokens.
        assert (await client.generate(_request("a@v1"))).output_ids == served.output_ids
        assert await client.loaded_lora_adapters() == {"a@v1"}
        await client.unload_lora_adapter("a@v1")


async def test_load_and_unload_while_rows_generate(
    lora_url: str, adapters: dict[str, Path]
) -> None:
    async with sglang_client(lora_url) as client:
        await client.load_lora_adapter("a@v1", str(adapters["a"]))
        stream = client.generate_stream(_request("a@v1", tokens=100_000, rid="long-a"))
        await anext(stream)
        # A load while a's row generates: the row goes on (no pause, no abort).
        await client.load_lora_adapter("b@v1", str(adapters["b"]))
        after_load = await anext(stream)
        assert after_load.token_ids and after_load.finish_reason is None
        unload = asyncio.create_task(client.unload_lora_adapter("a@v1"))
        await asyncio.sleep(0.5)
        assert not unload.done()  # its row is still running
        assert await client.loaded_lora_adapters() == {"b@v1"}  # but new requests cannot use it
        # The base and the other adapter generate meanwhile.
        assert len((await client.generate(_request("b@v1", tokens=8))).output_ids) == 8
        assert len((await client.generate(_request(None, tokens=8))).output_ids) == 8
        await client.abort_request(rid="long-a")
        deltas = [d async for d in stream]
        assert deltas[-1].finish_reason is not None and deltas[-1].finish_reason.type == "abort"
        reply = await asyncio.wait_for(unload, 30)
        assert reply.success and reply.loaded_adapters == {"b@v1": str(adapters["b"])}
        await client.unload_lora_adapter("b@v1")


async def test_without_enable_lora_adapters_are_refused(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    with EngineServer(tiny_model_dir, num_threads=1) as server:
        async with sglang_client(server.url) as client:
            with pytest.raises(BackendOperationFailed, match="LoRA is not enabled"):
                await client.load_lora_adapter("a@v1", str(adapters["a"]))
            with pytest.raises(BackendOperationFailed, match="LoRA is not enabled"):
                await client.unload_lora_adapter("a@v1")
            assert await client.loaded_lora_adapters() == set()
            with pytest.raises(BackendRejected, match="but LoRA is not enabled"):
                await client.generate(_request("a@v1"))
