"""Float comparisons for the trainer tests that hold on any CPU.

Two computations of the same gradient (micro-batched or not, megatron or HF,
one process or data-parallel replicas) sum the same float32 terms in another
order, and another CPU (another SIMD width, another BLAS blocking) orders them
differently again. The error of an element is a few ulps of the *terms* summed,
not of the result, so a near-zero gradient element (a key bias, whose true
gradient is 0; an embedding row summed over many tokens) can carry noise that
is large relative to itself. Hence gradients are compared with an absolute
tolerance scaled by the largest gradient element (``GRAD_SCALE_ATOL``) plus a
relative one (``GRAD_RTOL``): 100x float32 noise, and still far below what a
wrong normalisation or a dropped micro-batch changes (percents of the largest
elements).

Weights after an optimizer step are *not* compared across two such
computations: AdamW's first step is ``lr * g / (|g| + eps)``, which turns the
noise of a near-zero ``g`` into an lr-sized difference. What is checked instead
is that the optimizer applied AdamW to the gradients it was given
(:func:`assert_adamw_applied`): an elementwise computation, equal to a few ulps
on any CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from proxima.trainer.config import OptimConfig
from torch import Tensor

GRAD_RTOL = 1e-4
GRAD_SCALE_ATOL = 1e-5  # times the largest |gradient element|


def assert_grads_close(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
    """Every gradient of ``expected`` is in ``actual`` and agrees up to summation order."""
    assert expected, "no gradients to compare"
    missing = expected.keys() - actual.keys()
    assert not missing, f"gradients missing: {sorted(missing)[:5]}"
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 0, "every expected gradient is zero"
    for key, want in expected.items():
        torch.testing.assert_close(
            actual[key], want, atol=GRAD_SCALE_ATOL * scale, rtol=GRAD_RTOL, msg=key
        )


def adamw_replay(
    initial: Mapping[str, Tensor], steps: Sequence[Mapping[str, Tensor]], optim: OptimConfig
) -> list[dict[str, Tensor]]:
    """The weights after each of ``steps`` AdamW steps from ``initial`` with the given gradients.

    Only the keys of the first step's gradients are trained (and returned).
    """
    params = {k: initial[k].detach().clone().requires_grad_(True) for k in steps[0]}
    optimizer = torch.optim.AdamW(
        params.values(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
    )
    out = []
    for grads in steps:
        for key, param in params.items():
            param.grad = grads[key].detach().clone()
        optimizer.step()
        out.append({k: p.detach().clone() for k, p in params.items()})
    return out


def assert_adamw_applied(
    updated: Mapping[str, Tensor], expected: Mapping[str, Tensor], optim: OptimConfig
) -> None:
    """``updated`` weights equal :func:`adamw_replay`'s to within float32 rounding.

    The bound is 1e-5 of the weight plus 1e-5 of ``lr``: some 80 ulps, room for another CPU's
    fused multiply-adds and vector paths over several steps, and still 100x smaller than one
    step's move (about ``lr`` per element), so a step not taken or taken twice fails.
    """
    assert expected
    for key, want in expected.items():
        torch.testing.assert_close(updated[key], want, atol=1e-5 * optim.lr, rtol=1e-5, msg=key)
