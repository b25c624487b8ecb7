"""Token selection: truncation rules with hand-computed expectations, greedy, seeding."""

from __future__ import annotations

import math

import pytest
import torch
from proxima.proxy.backends.protocol import SamplingParams
from proxima.proxy.embedded.sampling import (
    make_generator,
    sample_batch,
    scaled_logprobs,
    truncated_probs,
)

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])
LOGPROBS = PROBS.log()


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        ({}, [0.05, 0.5, 0.15, 0.3]),
        ({"top_k": 2}, [0.0, 0.5, 0.0, 0.3]),  # the two largest
        ({"top_p": 0.7}, [0.0, 0.5, 0.0, 0.3]),  # mass before 0.3 is 0.5 < 0.7; before 0.15 is 0.8
        ({"top_p": 0.45}, [0.0, 0.5, 0.0, 0.0]),  # mass before 0.3 is 0.5, not < 0.45
        ({"min_p": 0.4}, [0.0, 0.5, 0.0, 0.3]),  # keep p >= 0.4 * 0.5 = 0.2
        ({"top_k": 3, "min_p": 0.5}, [0.0, 0.5, 0.0, 0.3]),  # top 3, then p >= 0.25
    ],
)
def test_truncation(options: dict[str, float], kept: list[float]) -> None:
    probs = truncated_probs(LOGPROBS, SamplingParams(**options))
    # float32 exp of float32 logs: a few ulps of each probability, on any CPU below 1e-5
    assert probs.tolist() == pytest.approx(kept, abs=1e-5)


def test_scaled_logprobs_per_row_temperature() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    logprobs = scaled_logprobs(logits, torch.tensor([1.0, 0.5]))
    # Row 2 is log_softmax([2, 4, 6]): log(e^6 / (e^2 + e^4 + e^6)).
    # float32 against float64 hand values: a few float32 ulps, bounded at 1e-5 for any CPU
    assert float(logprobs[1, 2]) == pytest.approx(
        6 - math.log(math.exp(2) + math.exp(4) + math.exp(6)), rel=1e-5, abs=1e-6
    )
    assert float(logprobs[0, 2]) == pytest.approx(
        3 - math.log(math.exp(1) + math.exp(2) + math.exp(3)), rel=1e-5, abs=1e-6
    )


def test_greedy_takes_argmax_and_reports_its_logprob() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5]])
    [token] = sample_batch(logits, [SamplingParams(temperature=0)], [make_generator(None)], [2])
    logprobs = torch.log_softmax(logits[0], dim=-1)
    assert token.token_id == 1
    assert token.logprob == pytest.approx(float(logprobs[1]))
    assert token.top_logprobs is not None
    assert [t for _, t in token.top_logprobs] == [1, 3]


def test_sampling_respects_truncation_and_seed() -> None:
    params = SamplingParams(temperature=1.0, top_k=2, sampling_seed=123)
    logits = LOGPROBS.unsqueeze(0)

    def draw(generator: torch.Generator) -> list[int]:
        return [sample_batch(logits, [params], [generator], [0])[0].token_id for _ in range(200)]

    draws = draw(make_generator(123))
    assert set(draws) == {1, 3}
    assert 0.5 < draws.count(1) / 200 < 0.8  # 0.5 / (0.5 + 0.3) = 0.625
    assert draw(make_generator(123)) == draws


def test_rows_sample_independently_of_their_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.8, sampling_seed=1),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.9),
    ]
    batch = sample_batch(
        logits, params, [make_generator(7), make_generator(None), make_generator(9)], [0, 0, 0]
    )
    alone = sample_batch(logits[2:], params[2:], [make_generator(9)], [0])
    assert batch[2] == alone[0]
    assert batch[1].token_id == int(logits[1].argmax())
    expected = torch.log_softmax(logits[0] / 0.8, dim=-1)[batch[0].token_id]
    assert batch[0].logprob == pytest.approx(float(expected))
