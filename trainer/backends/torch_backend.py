"""The torch training backend: an HF causal LM in float32 with AdamW, on the CPU or one GPU.

:class:`TorchBackend` implements ``proxima.trainer.backends.base.PPOBackend``
with the exact packed attention of ``proxima.trainer.logprobs``; the step's
plan (minibatches, micro-batches, loss inputs), the optimizer, clipping and HF
weight reading are ``proxima.trainer.backends.base``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.to(self.device)  # type: ignore[arg-type]  # HF's stub of .to() takes a model
        use_varlen_attention(self.model)
        if optim.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
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
        self.model.eval()
        with torch.no_grad():
            return logprobs_by_sample(
                samples,
                self.batching,
                lambda packed: forward_logprobs(
                    self.model, packed.to(self.device), loss_tokens_only=True
                ),
            )

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        """``ppo.ppo_minibatches`` AdamW steps (see the module docstring)."""
        if not samples:
            raise ValueError("train_step needs at least one sample")
        self.model.train()
        stats: list[PPOStats] = []
        losses: list[Tensor] = []
        grad_norms: list[float] = []
        minibatches = split_minibatches(samples, self.ppo.ppo_minibatches)
        for k, minibatch in enumerate(minibatches):
            total_loss_tokens = sum(s.num_loss_tokens for s in minibatch)
            loss_fn = ppo_loss_fn(self.ppo, total_loss_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            mb_stats = []
            for indices in micro_batches(minibatch, self.batching):
                packed = pack([minibatch[i] for i in indices]).to(self.device)
                logprobs = forward_logprobs(self.model, packed, loss_tokens_only=True)  # (T,)
                loss, loss_stats = loss_fn(logprobs, **loss_inputs(packed, first_minibatch=k == 0))
                loss.backward()  # micro-batch losses sum to the minibatch token mean
                mb_stats.append(loss_stats)
            grad_norms.append(clip_grad_norm(self.model.parameters(), self.optim_config.grad_clip))
            self.optimizer.step()
            merged = PPOStats.merge(mb_stats)
            losses.append(merged.loss)
            stats.extend(mb_stats)
        self.optimizer.zero_grad(set_to_none=True)
        return step_stats(stats, losses, grad_norms)

    def export_hf(self, out_dir: Path) -> None:
        """``save_pretrained`` (safetensors; tied weights stored once) plus tokenizer files."""
        self.model.save_pretrained(out_dir, safe_serialization=True)
        copy_tokenizer_files(self.model_dir, out_dir)

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
