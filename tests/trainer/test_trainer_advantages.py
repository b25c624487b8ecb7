"""Returns and advantages (``proxima.trainer.advantages``): hand-computed cases."""

from __future__ import annotations

import math

import pytest
from proxima.trainer.advantages import (
    UNGROUPED_GROUP,
    advantage_groups,
    discounted_returns,
    group_advantages,
)


def _adv(returns: dict[str, list[float]], **kw: object) -> dict[str, list[float]]:
    group = {sid: "g" for sid in returns}
    return group_advantages(returns, group, **kw)  # type: ignore[arg-type]


def test_discounted_returns_hand_computed() -> None:
    # G_3 = 2; G_2 = 0 + 0.9 * 2 = 1.8; G_1 = 1 + 0.9 * 1.8 = 2.62
    assert discounted_returns([1.0, 0.0, 2.0], 0.9) == pytest.approx([2.62, 1.8, 2.0])
    assert discounted_returns([1.0, 0.0, 2.0], 1.0) == pytest.approx([3.0, 2.0, 2.0])
    assert discounted_returns([], 0.9) == []


# Hand-computed tables. Notation: m_i session mean return, mu group mean of the m_i,
# sigma^2 = mean over sessions of (mean over its turns of (G - mu)^2).
GROUP_MEAN_STD_CASES = [
    # per-turn returns survive: a = [2.62, 1.8, 2.0], b = [0]
    # m_a = 6.42 / 3 = 2.14, m_b = 0, mu = 1.07
    # var_a = (1.55^2 + 0.73^2 + 0.93^2) / 3 = 3.8003 / 3 = 1.2667667; var_b = 1.07^2 = 1.1449
    # sigma = sqrt((1.2667667 + 1.1449) / 2) = sqrt(1.2058333) = 1.0981044
    (
        {"a": [2.62, 1.8, 2.0], "b": [0.0]},
        {"a": [1.55 / 1.0981044, 0.73 / 1.0981044, 0.93 / 1.0981044], "b": [-1.07 / 1.0981044]},
    ),
    # rewards [1, -1] and [0, 0] at gamma 1: returns [0, -1] and [0, 0] tie on G_1 = 0
    # m = -0.5, 0; mu = -0.25; var_a = (0.25^2 + 0.75^2) / 2 = 0.3125; var_b = 0.0625
    # sigma = sqrt(0.1875) = sqrt(3) / 4 -> A = 0.25 / sigma = 1/sqrt(3), -0.75 / sigma = -sqrt(3)
    (
        {"a": [0.0, -1.0], "b": [0.0, 0.0]},
        {"a": [1 / math.sqrt(3), -math.sqrt(3)], "b": [1 / math.sqrt(3), 1 / math.sqrt(3)]},
    ),
    # final reward only, gamma 1, different turn counts: exactly GRPO on R = [1, 0, 1, 0]
    # (mean 0.5, population std 0.5) whatever the number of turns
    (
        {"a": [1.0, 1.0, 1.0], "b": [0.0, 0.0], "c": [1.0], "d": [0.0, 0.0, 0.0, 0.0]},
        {"a": [1.0, 1.0, 1.0], "b": [-1.0, -1.0], "c": [1.0], "d": [-1.0] * 4},
    ),
    # one session alone with different turn returns: mu = 2, sigma = 1
    ({"a": [1.0, 3.0]}, {"a": [-1.0, 1.0]}),
]


@pytest.mark.parametrize(("returns", "expected"), GROUP_MEAN_STD_CASES)
def test_group_mean_std_hand_computed(
    returns: dict[str, list[float]], expected: dict[str, list[float]]
) -> None:
    adv = _adv(returns, baseline="group_mean", normalize_std=True)
    assert adv.keys() == expected.keys()
    for sid, values in expected.items():
        # Python floats (float64) against hand-computed values: rounding is ~1e-15.
        assert adv[sid] == pytest.approx(values, rel=1e-6, abs=1e-9)


def test_small_std_does_not_blow_up() -> None:
    # Two sessions succeed after 3 turns, two after 4, gamma 0.9, reward 1 at the end:
    # s1 = [0.81, 0.9, 1], s3 = [0.729, 0.81, 0.9, 1].
    # m_1 = 2.71 / 3 = 0.9033333, m_3 = 3.439 / 4 = 0.85975, mu = 0.8815417
    # var_1 = (0.0051170 + 0.0003407 + 0.0140324) / 3 = 0.0064967
    # var_3 = (0.0232689 + 0.0051170 + 0.0003407 + 0.0140324) / 4 = 0.0106898
    # sigma = sqrt((0.0064967 + 0.0106898) / 2) = 0.0926997
    # A(s3, t=1) = (0.729 - 0.8815417) / 0.0926997 = -1.6455; A(t=last) = 0.1184583 / 0.0927 = 1.2779
    # The episode-level std of G_1 = [0.81, 0.81, 0.729, 0.729] is 0.0405, which gave
    # (1 - 0.7695) / 0.0405 = 5.69 on the last turn.
    r1, r3 = discounted_returns([0, 0, 1], 0.9), discounted_returns([0, 0, 0, 1], 0.9)
    adv = _adv({"s1": r1, "s2": r1, "s3": r3, "s4": r3}, baseline="group_mean", normalize_std=True)
    assert adv["s3"][0] == pytest.approx(-1.64551, abs=1e-4)
    assert adv["s3"][-1] == pytest.approx(1.27785, abs=1e-4)
    assert max(abs(a) for v in adv.values() for a in v) <= math.sqrt(4 * 4 - 1)


def test_leave_one_out_hand_computed() -> None:
    # m_x = 1, m_y = 2, m_z = (6 + 4) / 2 = 5
    # b_x = (2 + 5) / 2 = 3.5; b_y = (1 + 5) / 2 = 3; b_z = (1 + 2) / 2 = 1.5
    adv = _adv(
        {"x": [1.0], "y": [2.0], "z": [6.0, 4.0]}, baseline="leave_one_out", normalize_std=False
    )
    assert adv == {"x": [-2.5], "y": [-1.0], "z": [4.5, 2.5]}


def test_equal_returns_give_exactly_zero() -> None:
    # 0.1 * 3 is not exactly representable: a float mean would leave a ~1e-17 "std".
    returns = {"a": [0.1, 0.1], "b": [0.1], "c": [0.1, 0.1, 0.1]}
    for baseline in ("group_mean", "leave_one_out"):
        for normalize in (True, False):
            adv = _adv(returns, baseline=baseline, normalize_std=normalize)
            assert adv == {"a": [0.0, 0.0], "b": [0.0], "c": [0.0, 0.0, 0.0]}
    # Episode returns tie (all G_1 = 0.1) but later turns differ: that is signal now.
    tied = _adv({"a": [0.1, 5.0], "b": [0.1]}, baseline="group_mean", normalize_std=False)
    assert tied["a"][1] > 0 > tied["a"][0]


def test_single_session_and_no_baseline() -> None:
    single = {"a": [1.0, 3.0]}
    assert _adv(single, baseline="leave_one_out", normalize_std=False) == {"a": [0.0, 0.0]}
    assert _adv(single, baseline="none", normalize_std=False) == {"a": [1.0, 3.0]}
    with pytest.raises(ValueError, match="baseline"):
        _adv(single, baseline="none", normalize_std=True)


def test_groups_are_normalised_independently() -> None:
    returns = {"a": [1.0], "b": [3.0], "c": [10.0], "d": [30.0], "e": []}
    group = {"a": "g1", "b": "g1", "c": "g2", "d": "g2", "e": "g2"}
    adv = group_advantages(returns, group, baseline="group_mean", normalize_std=True)
    assert adv == {"a": [-1.0], "b": [1.0], "c": [-1.0], "d": [1.0], "e": []}


def test_ungrouped_sessions_share_a_batch_baseline() -> None:
    ids = {"p1": None, "p2": None, "p3": None, "x": "q7"}
    pooled = advantage_groups(ids, ungrouped="batch")
    assert pooled == {
        "p1": UNGROUPED_GROUP,
        "p2": UNGROUPED_GROUP,
        "p3": UNGROUPED_GROUP,
        "x": "q7",
    }
    alone = advantage_groups(ids, ungrouped="alone")
    assert len({alone["p1"], alone["p2"], alone["p3"], alone["x"]}) == 4
    # Production rewards 1, 0, 0.5: batch mean 0.5, population std sqrt(1/6) = 0.4082483
    returns = {"p1": [1.0], "p2": [0.0], "p3": [0.5], "x": [2.0]}
    adv = group_advantages(returns, pooled, baseline="group_mean", normalize_std=True)
    assert adv["p1"] == pytest.approx([0.5 / 0.4082483])
    assert adv["p2"] == pytest.approx([-0.5 / 0.4082483])
    assert adv["p3"] == [0.0] and adv["x"] == [0.0]  # x: a group of one with one return
    # Alone, each is a group of one with one return: no signal.
    adv = group_advantages(returns, alone, baseline="group_mean", normalize_std=True)
    assert all(v == [0.0] for v in adv.values())
