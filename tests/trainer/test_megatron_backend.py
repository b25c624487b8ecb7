"""megatron-core backend on CPU: exact HF <-> mcore conversion, logprob and update parity.

Tolerances (float32 on CPU): logprobs agree with the HF model to 1e-5
(observed ~1e-6; the two compute the same ops in a different order).
Gradients agree up to summation order (``tests/trainer/closeness.py``: an
absolute tolerance scaled by the largest gradient element, plus ``1e-4``
relative), the loss to ``1e-5`` relative and the gradient norm to ``1e-4``.
Weights after the AdamW step are not compared with HF's (AdamW's first step
``lr * g / (|g| + eps)`` turns the summation noise of a near-zero ``g`` into an
lr-sized difference, another on each CPU); the test checks instead that the
step is AdamW with the configured hyperparameters applied to megatron's own
gradients.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state
from proxima.proxy.serving import free_port
from proxima.trainer.backends.base import read_hf_state_dict
from proxima.trainer.backends.megatron.backend import MegatronBackend, MicroBatch, split_segments
from proxima.trainer.backends.megatron.compat import CpuRNGStatesTracker
from proxima.trainer.backends.megatron.convert import (
    hf_to_mcore,
    mcore_to_hf,
    merge_tensor_parallel_shards,
    shard_for_tensor_parallel,
)
from proxima.trainer.backends.megatron.model import MegatronParallelConfig, model_shape
from proxima.trainer.batching import PackedBatch
from proxima.trainer.config import OptimConfig
from proxima.trainer.logprobs import forward_logprobs as hf_packed_logprobs
from proxima.trainer.loss import decoupled_ppo_loss
from torch import Tensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.trainer.closeness import adamw_replay, assert_adamw_applied, assert_grads_close

pytestmark = pytest.mark.usefixtures("megatron_process_group")

LOGPROB_ATOL = 1e-5
LR = 1e-3
TEMPERATURE = 0.7


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> MegatronBackend:
    """Read-only backend on the tiny Qwen2 model (tests that train build their own)."""
    return MegatronBackend(tiny_model_dir)


def hf_model(model_dir: Path) -> torch.nn.Module:
    """The HF reference model, float32 on CPU."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_logprobs(model: torch.nn.Module, input_ids: Tensor, temperature: float) -> Tensor:
    """Reference next-token logprobs: log_softmax(logits / T) at the next tokens. (B, T) -> (B, T-1)."""
    logits = model(input_ids=input_ids).logits  # (B, T, V)
    logprobs = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)  # (B, T-1, V)
    return logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)


def random_batch(seed: int, batch: int = 3, length: int = 12, vocab: int = 263) -> Tensor:
    """Token ids (B, T) from a fixed generator."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def weighted_pg_loss(
    logprobs: Tensor, advantages: Tensor, *, total_tokens: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """-sum(logprobs * A) / total_tokens: summing over micro-batches gives the batch mean."""
    loss = -(logprobs * advantages).sum() / total_tokens
    return loss, {"loss": loss.detach()}


def mcore_grads_as_hf(backend: MegatronBackend) -> dict[str, Tensor]:
    """The backend's gradients in HF layout (they have the parameters' shapes)."""
    grads = {name: p.grad for name, p in backend.model.named_parameters() if p.grad is not None}
    return mcore_to_hf(grads, backend.shape)


def assert_step_is_adamw(
    megatron: MegatronBackend, initial: dict[str, Tensor], optim: OptimConfig
) -> None:
    """The weights moved by one AdamW step (``optim``) on megatron's own (clipped) gradients."""
    expected = adamw_replay(initial, [mcore_grads_as_hf(megatron)], optim)[0]
    assert_adamw_applied(megatron.to_hf_state_dict(), expected, optim)


# --------------------------------------------------------------------------- conversion


def test_hf_to_mcore_to_hf_round_trip_is_exact(tiny_model_dir: Path) -> None:
    hf_state = read_hf_state_dict(tiny_model_dir)
    shape = model_shape(hf_model(tiny_model_dir).config, MegatronParallelConfig())
    mcore = hf_to_mcore(hf_state, shape)
    assert mcore["embedding.word_embeddings.weight"].shape == (384, 64)  # 263 padded to 128k
    assert "output_layer.weight" not in mcore  # tied
    back = mcore_to_hf(mcore, shape)
    assert back.keys() == hf_state.keys()
    for key, tensor in hf_state.items():
        assert torch.equal(back[key], tensor), key


def test_qkv_and_fc1_layouts_follow_megatron(tiny_model_dir: Path) -> None:
    """Hand-checked layout: 4 heads, 2 groups, head_dim 16 -> per group [q, q, k, v]."""
    hf_state = read_hf_state_dict(tiny_model_dir)
    shape = model_shape(hf_model(tiny_model_dir).config, MegatronParallelConfig())
    mcore = hf_to_mcore(hf_state, shape)
    qkv = mcore["decoder.layers.1.self_attention.linear_qkv.weight"]  # (2 * (2 + 2) * 16, 64)
    q = hf_state["model.layers.1.self_attn.q_proj.weight"]  # (4 * 16, 64)
    k = hf_state["model.layers.1.self_attn.k_proj.weight"]  # (2 * 16, 64)
    v = hf_state["model.layers.1.self_attn.v_proj.weight"]  # (2 * 16, 64)
    expected = torch.cat([q[0:32], k[0:16], v[0:16], q[32:64], k[16:32], v[16:32]])
    assert torch.equal(qkv, expected)
    bias = mcore["decoder.layers.1.self_attention.linear_qkv.bias"]
    qb = hf_state["model.layers.1.self_attn.q_proj.bias"]
    kb = hf_state["model.layers.1.self_attn.k_proj.bias"]
    vb = hf_state["model.layers.1.self_attn.v_proj.bias"]
    assert torch.equal(bias, torch.cat([qb[:32], kb[:16], vb[:16], qb[32:], kb[16:], vb[16:]]))
    fc1 = mcore["decoder.layers.0.mlp.linear_fc1.weight"]
    gate = hf_state["model.layers.0.mlp.gate_proj.weight"]
    up = hf_state["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))

    # Tensor-parallel rank 1 of 2 holds query group 1 and the second half of gate and up.
    rank1 = shard_for_tensor_parallel(mcore, tp_size=2, tp_rank=1)
    assert torch.equal(
        rank1["decoder.layers.1.self_attention.linear_qkv.weight"],
        torch.cat([q[32:64], k[16:32], v[16:32]]),
    )
    assert torch.equal(
        rank1["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[64:], up[64:]])
    )
    shards = [shard_for_tensor_parallel(mcore, tp_size=2, tp_rank=r) for r in range(2)]
    merged = merge_tensor_parallel_shards(shards)
    assert merged.keys() == mcore.keys()
    assert all(torch.equal(merged[key], mcore[key]) for key in mcore)


def test_model_weights_round_trip_through_gpt_model(
    backend: MegatronBackend, tiny_model_dir: Path
) -> None:
    hf_state = read_hf_state_dict(tiny_model_dir)
    exported = backend.to_hf_state_dict()
    assert exported.keys() == hf_state.keys()
    for key, tensor in hf_state.items():
        assert torch.equal(exported[key], tensor), key


def test_untied_llama_converts_exactly_and_matches_hf(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    llama = MegatronBackend(tmp_path)
    hf_state = read_hf_state_dict(tmp_path)
    assert "lm_head.weight" in hf_state
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in dict(
        llama.model.named_parameters()
    )
    exported = llama.to_hf_state_dict()
    assert exported.keys() == hf_state.keys()
    assert all(torch.equal(exported[key], hf_state[key]) for key in hf_state)

    input_ids = random_batch(5, vocab=300)
    with torch.no_grad():
        expected = hf_logprobs(hf_model(tmp_path).eval(), input_ids, TEMPERATURE)
    actual = llama.forward_logprobs(input_ids, temperature=TEMPERATURE)
    torch.testing.assert_close(actual, expected, atol=LOGPROB_ATOL, rtol=0)


# --------------------------------------------------------------------------- forward


def test_logprobs_match_hf(backend: MegatronBackend, tiny_model_dir: Path) -> None:
    input_ids = random_batch(1)
    with torch.no_grad():
        expected = hf_logprobs(hf_model(tiny_model_dir).eval(), input_ids, TEMPERATURE)
    actual = backend.forward_logprobs(input_ids, temperature=TEMPERATURE)
    assert actual.shape == (3, 11)
    torch.testing.assert_close(actual, expected, atol=LOGPROB_ATOL, rtol=0)


def test_packed_rows_equal_sequences_run_alone(
    backend: MegatronBackend, tiny_model_dir: Path
) -> None:
    """Two rows holding 3 sequences (5 + 7 tokens, 9 tokens + 3 right-pad positions)."""
    seqs = [random_batch(s, batch=1, length=n)[0] for s, n in ((2, 5), (3, 7), (4, 9))]
    pad = torch.zeros(3, dtype=torch.long)
    input_ids = torch.stack([torch.cat(seqs[:2]), torch.cat([seqs[2], pad])])  # (2, 12)
    position_ids = torch.stack(
        [torch.cat([torch.arange(5), torch.arange(7)]), torch.cat([torch.arange(9), pad])]
    )
    temperature = torch.full((2, 11), 1.3)
    temperature[0, :5] = TEMPERATURE  # per token: each sequence its own sampling temperature
    packed = backend.forward_logprobs(input_ids, position_ids, temperature)  # (2, 11)

    model = hf_model(tiny_model_dir).eval()
    with torch.no_grad():
        alone = [
            hf_logprobs(model, s[None], t)[0] for s, t in zip(seqs, (0.7, 1.3, 1.3), strict=True)
        ]
    torch.testing.assert_close(packed[0, :4], alone[0], atol=LOGPROB_ATOL, rtol=0)
    assert packed[0, 4].item() == 0.0  # the first sequence's last token: no next token
    torch.testing.assert_close(packed[0, 5:], alone[1], atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(packed[1, :8], alone[2], atol=LOGPROB_ATOL, rtol=0)


def test_split_segments_rejects_positions_that_do_not_restart_at_zero() -> None:
    good = split_segments(torch.tensor([[0, 1, 2, 0, 1]]))
    assert [(s.row, s.start, s.end) for s in good] == [(0, 0, 3), (0, 3, 5)]
    with pytest.raises(ValueError, match="must start at 0"):
        split_segments(torch.tensor([[3, 4, 5]]))
    with pytest.raises(ValueError, match="must count"):
        split_segments(torch.tensor([[0, 1, 3]]))


def make_packed_batch(seed: int, lengths: list[int], temperature: float) -> PackedBatch:
    """A PackedBatch as ``proxima.trainer.batching.pack`` lays it out, with random PPO inputs."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    input_ids = torch.randint(0, 263, (total,), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    targets = torch.cat([input_ids[1:], input_ids.new_zeros(1)])  # next token in the row
    targets[cu[1:] - 1] = 0  # ... but 0 at each sequence's end
    loss_mask = torch.ones(total)
    loss_mask[cu[1:] - 1] = 0.0  # a sequence's last position has no target
    loss_mask[0] = 0.0  # a prompt token
    behav = -torch.rand(total, generator=gen) * 4.0
    return PackedBatch(
        input_ids=input_ids,
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=cu,
        targets=targets,
        loss_mask=loss_mask,
        behav_logprobs=behav * loss_mask,
        advantages=torch.randn(total, generator=gen) * loss_mask,
        versions=torch.zeros(total, dtype=torch.long),
        temperatures=torch.full((total,), temperature),
        prox_logprobs=(behav + 0.05 * torch.randn(total, generator=gen)) * loss_mask,
    )


def test_packed_batch_logprobs_match_torch_backend_path(
    backend: MegatronBackend, tiny_model_dir: Path
) -> None:
    packed = make_packed_batch(7, [6, 9, 4], TEMPERATURE)
    with torch.no_grad():
        expected = hf_packed_logprobs(hf_model(tiny_model_dir).eval(), packed)  # (T,)
    actual = backend.forward_packed_logprobs(packed)
    ends = packed.cu_seqlens[1:].long() - 1
    keep = torch.ones_like(actual, dtype=torch.bool)
    keep[ends] = False
    torch.testing.assert_close(actual[keep], expected[keep], atol=LOGPROB_ATOL, rtol=0)
    assert torch.all(actual[ends] == 0.0)


# --------------------------------------------------------------------------- training


def test_adamw_step_matches_hf(tiny_model_dir: Path) -> None:
    """Two micro-batches on megatron == one full batch on HF: loss, grads, grad norm, weights."""
    optim = OptimConfig(lr=LR, grad_clip=None, weight_decay=0.01)
    megatron = MegatronBackend(tiny_model_dir, optim=optim)
    input_ids = random_batch(11, batch=4)
    advantages = torch.randn(4, 11, generator=torch.Generator().manual_seed(12))
    loss_fn = functools.partial(weighted_pg_loss, total_tokens=advantages.numel())
    micro_batches = [
        MicroBatch(input_ids[i : i + 2], temperature=TEMPERATURE, loss_inputs={"advantages": a})
        for i, a in ((0, advantages[:2]), (2, advantages[2:]))
    ]
    result = megatron.train_step(micro_batches, loss_fn)

    model = hf_model(tiny_model_dir).train()
    loss, _ = loss_fn(hf_logprobs(model, input_ids, TEMPERATURE), advantages)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    hf_grads = {name: p.grad for name, p in model.named_parameters()}

    assert len(result.stats) == 2
    # Megatron's kernels differ from HF's (per-token logprobs agree to LOGPROB_ATOL), so the
    # token-mean loss is compared at a matching tolerance, not at float32 rounding.
    assert result.loss == pytest.approx(loss.item(), rel=1e-4, abs=1e-4)
    assert result.grad_norm == pytest.approx(grad_norm.item(), rel=1e-4)
    mcore_grads = mcore_grads_as_hf(megatron)
    assert mcore_grads.keys() == {k for k in hf_grads if k in megatron.to_hf_state_dict()}
    assert_grads_close(mcore_grads, {k: hf_grads[k] for k in mcore_grads})
    assert_step_is_adamw(megatron, read_hf_state_dict(tiny_model_dir), optim)
    # and the step did move the weights
    assert not torch.equal(
        megatron.to_hf_state_dict()["model.norm.weight"],
        read_hf_state_dict(tiny_model_dir)["model.norm.weight"],
    )


def test_decoupled_ppo_step_on_packed_batches_matches_hf(tiny_model_dir: Path) -> None:
    """The trainer's real loss on packed micro-batches, with gradient clipping."""
    optim = OptimConfig(lr=LR, grad_clip=0.1)
    megatron = MegatronBackend(tiny_model_dir, optim=optim)
    packs = [make_packed_batch(21, [7, 5], 1.0), make_packed_batch(22, [10], 1.0)]
    total = sum(p.num_loss_tokens for p in packs)
    loss_fn = functools.partial(
        decoupled_ppo_loss, eps_clip=0.2, importance_weight_cap=5.0, total_loss_tokens=total
    )
    result = megatron.train_step([MicroBatch.from_packed(p) for p in packs], loss_fn)

    model = hf_model(tiny_model_dir).train()
    hf_loss = torch.zeros(())
    for p in packs:
        loss, _ = loss_fn(
            hf_packed_logprobs(model, p),
            p.prox_logprobs,
            p.behav_logprobs,
            p.advantages,
            p.loss_mask,
        )
        loss.backward()
        hf_loss += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    hf_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    assert result.grad_norm > 0.1  # clipping was active
    assert result.loss == pytest.approx(hf_loss.item(), rel=1e-4, abs=1e-4)  # see above
    assert result.grad_norm == pytest.approx(grad_norm.item(), rel=1e-4)
    assert float(result.stats[0].loss_tokens) == packs[0].num_loss_tokens
    mcore_grads = mcore_grads_as_hf(megatron)  # after clipping, as AdamW got them
    assert_grads_close(mcore_grads, {k: hf_grads[k] for k in mcore_grads})
    assert_step_is_adamw(megatron, read_hf_state_dict(tiny_model_dir), optim)


def test_export_hf_loads_in_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    megatron = MegatronBackend(tiny_model_dir, optim=OptimConfig(lr=LR))
    input_ids = random_batch(31)
    advantages = torch.randn(3, 11, generator=torch.Generator().manual_seed(32))
    megatron.train_step(
        [MicroBatch(input_ids, loss_inputs={"advantages": advantages})],
        functools.partial(weighted_pg_loss, total_tokens=advantages.numel()),
    )
    out = megatron.export_hf(tmp_path / "export")
    assert out is not None
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert read_hf_state_dict(out).keys() == read_hf_state_dict(tiny_model_dir).keys()
    exported = read_hf_state_dict(out)
    assert all(torch.equal(t, megatron.to_hf_state_dict()[k]) for k, t in exported.items())

    reloaded = hf_model(out).eval()
    with torch.no_grad():
        expected = hf_logprobs(reloaded, input_ids, 1.0)
    torch.testing.assert_close(
        megatron.forward_logprobs(input_ids), expected, atol=LOGPROB_ATOL, rtol=0
    )


# --------------------------------------------------------------------------- parallel and compat


def _tensor_parallel_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    """One of two gloo ranks: TP=2 forward, one AdamW step, gathered HF weights."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    megatron = MegatronBackend(
        model_dir,
        optim=OptimConfig(lr=LR, grad_clip=None),
        parallel=MegatronParallelConfig(tensor_parallel=2),
    )
    input_ids = random_batch(41)
    advantages = torch.randn(3, 11, generator=torch.Generator().manual_seed(42))
    before = megatron.forward_logprobs(input_ids, temperature=TEMPERATURE)
    initial = megatron.to_hf_state_dict()
    result = megatron.train_step(
        [MicroBatch(input_ids, temperature=TEMPERATURE, loss_inputs={"advantages": advantages})],
        functools.partial(weighted_pg_loss, total_tokens=advantages.numel()),
    )
    local_shapes = {n: tuple(p.shape) for n, p in megatron.model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in megatron.model.named_parameters() if p.grad is not None}
    torch.save(
        {
            "grads": grads,  # this rank's shards, mcore layout
            "logprobs": before,
            "initial": initial,
            "updated": megatron.to_hf_state_dict(),
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "qkv_shape": local_shapes["decoder.layers.0.self_attention.linear_qkv.weight"],
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_tensor_parallel_2_on_cpu_gloo_matches_hf(tiny_model_dir: Path, tmp_path: Path) -> None:
    mp.spawn(
        _tensor_parallel_worker,
        args=(free_port(), str(tiny_model_dir), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    input_ids = random_batch(41)
    advantages = torch.randn(3, 11, generator=torch.Generator().manual_seed(42))
    model = hf_model(tiny_model_dir).train()
    with torch.no_grad():
        expected = hf_logprobs(model, input_ids, TEMPERATURE)
    loss, _ = weighted_pg_loss(
        hf_logprobs(model, input_ids, TEMPERATURE), advantages, total_tokens=advantages.numel()
    )
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    hf_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    hf_state = read_hf_state_dict(tiny_model_dir)
    shape = model_shape(model.config, MegatronParallelConfig(tensor_parallel=2))
    grads = mcore_to_hf(merge_tensor_parallel_shards([r["grads"] for r in ranks]), shape)
    assert_grads_close(grads, {k: hf_grads[k] for k in grads})
    defaults = OptimConfig(lr=LR)
    stepped = adamw_replay(hf_state, [grads], defaults)[0]
    for result in ranks:
        assert result["qkv_shape"] == (64, 64)  # one query group of two: half of (128, 64)
        torch.testing.assert_close(result["logprobs"], expected, atol=LOGPROB_ATOL, rtol=0)
        assert all(torch.equal(result["initial"][k], t) for k, t in hf_state.items())
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-4)  # HF vs mcore
        assert result["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
        assert_adamw_applied(result["updated"], stepped, defaults)


def test_parallel_config_rejects_what_cannot_run(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel=2"):
        MegatronParallelConfig(pipeline_parallel=2)
    config = hf_model(tiny_model_dir).config
    with pytest.raises(ValueError, match="tensor_parallel=4 must divide num_key_value_heads=2"):
        model_shape(config, MegatronParallelConfig(tensor_parallel=4))


def test_cpu_rng_tracker_forks_named_streams_without_touching_the_default() -> None:
    tracker = CpuRNGStatesTracker()
    tracker.add("stream", 123)
    torch.manual_seed(0)
    default_first = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("stream"):
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), default_first)  # the default stream did not advance
    with tracker.fork("stream"):
        second = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # the stream continued
    with pytest.raises(ValueError, match="seed 123 already exists"):
        tracker.add("other", 123)
