"""Broadcast weight pushes speak SGLang 0.5.23's own wire and bucket layout.

The bodies of ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/begin_weight_update`` and ``/end_weight_update`` are
compared field by field with SGLang's ``io_struct.py`` structs (read with ``ast``: importing
them pulls SGLang's GPU stack); the routes are read from its ``http_server.py`` (each takes
its struct and answers 400 when ``success`` is false). The flattened bucket is checked
against SGLang's own ``FlattenedTensorBucket`` (``weight_sync/tensor_bucket.py`` needs only
torch, so it is loaded by file path): same offsets, same alignment rule, and what the
trainer sends is what SGLang reconstructs.
"""

from __future__ import annotations

import ast
import importlib.util
from types import ModuleType

import pytest
import torch
from proxima.proxy.backends.protocol import (
    BeginWeightUpdateBody,
    DestroyWeightsUpdateGroupBody,
    EndWeightUpdateBody,
    InitWeightsUpdateGroupBody,
    UpdateWeightsFromDistributedBody,
    WeightSyncResponse,
)
from proxima.proxy.embedded.process_group import (
    TensorSpec,
    aligned_order,
    dtype_name,
    flat_offsets,
)
from pydantic import BaseModel, ValidationError

from tests.proxy.backends.test_sglang_contract import SGLANG_DIR, _required, _struct_fields

IO_STRUCT = "srt/managers/io_struct.py"
ROUTES = {
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", InitWeightsUpdateGroupBody),
    "/destroy_weights_update_group": (
        "DestroyWeightsUpdateGroupReqInput",
        DestroyWeightsUpdateGroupBody,
    ),
    "/begin_weight_update": ("BeginWeightUpdateReqInput", BeginWeightUpdateBody),
    "/end_weight_update": ("EndWeightUpdateReqInput", EndWeightUpdateBody),
    "/update_weights_from_distributed": (
        "UpdateWeightsFromDistributedReqInput",
        UpdateWeightsFromDistributedBody,
    ),
}


def _defaults(relative: str, cls_name: str) -> dict[str, object]:
    """``field -> default`` of the fields of an SGLang struct that have a literal default."""
    tree = ast.parse((SGLANG_DIR / relative).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    out: dict[str, object] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
            try:
                out[stmt.target.id] = ast.literal_eval(stmt.value)
            except ValueError:
                continue
    return out


def test_bodies_are_sglangs_structs() -> None:
    """Same fields, same required ones, same defaults (less the IPC fields SGLang fills)."""
    internal = {"rid", "http_worker_ipc"}
    for struct, ours in ROUTES.values():
        fields = _struct_fields(IO_STRUCT, struct)
        assert _required(ours) == {k: v for k, v in fields.items() if k not in internal}, struct
        for name, default in _defaults(IO_STRUCT, struct).items():
            assert ours.model_fields[name].default == default, (struct, name)
    for reply in (
        "InitWeightsUpdateGroupReqOutput",
        "DestroyWeightsUpdateGroupReqOutput",
        "UpdateWeightsFromDistributedReqOutput",
        "BeginWeightUpdateReqOutput",
        "EndWeightUpdateReqOutput",
    ):
        assert set(_struct_fields(IO_STRUCT, reply)) - internal == set(
            WeightSyncResponse.model_fields
        ), reply


def _route_handlers() -> dict[str, ast.AsyncFunctionDef]:
    tree = ast.parse((SGLANG_DIR / "srt/entrypoints/http_server.py").read_text())
    handlers = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        for deco in node.decorator_list:
            if (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Attribute)
                and deco.func.attr == "post"
                and deco.args
                and isinstance(deco.args[0], ast.Constant)
            ):
                handlers[str(deco.args[0].value)] = node
    return handlers


def test_sglang_serves_each_route_with_its_struct_and_400_on_failure() -> None:
    handlers = _route_handlers()
    for route, (struct, _) in ROUTES.items():
        handler = handlers[route]
        source = ast.unparse(handler)
        assert struct in ast.unparse(handler.args), (route, "takes its struct as the body")
        assert "BAD_REQUEST" in source and "'success': success" in source, route


def test_strict_bodies_refuse_what_sglang_would_misread() -> None:
    with pytest.raises(ValidationError, match="one length"):
        UpdateWeightsFromDistributedBody(names=["a", "b"], dtypes=["float32"], shapes=[[1]])
    with pytest.raises(ValidationError):
        InitWeightsUpdateGroupBody(
            master_address="h", master_port=1, rank_offset=0, world_size=2
        )  # rank 0 is the trainer's
    wire = UpdateWeightsFromDistributedBody(names=["a"], dtypes=["bfloat16"], shapes=[[2, 3]])
    dumped = wire.model_dump(exclude_none=True)
    assert "weight_version" not in dumped and dumped["flush_cache"] is True


def _sglang_bucket_module() -> ModuleType:
    path = SGLANG_DIR / "srt" / "weight_sync" / "tensor_bucket.py"
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flattened_bucket_is_sglangs_layout() -> None:
    """Offsets, the alignment rule and the bytes agree with SGLang's FlattenedTensorBucket."""
    bucket_cls = _sglang_bucket_module().FlattenedTensorBucket
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.bias": torch.randn(3, generator=generator).to(torch.bfloat16),
        "b.weight": torch.randn(5, 7, generator=generator),
        "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d.scale": torch.randn(1, generator=generator).to(torch.float16),
    }
    specs = aligned_order(
        [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    )
    assert [s.name for s in specs] == ["c.ids", "b.weight", "a.bias", "d.scale"]
    names = [s.name for s in specs]
    dtypes = [s.dtype for s in specs]
    shapes = [list(s.shape) for s in specs]
    theirs = bucket_cls.empty(names, dtypes, shapes, "cpu")
    assert [(m.start_idx, m.end_idx) for m in theirs.get_metadata()] == flat_offsets(specs)

    # What the trainer broadcasts (send_bucket's flat buffer) SGLang reconstructs exactly.
    flat = torch.cat([tensors[n].reshape(-1).view(torch.uint8) for n in names])
    theirs.get_flattened_tensor().copy_(flat)
    for name, tensor in theirs.reconstruct_tensors():
        assert torch.equal(tensor, tensors[name]), name

    # An unaligned order is refused by both.
    unaligned = [specs[2], specs[0]]  # 3 two-byte elements, then an 8-byte dtype
    with pytest.raises(ValueError, match="[Uu]naligned"):
        bucket_cls.empty(
            [s.name for s in unaligned],
            [s.dtype for s in unaligned],
            [list(s.shape) for s in unaligned],
            "cpu",
        )
    with pytest.raises(ValueError, match="unaligned"):
        flat_offsets(unaligned)


def test_every_protocol_body_is_strict() -> None:
    for _, body in ROUTES.values():
        assert issubclass(body, BaseModel) and body.model_config.get("extra") == "forbid"
    with pytest.raises(ValidationError):
        DestroyWeightsUpdateGroupBody.model_validate({"group_name": "g", "extra": 1})
