"""LoRA adapters on one frozen base: peft's multi-adapter model, an AdamW per adapter.

:class:`LoraBackend` loads the base model once (float32, frozen) and adds one
LoRA adapter per name of ``[trainer.lora] adapters`` (peft ``LoraConfig``:
``r = rank``, ``lora_alpha = alpha``, ``target_modules``, ``lora_dropout``).
Every adapter is a policy of its own; :meth:`LoraBackend.policy` gives the
``PPOBackend`` of one adapter (:class:`AdapterPolicy`), which the training
loop drives exactly as it drives the full model:

- every call first makes its adapter the active one (``PeftModel.set_adapter``:
  only that adapter's LoRA layers join the forward pass and only their
  parameters require grad), so the proximal logprobs, the training pass and
  its decoupled loss all see ``W x + (alpha / r) B_a A_a x`` of adapter ``a``;
- ``train_step`` is ``TorchBackend``'s minibatch loop with adapter ``a``'s own
  AdamW over ``a``'s LoRA parameters only: the base and every other adapter
  get no gradient and are not touched;
- ``export_hf`` writes the adapter alone in peft's format
  (``adapter_config.json`` + ``adapter_model.safetensors``, the keys
  ``PeftModel.save_pretrained`` writes), which the inference backends load as
  a LoRA adapter; ``load_hf_weights`` reads such a directory back;
- ``state_dict`` / ``load_state_dict``: the adapter's LoRA tensors and its
  optimizer state (the base is the model directory's, never checkpointed).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from proxima.trainer.backends.base import StepStats, build_optimizer, read_hf_state_dict
from proxima.trainer.backends.torch_backend import (
    load_train_model,
    resolve_device,
    run_compute_logprobs,
    run_train_step,
)
from proxima.trainer.config import BatchingConfig, LoraConfig, OptimConfig, PPOConfig
from proxima.trainer.samples import Sample
from safetensors.torch import save_file
from torch import Tensor

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraBackend:
    """The base model of ``model_dir`` frozen, with one trainable LoRA adapter per name.

    ``self.model`` is the ``peft.PeftModel`` wrapping the base (peft injects
    the LoRA layers into the base modules in place, so every adapter shares
    the one copy of the base weights); ``self.optimizers[name]`` is adapter
    ``name``'s AdamW. Use :meth:`policy` to train or export one adapter.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lora: LoraConfig,
        ppo: PPOConfig,
        batching: BatchingConfig,
        optim: OptimConfig,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        if not lora.adapters:
            raise ValueError("LoraBackend needs at least one adapter in lora.adapters")
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.lora = lora
        self.ppo = ppo
        self.batching = batching
        self.optim_config = optim
        self.device = resolve_device(device)
        peft_config = PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; alpha/r takes any float
            target_modules=list(lora.target_modules),
            lora_dropout=lora.dropout,
            bias="none",
            task_type="CAUSAL_LM",
        )
        first, *others = lora.adapters
        base = load_train_model(self.model_dir, self.device, optim)
        base.requires_grad_(False)  # frozen: only LoRA parameters (added below) ever train
        try:
            self.model = get_peft_model(base, peft_config, adapter_name=first)
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(
                f"lora.target_modules={list(lora.target_modules)} does not fit {self.model_dir}: "
                f"{exc}; name linear layers of the model (e.g. q_proj, v_proj)"
            ) from exc
        for name in others:
            self.model.add_adapter(name, peft_config)
        self.optimizers = {
            name: build_optimizer(self.adapter_parameters(name), optim) for name in lora.adapters
        }
        self._activate(first)
        logger.info(
            "LoRA adapters ready",
            extra={"adapters": list(lora.adapters), "rank": lora.rank, "alpha": lora.alpha},
        )

    # ------------------------------------------------------------------ adapters

    def policy(self, adapter: str) -> AdapterPolicy:
        """The ``PPOBackend`` of one adapter (shares this model and compute)."""
        if adapter not in self.optimizers:
            raise KeyError(f"unknown adapter {adapter!r}; configured: {list(self.optimizers)}")
        return AdapterPolicy(self, adapter)

    def adapter_parameters(self, adapter: str) -> list[Tensor]:
        """The LoRA parameters of ``adapter`` (its ``lora_A`` and ``lora_B`` of every target)."""
        return [p for n, p in self.model.named_parameters() if _owner(n) == adapter]

    def base_parameters(self) -> list[tuple[str, Tensor]]:
        """The base model's parameters (frozen), by name."""
        return [(n, p) for n, p in self.model.named_parameters() if _owner(n) is None]

    def _activate(self, adapter: str) -> None:
        """Make ``adapter`` the one applied (and the only one with trainable parameters)."""
        if self.model.active_adapter != adapter:
            self.model.set_adapter(adapter)

    def compute_adapter_logprobs(
        self, adapter: str, samples: Sequence[Sample]
    ) -> list[list[float]]:
        """``TorchBackend.compute_logprobs`` with ``adapter`` applied."""
        self._activate(adapter)
        return run_compute_logprobs(self.model, samples, self.batching, self.device)

    def train_adapter_step(self, adapter: str, samples: Sequence[Sample]) -> StepStats:
        """PPO minibatch updates of ``adapter`` alone, with its own AdamW."""
        self._activate(adapter)
        return run_train_step(
            self.model,
            self.optimizers[adapter],
            samples,
            params=self.adapter_parameters(adapter),
            ppo=self.ppo,
            batching=self.batching,
            grad_clip=self.optim_config.grad_clip,
            device=self.device,
        )

    def export_adapter(self, adapter: str, out_dir: Path) -> None:
        """Write ``adapter`` in peft's format (the files ``save_pretrained`` writes for it)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, adapter_name=adapter)
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in state.items()},
            str(out_dir / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
        self.model.peft_config[adapter].save_pretrained(str(out_dir))

    def load_adapter_weights(self, adapter: str, adapter_dir: Path) -> None:
        """Load a peft directory written by :meth:`export_adapter` into ``adapter``."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import set_peft_model_state_dict

        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        expected = self.model.peft_config[adapter]
        assert isinstance(expected, PeftLoraConfig)
        # peft keeps a list of module names as a set; this backend always configures names.
        targets = sorted(expected.target_modules or ())
        if int(config["r"]) != expected.r or sorted(config["target_modules"]) != targets:
            raise ValueError(
                f"{adapter_dir}: rank {config['r']} on {sorted(config['target_modules'])}, but "
                f"lora is configured with rank {expected.r} on {targets}"
            )
        state = read_hf_state_dict(adapter_dir, device=str(self.device))
        result = set_peft_model_state_dict(self.model, state, adapter_name=adapter)
        missing = [k for k in result.missing_keys if _owner(k) == adapter]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{adapter_dir} does not match adapter {adapter!r}: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )

    def adapter_state_dict(self, adapter: str) -> dict[str, Any]:
        """``adapter``'s LoRA tensors (peft's keys) and its optimizer state."""
        from peft import get_peft_model_state_dict

        return {
            "adapter": get_peft_model_state_dict(self.model, adapter_name=adapter),
            "optimizer": self.optimizers[adapter].state_dict(),
        }

    def load_adapter_state_dict(self, adapter: str, state: dict[str, Any]) -> None:
        """Restore what :meth:`adapter_state_dict` returned."""
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state["adapter"], adapter_name=adapter)
        self.optimizers[adapter].load_state_dict(state["optimizer"])

    # ------------------------------------------------------------------ every adapter

    def state_dict(self) -> dict[str, Any]:
        """Every adapter's LoRA tensors and optimizer state, by adapter name."""
        return {name: self.adapter_state_dict(name) for name in self.optimizers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (every adapter it names)."""
        for name, adapter_state in state.items():
            self.load_adapter_state_dict(name, adapter_state)


class AdapterPolicy:
    """One adapter of a :class:`LoraBackend` as a ``PPOBackend`` (the loop's view of a policy)."""

    def __init__(self, backend: LoraBackend, adapter: str) -> None:
        self.backend = backend
        self.adapter = adapter

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Logprobs with this adapter applied (no grad)."""
        return self.backend.compute_adapter_logprobs(self.adapter, samples)

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        """PPO updates of this adapter only."""
        return self.backend.train_adapter_step(self.adapter, samples)

    def export_hf(self, out_dir: Path) -> None:
        """The adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``)."""
        self.backend.export_adapter(self.adapter, out_dir)

    def load_hf_weights(self, model_dir: Path) -> None:
        """Load a peft adapter directory into this adapter."""
        self.backend.load_adapter_weights(self.adapter, model_dir)

    def state_dict(self) -> dict[str, Any]:
        """This adapter's LoRA tensors and optimizer state."""
        return self.backend.adapter_state_dict(self.adapter)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.backend.load_adapter_state_dict(self.adapter, state)


def _owner(name: str) -> str | None:
    """The adapter a parameter of the peft model belongs to (None: the base).

    peft names a LoRA parameter ``<module>.lora_A.<adapter>.weight`` (``lora_B``
    likewise; embeddings ``<module>.lora_embedding_A.<adapter>``).
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None
