"""The torch training backend: an HF causal LM in float32 with AdamW, on the CPU or one GPU.

:class:`TorchBackend` implements ``proxima.trainer.backends.base.PPOBackend``
with the exact packed attention of ``proxima.trainer.logprobs``; the step's
plan (minibatches, micro-batches, loss inputs), the optimizer, clipping and HF
weight reading are ``proxima.trainer.backends.base``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from proxima.trainer.backends.base import (
    StepStats,
    build_optimizer,
    check_loaded_keys,
    clip_grad_norm,
    copy_tokenizer_files,
    logprobs_by_sample,
    loss_inputs,
    micro_batches,
    ppo_loss_fn,
    read_hf_state_dict,
    split_minibatches,
    step_stats,
)
from proxima.trainer.batching import pack
from proxima.trainer.config import BatchingConfig, OptimConfig, PPOConfig
from proxima.trainer.logprobs import forward_logprobs, use_varlen_attention
from proxima.trainer.loss import PPOStats
from proxima.trainer.samples import Sample
from torch import Tensor
from transformers import AutoModelForCausalLM

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the first GPU when there is one, else CPU; otherwise ``torch.device(device)``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; set device = cpu")
    return resolved


def load_train_model(model_dir: Path, device: torch.device, optim: OptimConfig) -> Any:
    """The HF causal LM of ``model_dir`` in float32 on ``device``, with exact packed attention."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device)  # type: ignore[arg-type]  # HF's stub of .to() takes a model
    use_varlen_attention(model)
    if optim.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def run_compute_logprobs(
    model: Any, samples: Sequence[Sample], batching: BatchingConfig, device: torch.device
) -> list[list[float]]:
    """Token-aligned logprobs of each sample under ``model``, no grad, at loss tokens only."""
    model.eval()
    with torch.no_grad():
        return logprobs_by_sample(
            samples,
            batching,
            lambda packed: forward_logprobs(model, packed.to(device), loss_tokens_only=True),
        )


def run_train_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    *,
    params: Sequence[Tensor],
    ppo: PPOConfig,
    batching: BatchingConfig,
    grad_clip: float | None,
    device: torch.device,
) -> StepStats:
    """``ppo.ppo_minibatches`` steps of ``optimizer`` over ``params`` (``base``'s plan).

    ``params`` are the parameters whose gradients are clipped (those
    ``optimizer`` steps): the whole model, or one LoRA adapter.
    """
    if not samples:
        raise ValueError("train_step needs at least one sample")
    model.train()
    stats: list[PPOStats] = []
    losses: list[Tensor] = []
    grad_norms: list[float] = []
    minibatches = split_minibatches(samples, ppo.ppo_minibatches)
    for k, minibatch in enumerate(minibatches):
        total_loss_tokens = sum(s.num_loss_tokens for s in minibatch)
        loss_fn = ppo_loss_fn(ppo, total_loss_tokens)
        optimizer.zero_grad(set_to_none=True)
        mb_stats = []
        for indices in micro_batches(minibatch, batching):
            packed = pack([minibatch[i] for i in indices]).to(device)
            logprobs = forward_logprobs(model, packed, loss_tokens_only=True)  # (T,)
            loss, loss_stats = loss_fn(logprobs, **loss_inputs(packed, first_minibatch=k == 0))
            loss.backward()  # micro-batch losses sum to the minibatch token mean
            mb_stats.append(loss_stats)
        grad_norms.append(clip_grad_norm(params, grad_clip))
        optimizer.step()
        merged = PPOStats.merge(mb_stats)
        losses.append(merged.loss)
        stats.extend(mb_stats)
    optimizer.zero_grad(set_to_none=True)
    return step_stats(stats, losses, grad_norms)


class TorchBackend:
    """An HF causal LM in float32 with AdamW, on the CPU or one GPU.

    The model runs with ``proxima_varlen_sdpa`` attention (exact packed
    sequences, see ``proxima.trainer.logprobs``). Dropout should be 0 in the model
    config (HF's default for Qwen2/Llama): proximal and current logprobs are
    then the same function of the weights, so the first minibatch starts at
    ``ratio = 1`` exactly.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        ppo: PPOConfig,
        batching: BatchingConfig,
        optim: OptimConfig,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.ppo = ppo
        self.batching = batching
        self.optim_config = optim
        self.device = resolve_device(device)
        self.model = load_train_model(self.model_dir, self.device, optim)
        self.optimizer = build_optimizer(self.model.parameters(), optim)
        logger.info(
            "torch backend ready",
            extra={"model_dir": str(self.model_dir), "device": str(self.device)},
        )

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Token-aligned logprobs of each sample with the current weights (no grad).

        Computed at loss tokens only (the generated ones, where PPO reads them);
        every other entry is 0.0.
        """
        return run_compute_logprobs(self.model, samples, self.batching, self.device)

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        """``ppo.ppo_minibatches`` AdamW steps (see the module docstring)."""
        return run_train_step(
            self.model,
            self.optimizer,
            samples,
            params=list(self.model.parameters()),
            ppo=self.ppo,
            batching=self.batching,
            grad_clip=self.optim_config.grad_clip,
            device=self.device,
        )

    def export_hf(self, out_dir: Path) -> None:
        """``save_pretrained`` (safetensors; tied weights stored once) plus tokenizer files."""
        self.model.save_pretrained(out_dir, safe_serialization=True)
        copy_tokenizer_files(self.model_dir, out_dir)

    def hf_tensors(self) -> Iterable[tuple[str, Tensor]]:
        """The HF model's state dict, by HF name (``InMemoryWeights``)."""
        return self.model.state_dict().items()  # type: ignore[no-any-return]

    def load_hf_weights(self, model_dir: Path) -> None:
        """Load every ``*.safetensors`` file of ``model_dir`` into the model (all weights needed)."""
        state = read_hf_state_dict(model_dir, device=str(self.device))
        result = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if self.model.config.tie_word_embeddings:
            tied.add("lm_head.weight")
        check_loaded_keys(
            result, what=f"{model_dir} does not match the model", ignore=tied.__contains__
        )
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state (tensors stay on their device)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore model and optimizer state saved by :meth:`state_dict`."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
