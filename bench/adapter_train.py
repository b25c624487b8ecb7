"""Benchmark: one trainer step of a LoRA adapter vs one of full fine-tuning, side by side.

The same PPO step (proximal pass excluded: one minibatch, the training pass
gives the proximal logprobs) over the same batch on the same model, by
``proxima.trainer.backends``: ``TorchBackend`` (every weight trains, AdamW
over all of them) and ``LoraBackend`` (the base frozen, one adapter of rank
``--rank`` on every linear layer, AdamW over the adapter alone). One
backend is in memory at a time (LoRA, then full): a warm-up step, then
``--rounds`` timed steps; medians. A batch is
``--samples`` sequences of ``--prompt`` + ``--completion`` tokens (random ids:
the step's cost does not depend on which tokens they are).

:func:`measure_trainer_steps` is what ``bench/adapters.py`` calls for its
trainer line. Run alone (nice 19 on a shared machine: both sides see the
same load)::

    nice -n 19 .venv/bin/python bench/adapter_train.py            # SmolLM2 (.cache/models)
    nice -n 19 .venv/bin/python bench/adapter_train.py --model DIR

Last line: ``trainer step: LoRA L s vs full F s (ratio R)``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxima.trainer.backends.lora import LoraBackend  # noqa: E402
from proxima.trainer.backends.torch_backend import TorchBackend  # noqa: E402
from proxima.trainer.config import (  # noqa: E402
    BatchingConfig,
    LoraConfig,
    OptimConfig,
    PPOConfig,
)
from proxima.trainer.pipeline.demo_model import prepare_smollm2  # noqa: E402
from proxima.trainer.samples import Sample  # noqa: E402

LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def batch(vocab: int, *, samples: int, prompt: int, completion: int, seed: int = 0) -> list[Sample]:
    """``samples`` sequences, advantages +1/-1 alternating, behaviour logprobs -2."""
    rng = random.Random(seed)
    mask = [0] * prompt + [1] * completion
    return [
        Sample(
            session_id=f"s{i}",
            group_id="g",
            input_ids=[rng.randrange(vocab) for _ in mask],
            loss_mask=mask,
            behav_logprobs=[-2.0 * m for m in mask],
            versions=[0 if m else -1 for m in mask],
            advantages=[(1.0 if i % 2 == 0 else -1.0) * m for m in mask],
            temperature=1.0,
        )
        for i in range(samples)
    ]


def _timed(step: Callable[[list[Sample]], object], data: list[Sample]) -> float:
    t = time.perf_counter()
    step(data)
    return time.perf_counter() - t


def measure_trainer_steps(
    model_dir: Path,
    *,
    rank: int = 16,
    rounds: int = 3,
    samples: int = 8,
    prompt: int = 64,
    completion: int = 128,
) -> tuple[float, float]:
    """Median seconds of one trainer step ``(lora_s, full_s)`` on ``model_dir``.

    One backend in memory at a time (a full step's AdamW state is twice the
    model): LoRA's warm-up and ``rounds`` steps, then the full model's.
    """
    ppo, batching, optim = PPOConfig(), BatchingConfig(max_tokens_per_mb=4096), OptimConfig()
    lora_config = LoraConfig(
        adapters=("bench",), rank=rank, alpha=2.0 * rank, target_modules=LINEAR_TARGETS
    )

    def build_lora() -> tuple[Callable[[list[Sample]], object], int, int]:
        backend = LoraBackend(model_dir, lora=lora_config, ppo=ppo, batching=batching, optim=optim)
        trainable = sum(p.numel() for p in backend.adapter_parameters("bench"))
        return backend.policy("bench").train_step, trainable, backend.model.config.vocab_size

    def build_full() -> tuple[Callable[[list[Sample]], object], int, int]:
        backend = TorchBackend(model_dir, ppo=ppo, batching=batching, optim=optim)
        trainable = sum(p.numel() for p in backend.model.parameters())
        return backend.train_step, trainable, backend.model.config.vocab_size

    builders = {"lora": build_lora, "full": build_full}
    times: dict[str, list[float]] = {}
    params: dict[str, int] = {}
    for name, build in builders.items():
        step, params[name], vocab = build()
        data = batch(vocab, samples=samples, prompt=prompt, completion=completion)
        step(data)  # warm-up: AdamW state allocated, kernels chosen
        times[name] = []
        for _ in range(rounds):
            times[name].append(_timed(step, data))
        del step
        gc.collect()
    print(
        f"trainer step, {samples} x ({prompt} + {completion}) tokens, {rounds} steps each: "
        f"LoRA rank {rank} ({params['lora'] / 1e6:.2f} M trainable) "
        + ", ".join(f"{t:.2f}" for t in times["lora"])
        + f" s; full ({params['full'] / 1e6:.0f} M trainable) "
        + ", ".join(f"{t:.2f}" for t in times["full"])
        + " s"
    )
    return statistics.median(times["lora"]), statistics.median(times["full"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model dir (default: SmolLM2)")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache/models"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=128)
    args = p.parse_args()
    model_dir = args.model or prepare_smollm2(args.cache_dir)
    lora_s, full_s = measure_trainer_steps(
        model_dir,
        rank=args.rank,
        rounds=args.rounds,
        samples=args.samples,
        prompt=args.prompt,
        completion=args.completion,
    )
    print(f"model: {model_dir.name}")
    print(f"trainer step: LoRA {lora_s:.2f} s vs full {full_s:.2f} s (ratio {lora_s / full_s:.2f})")


if __name__ == "__main__":
    main()
