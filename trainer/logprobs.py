"""Per-token logprobs of a packed micro-batch through a Hugging Face causal LM.

The packed row holds several sequences back to back. Each must attend only to
its own earlier tokens, and its rotary positions must restart at 0, so the
result equals running every sequence alone.

Attention approach, by the model's ``config._attn_implementation``:

- ``flash_attention_2`` / ``flash_attention_3``: no mask; HF derives
  ``cu_seqlens`` from the restarting ``position_ids`` and calls the varlen
  kernel (exact and ``O(sum L_s^2)``; GPU).
- ``sdpa`` and ``eager`` (CPU, or GPU without flash-attn): an explicit 4-D
  block-diagonal causal mask ``(1, 1, T, T)`` (boolean for SDPA, additive
  float for eager). HF passes a 4-D mask through unchanged. This is exact but
  costs ``O(T^2)`` memory and attention FLOPs per micro-batch, including the
  masked cross-sequence blocks; keep ``max_tokens_per_mb`` moderate there.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .batching import PackedBatch
from .loss import token_logprobs

_VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def block_causal_mask(cu_seqlens: Tensor) -> Tensor:
    """Boolean block-diagonal causal mask of a packed row: True where query i may attend key j.

    ``mask[i, j] = (seq(i) == seq(j)) and (j <= i)``.
    Shape: cu_seqlens ``(S+1,)`` -> ``(T, T)`` with ``T = cu_seqlens[-1]``.
    """
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (S,)
    seq_of = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=cu_seqlens.device), lengths.long()
    )  # (T,)
    same_seq = seq_of[:, None] == seq_of[None, :]  # (T, T)
    return torch.tril(same_seq)  # (T, T) causal within each block


def _attention_mask(model: nn.Module, packed: PackedBatch, dtype: torch.dtype) -> Tensor | None:
    implementation = getattr(model.config, "_attn_implementation", "eager")
    if implementation in _VARLEN_IMPLEMENTATIONS:
        return None  # HF detects packing from position_ids and uses varlen attention
    allowed = block_causal_mask(packed.cu_seqlens)[None, None]  # (1, 1, T, T)
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        blocked = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
        return torch.where(allowed, torch.zeros_like(blocked), blocked)  # additive mask
    raise ValueError(
        f"attention implementation {implementation!r} is not supported for packed sequences; "
        "load the model with attn_implementation='sdpa', 'eager' or 'flash_attention_2'"
    )


def forward_logprobs(
    model: nn.Module, packed: PackedBatch, temperature: float | Tensor | None = None
) -> Tensor:
    """Logprob of every next-token target of a packed micro-batch.

    Runs one forward pass over the packed row (``position_ids`` restart per
    sequence, block-diagonal causal attention) and returns
    ``log softmax(logits / T)[targets]``. Gradients flow unless the caller wraps
    the call in ``torch.no_grad()`` (proximal logprobs).

    Args:
        model: an HF causal LM (e.g. ``Qwen2ForCausalLM``).
        packed: the micro-batch, on the model's device.
        temperature: overrides the per-sequence sampling temperatures
            ``packed.temperatures`` when given (float or ``(T,)`` tensor).

    Returns:
        ``(T,)`` float32 logprobs, aligned with ``packed.targets``; entries at a
        sequence's last position are meaningless (``loss_mask`` is 0 there).
    """
    embed = model.get_input_embeddings()
    dtype = embed.weight.dtype
    outputs = model(
        input_ids=packed.input_ids[None],  # (1, T)
        position_ids=packed.position_ids[None],  # (1, T)
        attention_mask=_attention_mask(model, packed, dtype),
        use_cache=False,
    )
    logits = outputs.logits[0]  # (T, V)
    temps = packed.temperatures if temperature is None else temperature
    return token_logprobs(logits, packed.targets, temps)  # (T,)
