"""Per-token logprobs of a packed micro-batch through a Hugging Face causal LM.

The packed row holds several sequences back to back. Each must attend only to
its own earlier tokens, and its rotary positions must restart at 0, so the
result equals running every sequence alone.

Attention approach, by the model's ``config._attn_implementation``:

- ``proxima_varlen_sdpa`` (:func:`use_varlen_attention`; recommended without
  flash-attn, and what the torch backend uses on CPU): an attention function
  registered with HF's ``AttentionInterface`` that splits the packed row at
  ``cu_seqlens`` and runs causal SDPA on each sequence. Exact, no mask,
  ``O(sum L_s^2)`` attention; the projections and MLP still run once over the
  whole packed row.
- ``flash_attention_2`` / ``flash_attention_3``: the varlen kernel, given
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` (exact, ``O(sum L_s^2)``; GPU).
- ``sdpa`` and ``eager``: an explicit 4-D block-diagonal causal mask
  ``(1, 1, T, T)`` (boolean for SDPA, additive float for eager); HF passes a
  4-D mask through unchanged. Exact, but ``O(T^2)`` memory and attention
  FLOPs per micro-batch including the masked cross-sequence blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel

from .batching import PackedBatch
from .constrained import with_grammar_masks
from .loss import token_logprobs

VARLEN_SDPA = "proxima_varlen_sdpa"
_VARLEN_IMPLEMENTATIONS = (VARLEN_SDPA, "flash_attention_2", "flash_attention_3")


def varlen_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF attention function for a packed row: causal SDPA on each ``cu_seqlens`` segment.

    Shape: query ``(B, H, T, D)``, key/value ``(B, H_kv, T, D)`` (grouped-query
    heads are expanded by SDPA's ``enable_gqa``) -> ``(B, T, H, D)``, the layout
    HF attention functions return. With ``cu_seq_lens_q`` ``(S+1,)`` in kwargs
    (``B == 1``, from :func:`forward_logprobs`) each segment attends to itself
    only; without it every row is one causal sequence (right padding is then
    harmless for the real tokens; left padding is not supported, since HF builds
    no padding mask for this implementation).
    """
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"{VARLEN_SDPA} does not support sliding-window attention; this model needs "
            "attn_implementation='sdpa' or 'eager' in the trainer"
        )
    dropout_p = dropout if module.training else 0.0
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        bounds = [0, query.shape[2]]  # one causal sequence per row
    elif query.shape[0] != 1:
        raise ValueError(
            f"{VARLEN_SDPA} with cu_seq_lens_q needs one packed row, got {query.shape[0]}"
        )
    else:
        bounds = cu_seqlens.tolist()
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],  # (B, H, L_s, D)
            key[:, :, start:end],  # (B, H_kv, L_s, D)
            value[:, :, start:end],
            dropout_p=dropout_p,
            is_causal=True,
            scale=scaling,
            enable_gqa=True,
        )
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    attn_output = torch.cat(outputs, dim=2)  # (B, H, T, D)
    return attn_output.transpose(1, 2).contiguous(), None  # (B, T, H, D)


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)


def use_varlen_attention(model: PreTrainedModel) -> None:
    """Switch an HF model to :func:`varlen_sdpa_attention` (in place) for packed training."""
    model.set_attn_implementation(VARLEN_SDPA)


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


def _block_mask_for(implementation: str, packed: PackedBatch, dtype: torch.dtype) -> Tensor:
    """The 4-D block-diagonal causal mask in the form ``implementation`` expects."""
    allowed = block_causal_mask(packed.cu_seqlens)[None, None]  # (1, 1, T, T)
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        blocked = torch.full(
            allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=allowed.device
        )
        return torch.where(allowed, torch.zeros_like(blocked), blocked)  # additive mask
    raise ValueError(
        f"attention implementation {implementation!r} is not supported for packed sequences; "
        f"call use_varlen_attention(model) or load it with attn_implementation='{VARLEN_SDPA}', "
        "'sdpa', 'eager' or 'flash_attention_2'"
    )


def forward_logprobs(
    model: PreTrainedModel,
    packed: PackedBatch,
    temperature: float | Tensor | None = None,
    *,
    loss_tokens_only: bool = False,
) -> Tensor:
    """Logprob of every next-token target of a packed micro-batch.

    Runs one forward pass over the packed row (``position_ids`` restart per
    sequence; each sequence attends causally to itself only, by the approach
    of the module docstring) and returns
    ``log softmax(logits / T)[targets]``. Gradients flow unless the caller wraps
    the call in ``torch.no_grad()`` (proximal logprobs).

    Args:
        model: an HF causal LM (e.g. ``Qwen2ForCausalLM``).
        packed: the micro-batch, on the model's device.
        temperature: overrides the per-sequence sampling temperatures
            ``packed.temperatures`` when given (float or ``(T,)`` tensor).
        loss_tokens_only: project to the vocabulary only where ``loss_mask``
            is set (HF's ``logits_to_keep`` with indices); other entries are 0.
            The ``(T, V)`` logits of prompt tokens are never built, which for
            a large vocabulary is most of a training step's memory.

    Grammar-constrained targets (``packed.grammar_positions``) get the logprob of the
    masked, renormalised distribution the engine sampled them from
    (``proxima.trainer.constrained``).

    Returns:
        ``(T,)`` float32 logprobs, aligned with ``packed.targets``; entries at a
        sequence's last position are meaningless (``loss_mask`` is 0 there).
    """
    implementation = getattr(model.config, "_attn_implementation", "eager")
    attention: dict[str, Any]
    if implementation in _VARLEN_IMPLEMENTATIONS:
        max_length = max(packed.seq_lens)
        attention = {
            "cu_seq_lens_q": packed.cu_seqlens,
            "cu_seq_lens_k": packed.cu_seqlens,
            "max_length_q": max_length,
            "max_length_k": max_length,
        }
    else:
        dtype = model.dtype
        attention = {"attention_mask": _block_mask_for(implementation, packed, dtype)}
    temps = packed.temperatures if temperature is None else temperature
    keep: Tensor | None = None
    if loss_tokens_only:
        keep = packed.loss_mask.nonzero().squeeze(-1)  # (K,) positions that carry loss
        attention["logits_to_keep"] = keep
    outputs = model(
        input_ids=packed.input_ids[None],  # (1, T)
        position_ids=packed.position_ids[None],  # (1, T)
        use_cache=False,
        **attention,
    )
    logits = outputs.logits[0]  # (T, V), or (K, V) at the kept positions
    grammar = (packed.grammar_positions, packed.grammar_bitmask)
    if keep is None:
        plain = token_logprobs(logits, packed.targets, temps)  # (T,)
        return with_grammar_masks(plain, logits, packed.targets, grammar, temps, keep)
    kept_temps = temps
    if isinstance(temps, Tensor):
        kept_temps = torch.broadcast_to(temps, packed.targets.shape)[keep]  # (K,)
    kept = token_logprobs(logits, packed.targets[keep], kept_temps)  # (K,)
    plain = kept.new_zeros(packed.targets.shape).index_put((keep,), kept)  # (T,)
    return with_grammar_masks(plain, logits, packed.targets, grammar, temps, keep)
