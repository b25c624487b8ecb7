"""HF <-> megatron weights: conversion, tensor-parallel sharding, loading and HF export.

Pure functions on state dicts: :func:`hf_to_mcore` / :func:`mcore_to_hf`
(exact inverses) and :func:`shard_for_tensor_parallel` /
:func:`merge_tensor_parallel_shards`. Layouts (megatron 0.16.1, local spec)::

    embedding.word_embeddings.weight       = embed_tokens, vocab padded with zero rows
    decoder.layers.i.input_layernorm       = input_layernorm
    self_attention.linear_qkv.weight/bias  = per query group g: [q heads of g; k_g; v_g]
    self_attention.linear_proj             = o_proj
    pre_mlp_layernorm                      = post_attention_layernorm
    mlp.linear_fc1                         = [gate_proj; up_proj]  (silu(gate) * up)
    mlp.linear_fc2                         = down_proj
    decoder.final_layernorm                = norm
    output_layer.weight                    = lm_head (absent when tied)

Under tensor parallelism each rank holds a contiguous slice of the query
groups, of the vocabulary, of ``gate`` and of ``up`` (its fc1 shard is
``[gate_r; up_r]``), and a column slice of ``linear_proj``/``linear_fc2``.
:func:`load_hf_weights` puts a rank's shard into the model;
:func:`to_hf_state_dict` / :func:`export_hf` gather the shards and write an HF
safetensors checkpoint the inference backends load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from proxima.trainer.backends.base import check_loaded_keys, copy_tokenizer_files
from proxima.trainer.backends.megatron.model import MegatronParallelConfig, ModelShape, model_shape
from safetensors.torch import save_file
from torch import Tensor
from transformers import PretrainedConfig

_EXTRA_STATE_SUFFIX = "._extra_state"

# --------------------------------------------------------------------------- conversion


def _layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _pad_vocab(weight: Tensor, padded_vocab_size: int) -> Tensor:
    rows = padded_vocab_size - weight.shape[0]
    if rows < 0:
        raise ValueError(f"vocab {weight.shape[0]} is larger than padded vocab {padded_vocab_size}")
    if rows == 0:
        return weight.clone()
    return torch.cat([weight, weight.new_zeros(rows, *weight.shape[1:])], dim=0)


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: ModelShape) -> Tensor:
    """HF q/k/v (weights ``(heads*d, h)`` or biases ``(heads*d,)``) -> megatron's grouped layout."""
    rest = q.shape[1:]
    q = q.reshape(shape.num_kv_heads, shape.heads_per_group * shape.head_dim, *rest)
    k = k.reshape(shape.num_kv_heads, shape.head_dim, *rest)
    v = v.reshape(shape.num_kv_heads, shape.head_dim, *rest)
    fused = torch.cat([q, k, v], dim=1)  # (groups, (hpg + 2) * d, *rest)
    return fused.reshape(-1, *rest)


def _split_qkv(fused: Tensor, shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_fuse_qkv`."""
    rest = fused.shape[1:]
    q_rows = shape.heads_per_group * shape.head_dim
    grouped = fused.reshape(shape.num_kv_heads, q_rows + 2 * shape.head_dim, *rest)
    q, k, v = torch.split(grouped, [q_rows, shape.head_dim, shape.head_dim], dim=1)
    return (
        q.reshape(-1, *rest).clone(),
        k.reshape(-1, *rest).clone(),
        v.reshape(-1, *rest).clone(),
    )


def hf_to_mcore(hf_state: Mapping[str, Tensor], shape: ModelShape) -> dict[str, Tensor]:
    """HF Llama/Qwen2 state dict -> unsharded megatron GPTModel state dict (no ``_extra_state``)."""
    out: dict[str, Tensor] = {
        "embedding.word_embeddings.weight": _pad_vocab(
            hf_state["model.embed_tokens.weight"], shape.padded_vocab_size
        ),
        "decoder.final_layernorm.weight": hf_state["model.norm.weight"].clone(),
    }
    if not shape.tied_embeddings:
        out["output_layer.weight"] = _pad_vocab(hf_state["lm_head.weight"], shape.padded_vocab_size)
    for i in range(shape.num_layers):
        hf, mc = _hf_layer(i), _layer(i)
        attn = hf + "self_attn."
        out[mc + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"].clone()
        out[mc + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf_state[attn + "q_proj.weight"],
            hf_state[attn + "k_proj.weight"],
            hf_state[attn + "v_proj.weight"],
            shape,
        )
        if shape.qkv_bias:
            out[mc + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf_state[attn + "q_proj.bias"],
                hf_state[attn + "k_proj.bias"],
                hf_state[attn + "v_proj.bias"],
                shape,
            )
        out[mc + "self_attention.linear_proj.weight"] = hf_state[attn + "o_proj.weight"].clone()
        out[mc + "pre_mlp_layernorm.weight"] = hf_state[
            hf + "post_attention_layernorm.weight"
        ].clone()
        out[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]], dim=0
        )
        out[mc + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"].clone()
    return out


def mcore_to_hf(mcore_state: Mapping[str, Tensor], shape: ModelShape) -> dict[str, Tensor]:
    """Unsharded megatron state dict -> HF checkpoint state dict (exact inverse of :func:`hf_to_mcore`).

    As in HF checkpoints, ``lm_head.weight`` is omitted when embeddings are tied.
    """
    vocab = shape.vocab_size
    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": mcore_state["embedding.word_embeddings.weight"][
            :vocab
        ].clone(),
        "model.norm.weight": mcore_state["decoder.final_layernorm.weight"].clone(),
    }
    if not shape.tied_embeddings:
        out["lm_head.weight"] = mcore_state["output_layer.weight"][:vocab].clone()
    for i in range(shape.num_layers):
        hf, mc = _hf_layer(i), _layer(i)
        attn = hf + "self_attn."
        out[hf + "input_layernorm.weight"] = mcore_state[mc + "input_layernorm.weight"].clone()
        qkv = _split_qkv(mcore_state[mc + "self_attention.linear_qkv.weight"], shape)
        for name, tensor in zip(("q_proj", "k_proj", "v_proj"), qkv, strict=True):
            out[f"{attn}{name}.weight"] = tensor
        if shape.qkv_bias:
            qkv_bias = _split_qkv(mcore_state[mc + "self_attention.linear_qkv.bias"], shape)
            for name, tensor in zip(("q_proj", "k_proj", "v_proj"), qkv_bias, strict=True):
                out[f"{attn}{name}.bias"] = tensor
        out[attn + "o_proj.weight"] = mcore_state[mc + "self_attention.linear_proj.weight"].clone()
        out[hf + "post_attention_layernorm.weight"] = mcore_state[
            mc + "pre_mlp_layernorm.weight"
        ].clone()
        gate, up = torch.chunk(mcore_state[mc + "mlp.linear_fc1.weight"], 2, dim=0)
        out[hf + "mlp.gate_proj.weight"] = gate.clone()
        out[hf + "mlp.up_proj.weight"] = up.clone()
        out[hf + "mlp.down_proj.weight"] = mcore_state[mc + "mlp.linear_fc2.weight"].clone()
    return out


def _tp_split_dim(key: str) -> int | None:
    """Dimension along which ``key`` is split over tensor-parallel ranks (None: replicated)."""
    if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if key.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
        return 0
    if key.endswith("mlp.linear_fc1.weight"):
        return 0
    if key.endswith(("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")):
        return 1
    return None


def shard_for_tensor_parallel(
    state: Mapping[str, Tensor], *, tp_size: int, tp_rank: int
) -> dict[str, Tensor]:
    """The slice of an unsharded megatron state dict that tensor-parallel rank ``tp_rank`` holds."""
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        dim = _tp_split_dim(key)
        if dim is None or tp_size == 1:
            out[key] = tensor.clone()
        elif key.endswith("mlp.linear_fc1.weight"):
            gate, up = torch.chunk(tensor, 2, dim=0)
            out[key] = torch.cat(
                [gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0
            )
        else:
            out[key] = tensor.chunk(tp_size, dim=dim)[tp_rank].clone()
    return out


def merge_tensor_parallel_shards(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Inverse of :func:`shard_for_tensor_parallel` over all ranks' shards (in rank order)."""
    if not shards:
        raise ValueError("merge_tensor_parallel_shards needs at least one shard")
    out: dict[str, Tensor] = {}
    for key in shards[0]:
        dim = _tp_split_dim(key)
        parts = [shard[key] for shard in shards]
        if dim is None or len(shards) == 1:
            out[key] = parts[0].clone()
        elif key.endswith("mlp.linear_fc1.weight"):
            gates, ups = zip(*(torch.chunk(p, 2, dim=0) for p in parts), strict=True)
            out[key] = torch.cat([*gates, *ups], dim=0)
        else:
            out[key] = torch.cat(parts, dim=dim)
    return out


def load_hf_weights(
    model: GPTModel,
    hf_state: Mapping[str, Tensor],
    hf_config: PretrainedConfig,
    parallel: MegatronParallelConfig,
) -> None:
    """Copy HF weights into ``model``, keeping this process's tensor-parallel shard."""
    shape = model_shape(hf_config, parallel)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local = shard_for_tensor_parallel(
        hf_to_mcore(hf_state, shape), tp_size=tp_size, tp_rank=tp_rank
    )
    result = model.load_state_dict(local, strict=False)
    check_loaded_keys(
        result,
        what="HF -> megatron weight mapping mismatch",
        ignore=lambda k: k.endswith(_EXTRA_STATE_SUFFIX),
    )


def _local_weights(model: GPTModel) -> dict[str, Tensor]:
    return {
        key: value.detach()
        for key, value in model.state_dict().items()
        if not key.endswith(_EXTRA_STATE_SUFFIX) and isinstance(value, Tensor)
    }


def to_hf_state_dict(
    model: GPTModel, hf_config: PretrainedConfig, parallel: MegatronParallelConfig
) -> dict[str, Tensor]:
    """The model's weights as an HF checkpoint state dict on CPU.

    Collective over the tensor-parallel group: every TP rank must call it and
    every rank gets the full state dict.
    """
    shape = model_shape(hf_config, parallel)
    local = _local_weights(model)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size == 1:
        shards: list[dict[str, Tensor]] = [{k: v.cpu() for k, v in local.items()}]
    else:
        group = parallel_state.get_tensor_model_parallel_group()
        shards = [{} for _ in range(tp_size)]
        for key in sorted(local):
            tensor = local[key].contiguous()
            if _tp_split_dim(key) is None:
                for shard in shards:
                    shard[key] = tensor.cpu()
                continue
            gathered = [torch.empty_like(tensor) for _ in range(tp_size)]
            dist.all_gather(gathered, tensor, group=group)
            for shard, part in zip(shards, gathered, strict=True):
                shard[key] = part.cpu()
    return mcore_to_hf(merge_tensor_parallel_shards(shards), shape)


def export_hf(
    model: GPTModel,
    hf_config: PretrainedConfig,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    parallel: MegatronParallelConfig,
) -> Path | None:
    """Write the model as an HF checkpoint (config, ``model.safetensors``, tokenizer).

    Collective over the whole job (every rank must call it): data-parallel
    replica 0 gathers its tensor-parallel shards (the other replicas hold the
    same weights and skip the gather), only global rank 0 writes, and a
    barrier ends it. Returns ``out_dir`` on rank 0, None elsewhere. A
    ``generation_config.json`` next to the tokenizer is copied too.
    """
    out = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    hf_state: dict[str, Tensor] | None = None
    if parallel_state.get_data_parallel_rank() == 0:
        hf_state = to_hf_state_dict(model, hf_config, parallel)  # collective over the TP group
    if rank == 0:
        assert hf_state is not None  # global rank 0 belongs to replica 0
        out.mkdir(parents=True, exist_ok=True)
        hf_config.save_pretrained(out)
        save_file(
            {k: v.contiguous() for k, v in hf_state.items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )
        copy_tokenizer_files(Path(tokenizer_dir), out)
    if dist.is_initialized():
        dist.barrier()
    return out if rank == 0 else None
