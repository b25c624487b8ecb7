"""Completions sampled under a grammar / logit bias / penalties are context, never loss tokens."""

from __future__ import annotations

import math

import pytest
import torch
from proxima.proxy.store.records import CompletionRecord, SessionRecord
from proxima.trainer.config import AdvantageConfig
from proxima.trainer.logit_transforms import behaviour_logprobs_reproducible, logit_transforms
from proxima.trainer.loss import decoupled_ppo_loss
from proxima.trainer.samples import build_samples

from tests.trainer.records import completion_record, session_record


def _session(reward: float) -> SessionRecord:
    return session_record(reward=reward)


def _completion(
    cid: str,
    prompt: list[int],
    output: list[int],
    *,
    minute: int,
    parent: str | None = None,
    transforms: list[str] | None = None,
) -> CompletionRecord:
    sampling: dict[str, object] = {"temperature": 1.0}
    if transforms:
        sampling["logit_transforms"] = transforms
    return completion_record(cid, prompt, output, minute=minute, parent=parent, sampling=sampling)


@pytest.mark.parametrize(
    ("transforms", "reproducible"),
    [
        (None, True),
        (["grammar:json_schema"], False),
        (["grammar:structural_tag"], False),
        (["logit_bias"], False),
        (["frequency_penalty", "presence_penalty"], False),
    ],
)
def test_which_completions_are_reproducible(
    transforms: list[str] | None, reproducible: bool
) -> None:
    c = _completion("c", [1], [2], minute=0, transforms=transforms)
    assert logit_transforms(c) == (transforms or [])
    assert behaviour_logprobs_reproducible(c) is reproducible


def test_constrained_turn_is_context_in_the_chain() -> None:
    # c1 (plain) -> c2 (structured output) -> c3 (plain), one chain of tokens.
    completions = [
        _completion("c1", [1, 2], [3, 4], minute=1),
        _completion(
            "c2", [1, 2, 3, 4, 5], [6, 7], minute=2, parent="c1", transforms=["grammar:json_schema"]
        ),
        _completion("c3", [1, 2, 3, 4, 5, 6, 7, 8], [9], minute=3, parent="c2"),
    ]
    cfg = AdvantageConfig(discount=1.0, baseline="none", normalize_std=False)
    [sample] = build_samples([(_session(reward=2.0), completions)], cfg)
    assert sample.completion_ids == ("c1", "c3")
    assert sample.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 0, 0, 1]  # c2's tokens 6, 7: context
    assert sample.behav_logprobs == pytest.approx([0, 0, -0.5, -0.5, 0, 0, 0, 0, -0.5])
    assert sample.versions == [-1, -1, 0, 0, -1, -1, -1, -1, 0]
    # The constrained turn still counts in the returns: G_t = 2 for every turn (gamma = 1).
    assert sample.advantages == pytest.approx([0, 0, 2, 2, 0, 0, 0, 0, 2])


def test_a_session_of_only_constrained_turns_has_nothing_to_train() -> None:
    completions = [_completion("c1", [1], [2, 3], minute=1, transforms=["grammar:structural_tag"])]
    cfg = AdvantageConfig(baseline="none", normalize_std=False)
    assert build_samples([(_session(reward=1.0), completions)], cfg) == []


def test_masked_logprobs_would_give_a_wrong_weight_and_get_no_gradient() -> None:
    # One state, vocabulary of 3 with probabilities pi = (0.5, 0.3, 0.2); the grammar allows
    # tokens {1, 2}, so Z = 0.5 and the engine reports b = log(0.3 / 0.5) for token 1.
    # Hand-computed, on-policy (same weights): p = log 0.3, so w = exp(p - b) = Z = 0.5,
    # not 1: training that token would scale its gradient by 0.5 for no reason.
    pi = torch.tensor([0.5, 0.3, 0.2])
    z = float(pi[1:].sum())
    b = math.log(0.3 / z)
    p = math.log(0.3)
    assert math.exp(p - b) == pytest.approx(0.5)

    # Through build_samples the token gets loss mask 0: no loss, no gradient, w = 1 elsewhere.
    completions = [
        _completion("c1", [1], [2], minute=1),
        _completion("c2", [1, 2, 3], [4], minute=2, parent="c1", transforms=["grammar:regex"]),
    ]
    completions[1].output_logprobs[:] = [b]
    cfg = AdvantageConfig(discount=1.0, baseline="none", normalize_std=False)
    [sample] = build_samples([(_session(reward=1.0), completions)], cfg)
    trained = torch.tensor(sample.loss_mask, dtype=torch.bool)  # (L,)
    behav = torch.tensor(sample.behav_logprobs)  # (L,)
    current = torch.tensor([0.0, -0.5, 0.0, p], requires_grad=True)  # (L,) l = p on token 4
    prox = torch.where(trained, behav, current.detach())  # on-policy: p = b where trained
    loss, stats = decoupled_ppo_loss(
        current,
        prox,
        behav,
        torch.tensor(sample.advantages),
        torch.tensor(sample.loss_mask),
        eps_clip=0.2,
        total_loss_tokens=sample.num_loss_tokens,
    )
    loss.backward()
    assert sample.loss_mask == [0, 1, 0, 0]
    assert current.grad is not None
    assert float(current.grad[3]) == 0.0  # the constrained token has no gradient
    assert float(current.grad[1]) == pytest.approx(-1.0)  # -A * ratio / N = -1 * 1 / 1
    assert float(stats.importance_weight_mean) == pytest.approx(1.0)
