"""Training backends: the model, its optimizer and weight export behind one interface.

- ``base``: the interface (:class:`~proxima.trainer.backends.base.PPOBackend`)
  and what every backend shares (minibatch and micro-batch plan, loss inputs,
  optimizer, gradient clipping, HF weight reading);
- ``torch_backend``: :class:`~proxima.trainer.backends.torch_backend.TorchBackend`,
  an HF model on the CPU or one GPU;
- ``megatron``: megatron-core (tensor x data parallel under torchrun), behind
  :class:`~proxima.trainer.backends.megatron.MegatronPPOBackend`.

:func:`build_backend` picks by ``cfg.backend``.
"""

from __future__ import annotations

from pathlib import Path

from proxima.trainer.backends.base import PPOBackend
from proxima.trainer.config import TrainerConfig


def build_backend(cfg: TrainerConfig, model_dir: str | Path) -> PPOBackend:
    """The backend ``cfg.backend`` names, loaded from ``model_dir``."""
    if cfg.backend == "megatron":
        from proxima.trainer.backends.megatron import MegatronPPOBackend

        return MegatronPPOBackend(model_dir, cfg)
    from proxima.trainer.backends.torch_backend import TorchBackend

    return TorchBackend(
        model_dir,
        ppo=cfg.ppo,
        batching=cfg.batching,
        optim=cfg.optim,
        device=cfg.device,
        seed=cfg.seed,
    )
