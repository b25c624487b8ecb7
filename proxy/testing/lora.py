"""Random LoRA adapters in peft's on-disk format, for tests and benchmarks (no peft needed).

peft saves an adapter as a directory with ``adapter_config.json`` (``r``,
``lora_alpha``, ``target_modules``, ...) and ``adapter_model.safetensors``
whose keys are ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and
``base_model.model.<module>.lora_B.weight`` ``(out, r)``; the layer's output
becomes ``W x + (lora_alpha / r) * B A x``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama / SmolLM2 / Qwen2 decoder layer."""


def linear_shapes(model: torch.nn.Module, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``module name -> (in_features, out_features)`` of the model's linears named in ``targets``."""
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }


def write_peft_adapter(
    path: str | Path,
    shapes: dict[str, tuple[int, int]],
    *,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    std: float = 0.05,
    base_model: str = "",
    extra_config: dict[str, object] | None = None,
) -> Path:
    """Write a random adapter of rank ``rank`` for the linears in ``shapes`` (see
    :func:`linear_shapes`); both A and B random (peft initialises B to zero, which
    would make the adapter a no-op). Returns the directory."""
    tensors = random_adapter_tensors(shapes, rank=rank, seed=seed, std=std)
    return save_peft_adapter(
        path, tensors, rank=rank, alpha=alpha, base_model=base_model, extra_config=extra_config
    )


def random_adapter_tensors(
    shapes: dict[str, tuple[int, int]], *, rank: int = 8, seed: int = 0, std: float = 0.05
) -> dict[str, torch.Tensor]:
    """peft's tensors (``base_model.model.<linear>.lora_{A,B}.weight``) of a random adapter."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (fan_in, fan_out) in shapes.items():
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * std
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * std
    return tensors


def save_peft_adapter(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    base_model: str = "",
    extra_config: dict[str, object] | None = None,
) -> Path:
    """Write ``tensors`` (peft's names) and their ``adapter_config.json`` as peft saves an
    adapter. Returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors})
    config: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **(extra_config or {}),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path
