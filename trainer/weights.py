"""Weight versions on disk, checkpoints, and the recovery rule; the push re-exported.

Layout of ``output_dir``::

    weights/v{n}/               HF checkpoint of policy version n (config, safetensors, tokenizer)
    checkpoints/step-{s:08d}/   trainer_state.json + state.pt (model and optimizer)
    pending.json                the step being pushed: its version and the sessions it trains
    train_log.jsonl             one record per step (``proxima.trainer.log``)
    adapters/<adapter>/         a LoRA adapter's own policy home ([trainer.lora] adapters):
        v{n}/                   its version n, peft's files (adapter_config.json,
                                adapter_model.safetensors)
        checkpoints/, pending.json, train_log.jsonl   as above, for this adapter alone
    .tmp-*                      partial writes; removed at start-up

Everything below holds per policy: the base model's files are the top level,
an adapter's are its home (:func:`policy_home`); the store keeps a version
sequence per policy, so the rule reads ``P`` of that policy.

The push to the proxy (``WeightSink``, ``ProxyWeightSink``, ``PushResult``,
``WeightPushError``) is ``proxima.trainer.weight_push``'s, importable from here too.

Every directory is written under a temporary name in the same parent, its
files fsynced, then renamed into place (``os.rename`` is atomic within one
file system), so a reader (the proxy loading ``weights/v{n}``, a restarted
trainer reading a checkpoint) never sees a partial one.

Recovery rule (applied at start-up by ``proxima.trainer.loop``). Let ``P`` be the
newest policy version recorded in the store (the proxy records a version only
after its backends loaded it, so ``P`` is the last pushed version) and ``C``
the newest checkpoint (version ``c``, step ``s``):

1. Pending step. ``pending.json`` is written before a push and removed once
   the step's sessions are marked TRAINED. If it names version ``n <= P``,
   the push landed but the trainer died before marking: its sessions (still
   CLAIMED by this trainer) are marked TRAINED into ``n`` now. If ``n > P``
   the push never landed: ``weights/v{n}`` is deleted and the sessions are
   released by step 2 and trained again (no pushed version contains them).
   A push from the trainer's memory (``[trainer.weights] transport = "broadcast"``)
   writes ``weights/v{n}`` only after the proxy took it (``exported`` false in the
   pending step), on the compute thread before the next step trains, and marks the
   sessions only then. A trainer that died in between leaves ``n = P`` with neither
   ``weights/vP`` nor a checkpoint at ``P``: version ``P``'s weights were lost with it (the
   backends serve them, nothing holds them to train on), so its sessions are released and
   trained again as if the push had not landed, and step 3 resumes from the newest export
   or checkpoint below ``P`` (exported before step ``P`` trained), still labelled version
   ``P`` so the next push is ``P + 1``. Until that push the backends serve the lost
   weights: their tokens train one step off-policy, as stale tokens do (the importance
   ratio corrects them).
2. ``release_claims(trainer_id)``: sessions of a step that died before its
   push go back to FINISHED and are claimed again.
3. Weights and version (:func:`plan_resume`):

   - no checkpoint and ``P = 0``: the initial model, version 0, step 0;
   - ``c = P``: model and optimizer from ``C``;
   - ``c < P``, or no checkpoint and ``P > 0`` (the trainer pushed steps after
     its last checkpoint): the model from the pushed weights of ``P``
     (``weights/vP``, else the path the store recorded), the optimizer from
     ``C`` when there is one (AdamW moments ``P - c`` steps old) or fresh;
     version ``P``, step ``s + (P - c)``;
   - version ``P`` lost (rule 1): the newest of ``C`` and ``weights/v{e}``, ``e < P``
     (model and optimizer from ``C`` when ``c >= e``, else the model from ``v{e}``
     and the optimizer from ``C`` or fresh; the initial model when neither), as version
     ``P``;
   - ``c > P``: refused. The checkpoint is ahead of what the proxy serves
     (another database, or a reset store); resuming would push a version
     the proxy rejects or skip versions.

So a restarted trainer's next push is ``P + 1`` (never the same version
twice), no pushed step is lost (its weights are on disk; a push from memory's
only for the seconds its export takes, and then its sessions are trained again),
and no session is trained twice (TRAINED sessions are never claimable again, and
released sessions are in no weights the trainer resumes from).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from proxima.trainer.log import ADAPTERS_DIR, policy_home
from proxima.trainer.weight_push import ProxyWeightSink, PushResult, WeightPushError, WeightSink

__all__ = [
    "CHECKPOINTS_DIR",
    "PENDING_FILE",
    "STATE_FILE",
    "TENSORS_FILE",
    "WEIGHTS_DIR",
    "Checkpoint",
    "PendingStep",
    "ProxyWeightSink",
    "PushResult",
    "RecoveryError",
    "ResumePlan",
    "TrainerState",
    "WeightPushError",
    "WeightSink",
    "atomic_dir",
    "clear_pending",
    "export_weights",
    "exported_versions",
    "latest_checkpoint",
    "lost_push",
    "marker_file",
    "plan_resume",
    "prune_weights",
    "read_pending",
    "remove_partial_writes",
    "save_checkpoint",
    "weights_dir",
    "write_pending",
]

logger = logging.getLogger(__name__)

WEIGHTS_DIR = "weights"
CHECKPOINTS_DIR = "checkpoints"
PENDING_FILE = "pending.json"
STATE_FILE = "trainer_state.json"
TENSORS_FILE = "state.pt"
_TMP_PREFIX = ".tmp-"


class RecoveryError(RuntimeError):
    """The trainer's saved state and the proxy's version cannot be reconciled."""


# --------------------------------------------------------------------------- atomic directories


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary directory next to ``final``; on success rename it to ``final``.

    An existing ``final`` is replaced (removed first). On an exception the
    temporary directory is removed and ``final`` is left as it was.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_partial_writes(output_dir: Path) -> int:
    """Delete ``.tmp-*`` leftovers of a crashed run (every policy's); how many were removed."""
    removed = 0
    homes = [output_dir, *sorted((output_dir / ADAPTERS_DIR).glob("*"))]
    parents = [p for home in homes for p in (home, home / WEIGHTS_DIR, home / CHECKPOINTS_DIR)]
    for parent in parents:
        if not parent.is_dir():
            continue
        for path in parent.glob(f"{_TMP_PREFIX}*"):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
    return removed


# --------------------------------------------------------------------------- weight versions


def _versions_root(output_dir: Path, adapter: str | None) -> Path:
    return output_dir / WEIGHTS_DIR if adapter is None else policy_home(output_dir, adapter)


def weights_dir(output_dir: Path, version: int, adapter: str | None = None) -> Path:
    """Where a policy's ``version`` is exported: ``<output_dir>/weights/v{version}`` (the
    base), ``<output_dir>/adapters/<adapter>/v{version}`` (an adapter)."""
    return _versions_root(output_dir, adapter) / f"v{version}"


def marker_file(adapter: str | None) -> str:
    """The file every complete export of the policy has: HF's config, or peft's."""
    return "config.json" if adapter is None else "adapter_config.json"


def export_weights(
    output_dir: Path, version: int, write: Callable[[Path], None], adapter: str | None = None
) -> Path:
    """Export a policy's ``version`` atomically; ``write(dir)`` writes its files into ``dir``
    (HF's config and safetensors; an adapter's peft config and safetensors)."""
    final = weights_dir(output_dir, version, adapter).resolve()
    marker = marker_file(adapter)
    with atomic_dir(final) as tmp:
        write(tmp)
        if not any(tmp.glob("*.safetensors")) or not (tmp / marker).is_file():
            raise RuntimeError(f"export of version {version} wrote no {marker}/*.safetensors")
    return final


def exported_versions(output_dir: Path, adapter: str | None = None) -> list[int]:
    """Versions of a policy with a complete export directory, ascending."""
    root = _versions_root(output_dir, adapter)
    if not root.is_dir():
        return []
    versions = []
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith("v") and path.name[1:].isdigit():
            versions.append(int(path.name[1:]))
    return sorted(versions)


def prune_weights(
    output_dir: Path, *, keep: int, served_version: int, adapter: str | None = None
) -> list[int]:
    """Delete a policy's exports but the newest ``keep`` and ``served_version``; return deleted."""
    versions = exported_versions(output_dir, adapter)
    kept = set(versions[-keep:]) | {served_version}
    deleted = [v for v in versions if v not in kept]
    for version in deleted:
        shutil.rmtree(weights_dir(output_dir, version, adapter), ignore_errors=True)
    if deleted:
        logger.info("pruned weight versions", extra={"deleted": deleted})
    return deleted


# --------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class TrainerState:
    """Where a trainer is: the policy version its weights are, and steps taken."""

    trainer_id: str
    version: int
    step: int


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory on disk."""

    path: Path
    state: TrainerState

    def load_tensors(self) -> dict[str, Any]:
        """The backend state (model + optimizer) on the CPU."""
        tensors: dict[str, Any] = torch.load(
            self.path / TENSORS_FILE, map_location="cpu", weights_only=True
        )
        return tensors


def save_checkpoint(output_dir: Path, state: TrainerState, backend_state: dict[str, Any]) -> Path:
    """Write ``checkpoints/step-{step}`` atomically, then delete older checkpoints."""
    final = output_dir / CHECKPOINTS_DIR / f"step-{state.step:08d}"
    with atomic_dir(final) as tmp:
        torch.save(backend_state, tmp / TENSORS_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state)), encoding="utf-8")
    for older in (output_dir / CHECKPOINTS_DIR).glob("step-*"):
        if older.is_dir() and older.name < final.name:
            shutil.rmtree(older, ignore_errors=True)
    logger.info("checkpoint saved", extra={"path": str(final), **asdict(state)})
    return final


def latest_checkpoint(output_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint, or None."""
    root = output_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return None
    for path in sorted(root.glob("step-*"), reverse=True):
        state_file = path / STATE_FILE
        if path.is_dir() and state_file.is_file() and (path / TENSORS_FILE).is_file():
            state = TrainerState(**json.loads(state_file.read_text(encoding="utf-8")))
            return Checkpoint(path=path, state=state)
    return None


# --------------------------------------------------------------------------- pending step


@dataclass(frozen=True)
class PendingStep:
    """A step between its weight export and marking its sessions TRAINED."""

    trainer_id: str
    version: int
    session_ids: list[str]
    exported: bool = True  # weights/v{version} written before the push (else after it)


def write_pending(output_dir: Path, pending: PendingStep) -> None:
    """Record the step about to push (atomically: write a temp file, then rename)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f"{_TMP_PREFIX}{PENDING_FILE}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(pending), f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, output_dir / PENDING_FILE)


def read_pending(output_dir: Path) -> PendingStep | None:
    """The pending step of a run that died mid-push, or None."""
    path = output_dir / PENDING_FILE
    if not path.is_file():
        return None
    return PendingStep(**json.loads(path.read_text(encoding="utf-8")))


def clear_pending(output_dir: Path) -> None:
    """The step is complete (sessions marked)."""
    (output_dir / PENDING_FILE).unlink(missing_ok=True)


# --------------------------------------------------------------------------- resume


@dataclass(frozen=True)
class ResumePlan:
    """What the trainer loads at start-up (rule 3 of the module docstring)."""

    source: Literal["initial", "checkpoint", "pushed"]
    version: int
    step: int
    checkpoint: Checkpoint | None  # model+optimizer ("checkpoint") or optimizer only ("pushed")
    weights_path: Path | None  # HF weights to load ("pushed")


def plan_resume(
    *,
    output_dir: Path,
    checkpoint: Checkpoint | None,
    pushed_version: int,
    pushed_paths: Sequence[tuple[int, str | None]] = (),
    adapter: str | None = None,
    lost: bool = False,
) -> ResumePlan:
    """Apply the recovery rule to one policy (the base, or ``adapter``).

    ``pushed_paths`` are the store's ``(version, path)`` records of that policy;
    ``lost``: version ``pushed_version`` was pushed from memory and lost before its export
    (rule 1).
    """
    if checkpoint is None and pushed_version == 0:
        return ResumePlan("initial", 0, 0, None, None)
    if lost:
        return _resume_below(output_dir, checkpoint, pushed_version, adapter)
    if checkpoint is not None:
        c = checkpoint.state.version
        if c > pushed_version:
            raise RecoveryError(
                f"checkpoint {checkpoint.path} is at version {c} but the proxy's store has "
                f"version {pushed_version}: the trainer is pointed at another database (or the "
                "store was reset); use the matching --db, or another output_dir to start over"
            )
        if c == pushed_version:
            return ResumePlan("checkpoint", c, checkpoint.state.step, checkpoint, None)
    local = weights_dir(output_dir, pushed_version, adapter)
    recorded = dict(pushed_paths).get(pushed_version)
    if (local / marker_file(adapter)).is_file():
        path = local
    elif recorded is not None and Path(recorded).is_dir():
        path = Path(recorded)
    else:
        raise RecoveryError(
            f"the proxy serves version {pushed_version} but its weights are neither in {local} "
            f"nor at the recorded path {recorded!r}; restore that directory to resume"
        )
    step = (
        checkpoint.state.step + (pushed_version - checkpoint.state.version)
        if checkpoint is not None
        else pushed_version
    )
    return ResumePlan("pushed", pushed_version, step, checkpoint, path)


def _resume_below(
    output_dir: Path, checkpoint: Checkpoint | None, version: int, adapter: str | None
) -> ResumePlan:
    """Rule 3 when ``version`` was lost: the newest weights below it, labelled ``version``."""
    marker = marker_file(adapter)
    exports = [
        v
        for v in exported_versions(output_dir, adapter)
        if v < version and (weights_dir(output_dir, v, adapter) / marker).is_file()
    ]
    c = checkpoint.state.version if checkpoint is not None else -1
    e = exports[-1] if exports else -1
    if checkpoint is not None and c >= e:
        return ResumePlan("checkpoint", version, checkpoint.state.step, checkpoint, None)
    if e < 0:
        return ResumePlan("initial", version, 0, None, None)
    step = checkpoint.state.step + (e - c) if checkpoint is not None else e
    return ResumePlan("pushed", version, step, checkpoint, weights_dir(output_dir, e, adapter))


def lost_push(
    pending: PendingStep | None,
    pushed_version: int,
    output_dir: Path,
    checkpoint: Checkpoint | None,
    adapter: str | None = None,
) -> bool:
    """Whether ``pending`` is a push from memory that landed and whose weights were lost
    (rule 1): version ``pushed_version``, neither exported nor in a checkpoint."""
    return (
        pending is not None
        and not pending.exported
        and pending.version == pushed_version
        and not (weights_dir(output_dir, pending.version, adapter) / marker_file(adapter)).is_file()
        and (checkpoint is None or checkpoint.state.version < pending.version)
    )
