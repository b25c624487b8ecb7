"""megatron-core training backend: GPTModel built from an HF Llama/Qwen2 config.

What lives here, top to bottom:

1. :func:`transformer_config_from_hf` / :func:`build_gpt_model`: the HF config
   mapped onto megatron's ``TransformerConfig`` (RMSNorm, SwiGLU, grouped
   query attention, Qwen2's qkv bias, RoPE base, tied or untied embeddings,
   no dropout) and a ``GPTModel`` with megatron's local (non-Transformer-
   Engine) layer spec.
2. Weight conversion, as pure functions on state dicts:
   :func:`hf_to_mcore` / :func:`mcore_to_hf` (exact inverses) and
   :func:`shard_for_tensor_parallel` / :func:`merge_tensor_parallel_shards`.
   Layouts (megatron 0.16.1, local spec)::

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
3. :func:`to_hf_state_dict` / :func:`export_hf`: gather the shards and write
   an HF safetensors checkpoint the inference backends load.
4. :class:`MegatronBackend`: ``forward_logprobs`` and ``train_step`` (AdamW),
   with tensor and data parallelism under ``torchrun`` (world = tensor
   parallel x data parallel; gradients summed over the data-parallel group).

Scope: pipeline parallelism is rejected at start-up (it needs megatron's
pipeline schedules, not wired here); parameters are float32. Packed inputs
(several sequences in one row, ``position_ids`` restarting at 0) are run as a
padded batch of their sequences, because the local attention has no
variable-length (THD) kernel and megatron's RoPE ignores ``position_ids``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer import TransformerConfig
from proxima.trainer.backends.megatron_compat import (
    cpu_device_shim,
    cuda_available,
    init_distributed,
    init_model_parallel,
)
from proxima.trainer.batching import PackedBatch
from proxima.trainer.config import OptimConfig
from proxima.trainer.loss import token_logprobs
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
_EXTRA_STATE_SUFFIX = "._extra_state"

# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class MegatronParallelConfig:
    """How the megatron backend lays the model out over processes."""

    tensor_parallel: int = 1
    """Tensor-parallel size; must divide the number of KV heads and FFN width."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size; only 1 is supported by this backend."""
    seed: int = 0
    """Seed of torch's default generator and megatron's named RNG streams."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times ``tensor_parallel``."""

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={self.tensor_parallel}: must be >= 1")
        if self.pipeline_parallel != 1:
            raise ValueError(
                f"pipeline_parallel={self.pipeline_parallel}: the megatron backend runs without "
                "pipeline parallelism; set pipeline_parallel=1 and use tensor/data parallelism"
            )
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("make_vocab_size_divisible_by must be >= 1")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the weight conversion needs, read once from the HF config."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def model_shape(hf_config: PretrainedConfig, parallel: MegatronParallelConfig) -> ModelShape:
    """Validate ``hf_config`` for this backend and read the conversion shape from it."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported by the megatron backend; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: only SwiGLU (silu) is supported")
    if getattr(hf_config, "rope_scaling", None):
        raise ValueError(f"rope_scaling={hf_config.rope_scaling!r} is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported (use_sliding_window=True)")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    tp = parallel.tensor_parallel
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of kv heads {num_kv_heads}"
        )
    if num_kv_heads % tp or int(hf_config.intermediate_size) % tp:
        raise ValueError(
            f"tensor_parallel={tp} must divide num_key_value_heads={num_kv_heads} and "
            f"intermediate_size={hf_config.intermediate_size}; pick a smaller tensor_parallel"
        )
    qkv_bias = model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return ModelShape(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        ffn_hidden_size=int(hf_config.intermediate_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=int(hf_config.vocab_size),
        padded_vocab_size=padded_vocab_size(
            int(hf_config.vocab_size),
            divisible_by=parallel.make_vocab_size_divisible_by,
            tensor_parallel=tp,
        ),
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
    )


def transformer_config_from_hf(
    hf_config: PretrainedConfig,
    parallel: MegatronParallelConfig,
    *,
    gradient_checkpointing: bool = False,
) -> TransformerConfig:
    """megatron ``TransformerConfig`` equivalent to an HF Llama/Qwen2 config (float32).

    Fusions that need CUDA kernels (bias/activation, rope, masked softmax,
    persistent layer norm, gradient-accumulation) are off, so the same config
    runs on CPU; parameters are created on CPU there and on the current GPU
    otherwise.
    """
    shape = model_shape(hf_config, parallel)
    if gradient_checkpointing and not cuda_available():
        raise ValueError(
            "gradient_checkpointing with the megatron backend needs CUDA (megatron's recompute "
            "uses CUDA RNG states); set optim.gradient_checkpointing=false on CPU"
        )
    recompute: dict[str, Any] = {}
    if gradient_checkpointing:
        recompute = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        use_cpu_initialization=not cuda_available(),
        # Weights are overwritten from HF right away, but megatron's initialisation is also
        # what tags tensor-parallel weights (``tensor_model_parallel``), which the gradient
        # norm needs to count each shard once.
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **recompute,
    )


def build_gpt_model(
    hf_config: PretrainedConfig,
    parallel: MegatronParallelConfig,
    *,
    gradient_checkpointing: bool = False,
) -> GPTModel:
    """A megatron ``GPTModel`` with the local layer spec, shaped like ``hf_config``.

    Needs :func:`~trainer.backends.megatron_compat.init_model_parallel` first.
    Its parameters are randomly initialised; load weights with :func:`load_hf_weights`.
    """
    shape = model_shape(hf_config, parallel)
    config = transformer_config_from_hf(
        hf_config, parallel, gradient_checkpointing=gradient_checkpointing
    )
    with cpu_device_shim():
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=shape.padded_vocab_size,
            max_sequence_length=int(hf_config.max_position_embeddings),
            pre_process=True,
            post_process=True,
            # Full-vocab logits on every rank: log-softmax then needs no TP collective.
            parallel_output=False,
            share_embeddings_and_output_weights=shape.tied_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=int(getattr(hf_config, "rope_theta", 10000)),
        )


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


def read_hf_state_dict(model_dir: str | Path) -> dict[str, Tensor]:
    """All tensors of an HF safetensors checkpoint (single file or sharded), on CPU."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors checkpoint files")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


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
    missing = [k for k in result.missing_keys if not k.endswith(_EXTRA_STATE_SUFFIX)]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"HF -> megatron weight mapping mismatch: missing {missing}, "
            f"unexpected {list(result.unexpected_keys)}"
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
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
        generation_config = Path(tokenizer_dir) / "generation_config.json"
        if generation_config.is_file():
            (out / "generation_config.json").write_text(generation_config.read_text())
    if dist.is_initialized():
        dist.barrier()
    return out if rank == 0 else None


# --------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class _Segment:
    row: int
    start: int
    end: int  # exclusive

    @property
    def length(self) -> int:
        return self.end - self.start


def split_segments(position_ids: Tensor) -> list[_Segment]:
    """Sequences in a (possibly packed) ``(B, T)`` batch: each starts where its position is 0.

    Positions must count ``0, 1, 2, ...`` within each sequence; anything else
    (left padding, offsets) is rejected rather than silently mis-rotated.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (B, T), got shape {tuple(position_ids.shape)}")
    segments: list[_Segment] = []
    positions = position_ids.cpu()
    for row in range(positions.shape[0]):
        starts = torch.nonzero(positions[row] == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            raise ValueError(f"position_ids row {row} must start at 0 (no left padding)")
        bounds = [*starts, positions.shape[1]]
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            expected = torch.arange(end - start)
            if not torch.equal(positions[row, start:end], expected):
                raise ValueError(
                    f"position_ids row {row}[{start}:{end}] must count 0..{end - start - 1} "
                    "within each packed sequence"
                )
            segments.append(_Segment(row=row, start=start, end=end))
    return segments


def causal_attention_mask(length: int, device: torch.device) -> Tensor:
    """megatron's mask convention: True where attention is blocked. Shape (1, 1, L, L)."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[
        None, None
    ]


# --------------------------------------------------------------------------- backend

StatsT = TypeVar("StatsT")
ObjT = TypeVar("ObjT")
LossFn = Callable[..., tuple[Tensor, StatsT]]
"""``loss_fn(logprobs, **loss_inputs) -> (loss, stats)``; losses are summed over micro-batches."""


@dataclass
class MicroBatch:
    """One forward/backward pass of a training step.

    ``loss_inputs`` are passed to the loss function as keyword arguments
    (e.g. ``advantages``, ``behav_logprobs``, ``prox_logprobs``, ``loss_mask``,
    each shaped like the logprobs, ``(B, T - 1)``).
    """

    input_ids: Tensor  # (B, T)
    position_ids: Tensor | None = None  # (B, T); None: one sequence per row
    temperature: float | Tensor = 1.0  # float or broadcastable to (B, T - 1)
    loss_inputs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_packed(cls, packed: PackedBatch) -> MicroBatch:
        """A trainer micro-batch as one packed row, with the PPO loss inputs.

        ``loss_inputs`` match :func:`proxima.trainer.loss.decoupled_ppo_loss`'s tensor
        arguments (``prox_logprobs`` None when the batch carries none: the loss
        then takes them from the training pass, see ``proxima.trainer.loss``). The
        packed row's last target slot is dropped: it ends a sequence, so its
        ``loss_mask`` is 0.
        """
        prox = None if packed.prox_logprobs is None else packed.prox_logprobs[None, :-1]
        return cls(
            input_ids=packed.input_ids[None],  # (1, T)
            position_ids=packed.position_ids[None],  # (1, T)
            temperature=packed.temperatures[None, :-1],  # (1, T-1)
            loss_inputs={
                "prox_logprobs": prox,
                "behav_logprobs": packed.behav_logprobs[None, :-1],
                "advantages": packed.advantages[None, :-1],
                "loss_mask": packed.loss_mask[None, :-1],
            },
        )


@dataclass
class TrainStepResult(Generic[StatsT]):
    """What one optimizer step reports."""

    loss: float  # sum over this replica's micro-batches of the losses returned by loss_fn
    grad_norm: float  # global L2 norm of the gradient before clipping
    stats: list[StatsT]  # loss_fn's stats, one per micro-batch, in order


class MegatronBackend:
    """A megatron-core GPTModel with the trainer's backend interface.

    Under ``torchrun`` every process constructs one; ranks sharing a
    tensor-parallel group must be fed the same micro-batches, data-parallel
    replicas different ones (possibly none). Gradients are summed over the
    data-parallel group (losses are normalised globally) and clipped by the
    global norm before each AdamW step, so every replica takes the same step.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        optim: OptimConfig | None = None,
        parallel: MegatronParallelConfig | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.optim_config = optim or OptimConfig()
        self.parallel = parallel or MegatronParallelConfig()
        self.dist_env = init_distributed()
        if cuda_available():
            # The current device is per thread, and the trainer loop builds and runs
            # the backend on its compute thread, not where the process group was made.
            torch.cuda.set_device(self.dist_env.local_rank)
        world = self.dist_env.world_size
        model_parallel = self.parallel.tensor_parallel * self.parallel.pipeline_parallel
        if world % model_parallel:
            raise ValueError(
                f"world size {world} is not a multiple of tensor_parallel * pipeline_parallel = "
                f"{model_parallel}: the world is model-parallel groups of {model_parallel} times "
                f"data-parallel replicas; launch a multiple of {model_parallel} processes (e.g. "
                f"torchrun --nproc-per-node {model_parallel}) or change [megatron] tensor_parallel"
            )
        init_model_parallel(
            tensor_parallel=self.parallel.tensor_parallel,
            pipeline_parallel=self.parallel.pipeline_parallel,
            seed=self.parallel.seed,
        )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if cuda_available()
            else torch.device("cpu")
        )
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.shape = model_shape(self.hf_config, self.parallel)
        self.model = build_gpt_model(
            self.hf_config,
            self.parallel,
            gradient_checkpointing=self.optim_config.gradient_checkpointing,
        )
        load_hf_weights(
            self.model, read_hf_state_dict(self.model_dir), self.hf_config, self.parallel
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.optim_config.lr,
            betas=self.optim_config.betas,
            weight_decay=self.optim_config.weight_decay,
        )
        logger.info(
            "megatron backend ready",
            extra={
                "model_dir": str(self.model_dir),
                "tensor_parallel": self.parallel.tensor_parallel,
                "data_parallel": parallel_state.get_data_parallel_world_size(),
                "device": str(self.device),
            },
        )

    # ------------------------------------------------------------------ forward

    def _run(self, input_ids: Tensor) -> Tensor:
        """Logits of right-aligned, unpacked sequences. (N, L) -> (N, L, V) over the real vocab."""
        mask = causal_attention_mask(input_ids.shape[1], self.device)  # (1, 1, L, L)
        # megatron's learned-position path is unused with RoPE; rotary angles are 0..L-1.
        position_ids = torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids)
        with cpu_device_shim():
            logits = self.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=mask
            )  # (N, L, V_padded)
        return logits[..., : self.shape.vocab_size]  # (N, L, V)

    def _logprobs(
        self, input_ids: Tensor, position_ids: Tensor | None, temperature: float | Tensor
    ) -> Tensor:
        """Next-token logprobs with the autograd graph (if grad is enabled). (B, T) -> (B, T-1)."""
        input_ids = input_ids.to(self.device)
        batch, length = input_ids.shape
        if isinstance(temperature, Tensor):
            temperature = torch.broadcast_to(temperature.to(self.device), (batch, length - 1))
        single = position_ids is None or torch.equal(
            position_ids.cpu(), torch.arange(length).expand(batch, length)
        )
        if single:
            logits = self._run(input_ids)  # (B, T, V)
            return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)  # (B, T-1)

        assert position_ids is not None
        segments = split_segments(position_ids)
        longest = max(s.length for s in segments)
        padded = input_ids.new_zeros(len(segments), longest)  # (N, L), right-padded
        for n, s in enumerate(segments):
            padded[n, : s.length] = input_ids[s.row, s.start : s.end]
        # (row, column) in the output and (segment, column) in the padded batch, per target.
        out_rows, out_cols, seg_idx, seg_cols = [], [], [], []
        for n, s in enumerate(segments):
            count = s.length - 1
            out_rows += [s.row] * count
            out_cols += range(s.start, s.end - 1)
            seg_idx += [n] * count
            seg_cols += range(count)
        index = (
            torch.tensor(out_rows, device=self.device),
            torch.tensor(out_cols, device=self.device),
        )
        seg_index = (
            torch.tensor(seg_idx, device=self.device),
            torch.tensor(seg_cols, device=self.device),
        )
        seg_temperature: float | Tensor = temperature
        if isinstance(temperature, Tensor):
            seg_temperature = torch.ones(len(segments), longest - 1, device=self.device)
            seg_temperature = seg_temperature.index_put(seg_index, temperature[index])
        logits = self._run(padded)  # (N, L, V)
        seg_logprobs = token_logprobs(logits[:, :-1], padded[:, 1:], seg_temperature)  # (N, L-1)
        # The last token of a packed sequence has no next token: its slot stays 0.
        out = seg_logprobs.new_zeros(batch, length - 1)  # (B, T-1)
        return out.index_put(index, seg_logprobs[seg_index])

    def forward_packed_logprobs(
        self, packed: PackedBatch, temperature: float | Tensor | None = None
    ) -> Tensor:
        """Logprobs of a packed micro-batch's ``targets``, like ``proxima.trainer.logprobs.forward_logprobs``.

        Shape: ``(T,)`` float32 on CPU, aligned with ``packed.targets``; a
        sequence's last position is 0 (it has no target). ``temperature``
        overrides ``packed.temperatures`` (float or ``(T,)``).
        """
        temps = packed.temperatures if temperature is None else temperature
        if isinstance(temps, Tensor):
            temps = torch.broadcast_to(temps, packed.input_ids.shape)[None, :-1]  # (1, T-1)
        logprobs = self.forward_logprobs(
            packed.input_ids[None], packed.position_ids[None], temps
        )  # (1, T-1)
        return F.pad(logprobs[0], (0, 1))  # (T,)

    def forward_logprobs(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        temperature: float | Tensor = 1.0,
    ) -> Tensor:
        """Log-probabilities of each next token under ``softmax(logits / temperature)``.

        Shape: ``input_ids`` ``(B, T)``; ``position_ids`` ``(B, T)`` or None (one
        sequence per row); packed rows restart positions at 0 for each
        sequence. Returns ``(B, T - 1)`` float32 on CPU, where ``[b, t]`` is
        ``log p(input_ids[b, t + 1] | prefix)``; slots whose next token starts a
        new packed sequence are 0.
        """
        self.model.eval()
        with torch.no_grad():
            return self._logprobs(input_ids, position_ids, temperature).float().cpu()

    # ------------------------------------------------------------------ training

    def train_step(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn[StatsT]
    ) -> TrainStepResult[StatsT]:
        """One AdamW step over ``micro_batches`` (gradients accumulate across them).

        ``loss_fn(logprobs, **mb.loss_inputs)`` gets logprobs ``(B, T - 1)`` with
        grad and returns ``(loss, stats)``; the step minimises the sum of the
        micro-batch losses (normalise inside the loss, e.g. by the global token
        count of the whole step across data-parallel replicas, as
        ``proxima.trainer.loss.decoupled_ppo_loss`` does with ``total_loss_tokens``).
        Gradients are then summed over data-parallel replicas.

        Under data parallelism a replica may get no micro-batch (fewer
        sequences than replicas): it still joins the gradient all-reduce with
        zero gradients and takes the same optimizer step; its ``stats`` are
        empty and its ``loss`` 0.
        """
        if not micro_batches and self.data_parallel_size == 1:
            raise ValueError("train_step needs at least one micro-batch")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        stats: list[StatsT] = []
        for mb in micro_batches:
            logprobs = self._logprobs(mb.input_ids, mb.position_ids, mb.temperature)  # (B, T-1)
            inputs = {
                k: v.to(self.device) if isinstance(v, Tensor) else v
                for k, v in mb.loss_inputs.items()
            }
            loss, mb_stats = loss_fn(logprobs, **inputs)
            with cpu_device_shim():
                loss.backward()
            total_loss += float(loss.detach())
            stats.append(mb_stats)
        self._sum_data_parallel_grads()
        grad_norm = self._clip_grad_norm(self.optim_config.grad_clip)
        self.optimizer.step()
        return TrainStepResult(loss=total_loss, grad_norm=grad_norm, stats=stats)

    def _sum_data_parallel_grads(self) -> None:
        """Sum the gradients over data-parallel replicas (one flat all-reduce).

        A sum, not a mean: each replica's loss is already normalised by the
        whole step's token count, so the sum is the gradient of the global
        loss, the same as one process running every micro-batch. A parameter
        with no gradient here (a replica without micro-batches) contributes
        zeros, so every replica reduces the same flat size; afterwards every
        parameter has a gradient (one that no replica reached gets zeros, so
        AdamW still applies its weight decay to it).
        """
        if self.data_parallel_size == 1:
            return
        params = list(self.model.parameters())
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _clip_grad_norm(self, max_norm: float | None) -> float:
        """Global gradient L2 norm over the model-parallel group; clip to ``max_norm`` if set.

        Parameters replicated across tensor-parallel ranks (norms) are counted
        once, on TP rank 0 (megatron's ``param_is_not_tensor_parallel_duplicate``).
        """
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        grads: list[Tensor] = []
        for param in self.model.parameters():
            if param.grad is None:
                continue
            grads.append(param.grad)
            if param_is_not_tensor_parallel_duplicate(param):
                squares = squares + param.grad.float().pow(2).sum()
        model_parallel_group = parallel_state.get_model_parallel_group()
        if dist.get_world_size(model_parallel_group) > 1:
            dist.all_reduce(squares, group=model_parallel_group)
        norm = float(squares.sqrt())
        if max_norm is not None and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for grad in grads:
                grad.mul_(scale)
        return norm

    # ------------------------------------------------------------------ data parallel

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model: ``world / (tensor_parallel * pipeline_parallel)``."""
        return parallel_state.get_data_parallel_world_size()

    @property
    def data_parallel_rank(self) -> int:
        """This process's replica; ranks of one tensor-parallel group share it."""
        return parallel_state.get_data_parallel_rank()

    def all_gather_data_parallel(self, obj: ObjT) -> list[ObjT]:
        """Every replica's ``obj`` (picklable, tensors on the CPU), in replica order.

        Collective over the data-parallel group, on megatron's gloo copy of it,
        so objects travel through the CPU on GPU machines too.
        """
        if self.data_parallel_size == 1:
            return [obj]
        out: list[Any] = [None] * self.data_parallel_size
        dist.all_gather_object(out, obj, group=parallel_state.get_data_parallel_group_gloo())
        return out

    # ------------------------------------------------------------------ export

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """Current weights as an HF checkpoint state dict (collective over the TP group)."""
        return to_hf_state_dict(self.model, self.hf_config, self.parallel)

    def export_hf(
        self, out_dir: str | Path, tokenizer_dir: str | Path | None = None
    ) -> Path | None:
        """Write an HF checkpoint for the inference backends; see :func:`export_hf`."""
        return export_hf(
            self.model, self.hf_config, tokenizer_dir or self.model_dir, out_dir, self.parallel
        )
