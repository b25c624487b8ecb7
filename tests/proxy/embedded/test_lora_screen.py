"""The engine refuses an adapter it would compute NaN or inf with, naming the field or module.

Each bad adapter is a good one (random, rank 8, every linear of the tiny model) with one
thing changed: a config value (``lora_alpha`` NaN, inf or huge, ``r`` a bool, a float or
out of range, ``target_modules`` empty or naming a layer the model lacks), or its weights
(values that overflow float32 only once ``lora_B`` is scaled by ``lora_alpha / r``, float64
values past float32's range, an update ``s B @ A`` of enormous norm). The good adapter
loads; each bad one is an ``AdapterLoadError`` whose message names what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from proxima.proxy.embedded.lora import AdapterLoadError, read_adapter
from proxima.proxy.policies.adapters import (
    MAX_LORA_ALPHA,
    AdapterConfigError,
    check_adapter_config,
)
from proxima.proxy.testing.lora import LLAMA_TARGETS, write_peft_adapter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

Linears = dict[str, torch.nn.Linear]


@pytest.fixture(scope="module")
def linears(tiny_model_dir: Path) -> Linears:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.fixture(scope="module")
def good(linears: Linears, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shapes = {n: (m.in_features, m.out_features) for n, m in linears.items()}
    shapes = {n: s for n, s in shapes.items() if n.rsplit(".", 1)[-1] in LLAMA_TARGETS}
    return write_peft_adapter(tmp_path_factory.mktemp("good") / "a", shapes, rank=8, alpha=16)


def _variant(
    good: Path,
    out: Path,
    config: dict[str, Any] | None = None,
    change: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of ``good`` with ``config`` merged into its config and ``change`` applied to its
    tensors. The config is written as Python's json does (NaN and Infinity as literals, as a
    trainer's json.dumps would)."""
    out.mkdir()
    merged = {**json.loads((good / "adapter_config.json").read_text()), **(config or {})}
    (out / "adapter_config.json").write_text(json.dumps(merged))
    tensors = load_file(good / "adapter_model.safetensors")
    if change is not None:
        change(tensors)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def _first(tensors: dict[str, torch.Tensor], kind: str) -> str:
    return sorted(k for k in tensors if k.endswith(f"lora_{kind}.weight"))[0]


def _scaled_overflow(tensors: dict[str, torch.Tensor]) -> None:
    # 1e36 is finite in float32; lora_alpha / r = 8000 / 8 = 1000 takes it past 3.4e38.
    tensors[_first(tensors, "B")].view(-1)[7] = 1e36


def _float64_overflow(tensors: dict[str, torch.Tensor]) -> None:
    key = _first(tensors, "A")
    a = tensors[key].double()
    a.view(-1)[3] = 1e39  # finite in float64, inf in float32 (the engine's dtype)
    tensors[key] = a


def _huge_update(value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        key = _first(tensors, "B")
        tensors[key] = torch.full_like(tensors[key], value)  # every value finite

    return change


CASES: dict[str, tuple[dict[str, Any] | None, Any, str]] = {
    "alpha NaN": ({"lora_alpha": math.nan}, None, r"'lora_alpha' must be a finite number"),
    "alpha inf": ({"lora_alpha": math.inf}, None, r"'lora_alpha' must be a finite number"),
    "alpha -inf": ({"lora_alpha": -math.inf}, None, r"'lora_alpha' must be a finite number"),
    "alpha huge": ({"lora_alpha": 1e30}, None, r"'lora_alpha' must be .* at most 65536"),
    "alpha huge int": ({"lora_alpha": 10**400}, None, r"'lora_alpha' must be a finite number"),
    "alpha bool": ({"lora_alpha": True}, None, r"'lora_alpha' must be a number, got True"),
    "alpha string": ({"lora_alpha": "16"}, None, r"'lora_alpha' must be a number"),
    "r true": ({"r": True}, None, r"'r' must be an integer from 1 to 65536, got True"),
    "r float": ({"r": 8.0}, None, r"'r' must be an integer .* got 8\.0"),
    "r zero": ({"r": 0}, None, r"'r' must be an integer"),
    "r huge": ({"r": 10**30}, None, r"'r' must be an integer"),
    "no targets": ({"target_modules": []}, None, r"'target_modules' must be a non-empty list"),
    "target not text": ({"target_modules": [3]}, None, r"'target_modules' must be"),
    "target unsupported": ({"target_modules": ["lm_head"]}, None, r"\['lm_head'\] are not"),
    "rslora not bool": ({"use_rslora": "yes"}, None, r"'use_rslora' must be a boolean"),
    "overflow once scaled": (
        {"lora_alpha": 8000},
        _scaled_overflow,
        r"model\.layers\.0\.mlp\.down_proj's weights overflow torch\.float32 once lora_B is "
        r"scaled by lora_alpha / r = 1000",
    ),
    "float64 past float32": (
        None,
        _float64_overflow,
        r"model\.layers\.0\.mlp\.down_proj's weights overflow torch\.float32",
    ),
    "huge update": (
        None,
        _huge_update(1000.0),
        r"down_proj: the update lora_alpha / r \* lora_B @ lora_A has norm 2\.\d+e\+04, over",
    ),
    "huge factor": (
        None,
        _huge_update(1e5),
        r"down_proj: lora_B \* 2 \(lora_alpha / r\) has norm \d\.\d+e\+06, over 1e\+06",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_adapter_is_refused_naming_what_is_wrong(
    case: str, good: Path, linears: Linears, tmp_path: Path
) -> None:
    config, change, message = CASES[case]
    bad = _variant(good, tmp_path / "bad", config, change)
    with pytest.raises(AdapterLoadError, match=message):
        read_adapter(bad, "bad", linears)


def test_the_good_adapter_and_its_edges_load(good: Path, linears: Linears, tmp_path: Path) -> None:
    adapter = read_adapter(good, "good", linears)
    assert adapter.rank == 8 and adapter.scale == 2.0
    assert all(bool(torch.isfinite(t).all()) for pair in adapter.weights.values() for t in pair)
    edge = _variant(good, tmp_path / "edge", {"lora_alpha": MAX_LORA_ALPHA / 1e4})
    assert read_adapter(edge, "edge", linears).scale == MAX_LORA_ALPHA / 1e4 / 8
    # float64 weights within float32's range are served (as float32).
    wide = _variant(
        good, tmp_path / "f64", None, lambda t: t.update({k: v.double() for k, v in t.items()})
    )
    loaded = read_adapter(wide, "f64", linears)
    assert {t.dtype for pair in loaded.weights.values() for t in pair} == {torch.float32}


def test_a_target_the_model_lacks_is_refused(good: Path, linears: Linears, tmp_path: Path) -> None:
    """``target_modules`` must name layers this model has: a model without MLP adapters
    (its linears here: attention only) refuses an adapter that targets ``gate_proj``."""
    attention = {n: m for n, m in linears.items() if ".self_attn." in n}
    only_q = _variant(good, tmp_path / "q", {"target_modules": ["q_proj", "gate_proj"]})
    with pytest.raises(AdapterLoadError, match=r"target_modules \['gate_proj'\] name no linear"):
        read_adapter(only_q, "q", attention)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"r": True, "lora_alpha": 16, "target_modules": ["q_proj"]}, "r"),
        ({"r": 8, "lora_alpha": math.nan, "target_modules": ["q_proj"]}, "lora_alpha"),
        ({"r": 8, "lora_alpha": 16, "target_modules": "q_proj\x00"}, "target_modules"),
        ({"r": 8, "target_modules": ["q_proj"]}, "lora_alpha"),
        ([1, 2], "adapter_config.json"),
    ],
)
def test_the_config_error_names_its_field(config: Any, field: str) -> None:
    with pytest.raises(AdapterConfigError) as caught:
        check_adapter_config(config)
    assert caught.value.field == field and field in str(caught.value)


def test_the_checked_config_carries_the_scale() -> None:
    plain = check_adapter_config({"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    assert (plain.rank, plain.scale, plain.targets) == (4, 2.0, None)
    rs = check_adapter_config(
        {"r": 4, "lora_alpha": -8.0, "target_modules": ["q_proj"], "use_rslora": True}
    )
    assert (rs.scale, rs.targets) == (-4.0, ("q_proj",))
