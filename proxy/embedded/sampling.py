"""Next-token selection for the rows of a batch, with the logprob the trainer needs.

The recorded logprob is ``log_softmax(logits / T)`` at the chosen token: the
distribution the token was drawn from *before* top-p / top-k / min-p
truncation (what SGLang reports, and what the trainer recomputes with the same
temperature). Greedy rows use ``T = 1``. ``logits`` are the model's after the
request's penalties, grammar mask and logit bias (``proxy/embedded/logits.py``),
so a constrained row reports logprobs of the masked, renormalised distribution
it sampled from, as SGLang does; forbidden tokens' logprobs (``-inf``) are
reported as the float32 minimum so they stay valid JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from proxima.proxy.backends.protocol import SamplingParams


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One chosen token with its logprob and, if asked for, the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[float, int]] | None


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row. Shape: logits ``(B, V)``, temperatures ``(B,)``."""
    return torch.log_softmax(logits / temperatures.unsqueeze(-1), dim=-1)  # (B, V)


def effective_temperature(params: SamplingParams) -> float:
    """The temperature logprobs are computed with (1.0 for greedy requests)."""
    return 1.0 if params.is_greedy else params.temperature


def truncated_probs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after top-k, top-p and min-p truncation (unnormalised). Shape ``(V,)``."""
    probs = logprobs.exp()  # (V,)
    vocab = probs.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(mass_before < params.top_p, sorted_probs, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs


def _has_truncation(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row drawn from unnormalised ``probs`` ``(B, V)`` with ``uniforms`` ``(B,)``.

    The first index whose cumulative mass exceeds ``u * total``; zero-probability
    entries are never chosen (float64 keeps rounding at the top end away).
    """
    cdf = probs.double().cumsum(dim=-1)  # (B, V)
    targets = uniforms.double() * cdf[:, -1]  # (B,)
    index = torch.searchsorted(cdf, targets.unsqueeze(-1), right=True).squeeze(-1)  # (B,)
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(index, last_nonzero)


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    top_logprobs_nums: Sequence[int],
) -> list[SampledToken]:
    """Choose the next token of every row. Shape: logits ``(B, V)``.

    Greedy rows take the argmax of the raw logits, exactly as HF's greedy
    search. Sampling rows draw one uniform from their own generator (so a
    seeded request samples the same tokens whatever batch it runs in) and
    invert the CDF of their truncated distribution, all rows at once.
    """
    logits = logits.float()
    temperatures = torch.tensor([effective_temperature(p) for p in params])
    logprobs = scaled_logprobs(logits, temperatures)  # (B, V)
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)  # -inf (masked) -> finite
    tokens = logits.argmax(dim=-1)  # (B,)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        probs = logprobs[sampled].exp()  # (S, V)
        for row, i in enumerate(sampled):
            if _has_truncation(params[i]):
                probs[row] = truncated_probs(logprobs[i], params[i])
        uniforms = torch.cat([torch.rand(1, generator=generators[i]) for i in sampled])  # (S,)
        tokens[sampled] = _inverse_cdf(probs, uniforms)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()  # (B,)
    results = []
    for i, (token_id, logprob) in enumerate(zip(tokens.tolist(), chosen, strict=True)):
        top: list[tuple[float, int]] | None = None
        if top_logprobs_nums[i] > 0:
            values, ids = torch.topk(logprobs[i], min(top_logprobs_nums[i], logprobs.shape[-1]))
            top = list(zip(values.tolist(), ids.tolist(), strict=True))
        results.append(SampledToken(token_id=token_id, logprob=logprob, top_logprobs=top))
    return results


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded if ``seed`` is given, else from OS entropy."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
