"""Admission of training sessions (``proxima.proxy.policies.staleness``): the boundary and groups."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from proxima.proxy.policies.staleness import admit, staleness_capacity
from proxima.proxy.testing.live import LiveProxy

# (admitted_so_far, version, eta, B) -> admitted?   capacity = (i + eta + 1) * B
BOUNDARY = [
    (7, 0, 1, 4, True),  # 7 < (0 + 1 + 1) * 4 = 8
    (8, 0, 1, 4, False),  # 8 == 8: full (the rule is <, not <=)
    (9, 0, 1, 4, False),
    (11, 1, 1, 4, True),  # version 1: capacity 12
    (12, 1, 1, 4, False),
    (0, 0, 0, 1, True),  # synchronous, B = 1: one session per version
    (1, 0, 0, 1, False),
    (1, 1, 0, 1, True),
]


@pytest.mark.parametrize(("admitted", "version", "eta", "batch", "expected"), BOUNDARY)
def test_capacity_boundary(
    admitted: int, version: int, eta: int, batch: int, expected: bool
) -> None:
    decision = admit(
        admitted_so_far=admitted,
        open_sessions=0,
        version=version,
        max_staleness=eta,
        batch_size=batch,
        max_open_sessions=100,
    )
    assert decision.admitted is expected
    assert (
        staleness_capacity(version=version, max_staleness=eta, batch_size=batch)
        == (version + eta + 1) * batch
    )
    if not expected:
        assert "staleness capacity reached" in decision.reason


def test_a_group_member_follows_its_admitted_group() -> None:
    full = dict(admitted_so_far=8, version=0, max_staleness=1, batch_size=4)
    assert not admit(**full, open_sessions=0, max_open_sessions=100).admitted
    joined = admit(**full, open_sessions=0, max_open_sessions=100, joins_admitted_group=True)
    assert joined.admitted
    # the open-session cap still applies to group members
    capped = admit(**full, open_sessions=5, max_open_sessions=5, joins_admitted_group=True)
    assert not capped.admitted and "open" in capped.reason
    assert admit(**{**full, "max_staleness": None}, open_sessions=0, max_open_sessions=9).admitted


def test_groups_are_admitted_as_a_unit_through_the_proxy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    live = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=["--max-staleness", "0", "--train-batch-size", "2"],
    ).start()
    try:

        def create(**body: object) -> httpx.Response:
            return httpx.post(
                live.url + "/rl/sessions", json=body, headers=live.admin_headers(), timeout=30
            )

        assert create(group_id="A").status_code == 200  # N = 0 < 2
        assert create(group_id="A").status_code == 200  # N = 1 < 2
        assert create(group_id="A").status_code == 200  # N = 2, capacity 2: A was admitted
        refused = create(group_id="B")  # a new group at capacity
        assert refused.status_code == 429 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "staleness_capacity"
        assert create().status_code == 429  # an ungrouped session is a group of its own
    finally:
        live.stop()
