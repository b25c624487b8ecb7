"""Benchmark: dynamic packed micro-batches vs a fixed number of padded micro-batches.

One training pass (forward + backward of the decoupled PPO loss, gradients
accumulated) over a minibatch of sequences with a long-tailed length
distribution (log-normal, clipped to ``[min_len, max_len]``), on a small
randomly initialised Qwen2 model:

- dynamic: AReaL algorithm 1 (``proxima.trainer.batching.plan_micro_batches``) under a
  token budget; each micro-batch packed into one row without padding, with
  per-sequence causal attention (``proxima.trainer.logprobs``, ``proxima_varlen_sdpa``).
  Optionally (``--block-mask``) also the packed row with a dense block-diagonal
  mask, to show what that costs.
- fixed: the usual padded batching with the *same number* of micro-batches
  (same number of forward/backward calls), sequences in arrival order split
  into equal-count chunks, each right-padded to its longest sequence and run
  with SDPA's causal fast path (no mask needed: right padding never leaks into
  real tokens under causal attention). This is the fairest padded baseline.

Computed tokens are what the model's projections and MLP process (padded
tokens for the fixed baseline); throughput counts real tokens only.

Run: ``.venv/bin/python bench/microbatching.py [--num-seqs 64 --hidden 128 ...]``.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxima.trainer.batching import fixed_micro_batches, pack, plan_micro_batches  # noqa: E402
from proxima.trainer.logprobs import VARLEN_SDPA, forward_logprobs  # noqa: E402
from proxima.trainer.loss import decoupled_ppo_loss, token_logprobs  # noqa: E402
from proxima.trainer.samples import Sample  # noqa: E402


@dataclass(frozen=True)
class Result:
    name: str
    micro_batches: int
    real_tokens: int
    computed_tokens: int
    max_mb_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.real_tokens / self.seconds


def long_tail_lengths(n: int, median: int, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    """Log-normal lengths (median ``median``, log-std ``sigma``) clipped to ``[lo, hi]``."""
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def make_samples(lengths: list[int], vocab: int, seed: int) -> list[Sample]:
    """Random token sequences: the first quarter is prompt, the rest generated."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k, n in enumerate(lengths):
        prompt = max(1, n // 4)
        mask = [0] * prompt + [1] * (n - prompt)
        advantage = float(torch.randn((), generator=g))
        samples.append(
            Sample(
                session_id=f"s{k}",
                group_id="g",
                input_ids=torch.randint(0, vocab, (n,), generator=g).tolist(),
                loss_mask=mask,
                behav_logprobs=[0.0] * n,
                versions=[0 if m else -1 for m in mask],
                advantages=[advantage * m for m in mask],
                temperature=1.0,
            )
        )
    return samples


def build_model(args: argparse.Namespace, attn: str) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.max_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation(attn)
    return model.train()


def ppo_backward(logprobs: torch.Tensor, targets_mask: torch.Tensor, adv: torch.Tensor, total: int):
    """On-policy decoupled PPO loss (prox = behav = current, detached) and its backward."""
    detached = logprobs.detach()
    loss, _ = decoupled_ppo_loss(
        logprobs, detached, detached, adv, targets_mask, eps_clip=0.2, total_loss_tokens=total
    )
    loss.backward()


def run_dynamic(model: Qwen2ForCausalLM, samples: list[Sample], plan: list[list[int]]) -> None:
    total = sum(s.num_loss_tokens for s in samples)
    for mb in plan:
        packed = pack([samples[i] for i in mb])
        logprobs = forward_logprobs(model, packed)  # (T_mb,)
        ppo_backward(logprobs, packed.loss_mask, packed.advantages, total)


def run_padded(model: Qwen2ForCausalLM, samples: list[Sample], chunks: list[list[int]]) -> None:
    total = sum(s.num_loss_tokens for s in samples)
    for chunk in chunks:
        rows = [samples[i] for i in chunk]
        width = max(s.num_tokens for s in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # (b, L_max), right padding
        mask = torch.zeros(len(rows), width)  # (b, L_max) loss mask on targets
        adv = torch.zeros(len(rows), width)
        for r, s in enumerate(rows):
            n = s.num_tokens
            ids[r, :n] = torch.tensor(s.input_ids)
            mask[r, : n - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
            adv[r, : n - 1] = torch.tensor(s.advantages[1:])
        logits = model(input_ids=ids, use_cache=False).logits  # (b, L_max, V), causal, no mask
        targets = torch.cat([ids[:, 1:], ids.new_zeros(len(rows), 1)], dim=1)  # (b, L_max)
        logprobs = token_logprobs(logits, targets, 1.0)  # (b, L_max)
        ppo_backward(logprobs, mask, adv, total)


def timed(name: str, fn: Callable[[], None], model: torch.nn.Module, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    print(f"  {name}: {best:.2f} s", file=sys.stderr)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--median-len", type=int, default=192)
    parser.add_argument("--sigma", type=float, default=1.1, help="log-normal log-std")
    parser.add_argument("--max-tokens-per-mb", type=int, default=4096)
    parser.add_argument("--min-mbs", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=263)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--block-mask", action="store_true", help="also time packing with a dense 4-D mask"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    lengths = long_tail_lengths(
        args.num_seqs, args.median_len, args.sigma, args.min_len, args.max_len, args.seed
    )
    samples = make_samples(lengths, args.vocab, args.seed)
    plan = plan_micro_batches(lengths, args.max_tokens_per_mb, args.min_mbs)
    chunks = fixed_micro_batches(lengths, len(plan))
    real = sum(lengths)
    print(
        f"{len(lengths)} sequences, {real} tokens, lengths min {min(lengths)} / median "
        f"{sorted(lengths)[len(lengths) // 2]} / max {max(lengths)}; model hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}; budget {args.max_tokens_per_mb} tokens/mb; "
        f"{args.threads} threads",
        file=sys.stderr,
    )

    # Warm up kernels / allocator once on a short slice.
    warm = build_model(args, VARLEN_SDPA)
    run_dynamic(warm, samples[:2], [[0, 1]])

    results = []
    model = build_model(args, VARLEN_SDPA)
    seconds = timed("dynamic", lambda: run_dynamic(model, samples, plan), model, args.repeats)
    mb_tokens = [sum(lengths[i] for i in mb) for mb in plan]
    results.append(
        Result("dynamic packed (varlen)", len(plan), real, real, max(mb_tokens), seconds)
    )

    if args.block_mask:
        model = build_model(args, "sdpa")
        seconds = timed(
            "block mask", lambda: run_dynamic(model, samples, plan), model, args.repeats
        )
        results.append(
            Result("dynamic packed (4-D mask)", len(plan), real, real, max(mb_tokens), seconds)
        )

    model = build_model(args, "sdpa")
    seconds = timed("fixed", lambda: run_padded(model, samples, chunks), model, args.repeats)
    padded = [len(c) * max(lengths[i] for i in c) for c in chunks]
    results.append(
        Result("fixed count, padded", len(chunks), real, sum(padded), max(padded), seconds)
    )

    header = (
        f"{'method':<27} {'mbs':>4} {'real tok':>9} {'computed':>9} {'padding':>8} "
        f"{'max tok/mb':>10} {'time s':>7} {'real tok/s':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        pad = 1 - r.real_tokens / r.computed_tokens
        print(
            f"{r.name:<27} {r.micro_batches:>4} {r.real_tokens:>9} {r.computed_tokens:>9} "
            f"{pad:>8.1%} {r.max_mb_tokens:>10} {r.seconds:>7.2f} {r.tokens_per_second:>10.0f}"
        )
    dynamic, fixed = results[0], results[-1]
    print(
        f"dynamic / fixed throughput: {dynamic.tokens_per_second / fixed.tokens_per_second:.2f}x; "
        f"computed tokens {fixed.computed_tokens / dynamic.computed_tokens:.2f}x fewer; "
        f"peak micro-batch {fixed.max_mb_tokens / dynamic.max_mb_tokens:.2f}x smaller"
    )


if __name__ == "__main__":
    main()
