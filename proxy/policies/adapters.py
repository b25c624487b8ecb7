"""Policies: the base model or one named LoRA adapter, and how requests name them.

One base model serves many policies. A *policy* is the base (``adapter`` is
``None``, SQL NULL) or a named adapter whose name matches ``ADAPTER_NAME_PATTERN``.
Each adapter has its own version sequence (from 1; its version 0 is the base
weights with no adapter applied), admission, pushes and production state.

Which policy a request uses is decided by its credential: a session's key
serves the session's adapter, a production key the adapter it was created
for. The ``model`` of a request may name the policy too, as
``"<served-model>:<adapter>"`` (``split_policy``); a name that disagrees with
the credential is refused (400, ``param: "model"``), and any other model name
says nothing. The admin token has no policy of its own: its ``model`` picks one.

An adapter's ``adapter_config.json`` is checked by :func:`check_adapter_config`
wherever it is read (the push route when the directory is readable there, the
embedded engine always): ``r`` a positive integer (not a bool), ``lora_alpha`` a
finite number of at most ``MAX_LORA_ALPHA`` in magnitude, ``target_modules`` a
non-empty list of module names (or one name); a value outside these is an
:class:`AdapterConfigError` that names the field. The weights themselves are the
engine's to check (it knows the layers and the dtype it computes in).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxima.proxy.backends.protocol import ADAPTER_NAME_PATTERN
from proxima.proxy.errors import BadRequest

MAX_LORA_RANK = 65536
"""The largest ``r`` an adapter may declare (no model's layer is wider)."""

MAX_LORA_ALPHA = 65536.0
"""The largest ``|lora_alpha|`` an adapter may declare: peft's are a small multiple of ``r``
(16, 32, 2 * r); a larger one only multiplies the adapter's output toward overflow."""


class AdapterConfigError(ValueError):
    """An ``adapter_config.json`` value no engine can serve; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"adapter_config.json: {message}")
        self.field = field


@dataclass(frozen=True)
class AdapterConfig:
    """The checked values of an ``adapter_config.json``: ``scale`` multiplies ``B @ A``."""

    rank: int
    alpha: float
    scale: float
    targets: tuple[str, ...] | None  # None: "all-linear"


def _number(config: dict[str, Any], field: str) -> float:
    value = config[field]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdapterConfigError(field, f"{field!r} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        number = math.inf
    if not math.isfinite(number) or abs(number) > MAX_LORA_ALPHA:
        raise AdapterConfigError(
            field,
            f"{field!r} must be a finite number of magnitude at most {MAX_LORA_ALPHA:g}, "
            f"got {value!r}",
        )
    return number


def _targets(value: Any) -> tuple[str, ...] | None:
    if value == "all-linear":
        return None
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, str) and t and "\x00" not in t for t in value)
    ):
        raise AdapterConfigError(
            "target_modules",
            f"'target_modules' must be a non-empty list of module names, got {value!r}",
        )
    return tuple(value)


def check_adapter_config(config: Any) -> AdapterConfig:
    """The values of a parsed ``adapter_config.json`` an engine computes with, checked (module
    docstring); ``AdapterConfigError`` names the first bad field."""
    if not isinstance(config, dict):
        raise AdapterConfigError("adapter_config.json", "it is not a JSON object")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if missing:
        raise AdapterConfigError(missing[0], f"it lacks {missing}")
    rank = config["r"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_LORA_RANK:
        raise AdapterConfigError(
            "r", f"'r' must be an integer from 1 to {MAX_LORA_RANK}, got {rank!r}"
        )
    alpha = _number(config, "lora_alpha")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool) and rslora is not None:
        raise AdapterConfigError("use_rslora", f"'use_rslora' must be a boolean, got {rslora!r}")
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    return AdapterConfig(rank, alpha, scale, _targets(config["target_modules"]))


def check_adapter(name: str | None) -> str | None:
    """``name`` if it is a valid adapter name (or ``None``, the base); else ``ValueError``."""
    if name is None:
        return None
    if not isinstance(name, str) or not ADAPTER_NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"adapter name {name!r} is not valid: use 1-64 characters of a-z, 0-9, '_' and '-', "
            "starting with a letter or digit"
        )
    return name


def policy_label(adapter: str | None) -> str:
    """How logs and messages name a policy: the adapter's name, or ``base``."""
    return "base" if adapter is None else f"adapter {adapter}"


def split_policy(model: str, served: str) -> tuple[str, str | None]:
    """``"<served>:<adapter>"`` -> ``(served, adapter)``; any other name -> ``(model, None)``.

    Only the served model's name followed by ``:`` names an adapter, so a
    harness's own model name (which may hold a ``:``) names none.
    """
    prefix = served + ":"
    if model.startswith(prefix):
        return served, model[len(prefix) :]
    return model, None


def screen_adapter_dir(path: str) -> None:
    """Refuse a pushed adapter whose ``adapter_config.json`` no engine can serve: a 400
    (``param: "path"``, ``code: "invalid_adapter_<field>"``) whose message names the field.
    A directory this process cannot read is left to the backends, which read it themselves."""
    config_file = Path(path) / "adapter_config.json"
    try:
        text = config_file.read_text()
    except (OSError, UnicodeDecodeError, ValueError):  # ValueError: a NUL in the path
        return
    try:
        check_adapter_config(json.loads(text))
    except ValueError as exc:  # JSONDecodeError, AdapterConfigError
        field = exc.field if isinstance(exc, AdapterConfigError) else "adapter_config.json"
        raise BadRequest(
            f"The adapter at {path} cannot be served: {exc}",
            param="path",
            code="invalid_adapter_" + field.replace(".", "_"),
        ) from None
