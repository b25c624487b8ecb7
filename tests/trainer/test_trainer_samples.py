"""Sessions -> samples: chain building, temperatures, validation, staleness, zero signal.

Returns and advantages themselves: ``test_trainer_advantages.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import pytest
from proxima.proxy.store.records import CompletionRecord, SessionRecord
from proxima.trainer.config import AdvantageConfig
from proxima.trainer.samples import (
    Sample,
    build_samples,
    filter_stale,
    logprob_temperature,
    session_problem,
    zero_signal_filter,
)

from tests.trainer.records import T0, completion_record, session_record


def _session(sid: str, group: str | None = "g", reward: float | None = None) -> SessionRecord:
    return session_record(sid, group=group, reward=reward)


def _completion(
    cid: str,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    minute: int,
    parent: str | None = None,
    reward: float | None = None,
    version: int = 0,
    temperature: float = 1.0,
    session: str = "s",
) -> CompletionRecord:
    return completion_record(
        cid,
        prompt,
        output,
        minute=minute,
        parent=parent,
        session=session,
        version=version,
        logprobs=[-0.1 * (k + 1) for k in range(len(output))],
        sampling={"temperature": temperature},
        reward=reward,
    )


# --------------------------------------------------------------------------- sequences


def _branching_session() -> tuple[SessionRecord, list[CompletionRecord]]:
    """c1 -> c2 (extends) -> c4 (does not extend: prompt rewritten); c1 -> c3 (extends, branch).

    Tokens: c1 prompt [1, 2], output [3, 4]; c2 prompt [1, 2, 3, 4, 5], output [6];
    c3 prompt [1, 2, 3, 4, 7], output [8, 9]; c4 prompt [50, 6], output [51].
    """
    completions = [
        _completion("c1", [1, 2], [3, 4], minute=1, reward=1.0, version=3),
        _completion("c3", [1, 2, 3, 4, 7], [8, 9], minute=3, parent="c1", version=5),
        _completion("c2", [1, 2, 3, 4, 5], [6], minute=2, parent="c1", version=4),
        _completion("c4", [50, 6], [51], minute=4, parent="c2", version=6),
    ]
    return _session("s", group=None, reward=2.0), completions


def test_chain_building_with_branch_trains_each_completion_once() -> None:
    cfg = AdvantageConfig(discount=0.5, baseline="none", normalize_std=False)
    samples = build_samples([_branching_session()], cfg)
    # Turns by created_at: c1, c2, c3, c4 with r = [1, 0, 0, 0 + 2 (session reward)]
    # G_4 = 2; G_3 = 0 + 0.5 * 2 = 1; G_2 = 0 + 0.5 * 1 = 0.5; G_1 = 1 + 0.5 * 0.5 = 1.25
    assert [s.completion_ids for s in samples] == [("c1", "c2"), ("c3",), ("c4",)]
    first, branch, restart = samples

    assert first.input_ids == [1, 2, 3, 4, 5, 6]
    assert first.loss_mask == [0, 0, 1, 1, 0, 1]
    assert first.behav_logprobs == pytest.approx([0, 0, -0.1, -0.2, 0, -0.1])
    assert first.versions == [-1, -1, 3, 3, -1, 4]
    assert first.advantages == pytest.approx([0, 0, 1.25, 1.25, 0, 0.5])
    assert first.oldest_version == 3

    # c1 is shared with the first path: here it is context only (mask 0).
    assert branch.input_ids == [1, 2, 3, 4, 7, 8, 9]
    assert branch.loss_mask == [0, 0, 0, 0, 0, 1, 1]
    assert branch.versions == [-1, -1, -1, -1, -1, 5, 5]
    assert branch.advantages == pytest.approx([0, 0, 0, 0, 0, 1.0, 1.0])

    # c4 rewrote its prompt, so it starts its own sequence.
    assert restart.input_ids == [50, 6, 51]
    assert restart.loss_mask == [0, 0, 1]
    assert restart.advantages == pytest.approx([0, 0, 2.0])
    assert all(s.group_id == "s" for s in samples)  # no group_id: the session is its own group


def test_individual_mode_one_sequence_per_completion() -> None:
    cfg = AdvantageConfig(sample_mode="individual", baseline="none", normalize_std=False)
    samples = build_samples([_branching_session()], cfg)
    assert [s.completion_ids for s in samples] == [("c1",), ("c2",), ("c3",), ("c4",)]
    assert samples[1].input_ids == [1, 2, 3, 4, 5, 6]
    assert samples[1].loss_mask == [0, 0, 0, 0, 0, 1]
    assert sum(s.num_loss_tokens for s in samples) == 6  # 2 + 1 + 2 + 1 generated tokens


def test_temperature_change_breaks_the_chain() -> None:
    completions = [
        _completion("c1", [1], [2], minute=1, temperature=1.0),
        _completion("c2", [1, 2, 3], [4], minute=2, parent="c1", temperature=0.7),
    ]
    samples = build_samples([(_session("s", reward=1.0), completions)], AdvantageConfig())
    assert [(s.completion_ids, s.temperature) for s in samples] == [(("c1",), 1.0), (("c2",), 0.7)]


def test_group_advantages_through_build_samples() -> None:
    sessions = [
        (_session("win", reward=1.0), [_completion("w1", [1], [2, 3], minute=1, session="win")]),
        (_session("lose", reward=0.0), [_completion("l1", [1], [4], minute=1, session="lose")]),
    ]
    samples = build_samples(sessions, AdvantageConfig())  # group_mean, normalize_std
    # R = [1, 0]: mean 0.5, std 0.5 -> A = +1, -1
    assert [s.advantages for s in samples] == [[0.0, 1.0, 1.0], [0.0, -1.0]]


def test_ungrouped_sessions_get_a_batch_baseline() -> None:
    # Three production sessions (no group_id) with rewards 1, 0, 0: pooled, mean 1/3,
    # population std sqrt(2) / 3 = 0.4714045 -> A = (2/3) / 0.4714 = sqrt(2), -(1/3) / 0.4714
    sessions = [
        (
            _session(sid, group=None, reward=r),
            [_completion(sid + "c", [1], [2], minute=i, session=sid)],
        )
        for i, (sid, r) in enumerate([("p1", 1.0), ("p2", 0.0), ("p3", 0.0)])
    ]
    samples = build_samples(sessions, AdvantageConfig())
    assert [s.advantages[1] for s in samples] == pytest.approx(
        [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]
    )
    alone = build_samples(sessions, AdvantageConfig(ungrouped="alone"))
    assert [s.advantages[1] for s in alone] == [0.0, 0.0, 0.0]  # groups of one


# Temperatures the logprobs were reported at (SGLang: T < 1e-6 -> T = 1, top_k = 1; the
# embedded engine: T < 1e-5 -> T = 1): requested -> reported.
LOGPROB_TEMPERATURES = [(0.0, 1.0), (1e-6, 1.0), (1e-5, 1e-5), (0.7, 0.7), (1.0, 1.0)]


@pytest.mark.parametrize(("requested", "reported"), LOGPROB_TEMPERATURES)
def test_greedy_completions_train_at_temperature_one(requested: float, reported: float) -> None:
    c = _completion("c", [1], [2, 3], minute=1, temperature=requested)
    assert logprob_temperature(c) == reported
    (sample,) = build_samples([(_session("s", reward=1.0), [c])], AdvantageConfig())
    assert sample.temperature == reported


def test_greedy_and_unit_temperature_turns_chain() -> None:
    # Both report logprobs at T = 1, so the child continues its parent's sequence.
    completions = [
        _completion("c1", [1], [2], minute=1, temperature=0.0),
        _completion("c2", [1, 2, 3], [4], minute=2, parent="c1", temperature=1.0),
    ]
    (sample,) = build_samples([(_session("s", reward=1.0), completions)], AdvantageConfig())
    assert sample.completion_ids == ("c1", "c2") and sample.temperature == 1.0


def _record(**overrides: object) -> CompletionRecord:
    fields: dict = dict(
        id="c", session_id="s", parent_id=None, prompt_ids=[1], output_ids=[2, 3],
        output_logprobs=[-1.0, -0.5], output_versions=[0, 0], finish_reason="stop",
        created_at=T0, sampling={"temperature": 1.0},
    )  # fmt: skip
    fields.update(overrides)
    return CompletionRecord(**fields)


INVALID_RECORDS = [
    ({"output_logprobs": [-1.0]}, "2 output_ids but 1 logprobs"),
    ({"output_versions": [0]}, "1 versions"),
    ({"output_logprobs": [-1.0, float("nan")]}, "not a finite value <= 0"),
    ({"output_logprobs": [-1.0, float("-inf")]}, "not a finite value <= 0"),
    ({"output_logprobs": [-1.0, 0.5]}, "not a finite value <= 0"),
    ({"output_ids": [2, -3]}, "outside the vocabulary"),
    ({"output_ids": [2, 300]}, r"outside the vocabulary \[0, 256\)"),
    ({"sampling": {"temperature": -1.0}}, "temperature -1.0"),
    ({"sampling": {"temperature": float("inf")}}, "temperature inf"),
]


@pytest.mark.parametrize(("overrides", "message"), INVALID_RECORDS)
def test_records_that_cannot_be_trained_are_named(overrides: dict, message: str) -> None:
    bad = _record(**overrides)
    assert session_problem([_record(id="ok")], vocab_size=256) is None
    problem = session_problem([_record(id="ok"), bad], vocab_size=256)
    assert problem is not None and problem.startswith("completion c:")
    assert re.search(message, problem)


def test_build_samples_names_the_bad_session() -> None:
    bad = _record(output_logprobs=[-1.0])
    with pytest.raises(ValueError, match="session s: completion c: 2 output_ids but 1 logprobs"):
        build_samples([(_session("s"), [bad])], AdvantageConfig())


def test_rounding_above_zero_is_accepted() -> None:
    # float32 logprobs of a near-certain token can round to +1e-7.
    assert session_problem([_record(output_logprobs=[1e-7, -0.5])], vocab_size=256) is None


def _sample_with_versions(versions: list[int]) -> Sample:
    n = len(versions) + 1
    return Sample(
        session_id="s",
        group_id="g",
        input_ids=list(range(n)),
        loss_mask=[0] + [1] * len(versions),
        behav_logprobs=[0.0] * n,
        versions=[-1, *versions],
        advantages=[0.0] * n,
        temperature=1.0,
    )


def test_filter_stale_sample_rule_drops_by_oldest_trained_token() -> None:
    samples = [_sample_with_versions(v) for v in ([10, 9], [8, 10], [7, 10], [10])]
    # current 10, eta 2: keep oldest >= 8
    kept, dropped = filter_stale(samples, current_version=10, max_staleness=2, rule="sample")
    assert [s.oldest_version for s in kept] == [9, 8, 10]
    assert dropped == 1
    kept, dropped = filter_stale(samples, 10, 0, rule="sample")  # synchronous
    assert [s.oldest_version for s in kept] == [10] and dropped == 3


# versions of the trained tokens -> loss mask after the token rule at current 10, eta 2
# (bound: version >= 8); None: the sample is dropped
TOKEN_RULE = [
    ([10, 9], [0, 1, 1]),
    ([7, 8, 10], [0, 0, 1, 1]),  # an interrupted completion keeps its recent tokens
    ([6, 7], None),
    ([8], [0, 1]),  # exactly eta behind: kept (the bound is inclusive)
]


@pytest.mark.parametrize(("versions", "mask"), TOKEN_RULE)
def test_filter_stale_token_rule_masks_only_stale_tokens(
    versions: list[int], mask: list[int] | None
) -> None:
    sample = _sample_with_versions(versions)
    kept, dropped = filter_stale([sample], current_version=10, max_staleness=2)
    if mask is None:
        assert (kept, dropped) == ([], 1)
    else:
        assert dropped == 0 and kept[0].loss_mask == mask
        assert kept[0].versions == sample.versions  # versions unchanged: stats read the mask


def _sample_with_advantages(sid: str, advantages: list[float]) -> Sample:
    n = len(advantages) + 1
    return Sample(
        session_id=sid,
        group_id="g",
        input_ids=list(range(n)),
        loss_mask=[0] + [1] * len(advantages),
        behav_logprobs=[0.0] * n,
        versions=[-1] + [0] * len(advantages),
        advantages=[5.0, *advantages],  # the prompt token's value is not trained: ignored
        temperature=1.0,
    )


# samples' trained advantages -> (kept session ids, removed count) per mode
ZERO_SIGNAL_CASES = [
    ([[1.0, 1.0], [0.0], [0.0, -0.5]], "filter", ["s0", "s2"], 1),
    ([[1.0, 1.0], [0.0], [0.0, -0.5]], "skip", ["s0", "s1", "s2"], 0),
    ([[1.0, 1.0], [0.0], [0.0, -0.5]], "keep", ["s0", "s1", "s2"], 0),
    ([[0.0, 0.0], [0.0]], "filter", [], 2),
    ([[0.0, 0.0], [0.0]], "skip", [], 2),
    ([[0.0, 0.0], [0.0]], "keep", ["s0", "s1"], 0),
]


@pytest.mark.parametrize(("advantages", "mode", "kept_ids", "removed"), ZERO_SIGNAL_CASES)
def test_zero_signal_filter(
    advantages: list[list[float]], mode: str, kept_ids: list[str], removed: int
) -> None:
    samples = [_sample_with_advantages(f"s{i}", a) for i, a in enumerate(advantages)]
    kept, count = zero_signal_filter(samples, mode)  # type: ignore[arg-type]
    assert [s.session_id for s in kept] == kept_ids and count == removed


def test_sample_rejects_misaligned_lists() -> None:
    with pytest.raises(ValueError, match="advantages has 1 entries"):
        Sample("s", "g", [1, 2], [0, 1], [0.0, 0.0], [-1, 0], [0.0], 1.0)
