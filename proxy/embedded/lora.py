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

An adapter is refused unless what the hook will compute with is servable: its
config's values (``proxima.proxy.policies.adapters.check_adapter_config``: ``r`` a
positive integer, ``lora_alpha`` finite and bounded, ``target_modules`` linears this
model has), and per module ``A`` and ``s B`` in the layer's dtype (float32 here)
finite, each of norm at most ``MAX_FACTOR_NORM``, their product ``s B @ A`` of norm
at most ``MAX_DELTA_NORM``. The error names the field or the module.

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
from proxima.proxy.policies.adapters import AdapterConfigError, check_adapter_config
from safetensors import SafetensorError
from safetensors.torch import load_file

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama / SmolLM2 / Qwen2 decoder layer an adapter may target."""

PEFT_PREFIX = "base_model.model."

MAX_DELTA_NORM = 1e4
"""The largest Frobenius norm of an adapter's update ``s B @ A`` to one layer. A trained
adapter's is of the order of the layer's own weights' (a few to a few hundred); one of 1e4
already multiplies the layer's output a thousandfold, and a few such layers overflow
float32 in the next normalisation (a sum of squares)."""

MAX_FACTOR_NORM = 1e6
"""The largest Frobenius norm of ``A`` and of ``s B`` alone: the hook computes ``x @ A``
before ``@ sB``, so a huge ``A`` against a tiny ``B`` overflows there first."""


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


def _check_config(config: dict[str, Any], name: str) -> tuple[int, float, set[str] | None]:
    """``(r, scale, target module names)`` (None: ``all-linear``); refuses what the engine
    would serve wrongly."""
    try:
        checked = check_adapter_config(config)
    except AdapterConfigError as exc:
        raise AdapterLoadError(str(exc)) from exc
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
    if checked.targets is None:
        return checked.rank, checked.scale, None
    unsupported = sorted(set(checked.targets) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise AdapterLoadError(
            f"adapter_config.json: target_modules {unsupported} are not supported; use "
            f"{list(SUPPORTED_TARGETS)}"
        )
    return checked.rank, checked.scale, set(checked.targets)


def _known_targets(targets: set[str] | None, linears: dict[str, torch.nn.Linear]) -> set[str]:
    """The target modules, each a linear the model has (``all-linear``: all it has)."""
    known = {m.rsplit(".", 1)[-1] for m in linears}
    if targets is None:
        return known
    absent = sorted(targets - known)
    if absent:
        raise AdapterLoadError(
            f"adapter_config.json: target_modules {absent} name no linear layer of this model "
            f"(it has {sorted(known)})"
        )
    return targets


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
    shape; every target linear must have its pair; what the engine computes with (the
    factors in the layer's dtype, ``B`` scaled) must be finite and bounded (:func:`_screen`)."""
    path = Path(path)
    rank, scale, config_targets = _check_config(_config(path), name)
    targets = _known_targets(config_targets, linears)
    if max_lora_rank is not None and rank > max_lora_rank:
        # SGLang's message (LoRAManager.validate_new_adapter).
        raise AdapterLoadError(
            f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory "
            "pool configuration. Please ensure that the LoRA adapter's rank is within the "
            "configured `--max-lora-rank` and that the target modules are included in "
            "`--lora-target-modules`."
        )
    pairs = _pairs(path, linears, targets)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        layer = linears[module]
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise AdapterLoadError(
                f"{module}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not fit a "
                f"({layer.out_features}, {layer.in_features}) layer at rank {rank}"
            )
        dtype = layer.weight.dtype
        # What the hook multiplies by: A and s * B in the layer's dtype (a float64 value
        # past float32's range, or a B that scale pushes past it, is inf there).
        weights[module] = (a.to(dtype), b.to(dtype) * scale)
    _screen(pairs, weights, scale)
    # Views (in, r) and (r, out): BatchAdapters.stacks copies them into its batch stacks.
    transposed = {m: (a.t(), sb.t()) for m, (a, sb) in weights.items()}
    return LoRAAdapter(name=name, path=str(path), rank=rank, scale=scale, weights=transposed)


def _pairs(
    path: Path, linears: dict[str, torch.nn.Linear], targets: set[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """``module -> {"A": lora_A, "B": lora_B}`` from the adapter's safetensors file."""
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
        if not tensor.is_floating_point():
            raise AdapterLoadError(f"tensor {key!r} is {tensor.dtype}, not floating point")
        pairs.setdefault(module, {})[kind[0]] = tensor
    expected = {m for m in linears if m.rsplit(".", 1)[-1] in targets}
    incomplete = sorted(m for m in expected if set(pairs.get(m, {})) != {"A", "B"})
    if incomplete:
        raise AdapterLoadError(f"missing lora_A/lora_B weights for {incomplete[:3]}")
    return pairs


def _screen(
    pairs: dict[str, dict[str, torch.Tensor]],
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> None:
    """Refuse an adapter whose computed update cannot be served: per module, ``A`` and
    ``s B`` in the serving dtype finite with norms at most ``MAX_FACTOR_NORM``, and the update
    ``s B @ A`` of norm at most ``MAX_DELTA_NORM``.

    One fused pass takes the norms of every factor (an L2 norm is inf or NaN where an element
    is, and one call costs a third of one check per module); a module passes at once when
    ``|A| |sB|``, which bounds ``|sB @ A|``, is within bounds. Only the others are looked at
    closely, in float64, to name the culprit or accept them.
    """
    factors = [t for pair in weights.values() for t in pair]
    norms = torch.stack(torch._foreach_norm(factors)).double().tolist()
    for i, (module, (a, sb)) in enumerate(weights.items()):
        norm_a, norm_sb = norms[2 * i], norms[2 * i + 1]
        small = norm_a <= MAX_FACTOR_NORM and norm_sb <= MAX_FACTOR_NORM
        if small and norm_a * norm_sb <= MAX_DELTA_NORM:
            continue
        _check_module(module, pairs[module], a, sb, scale)


def _check_module(
    module: str, pair: dict[str, torch.Tensor], a: torch.Tensor, sb: torch.Tensor, scale: float
) -> None:
    """One module's factors and update, exactly (float64), or an error naming what is wrong."""
    if not all_finite(pair["A"], pair["B"]):
        raise AdapterLoadError(f"non-finite values (NaN or inf) in {module}'s weights")
    if not all_finite(a, sb):
        raise AdapterLoadError(
            f"{module}'s weights overflow {a.dtype} once lora_B is scaled by "
            f"lora_alpha / r = {scale:g}: lora_alpha or the weights are too large"
        )
    a64, sb64 = a.double(), sb.double()
    for what, factor in (("lora_A", a64), (f"lora_B * {scale:g} (lora_alpha / r)", sb64)):
        norm = float(factor.norm())
        if norm > MAX_FACTOR_NORM:
            raise AdapterLoadError(
                f"{module}: {what} has norm {norm:.3g}, over {MAX_FACTOR_NORM:g}; "
                "lora_alpha or the weights are too large"
            )
    # |s B A|_F^2 = trace((s B)^T (s B) A A^T): two (r, r) products, not the (out, in) update.
    squared = float((sb64.t() @ sb64).mul_(a64 @ a64.t()).sum())
    if squared > MAX_DELTA_NORM**2:
        raise AdapterLoadError(
            f"{module}: the update lora_alpha / r * lora_B @ lora_A has norm "
            f"{math.sqrt(squared):.3g}, over {MAX_DELTA_NORM:g}; lora_alpha or the weights "
            "are too large"
        )


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
