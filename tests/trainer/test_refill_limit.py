"""``advantage.refill_limit``: a bound on what ``zero_signal = "refill"`` samples for one step.

Once the screen has dropped ``refill_limit`` sessions toward a step, the step trains the
groups with signal it holds (fewer than ``batch_size``), or, holding none, takes no
optimizer step and pushes nothing; without the bound the same step waits for a full batch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxima.proxy.store import SessionStatus, Store
from proxima.trainer.loop import Trainer

from tests.trainer.test_loop import RecordingSink, _cfg, add_session, statuses


async def _trainer(store: Store, model_dir: Path, tmp_path: Path, limit: int | None) -> Trainer:
    advantage = {"zero_signal": "refill", "refill_limit": limit}
    cfg = _cfg(tmp_path, model_dir, max_staleness=0, advantage=advantage)
    return await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)


async def test_the_limit_lets_a_short_batch_train(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tied = [await add_session(store, group="tied", reward=1.0, versions=[0, 0]) for _ in range(2)]
    signal = [await add_session(store, group="g", reward=float(i), versions=[0, 0]) for i in (1, 0)]
    trainer = await _trainer(store, tiny_model_dir, tmp_path, limit=2)
    record = await asyncio.wait_for(trainer.step(), 60)
    await trainer.close()
    assert record is not None and record.pushed and record.version == 1
    assert (record.sessions, record.trained_sessions, record.dropped_sessions) == (4, 2, 2)
    assert await statuses(store, tied) == [(SessionStatus.DROPPED, None)] * 2
    assert await statuses(store, signal) == [(SessionStatus.TRAINED, 1)] * 2


async def test_the_limit_with_nothing_held_is_a_step_without_a_push(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tied = [
        await add_session(store, group=f"tied{g}", reward=1.0, versions=[0, 0])
        for g in range(2)
        for _ in range(2)
    ]
    trainer = await _trainer(store, tiny_model_dir, tmp_path, limit=4)
    record = await asyncio.wait_for(trainer.step(), 60)
    await trainer.close()
    assert record is not None and not record.pushed and record.ppo == {}
    assert (record.sessions, record.trained_sessions, record.dropped_sessions) == (4, 0, 4)
    assert record.reward_mean == 1.0  # the curve still counts the rollouts
    assert await statuses(store, tied) == [(SessionStatus.DROPPED, None)] * 4


async def test_without_the_limit_the_same_step_waits_for_a_full_batch(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    for _ in range(2):
        await add_session(store, group="tied", reward=1.0, versions=[0, 0])
    signal = [await add_session(store, group="g", reward=float(i), versions=[0, 0]) for i in (1, 0)]
    trainer = await _trainer(store, tiny_model_dir, tmp_path, limit=None)
    step = asyncio.create_task(trainer.step())
    for _ in range(100):
        if (await statuses(store, signal))[0][0] is SessionStatus.CLAIMED:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # several polls: still short of batch_size 4
    assert not step.done()
    step.cancel()
    await trainer.close()
