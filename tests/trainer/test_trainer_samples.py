"""Sessions -> samples: returns, group advantages, chain building, staleness."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from proxima.proxy.store.records import CompletionRecord, SessionKind, SessionRecord, SessionStatus
from proxima.trainer.config import AdvantageConfig
from proxima.trainer.samples import (
    Sample,
    build_samples,
    discounted_returns,
    filter_stale,
    group_advantages,
)

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _session(sid: str, group: str | None = "g", reward: float | None = None) -> SessionRecord:
    return SessionRecord(
        id=sid,
        kind=SessionKind.TRAIN,
        status=SessionStatus.CLAIMED,
        group_id=group,
        data_id=None,
        metadata={},
        reward=reward,
        created_at=T0,
    )


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
    return CompletionRecord(
        id=cid,
        session_id=session,
        parent_id=parent,
        prompt_ids=list(prompt),
        output_ids=list(output),
        output_logprobs=[-0.1 * (k + 1) for k in range(len(output))],
        output_versions=[version] * len(output),
        finish_reason="stop",
        created_at=T0 + timedelta(minutes=minute),
        sampling={"temperature": temperature},
        reward=reward,
    )


# --------------------------------------------------------------------------- returns


def test_discounted_returns_hand_computed() -> None:
    # G_3 = 2; G_2 = 0 + 0.9 * 2 = 1.8; G_1 = 1 + 0.9 * 1.8 = 2.62
    assert discounted_returns([1.0, 0.0, 2.0], 0.9) == pytest.approx([2.62, 1.8, 2.0])
    assert discounted_returns([1.0, 0.0, 2.0], 1.0) == pytest.approx([3.0, 2.0, 2.0])
    assert discounted_returns([], 0.9) == []


def test_group_mean_std_advantages_keep_per_turn_rewards() -> None:
    returns = {"a": [2.62, 1.8, 2.0], "b": [0.0]}
    adv = group_advantages(returns, {"a": "g", "b": "g"}, baseline="group_mean", normalize_std=True)
    # R = [2.62, 0]; b = 1.31; population std = 1.31
    # a: [(2.62 - 1.31), (1.8 - 1.31), (2.0 - 1.31)] / 1.31 = [1.0, 0.374046, 0.526718]
    # b: (0 - 1.31) / 1.31 = -1
    assert adv["a"] == pytest.approx([1.0, 0.49 / 1.31, 0.69 / 1.31])
    assert adv["b"] == pytest.approx([-1.0])
    assert len(set(adv["a"])) == 3  # different per-turn returns stay different


def test_leave_one_out_hand_computed() -> None:
    returns = {"x": [1.0], "y": [2.0], "z": [6.0, 4.0]}
    group = dict.fromkeys(returns, "g")
    adv = group_advantages(returns, group, baseline="leave_one_out", normalize_std=False)
    # b_x = (2 + 6) / 2 = 4; b_y = (1 + 6) / 2 = 3.5; b_z = (1 + 2) / 2 = 1.5
    assert adv == {"x": [-3.0], "y": [-1.5], "z": [4.5, 2.5]}


def test_zero_variance_group_gets_zero_advantage() -> None:
    # 0.1 * 3 is not exactly representable: a float mean would leave a ~1e-17 "std".
    returns = {"a": [0.1, 5.0], "b": [0.1], "c": [0.1, -1.0, 0.1]}
    group = dict.fromkeys(returns, "g")
    for baseline in ("group_mean", "leave_one_out"):
        for normalize in (True, False):
            adv = group_advantages(returns, group, baseline=baseline, normalize_std=normalize)
            assert adv == {"a": [0.0, 0.0], "b": [0.0], "c": [0.0, 0.0, 0.0]}


def test_single_session_groups() -> None:
    single = {"a": [1.0, 3.0]}
    loo = group_advantages(single, {"a": "a"}, baseline="leave_one_out", normalize_std=False)
    assert loo == {"a": [0.0, 0.0]}  # nothing to compare against
    raw = group_advantages(single, {"a": "a"}, baseline="none", normalize_std=False)
    assert raw == {"a": [1.0, 3.0]}  # no baseline: A_t = G_t
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(single, {"a": "a"}, baseline="none", normalize_std=True)


def test_groups_are_normalised_independently() -> None:
    returns = {"a": [1.0], "b": [3.0], "c": [10.0], "d": [30.0]}
    group = {"a": "g1", "b": "g1", "c": "g2", "d": "g2"}
    adv = group_advantages(returns, group, baseline="group_mean", normalize_std=True)
    assert adv == {"a": [-1.0], "b": [1.0], "c": [-1.0], "d": [1.0]}


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


def test_mismatched_logprobs_are_rejected() -> None:
    bad = CompletionRecord(
        id="c", session_id="s", parent_id=None, prompt_ids=[1], output_ids=[2, 3],
        output_logprobs=[-1.0], output_versions=[0, 0], finish_reason="stop", created_at=T0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="2 output_ids but 1 logprobs"):
        build_samples([(_session("s"), [bad])], AdvantageConfig())


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


def test_filter_stale_drops_by_oldest_trained_token() -> None:
    samples = [_sample_with_versions(v) for v in ([10, 9], [8, 10], [7, 10], [10])]
    # current 10, eta 2: keep oldest >= 8
    kept, dropped = filter_stale(samples, current_version=10, max_staleness=2)
    assert [s.oldest_version for s in kept] == [9, 8, 10]
    assert dropped == 1
    kept, dropped = filter_stale(samples, current_version=10, max_staleness=0)  # synchronous
    assert [s.oldest_version for s in kept] == [10] and dropped == 3


def test_sample_rejects_misaligned_lists() -> None:
    with pytest.raises(ValueError, match="advantages has 1 entries"):
        Sample("s", "g", [1, 2], [0, 1], [0.0, 0.0], [-1, 0], [0.0], 1.0)
