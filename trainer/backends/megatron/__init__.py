"""The megatron-core training backend (CPU with gloo, or GPUs; tensor x data parallel).

- ``model``: the GPTModel built from an HF Llama/Qwen2 config;
- ``convert``: HF <-> megatron weights, tensor-parallel sharding, HF export;
- ``backend``: ``MegatronBackend``, the forward logprobs and the AdamW step;
- ``ppo``: :class:`MegatronPPOBackend`, the trainer's backend interface over it;
- ``compat``: what megatron-core needs to run on CPU (gloo, an RNG tracker,
  a device shim) and the torchrun process groups.

Importing this package does not import megatron-core; ``ppo`` does on first use.
"""

from proxima.trainer.backends.megatron.ppo import MegatronPPOBackend

__all__ = ["MegatronPPOBackend"]
