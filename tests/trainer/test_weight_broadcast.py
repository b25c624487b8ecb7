"""The trainer's side of a broadcast push: buckets, configuration, and which path a push takes.

Buckets are planned from a real export (every tensor once, in name order, each bucket
aligned for SGLang's flattened layout). The sink's choices are checked against a stand-in
proxy that records the calls it gets and answers as the real one does when no backend
answers (503 on ``GET /admin/weights/group``): an adapter goes from disk without touching
the group routes, a failed broadcast raises when ``fallback_to_disk`` is off and is pushed
from disk when it is on. The broadcast itself runs end to end in
``tests/proxy/test_weight_broadcast_live.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from proxima.proxy.embedded.process_group import flat_offsets
from proxima.proxy.serving import ThreadedServer
from proxima.trainer.config import TrainerConfig
from proxima.trainer.run import weight_sink
from proxima.trainer.weight_broadcast import BroadcastWeightSink
from proxima.trainer.weight_buckets import (
    BroadcastFailed,
    BucketBuffers,
    ExportReader,
    MemoryPacker,
    bucket_body,
    memory_specs,
    plan_buckets,
    read_specs,
)
from proxima.trainer.weights import ProxyWeightSink, WeightPushError
from proxima.trainer.weights_config import WeightsConfig
from pydantic import ValidationError
from safetensors.torch import save_file


def test_buckets_cover_every_tensor_once_aligned_and_bounded(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(300, 10, generator=generator),  # 12000 bytes
        "b.bias": torch.randn(3, generator=generator).bfloat16(),  # a 2-byte dtype first...
        "c.ids": torch.arange(5, dtype=torch.int64),  # ...then an 8-byte one, in name order
        "d.weight": torch.randn(10, 10, generator=generator),
        "e.scale": torch.randn(1, generator=generator).half(),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    specs, files = read_specs(tmp_path)
    assert [s.name for s in specs] == sorted(tensors)
    assert {s.name: (s.dtype, s.shape) for s in specs}["b.bias"] == ("bfloat16", (3,))
    assert set(files.values()) == {tmp_path / "model.safetensors"}

    buckets = plan_buckets(specs, bucket_bytes=500)
    names = [s.name for bucket in buckets for s in bucket]
    assert sorted(names) == sorted(tensors) and len(names) == len(tensors)
    for bucket in buckets:
        flat_offsets(bucket)  # aligned (raises otherwise)
        size = sum(s.nbytes for s in bucket)
        assert size <= 500 or len(bucket) == 1, bucket  # a bigger tensor goes alone
    assert [s.name for s in buckets[0]] == ["a.weight"]
    body = bucket_body(buckets[-1])
    assert len(body["names"]) == len(body["dtypes"]) == len(body["shapes"])
    one = plan_buckets(specs, bucket_bytes=10**9)
    assert len(one) == 1 and [s.dtype for s in one[0]][:2] == ["int64", "float32"]

    # What the trainer broadcasts: each bucket's bytes, read straight from the export into
    # one of two buffers kept across buckets.
    reader = ExportReader(files)
    buffers = BucketBuffers("cpu")
    try:
        for index, bucket in enumerate([*buckets, *one]):
            flat = buffers.get(index, flat_offsets(bucket)[-1][1])
            reader.fill(bucket, flat)
            for spec, (start, end) in zip(bucket, flat_offsets(bucket), strict=True):
                got = flat[start:end].view(spec.torch_dtype).reshape(spec.shape)
                assert torch.equal(got, tensors[spec.name]), spec.name
    finally:
        reader.close()


def test_in_memory_weights_tied_once_cast_to_the_served_dtype_into_kept_buffers() -> None:
    """A push from memory: a model's state dict (tied embedding and head, an int buffer)
    gives each storage once under its first name, floats cast to the wire's dtype, and the
    packed bytes equal the tensors; the two buffers are the same memory at every push."""
    generator = torch.Generator().manual_seed(1)
    embed = torch.randn(16, 8, generator=generator)
    state = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.randn(8, generator=generator),
        "model.steps": torch.arange(4, dtype=torch.int64),
        "lm_head.weight": embed.detach(),  # tied: the same storage under a second name
    }
    specs, tensors = memory_specs(lambda: state.items(), torch.bfloat16)
    assert [s.name for s in specs] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.steps",
    ]
    assert [s.dtype for s in specs] == ["bfloat16", "bfloat16", "int64"]
    buckets = plan_buckets(specs, bucket_bytes=64)
    assert len(buckets) >= 2
    buffers = BucketBuffers("cpu")
    seen: list[set[int]] = []
    for _push in range(2):
        packer = MemoryPacker(tensors)
        pointers = set()
        for index, bucket in enumerate(buckets):
            flat = buffers.get(index, flat_offsets(bucket)[-1][1])
            pointers.add(flat.untyped_storage().data_ptr())
            packer.fill(bucket, flat)
            for spec, (start, end) in zip(bucket, flat_offsets(bucket), strict=True):
                got = flat[start:end].view(spec.torch_dtype).reshape(spec.shape)
                assert torch.equal(got, state[spec.name].to(spec.torch_dtype)), spec.name
        packer.close()
        seen.append(pointers)
    assert len(seen[0]) == 2 and seen[0] == seen[1]  # two buffers, reused by the next push
    with pytest.raises(BroadcastFailed, match="no tensor"):
        memory_specs(lambda: iter(()))

    # A bucket of one tensor already in the wire's dtype goes from its own memory, no copy;
    # one to cast, a strided one, or one of several is packed.
    specs, tensors = memory_specs(lambda: state.items(), None)
    packer = MemoryPacker(tensors)
    alone = [s for s in specs if s.name == "model.embed_tokens.weight"]
    sent = packer.in_place(alone, "cpu")
    assert sent is not None and sent.data_ptr() == embed.data_ptr()
    assert torch.equal(sent.view(torch.float32).reshape(embed.shape), embed)
    assert packer.in_place(alone, "cuda") is None and packer.in_place(specs, "cpu") is None
    cast, _ = memory_specs(lambda: state.items(), torch.bfloat16)
    assert MemoryPacker(tensors).in_place(cast[:1], "cpu") is None
    strided = {"model.embed_tokens.weight": embed.t()}
    specs, tensors = memory_specs(lambda: strided.items(), None)
    assert MemoryPacker(tensors).in_place(specs, "cpu") is None


def test_config_section_and_the_sink_it_selects() -> None:
    cfg = TrainerConfig.model_validate(
        {"weights": {"transport": "broadcast", "bucket_mb": 64, "backend": "gloo"}}
    )
    assert cfg.weights.bucket_mb == 64 and cfg.weights.fallback_to_disk
    assert isinstance(weight_sink(cfg, "http://127.0.0.1:1", None), BroadcastWeightSink)
    assert isinstance(weight_sink(TrainerConfig(), "http://127.0.0.1:1", None), ProxyWeightSink)
    for bad in ({"transport": "rdma"}, {"bucket_mb": 0}, {"timeout_s": 0}, {"buckets": 3}):
        with pytest.raises(ValidationError):
            TrainerConfig.model_validate({"weights": bad})


class StandInProxy:
    """The proxy's admin routes as a proxy with no answering backend answers them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        app = FastAPI()

        @app.api_route("/admin/weights/group", methods=["GET", "POST", "DELETE"])
        async def group(request: Request) -> JSONResponse:
            self.calls.append((request.method, request.url.path, None))
            return JSONResponse(
                {
                    "error": {
                        "message": "No backend answers: no weight-update group can form.",
                        "type": "service_unavailable",
                        "param": None,
                        "code": None,
                    }
                },
                status_code=503,
            )

        @app.post("/admin/weights")
        async def push(request: Request) -> JSONResponse:
            body = await request.json()
            self.calls.append(("POST", "/admin/weights", body))
            return JSONResponse({"version": body["version"], "seconds": 0.01, "backends": []})

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"version": 0}

        self.app = app


@pytest.fixture
def stand_in() -> Iterator[tuple[StandInProxy, str]]:
    proxy = StandInProxy()
    with ThreadedServer(proxy.app) as server:
        yield proxy, server.url


def _sink(url: str, **settings: Any) -> BroadcastWeightSink:
    config = WeightsConfig.model_validate({"transport": "broadcast", **settings})
    return BroadcastWeightSink(url, admin_token=None, settings=config, timeout_s=10)


async def _push(sink: BroadcastWeightSink, **kwargs: Any) -> Any:
    try:
        return await sink.push(**kwargs)
    finally:
        await sink.aclose()


def test_an_adapter_goes_from_disk(stand_in: tuple[StandInProxy, str], tmp_path: Path) -> None:
    proxy, url = stand_in
    result = asyncio.run(_push(_sink(url), version=2, path=tmp_path, adapter="tenant-a"))
    assert result.transport == "disk"
    assert proxy.calls == [
        ("POST", "/admin/weights", {"version": 2, "path": str(tmp_path), "adapter": "tenant-a"})
    ]


def test_a_failed_broadcast_raises_without_fallback(
    stand_in: tuple[StandInProxy, str], tiny_model_dir: Path
) -> None:
    proxy, url = stand_in
    with pytest.raises(WeightPushError, match="broadcast push of version 1 failed.*No backend"):
        asyncio.run(_push(_sink(url, fallback_to_disk=False), version=1, path=tiny_model_dir))
    assert [(m, p) for m, p, _ in proxy.calls] == [("GET", "/admin/weights/group")]


def test_a_failed_broadcast_is_pushed_from_disk_with_fallback(
    stand_in: tuple[StandInProxy, str], tiny_model_dir: Path
) -> None:
    proxy, url = stand_in
    result = asyncio.run(_push(_sink(url), version=1, path=tiny_model_dir))
    assert result.transport == "disk"
    assert proxy.calls == [
        ("GET", "/admin/weights/group", None),
        ("POST", "/admin/weights", {"version": 1, "path": str(tiny_model_dir)}),
    ]
