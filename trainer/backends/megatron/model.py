"""The megatron GPTModel built from an HF Llama/Qwen2 config.

:func:`model_shape` validates the HF config for this backend and reads the
dimensions the weight conversion needs; :func:`transformer_config_from_hf` /
:func:`build_gpt_model` map it onto megatron's ``TransformerConfig`` (RMSNorm,
SwiGLU, grouped query attention, Qwen2's qkv bias, RoPE base, tied or untied
embeddings, no dropout) and a ``GPTModel`` with megatron's local
(non-Transformer-Engine) layer spec.

Scope: pipeline parallelism is rejected at start-up (it needs megatron's
pipeline schedules, not wired here); parameters are float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from proxima.trainer.backends.megatron.compat import cpu_device_shim, cuda_available
from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

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

    Needs :func:`~proxima.trainer.backends.megatron.compat.init_model_parallel` first.
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
