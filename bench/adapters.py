"""Benchmark: LoRA adapters as policies, measured side by side in one run.

1. Push: what a new policy version costs the backend. An adapter push writes
   peft's directory (``adapter_model.safetensors`` + config) and loads it with
   ``POST /load_lora_adapter`` (then unloads the old version); a full push
   writes ``model.safetensors`` and loads it with ``POST
   /update_weights_from_disk``. Both through the embedded engine's HTTP API on
   SmolLM2-135M-Instruct (the demo model), ``--pushes`` times each,
   interleaved; medians. Then the same arithmetic for a 7B model (Llama-2-7B's
   shapes, bf16) on paper, at the bytes/s this run measured.
2. Generation: the engine's output tokens/s for one batch of ``--rows`` rows
   (``--max-new-tokens`` each, greedy, ``ignore_eos``) where every row runs the
   base model, or the rows are spread over 1, 4 or 8 adapters (rank
   ``--rank``, every linear); the four configurations alternate ``--rounds``
   times; medians.
3. Trainer step time, LoRA vs full: :func:`measure_trainer_steps`, by
   ``bench/adapter_train.py`` (``--skip-trainer`` leaves it out).

Targets: an adapter push under a tenth of the full push; 8 adapters in one
batch at least half the base model's tokens/s. The last line:
``adapters: push P ms vs full F ms; 8 adapters T8 tok/s vs base T0 tok/s``.

Run (at nice 19 on a shared machine: both sides of each ratio see the same load)::

    nice -n 19 .venv/bin/python bench/adapters.py                # SmolLM2 (cached in .cache/models)
    nice -n 19 .venv/bin/python bench/adapters.py --model DIR    # any local Llama/Qwen2 HF model
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxima.proxy.backends.protocol import SamplingParams, lora_name  # noqa: E402
from proxima.proxy.embedded.engine import Engine  # noqa: E402
from proxima.proxy.embedded.live import EngineServer  # noqa: E402
from proxima.proxy.testing.lora import (  # noqa: E402
    LLAMA_TARGETS,
    linear_shapes,
    random_adapter_tensors,
    save_peft_adapter,
    write_peft_adapter,
)
from proxima.trainer.pipeline.demo_model import prepare_smollm2  # noqa: E402

logger = logging.getLogger("bench.adapters")

PUSH_TARGET = 0.1  # adapter push / full push
THROUGHPUT_TARGET = 0.5  # 8 adapters / base tokens per second

# Llama-2-7B: hidden 4096, MLP 11008, 32 layers, 32 KV heads; 6.74e9 parameters.
LLAMA7B_PARAMS = 6.74e9
LLAMA7B_LAYER_LINEARS = [(4096, 4096)] * 4 + [(4096, 11008), (4096, 11008), (11008, 4096)]
LLAMA7B_LAYERS = 32
BF16_BYTES = 2

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List three uses of copper and why.",
    "What makes bread rise? Answer in detail.",
    "Describe the water cycle to a child.",
    "Give advice to someone learning to cook.",
    "Why is the sky blue? Explain step by step.",
    "Summarise the plot of a detective novel you invent.",
]


@dataclass
class PushTimes:
    adapter_s: list[float]
    full_s: list[float]
    adapter_bytes: int
    full_bytes: int


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def measure_pushes(model_dir: Path, work: Path, *, rank: int, pushes: int) -> PushTimes:
    """Export + load, adapter vs full weights, alternating, through the engine's HTTP API."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shapes = linear_shapes(model, LLAMA_TARGETS)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # saved once, as HF does
    adapter_s: list[float] = []
    full_s: list[float] = []
    adapter_bytes = full_bytes = 0
    with (
        EngineServer(model_dir, enable_lora=True, num_threads=1) as server,
        httpx.Client(base_url=server.url, timeout=600) as http,
    ):
        previous: str | None = None
        for version in range(pushes + 1):  # version 0 warms both paths up: not counted
            # Adapter: write peft's directory, load the new version beside the old, unload the old.
            # The trainer holds the adapter's tensors as the full push holds the state dict:
            # drawing them is not part of the push.
            out = work / "adapters" / f"v{version}"
            tensors = random_adapter_tensors(shapes, rank=rank, seed=version)
            started = time.perf_counter()
            save_peft_adapter(out, tensors, rank=rank, alpha=2 * rank)
            name = lora_name("bench", version)
            reply = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(out)})
            reply.raise_for_status()
            if previous is not None:
                http.post("/unload_lora_adapter", json={"lora_name": previous}).raise_for_status()
            adapter_time = time.perf_counter() - started
            adapter_bytes = _dir_bytes(out)
            previous = name

            # Full weights: write model.safetensors (+ config), load them all.
            out = work / "full" / f"v{version}"
            started = time.perf_counter()
            out.mkdir(parents=True)
            save_file(state, str(out / "model.safetensors"))
            shutil.copy(model_dir / "config.json", out / "config.json")
            reply = http.post(
                "/update_weights_from_disk",
                json={"model_path": str(out), "weight_version": str(version)},
            )
            reply.raise_for_status()
            full_time = time.perf_counter() - started
            full_bytes = _dir_bytes(out)
            shutil.rmtree(out)  # 0.5 GB each
            logger.info(
                "push %d: adapter %.1f ms, full %.1f ms",
                version,
                adapter_time * 1e3,
                full_time * 1e3,
            )
            if version > 0:
                adapter_s.append(adapter_time)
                full_s.append(full_time)
    return PushTimes(adapter_s, full_s, adapter_bytes, full_bytes)


def llama7b_paper(times: PushTimes, rank: int) -> str:
    """The 7B arithmetic: bytes of a bf16 model and of a rank-``rank`` adapter on every
    linear, and the push times at the bytes/s this run measured."""
    full_bytes = LLAMA7B_PARAMS * BF16_BYTES
    adapter_params = LLAMA7B_LAYERS * sum(rank * (i + o) for i, o in LLAMA7B_LAYER_LINEARS)
    adapter_bytes = adapter_params * BF16_BYTES
    full_rate = times.full_bytes / statistics.median(times.full_s)  # bytes/s, write + load
    adapter_rate = times.adapter_bytes / statistics.median(times.adapter_s)
    return (
        f"7B on paper (Llama-2-7B shapes, bf16): full {full_bytes / 1e9:.1f} GB, "
        f"rank-{rank} adapter on every linear {adapter_params / 1e6:.1f}M params = "
        f"{adapter_bytes / 1e6:.0f} MB ({full_bytes / adapter_bytes:.0f}x smaller); at this run's "
        f"{full_rate / 1e6:.0f} MB/s (full) and {adapter_rate / 1e6:.0f} MB/s (adapter, "
        f"fixed costs included) a push takes {full_bytes / full_rate:.1f} s vs "
        f"{adapter_bytes / adapter_rate * 1e3:.0f} ms"
    )


async def _batch_tokens_per_s(engine: Engine, adapters: list[str | None], tokens: int) -> float:
    """One batch, row i on ``adapters[i]``, all admitted in one iteration."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    await engine.pause("in_place")
    handles = []
    for i, name in enumerate(adapters):
        adapter = await engine.resolve_adapter(name) if name else None
        prompt = engine.encode(PROMPTS[i % len(PROMPTS)])
        handles.append(engine.submit(prompt, params, adapter=adapter))
    started = time.perf_counter()
    await engine.resume()
    states = [await h.result() for h in handles]
    elapsed = time.perf_counter() - started
    assert all(len(s.output_ids) == tokens for s in states)
    return sum(len(s.output_ids) for s in states) / elapsed


async def measure_throughput(
    model_dir: Path, work: Path, *, rank: int, rows: int, tokens: int, rounds: int
) -> dict[int, list[float]]:
    """Tokens/s per number of adapters in the batch (0: the base alone)."""
    engine = await asyncio.to_thread(Engine, model_dir, enable_lora=True, max_loras_per_batch=8)
    engine.start()
    try:
        shapes = linear_shapes(engine.model, LLAMA_TARGETS)
        for k in range(8):
            path = write_peft_adapter(
                work / "serve" / f"a{k}", shapes, rank=rank, alpha=2 * rank, seed=100 + k
            )
            result = await engine.load_lora_adapter(f"a{k}", str(path))
            assert result.success, result.error_message
        results: dict[int, list[float]] = {0: [], 1: [], 4: [], 8: []}
        await _batch_tokens_per_s(engine, [None] * rows, 4)  # warm-up
        for r in range(rounds):
            for count in results:
                names: list[str | None] = [f"a{i % count}" if count else None for i in range(rows)]
                results[count].append(await _batch_tokens_per_s(engine, names, tokens))
            logger.info(
                "round %d: %s",
                r + 1,
                ", ".join(f"{c} adapters {v[-1]:.1f} tok/s" for c, v in results.items()),
            )
        return results
    finally:
        await engine.stop()


def measure_trainer_steps(model_dir: Path, rank: int) -> tuple[float, float]:
    """Trainer step time ``(lora_s, full_s)`` on ``model_dir``: ``bench/adapter_train.py``'s
    measurement (the trainer side), run here so the line comes from this run."""
    from adapter_train import measure_trainer_steps as trainer_steps  # bench/ is sys.path[0]

    return trainer_steps(model_dir, rank=rank)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model dir (default: SmolLM2)")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache/models"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-trainer", action="store_true", help="no trainer step measurement")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_dir = args.model or prepare_smollm2(args.cache_dir)

    with tempfile.TemporaryDirectory(prefix="bench-adapters-") as tmp:
        work = Path(tmp)
        pushes = measure_pushes(model_dir, work, rank=args.rank, pushes=args.pushes)
        throughput = asyncio.run(
            measure_throughput(
                model_dir,
                work,
                rank=args.rank,
                rows=args.rows,
                tokens=args.max_new_tokens,
                rounds=args.rounds,
            )
        )
    trainer = None if args.skip_trainer else measure_trainer_steps(model_dir, args.rank)

    push_ms = statistics.median(pushes.adapter_s) * 1e3
    full_ms = statistics.median(pushes.full_s) * 1e3
    print(f"model: {model_dir.name}; adapters rank {args.rank} on {', '.join(LLAMA_TARGETS)}")
    print(
        f"push (export + load, median of {args.pushes}): adapter {push_ms:.0f} ms "
        f"({pushes.adapter_bytes / 1e6:.1f} MB) vs full {full_ms:.0f} ms "
        f"({pushes.full_bytes / 1e6:.0f} MB): ratio {push_ms / full_ms:.3f} "
        f"(target < {PUSH_TARGET})"
    )
    print(llama7b_paper(pushes, args.rank))
    medians = {count: statistics.median(v) for count, v in throughput.items()}
    base = medians[0]
    for count in (1, 4, 8):
        print(
            f"generation, {args.rows} rows x {args.max_new_tokens} tokens, {count} adapter(s): "
            f"{medians[count]:.1f} tok/s = {medians[count] / base:.2f} of the base's {base:.1f} "
            f"(median of {args.rounds})"
        )
    print(f"target: 8 adapters >= {THROUGHPUT_TARGET} of the base")
    if trainer is None:
        print("trainer step LoRA vs full: not measured in this run (--skip-trainer)")
    else:
        lora_s, full_s = trainer
        print(f"trainer step: LoRA {lora_s:.2f} s vs full {full_s:.2f} s ({lora_s / full_s:.2f})")
    print(
        f"adapters: push {push_ms:.0f} ms vs full {full_ms:.0f} ms; "
        f"8 adapters {medians[8]:.1f} tok/s vs base {base:.1f} tok/s"
    )


if __name__ == "__main__":
    main()
