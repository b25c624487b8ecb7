"""Start-up recovery: settle a step that died around its push, release claims, plan the resume.

The rule itself (which of checkpoint, pushed weights and pending step wins)
is ``proxima.trainer.weights``'; this module applies it against the store:
:func:`recover` runs before the backend loads, :func:`settle_pending_step`
also when a push raised but may have landed.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from proxima.proxy.store import SessionStatus, Store
from proxima.trainer.log import policy_home
from proxima.trainer.weights import (
    ResumePlan,
    clear_pending,
    latest_checkpoint,
    lost_push,
    plan_resume,
    read_pending,
    weights_dir,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovery:
    """Where the trainer resumes, and what recovery did on the way."""

    plan: ResumePlan
    released: int  # claims released (this trainer's, and the checkpoint writer's)
    settled: int  # sessions marked TRAINED by settling a pending step


async def recover(
    store: Store, output_dir: Path, trainer_id: str, adapter: str | None = None
) -> Recovery:
    """Settle a pending step, release stale claims and plan the resume (``weights`` rule).

    Of one policy: the base (``adapter`` None), or an adapter, whose pending
    step and checkpoints are in its home and whose version is its own.
    """
    pushed_version = await store.current_policy_version(adapter=adapter)
    home = policy_home(output_dir, adapter)
    checkpoint = latest_checkpoint(home)
    lost = lost_push(read_pending(home), pushed_version, output_dir, checkpoint, adapter)
    if lost:  # its sessions are released below and trained again
        logger.warning(
            "version %s was pushed from memory and lost before its export: resuming from the "
            "newest weights below it, its sessions trained again",
            pushed_version,
        )
        clear_pending(home)
        settled = 0
    else:
        settled = await settle_pending_step(store, output_dir, pushed_version, adapter)
    released = await store.release_claims(trainer_id=trainer_id)
    if checkpoint is not None and checkpoint.state.trainer_id != trainer_id:
        logger.warning(
            "checkpoint was written by trainer %r, now running as %r; releasing both's claims",
            checkpoint.state.trainer_id,
            trainer_id,
        )
        released += await store.release_claims(trainer_id=checkpoint.state.trainer_id)
    records = await store.list_policy_versions(adapter=adapter)
    plan = plan_resume(
        output_dir=output_dir,
        checkpoint=checkpoint,
        pushed_version=pushed_version,
        pushed_paths=[(r.version, r.path) for r in records],
        adapter=adapter,
        lost=lost,
    )
    return Recovery(plan=plan, released=released, settled=settled)


async def settle_pending_step(
    store: Store, output_dir: Path, pushed_version: int, adapter: str | None = None
) -> int:
    """Rule 1 of ``proxima.trainer.weights``: finish or undo a step that died around its push.

    Of one policy (``pushed_version`` is its version). Returns the number of
    sessions marked TRAINED now.
    """
    home = policy_home(output_dir, adapter)
    pending = read_pending(home)
    if pending is None:
        return 0
    marked = 0
    if pending.version <= pushed_version:
        still_claimed = []
        for session_id in pending.session_ids:
            session = await store.get_session(session_id=session_id)
            if (
                session is not None
                and session.status == SessionStatus.CLAIMED
                and session.claimed_by == pending.trainer_id
            ):
                still_claimed.append(session_id)
        await store.mark_sessions(
            session_ids=still_claimed,
            status=SessionStatus.TRAINED,
            trained_version=pending.version,
        )
        marked = len(still_claimed)
        logger.info(
            "pending step settled: its push landed",
            extra={"version": pending.version, "marked": marked},
        )
    else:
        undo = weights_dir(output_dir, pending.version, adapter)
        if undo.exists():
            shutil.rmtree(undo)
        logger.info(
            "pending step undone: its push never landed", extra={"version": pending.version}
        )
    clear_pending(home)
    return marked
