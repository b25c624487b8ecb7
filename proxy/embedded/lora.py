"""LoRA adapters in the engine: read peft's directory, apply each row's adapter in a batch.

An adapter changes a linear layer ``y = W x`` into ``y = W x + s B A x`` with
``A`` ``(r, in)``, ``B`` ``(out, r)`` and ``s = lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with ``use_rslora``) (Hu et al. 2021, eq. 3). The base weights are
never touched: a forward hook on every target linear adds ``s B A x`` to the
rows whose request names an adapter, so rows of different adapters and base
rows share one forward pass, and a base row gets exactly the base model's
numbers (nothing is added to it).

For the rows with an adapter the hook computes, with ``n`` such rows and ``r``
the largest rank among them (smaller ranks padded with zeros)::

    t = bmm(x[rows], A_rows)    # (n, T, in) @ (n, in, r)  -> (n, T, r)
    d = bmm(t, sB_rows)         # (n, T, r)  @ (n, r, out) -> (n, T, out)
    y[rows] += d

``A_rows`` and ``sB_rows`` stack each row's adapter matrices; they are built
once per batch composition (:class:`BatchAdapters`), not once per step.

An adapter is read and checked off the worker thread (:func:`read_adapter`);
a :class:`LoRAAdapter` is immutable, so loading one never pauses generation,
and an unloaded adapter's tensors live on until its last row finishes.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama / SmolLM2 / Qwen2 decoder layer an adapter may target."""

PEFT_PREFIX = "base_model.model."


class AdapterLoadError(Exception):
    """The directory is not an adapter this engine can serve (message says why)."""


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One loaded adapter: per module, ``A`` transposed ``(in, r)`` and ``s B`` transposed
    ``(r, out)``, ready for ``x @ A_t @ sB_t``."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def _config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise AdapterLoadError(f"lora_path {str(path)!r} is not a directory")
    config_file = path / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError as exc:
        raise AdapterLoadError(f"no adapter_config.json in {str(path)!r}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterLoadError(f"cannot read {config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterLoadError("adapter_config.json is not a JSON object")
    return config


def _check_config(config: dict[str, Any], name: str) -> tuple[int, float, set[str]]:
    """``(r, scale, target module names)``; refuses what the engine would serve wrongly."""
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if missing:
        raise AdapterLoadError(f"adapter_config.json lacks {missing}")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(f"peft_type {config['peft_type']!r} is not LORA")
    if config.get("use_dora"):
        # SGLang's own refusal.
        raise AdapterLoadError(
            f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
        )
    refused = {
        "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas",
        "modules_to_save": "fully trained modules",
        "layers_to_transform": "a subset of layers",
    }
    for key, what in refused.items():
        if config.get(key):
            raise AdapterLoadError(f"{key} ({what}) is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterLoadError(f"bias {config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise AdapterLoadError("fan_in_fan_out adapters (Conv1D layers) are not supported")
    rank, alpha = config["r"], config["lora_alpha"]
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterLoadError(f"bad r {rank!r} or lora_alpha {alpha!r}")
    targets = config["target_modules"]
    if isinstance(targets, str):
        targets = SUPPORTED_TARGETS if targets == "all-linear" else [targets]
    unsupported = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise AdapterLoadError(
            f"target modules {unsupported} are not supported; use {list(SUPPORTED_TARGETS)}"
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale), set(targets)


def all_finite(*tensors: torch.Tensor) -> bool:
    """No NaN or inf in ``tensors``: ``x * 0`` sums to 0 exactly when every element of ``x``
    is finite (an inf or NaN makes it NaN; zeros cannot overflow), and the multiply and sum
    take a third of the time of ``isfinite(x).all()`` on CPU."""
    total = sum((t.mul(0).sum(dtype=torch.float32) for t in tensors), torch.zeros(()))
    return bool(torch.isfinite(total))


def read_adapter(
    path: str | Path,
    name: str,
    linears: dict[str, torch.nn.Linear],
    *,
    max_lora_rank: int | None = None,
) -> LoRAAdapter:
    """Read and check peft's adapter directory ``path`` against the model's ``linears``
    (module name -> layer). Every tensor must belong to a target linear with the right
    shape and be finite; every target linear must have its pair."""
    path = Path(path)
    rank, scale, targets = _check_config(_config(path), name)
    if max_lora_rank is not None and rank > max_lora_rank:
        # SGLang's message (LoRAManager.validate_new_adapter).
        raise AdapterLoadError(
            f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory "
            "pool configuration. Please ensure that the LoRA adapter's rank is within the "
            "configured `--max-lora-rank` and that the target modules are included in "
            "`--lora-target-modules`."
        )
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterLoadError(f"no adapter_model.safetensors in {str(path)!r}")
    try:
        tensors = load_file(weights_file, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise AdapterLoadError(f"cannot read adapter_model.safetensors: {exc}") from exc

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not key.startswith(PEFT_PREFIX) or kind not in ("A.weight", "B.weight"):
            raise AdapterLoadError(f"unexpected tensor {key!r} (not a LoRA A/B weight)")
        if module not in linears or module.rsplit(".", 1)[-1] not in targets:
            raise AdapterLoadError(f"tensor {key!r} names no target linear of the model")
        pairs.setdefault(module, {})[kind[0]] = tensor
    expected = {m for m in linears if m.rsplit(".", 1)[-1] in targets}
    incomplete = sorted(m for m in expected if set(pairs.get(m, {})) != {"A", "B"})
    if incomplete:
        raise AdapterLoadError(f"missing lora_A/lora_B weights for {incomplete[:3]}")

    # One pass over every tensor first (an L2 norm is inf or NaN where an element is, and
    # one fused call costs a third of one check per module); only a failure, or a norm
    # overflowed by finite values past 1e19, looks module by module to name the culprit.
    whole_finite = bool(torch.stack(torch._foreach_norm(list(tensors.values()))).isfinite().all())
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        layer = linears[module]
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise AdapterLoadError(
                f"{module}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not fit a "
                f"({layer.out_features}, {layer.in_features}) layer at rank {rank}"
            )
        if not whole_finite and not all_finite(a, b):
            raise AdapterLoadError(f"non-finite values (NaN or inf) in {module}'s weights")
        dtype = layer.weight.dtype
        # Views (in, r) and (r, out): BatchAdapters.stacks copies them into its batch stacks.
        a_t = a.to(dtype).t()
        sb_t = (b.to(dtype) * scale).t()
        weights[module] = (a_t, sb_t)
    return LoRAAdapter(name=name, path=str(path), rank=rank, scale=scale, weights=weights)


class BatchAdapters:
    """Which rows of a batch use which adapter, with each module's stacked matrices
    (built on first use, then reused for every step of the same composition)."""

    def __init__(self, adapters: Sequence[LoRAAdapter | None]) -> None:
        self.adapters = tuple(adapters)
        self.rows = [i for i, a in enumerate(adapters) if a is not None]
        self.all_rows = len(self.rows) == len(adapters)
        self.row_index = torch.tensor(self.rows, dtype=torch.long)  # (n,)
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}

    @property
    def key(self) -> tuple[str | None, ...]:
        return tuple(a.lora_id if a is not None else None for a in self.adapters)

    def stacks(
        self, module: str, linear: torch.nn.Linear
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(A_rows (n, in, r), sB_rows (n, r, out))`` for ``module``; None when no row's
        adapter targets it."""
        if module in self._stacks:
            return self._stacks[module]
        used = [a for i in self.rows if (a := self.adapters[i]) is not None]
        if not any(module in a.weights for a in used):
            self._stacks[module] = None
            return None
        rank = max(a.rank for a in used if module in a.weights)
        dtype = linear.weight.dtype
        a_rows = torch.zeros(len(used), linear.in_features, rank, dtype=dtype)
        b_rows = torch.zeros(len(used), rank, linear.out_features, dtype=dtype)
        for j, adapter in enumerate(used):
            if module in adapter.weights:
                a_t, sb_t = adapter.weights[module]
                a_rows[j, :, : adapter.rank] = a_t
                b_rows[j, : adapter.rank, :] = sb_t
        self._stacks[module] = (a_rows, b_rows)
        return a_rows, b_rows


class LoRAHooks:
    """Forward hooks on the model's target linears that add each row's adapter.

    The worker sets :attr:`batch` before a forward pass (None: no adapter rows,
    the hooks return the base output untouched).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.linears: dict[str, torch.nn.Linear] = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in SUPPORTED_TARGETS
        }
        self.batch: BatchAdapters | None = None
        for name, module in self.linears.items():
            module.register_forward_hook(self._hook(name, module))

    def set_rows(self, adapters: Sequence[LoRAAdapter | None]) -> None:
        """Name the adapter of each row of the next forward passes (in row order)."""
        if not any(a is not None for a in adapters):
            self.batch = None
        elif self.batch is None or self.batch.key != tuple(
            a.lora_id if a is not None else None for a in adapters
        ):
            self.batch = BatchAdapters(adapters)

    def _hook(self, name: str, linear: torch.nn.Linear) -> Any:
        def hook(_: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> Any:
            batch = self.batch
            if batch is None:
                return None  # the base output, untouched
            stacks = batch.stacks(name, linear)
            if stacks is None:
                return None
            a_rows, b_rows = stacks
            x = inputs[0]  # (B, T, in)
            xs = x if batch.all_rows else x.index_select(0, batch.row_index)  # (n, T, in)
            delta = torch.bmm(torch.bmm(xs, a_rows), b_rows)  # (n, T, out)
            if batch.all_rows:
                return out + delta
            return out.index_add(0, batch.row_index, delta)

        return hook
