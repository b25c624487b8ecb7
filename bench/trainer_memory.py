"""Benchmark: trainer peak memory and time with logits at every token vs at loss tokens only.

One forward + backward of the decoupled PPO loss over a packed micro-batch
(``--sequences`` sequences of ``--prompt`` prompt + ``--generated`` generated
tokens) through an HF causal LM, as the torch backend's train step runs it,
once with the vocabulary projection at every position (``(T, V)`` logits)
and once with ``forward_logprobs(..., loss_tokens_only=True)`` (``(K, V)``, K
the loss tokens). Each variant runs in a fresh process so its peak RSS is its
own. Default model: SmolLM2-135M-Instruct (vocabulary 49,152), the demo model.

Run: ``.venv/bin/python bench/trainer_memory.py`` (about a minute on 2 cores);
``--model DIR`` for another HF directory.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(model_dir: Path, args: argparse.Namespace, loss_tokens_only: bool) -> dict[str, float]:
    """One forward/backward in this process; peak RSS (MiB) and seconds."""
    import torch
    from proxima.trainer.batching import pack
    from proxima.trainer.logprobs import forward_logprobs, use_varlen_attention
    from proxima.trainer.loss import decoupled_ppo_loss
    from proxima.trainer.samples import Sample
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_varlen_attention(model)
    vocab = model.config.vocab_size
    mask = [0] * args.prompt + [1] * args.generated
    samples = [
        Sample(
            session_id=f"s{i}",
            group_id="g",
            input_ids=torch.randint(0, vocab, (len(mask),)).tolist(),
            loss_mask=mask,
            behav_logprobs=[-2.0 * m for m in mask],
            versions=[0 if m else -1 for m in mask],
            advantages=[(1.0 if i % 2 else -1.0) * m for m in mask],
            temperature=1.0,
        )
        for i in range(args.sequences)
    ]
    packed = pack(samples)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    logprobs = forward_logprobs(model, packed, loss_tokens_only=loss_tokens_only)  # (T,)
    loss, _ = decoupled_ppo_loss(
        logprobs, None, packed.behav_logprobs, packed.advantages, packed.loss_mask,
        eps_clip=0.2, total_loss_tokens=packed.num_loss_tokens,
    )  # fmt: skip
    loss.backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak, "model_mib": loaded, "seconds": seconds, "tokens": packed.num_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default SmolLM2)")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=80)
    parser.add_argument("--generated", type=int, default=48)
    parser.add_argument("--variant", choices=["all", "loss"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from proxima.trainer.pipeline.demo_model import prepare_smollm2

        args.model = prepare_smollm2(ROOT / ".cache" / "models")
    if args.variant:  # a child process: one measurement, as JSON
        print(json.dumps(measure(args.model, args, loss_tokens_only=args.variant == "loss")))
        return 0
    results = {}
    for variant in ("all", "loss"):
        cmd = [sys.executable, __file__, "--variant", variant, "--model", str(args.model),
               "--sequences", str(args.sequences), "--prompt", str(args.prompt),
               "--generated", str(args.generated)]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    a, b = results["all"], results["loss"]
    print(
        f"model {args.model.name}; one micro-batch of {a['tokens']} tokens "
        f"({args.sequences} x ({args.prompt} prompt + {args.generated} generated)), forward + backward"
    )
    print(f"{'logits at':<16} {'peak RSS MiB':>12} {'above model':>12} {'seconds':>8}")
    for name, r in (("every token", a), ("loss tokens", b)):
        above = r["peak_mib"] - r["model_mib"]
        print(f"{name:<16} {r['peak_mib']:>12.0f} {above:>12.0f} {r['seconds']:>8.2f}")
    saved = (a["peak_mib"] - a["model_mib"]) / max(1.0, b["peak_mib"] - b["model_mib"])
    print(f"activation memory: {saved:.2f}x less; time: {a['seconds'] / b['seconds']:.2f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
