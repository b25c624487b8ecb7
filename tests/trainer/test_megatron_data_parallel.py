"""Data parallelism in ``MegatronPPOBackend``: 2 gloo ranks on CPU (TP 1 x DP 2) equal one process.

Each replica runs its share of the micro-batches, the logprobs are exchanged,
the gradients summed; so one process running the whole batch is the
reference. Each step of the reference starts from the replicas' state before
that step (weights and AdamW state), so the two sides differ only in float
summation order: micro-batches are packed (hence padded inside megatron)
differently and the gradient sum is ordered differently. Logprobs agree to
``1e-5`` absolute (as against HF in test_megatron_backend.py), the step's loss
to ``1e-5`` relative, the gradients up to summation order
(``tests/trainer/closeness.py``) and the gradient norm to ``1e-4`` relative.
Weights after AdamW steps are not compared across the two sides (AdamW's first
steps ``~lr * g / (|g| + eps)`` turn the noise of a near-zero ``g`` into
lr-sized differences, another on each CPU); the replicas' weights are checked to
be AdamW applied to their summed gradients, and equal on both replicas.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state
from proxima.proxy.serving import free_port
from proxima.trainer.backends.base import assign_to_replicas, micro_batches, read_hf_state_dict
from proxima.trainer.backends.megatron import MegatronPPOBackend
from proxima.trainer.backends.megatron.backend import MegatronBackend
from proxima.trainer.backends.megatron.compat import broadcast_object
from proxima.trainer.backends.megatron.convert import mcore_to_hf
from proxima.trainer.backends.megatron.model import MegatronParallelConfig
from proxima.trainer.config import BatchingConfig, TrainerConfig
from proxima.trainer.samples import Sample
from proxima.trainer.torchrun import init_ranks
from torch import Tensor

from tests.trainer.closeness import adamw_replay, assert_adamw_applied, assert_grads_close

LR = 1e-3
LOGPROB_ATOL = 1e-5
# Losses of other packings: a token mean of float32 terms of size ~1 moves by ~1e-7 with the
# summation order and can sit near 0 (normalised advantages), so the bound is absolute too.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-5
GRAD_NORM_RTOL = 1e-4
STAT_ATOL = 1e-5
# (prompt, generated) tokens: sequences of 7 to 120 tokens, 271 in all.
SHAPES = [(4, 3), (20, 60), (6, 10), (30, 90), (3, 5), (10, 30)]
# Budget -> micro-batches of SHAPES: 512 -> one alone, two with two replicas (each runs one,
# packed differently from the single process's); 128 -> three either way (the replicas run
# one and two).
WIDE, NARROW = BatchingConfig(max_tokens_per_mb=512), BatchingConfig(max_tokens_per_mb=128)


def _cfg(model_dir: Path, tensor_parallel: int = 1) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "backend": "megatron",
            "optim": {"lr": LR, "grad_clip": None},
            "megatron": {"tensor_parallel": tensor_parallel},
            "connection": {"model_dir": model_dir},
        }
    )


def _samples() -> list[Sample]:
    """Sequences of very different lengths, two temperatures, prox = behav + noise."""
    rng = random.Random(5)
    samples = []
    for i, (prompt, generated) in enumerate(SHAPES):
        mask = [0] * prompt + [1] * generated
        behav = [-rng.uniform(0.5, 4.0) * m for m in mask]
        samples.append(
            Sample(
                session_id=f"s{i}",
                group_id="g",
                input_ids=[rng.randrange(256) for _ in mask],
                loss_mask=mask,
                behav_logprobs=behav,
                versions=[0 if m else -1 for m in mask],
                advantages=[rng.choice((-1.0, 1.0)) * rng.uniform(0.5, 1.5) * m for m in mask],
                temperature=0.7 if i % 2 else 1.0,
                prox_logprobs=[
                    b + 0.1 * rng.gauss(0.0, 1.0) * m for b, m in zip(behav, mask, strict=True)
                ],
            )
        )
    return samples


def _steps() -> dict[str, tuple[BatchingConfig, list[Sample]]]:
    """The train steps in order: token budget and batch (``one``: replica 1 gets nothing)."""
    samples = _samples()
    return {"wide": (WIDE, samples), "narrow": (NARROW, samples), "one": (NARROW, samples[3:4])}


def _grads_as_hf(backend: MegatronBackend) -> dict[str, Tensor]:
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    return mcore_to_hf(grads, backend.shape)


def _run(backend: MegatronPPOBackend, starts: dict[str, Any] | None = None) -> dict[str, Any]:
    """What both sides record: logprobs, then per train step its stats, gradients and weights.

    ``starts``: the state (``state_dict()``) to load before each step; the state
    before each step is recorded as ``start`` (on rank 0; collective).
    """
    without_prox = [dataclasses.replace(s, prox_logprobs=None) for s in _samples()]
    backend.batching = WIDE  # what the backend plans micro-batches with
    out: dict[str, Any] = {"logprobs": backend.compute_logprobs(without_prox)}
    for name, (batching, batch) in _steps().items():
        if starts is not None:
            backend.load_state_dict(starts[name])
        start = copy.deepcopy(backend.state_dict())  # state_dict() shares storage with the model
        backend.batching = batching
        stats = backend.train_step(batch)
        out[name] = {
            "start": start,
            "stats": stats.as_dict(),
            "grads": _grads_as_hf(backend.megatron),
            "weights": backend.megatron.to_hf_state_dict(),
        }
    return out


def _data_parallel_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    """One of two gloo ranks (TP 1 x DP 2): the steps of :func:`_run`, then a checkpoint round trip."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    backend = MegatronPPOBackend(model_dir, _cfg(Path(model_dir)))
    out = _run(backend)
    out["data_parallel"] = (
        backend.megatron.data_parallel_size,
        backend.megatron.data_parallel_rank,
    )
    checkpoint = backend.state_dict()  # collective; rank 0 gets it
    out["checkpoint"] = checkpoint
    backend.load_state_dict(broadcast_object(checkpoint))  # a resume with the same world
    out["reloaded"] = backend.megatron.to_hf_state_dict()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def single(megatron_process_group: None, tiny_model_dir: Path) -> MegatronPPOBackend:
    """The same backend in one process (TP 1, DP 1)."""
    return MegatronPPOBackend(tiny_model_dir, _cfg(tiny_model_dir))


@pytest.fixture(scope="module")
def reference(single: MegatronPPOBackend, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What :func:`_run` records in one process, each step from the replicas' state before it."""
    return _run(single, starts={step: ranks[0][step]["start"] for step in STEPS})


@pytest.fixture(scope="module")
def ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the two data-parallel ranks recorded."""
    out_dir = tmp_path_factory.mktemp("data-parallel")
    mp.spawn(
        _data_parallel_worker,
        args=(free_port(), str(tiny_model_dir), str(out_dir)),
        nprocs=2,
        join=True,
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


# --------------------------------------------------------------------------- the plan


def test_assign_to_replicas_balances_tokens_longest_first() -> None:
    # 9 -> r0, 7 -> r1, 5 -> r1 (7 < 9), 1 -> r0 (9 < 12): loads 10 and 12.
    assert assign_to_replicas([5, 9, 1, 7], 2) == [[1, 2], [0, 3]]
    assert assign_to_replicas([4, 4, 4], 3) == [[0], [1], [2]]
    assert assign_to_replicas([3], 2) == [[0], []]  # fewer items than replicas
    assert assign_to_replicas([], 2) == [[], []]
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        assign_to_replicas([1], 0)


def test_micro_batch_plan_has_one_per_replica_when_it_can() -> None:
    samples = _samples()[:3]  # 7, 80 and 16 tokens: one micro-batch fits them all
    batching = BatchingConfig(max_tokens_per_mb=128)
    assert len(micro_batches(samples, batching)) == 1
    assert len(micro_batches(samples, batching, replicas=2)) == 2
    assert len(micro_batches(samples, batching, replicas=4)) == 3  # no more than the samples
    plan = micro_batches(samples, BatchingConfig(max_tokens_per_mb=128, min_mbs=3), replicas=2)
    assert len(plan) == 3  # min_mbs still holds


# --------------------------------------------------------------------------- TP 1 x DP 2


def test_compute_logprobs_on_two_replicas_equals_one_process(
    ranks: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    expected = reference["logprobs"]
    assert [r["data_parallel"] for r in ranks] == [(2, 0), (2, 1)]
    for rank in ranks:  # every rank returns every sample, in input order
        assert [len(v) for v in rank["logprobs"]] == [p + g for p, g in SHAPES]
        for actual, want in zip(rank["logprobs"], expected, strict=True):
            torch.testing.assert_close(
                torch.tensor(actual), torch.tensor(want), atol=LOGPROB_ATOL, rtol=0
            )


STEPS = list(_steps())


@pytest.mark.parametrize("step", STEPS)
def test_train_step_on_two_replicas_equals_one_process(
    ranks: list[dict[str, Any]], reference: dict[str, Any], tiny_model_dir: Path, step: str
) -> None:
    """Each step after the previous ones: loss, statistics, summed gradients, AdamW on them.

    ``wide``: two micro-batches, one per replica (one process packs a single
    one); ``narrow``: three, the replicas run one and two; ``one``: a single
    sample, replica 1 idle (zero gradients, same AdamW step).
    """
    want = reference[step]
    assert ranks[0][step]["stats"] == ranks[1][step]["stats"]  # every rank logs the global step
    stats = ranks[0][step]["stats"]
    assert stats["micro_batches"] == {"wide": 2, "narrow": 3, "one": 1}[step]
    assert stats["loss_tokens"] == want["stats"]["loss_tokens"]
    assert stats["loss"] == pytest.approx(want["stats"]["loss"], rel=LOSS_RTOL, abs=LOSS_ATOL)
    assert stats["grad_norm"] == pytest.approx(want["stats"]["grad_norm"], rel=GRAD_NORM_RTOL)
    for key in ("importance_weight_mean", "importance_weight_max", "approx_kl", "clip_fraction"):
        assert stats[key] == pytest.approx(want["stats"][key], abs=STAT_ATOL), key

    done = STEPS[: STEPS.index(step) + 1]  # the AdamW steps the weights have taken
    optim = _cfg(tiny_model_dir).optim
    stepped = adamw_replay(
        read_hf_state_dict(tiny_model_dir), [ranks[0][s]["grads"] for s in done], optim
    )[-1]
    for rank in ranks:
        assert_grads_close(rank[step]["grads"], want["grads"])  # the summed gradient
        assert_adamw_applied(rank[step]["weights"], stepped, optim)
    # Both replicas hold the same weights (bitwise: the same all-reduced gradients through the
    # same elementwise AdamW), and the step moved them (the idle replica's too).
    assert all(
        torch.equal(ranks[1][step]["weights"][k], t) for k, t in ranks[0][step]["weights"].items()
    )
    before = ranks[1][done[-2]]["weights"] if len(done) > 1 else read_hf_state_dict(tiny_model_dir)
    assert not torch.equal(
        ranks[1][step]["weights"]["model.norm.weight"], before["model.norm.weight"]
    )


def test_checkpoint_keeps_one_copy_and_loads_with_any_number_of_replicas(
    ranks: list[dict[str, Any]], reference: dict[str, Any], single: MegatronPPOBackend
) -> None:
    checkpoint = ranks[0]["checkpoint"]
    assert ranks[1]["checkpoint"] == {}
    assert len(checkpoint["ranks"]) == 1  # replica 0's one tensor-parallel shard
    for rank in ranks:  # same-world resume: the weights are those saved
        trained = rank[STEPS[-1]]["weights"]
        assert all(torch.equal(rank["reloaded"][k], t) for k, t in trained.items())
    # One process (DP 1) resumes from it (after its own run): the weights the replicas trained.
    single.load_state_dict(checkpoint)
    restored = single.megatron.to_hf_state_dict()
    assert all(torch.equal(restored[k], t) for k, t in ranks[0][STEPS[-1]]["weights"].items())
    assert single.megatron.optimizer.state_dict()["state"]
    two_shards = {"ranks": [checkpoint["ranks"][0], checkpoint["ranks"][0]]}
    with pytest.raises(ValueError, match="saved with tensor_parallel = 2"):
        single.load_state_dict(two_shards)


# --------------------------------------------------------------------------- refusals


def test_world_not_a_multiple_of_tensor_parallel_is_refused(
    megatron_process_group: None, tiny_model_dir: Path
) -> None:
    with pytest.raises(ValueError, match="world size 1 is not a multiple of .* = 2"):
        MegatronBackend(tiny_model_dir, parallel=MegatronParallelConfig(tensor_parallel=2))


def test_torch_backend_under_torchrun_points_at_megatron(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _cfg(tiny_model_dir).model_copy(update={"backend": "torch"})
    with pytest.raises(ValueError, match='torchrun started 2.*set backend = "megatron"'):
        init_ranks(cfg)


def test_one_minibatch_takes_prox_from_its_own_forward_pass(single: MegatronPPOBackend) -> None:
    """Without prox_logprobs the (only) minibatch uses its training pass's detached logprobs:
    the same loss and gradients as recomputing them first (the trainer loop skips that pass)."""
    batch = [dataclasses.replace(s, prox_logprobs=None) for s in _samples()]
    start = copy.deepcopy(single.state_dict())  # state_dict() shares storage with the model
    single.batching = NARROW
    try:
        recomputed = [
            dataclasses.replace(s, prox_logprobs=p)
            for s, p in zip(batch, single.compute_logprobs(batch), strict=True)
        ]
        with_prox = single.train_step(recomputed).as_dict()
        grads_with_prox = _grads_as_hf(single.megatron)
        single.load_state_dict(start)
        without_prox = single.train_step(batch).as_dict()
        grads_without = _grads_as_hf(single.megatron)
    finally:
        single.load_state_dict(start)
    assert without_prox["loss"] == pytest.approx(with_prox["loss"], rel=LOSS_RTOL, abs=LOSS_ATOL)
    # ratio = exp(l - prox) is 1 exactly without prox and 1 to a few ulps with the recomputed one;
    # the k3 term (ratio - 1) - log(ratio) then carries exp's rounding near 1 (an ulp of 1 is
    # 1.2e-7, and exp's last ulps differ by CPU), so the bound is 1e-6, not the ~1e-14 of exact math.
    assert without_prox["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert_grads_close(grads_without, grads_with_prox)
