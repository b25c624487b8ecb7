"""Does asynchronous training learn as well as synchronous? A seeded staleness ablation.

Each arm trains the testbed policy (``proxima.trainer.testbed``: small
addition, tiny model, through a real ``proxima serve`` + store + trainer) for
the same number of PPO steps, with every batch generated exactly ``k``
versions behind the trainer (controlled staleness, lockstep; ``k = 0`` is
synchronous RL), with the decoupled objective (AReaL eq. 5: proximal
logprobs recomputed, ``w = exp(prox - behav)``) or naive PPO (``prox =
behav``: the clip is taken around the stale behaviour policy, no
correction). Seeds fix the prompts, the sampling seeds and the trainer's
initialisation order, so arms with the same seed differ only in ``k`` and the
objective.

Printed: per arm, the final reward (the trainer's final policy sampled at
T = 1 on every prompt, mean +- std over seeds) and the steps to reach the
reward threshold (trailing 5-step mean of the training reward, mean over the
seeds that reached it, and how many did); then the line

    staleness ablation: sync R0+-S0; eta4 decoupled R1+-S1; eta4 naive R2+-S2

Written: ``<out>/results.jsonl`` (one line per finished run; a rerun skips
runs already there) and ``<out>/learning_curves.png`` (mean training reward
per step with a +-1 std band per arm).

    .venv/bin/python bench/staleness_ablation.py --quick       # sync, eta4 x2, 3 seeds
    .venv/bin/python bench/staleness_ablation.py               # sync, eta 1,2,4,8 x2, 3 seeds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from proxima.trainer.testbed import (  # noqa: E402
    Arm,
    ArmResult,
    as_json,
    prepare_model,
    run_arm,
    steps_to,
    summary,
)


def grid(etas: list[int], seeds: int, **settings: object) -> list[Arm]:
    arms = []
    for seed in range(seeds):
        arms.append(Arm(k=0, decoupled=True, seed=seed, **settings))  # type: ignore[arg-type]
        for k in etas:
            for decoupled in (True, False):
                arms.append(Arm(k=k, decoupled=decoupled, seed=seed, **settings))  # type: ignore[arg-type]
    return arms


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def key(arm: dict) -> tuple:
    return tuple(sorted(arm.items()))


def table(rows: list[dict], threshold: float) -> tuple[list[str], dict[str, tuple[float, float]]]:
    by_name: dict[str, list[dict]] = {}
    for row in rows:
        arm = Arm(**row["arm"])
        by_name.setdefault(arm.name, []).append(row)
    order = sorted(
        by_name, key=lambda n: (n != "sync", int(n.split()[0][3:]) if n != "sync" else 0, n)
    )
    lines = [
        f"{'arm':<16} {'seeds':>5} {'final reward':>16} {'last-10 train':>16} "
        f"{'last-20 - sync':>16} {f'steps to {threshold:.2f}':>16} {'s/run':>7}"
    ]
    finals = {}

    def tail(row: dict, n: int) -> float:
        return sum(row["rewards"][-n:]) / len(row["rewards"][-n:])

    sync_by_seed = {r["arm"]["seed"]: r for r in by_name.get("sync", [])}
    for name in order:
        runs = by_name[name]
        final = summary([r["final_reward"] for r in runs])
        last = summary([tail(r, 10) for r in runs])
        # paired with sync on the same seed: same prompts and sampling seeds, so most of
        # the seed-to-seed noise cancels
        diffs = [
            tail(r, 20) - tail(sync_by_seed[r["arm"]["seed"]], 20)
            for r in runs
            if r["arm"]["seed"] in sync_by_seed
        ]
        paired = f"{summary(diffs)[0]:>+9.3f} +- {summary(diffs)[1]:.3f}" if diffs else f"{'-':>16}"
        reached = [s for s in (steps_to(r["rewards"], threshold) for r in runs) if s is not None]
        steps = (
            f"{summary([float(s) for s in reached])[0]:.0f} ({len(reached)}/{len(runs)})"
            if reached
            else f"- (0/{len(runs)})"
        )
        secs = sum(r["seconds"] for r in runs) / len(runs)
        lines.append(
            f"{name:<16} {len(runs):>5} {final[0]:>9.3f} +- {final[1]:.3f} "
            f"{last[0]:>9.3f} +- {last[1]:.3f} {paired} {steps:>16} {secs:>7.0f}"
        )
        finals[name] = final
    return lines, finals


SMOOTH = 5  # steps in the trailing mean of the plotted curves


def _trailing_mean(t: torch.Tensor, window: int) -> torch.Tensor:
    """Mean of the last ``window`` steps (fewer at the start) along the last dim of ``t``."""
    c = torch.cumsum(t, dim=-1)
    shifted = torch.nn.functional.pad(c, (window, 0))[..., : t.shape[-1]]
    counts = torch.arange(1, t.shape[-1] + 1).clamp(max=window)
    return (c - shifted) / counts


def plot(rows: list[dict], path: Path) -> None:
    """Three panels: learning curves of the decoupled arms, of the naive arms (each with
    sync and a +-1 std band over seeds), and final reward against staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name: dict[str, list[dict]] = {}
    for row in rows:
        by_name.setdefault(Arm(**row["arm"]).name, []).append(row)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = plt.get_cmap("viridis")
    etas = sorted({Arm(**r["arm"]).k for r in rows})

    def color(k: int) -> object:
        return "black" if k == 0 else colors(etas.index(k) / max(1, len(etas) - 1) * 0.9)

    for ax, objective in zip(axes[:2], ("decoupled", "naive"), strict=True):
        for name in sorted(by_name, key=lambda n: Arm(**by_name[n][0]["arm"]).k):
            if name != "sync" and not name.endswith(objective):
                continue
            curves = [r["rewards"] for r in by_name[name]]
            n = min(len(c) for c in curves)
            t = torch.tensor([c[:n] for c in curves])  # (seeds, steps)
            t = _trailing_mean(t, SMOOTH)  # per-step rewards of 32 samples are noisy
            mean = t.mean(0)
            std = t.std(0, unbiased=True) if len(curves) > 1 else torch.zeros(n)
            steps = list(range(1, n + 1))
            k = Arm(**by_name[name][0]["arm"]).k
            label = f"{name} ({len(curves)} seeds)"
            ax.plot(steps, mean.tolist(), color=color(k), label=label, lw=1.4)
            ax.fill_between(
                steps, (mean - std).tolist(), (mean + std).tolist(), color=color(k), alpha=0.12
            )
        ax.set_xlabel("PPO step (trainer version)")
        ax.set_ylabel("training reward (batch generated k versions behind)")
        ax.set_title(f"{objective} vs sync: {SMOOTH}-step trailing mean, +-1 std over seeds")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[2]
    for objective, marker in (("decoupled", "o"), ("naive", "s")):
        xs, ys, es = [], [], []
        for k in etas:
            name = "sync" if k == 0 else f"eta{k} {objective}"
            if name not in by_name:
                continue
            mean, std = summary([r["final_reward"] for r in by_name[name]])
            xs.append(k)
            ys.append(mean)
            es.append(std)
        ax.errorbar(xs, ys, yerr=es, marker=marker, capsize=4, label=objective)
    ax.set_xlabel("staleness k (versions behind)")
    ax.set_ylabel("final reward (final policy, T = 1)")
    ax.set_title("final reward vs staleness: mean +- 1 std over seeds")
    ax.set_xticks(etas)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="sync and eta 4 only (9 runs: a subset of the full grid)",
    )
    p.add_argument(
        "--etas", type=int, nargs="+", default=None, help="staleness arms (default 1 2 4 8)"
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="PPO steps per run")
    p.add_argument(
        "--prompts", type=int, default=None, help="prompts per step (x group size; default 8)"
    )
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--digits", type=int, default=3, help="prompts a+b with a, b < digits")
    p.add_argument("--minibatches", type=int, default=1, help="ppo_minibatches")
    p.add_argument("--zero-signal", default="filter", choices=["filter", "skip", "keep"])
    p.add_argument("--threshold", type=float, default=0.35)
    p.add_argument("--out", type=Path, default=Path("runs/staleness_ablation"))
    p.add_argument("--cache", type=Path, default=Path(".cache/testbed"))
    p.add_argument(
        "--only", nargs="+", default=None, help='arm names to run, e.g. "eta4 decoupled"'
    )
    p.add_argument("--report-only", action="store_true", help="table and plot from results.jsonl")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    etas = args.etas or ([4] if args.quick else [1, 2, 4, 8])
    steps = args.steps
    prompts = args.prompts or 8
    settings = dict(
        steps=steps,
        prompts_per_step=prompts,
        group_size=args.group_size,
        lr=args.lr,
        ppo_minibatches=args.minibatches,
        zero_signal=args.zero_signal,
        digits=args.digits,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    if not args.report_only:
        model = prepare_model(args.cache)
        done = {key(r["arm"]) for r in load(results)}
        arms = [a for a in grid(etas, args.seeds, **settings) if key(a.__dict__) not in done]
        arms = [a for a in arms if args.only is None or a.name in args.only]
        print(f"{len(arms)} runs to do ({len(done)} already in {results})", flush=True)
        for i, arm in enumerate(arms, 1):
            t = time.monotonic()
            result: ArmResult = asyncio.run(
                run_arm(arm, model, args.out / f"run-{arm.name.replace(' ', '-')}-s{arm.seed}")
            )
            with results.open("a") as f:
                f.write(json.dumps(as_json(result)) + "\n")
            print(
                f"[{i}/{len(arms)}] {arm.name} seed {arm.seed}: final {result.final_reward:.3f}, "
                f"train {result.rewards[0]:.2f} -> {sum(result.rewards[-5:]) / 5:.2f} "
                f"({time.monotonic() - t:.0f} s)",
                flush=True,
            )
    wanted = {key(a.__dict__) for a in grid(etas, args.seeds, **settings)}
    rows = [r for r in load(results) if key(r["arm"]) in wanted]
    if not rows:
        print("no results yet", file=sys.stderr)
        return 1
    lines, finals = table(rows, args.threshold)
    print("\n".join(lines))
    plot(rows, args.out / "learning_curves.png")
    print(f"curves: {args.out / 'learning_curves.png'}")

    def fmt(name: str) -> str:
        if name not in finals:
            return f"{name} n/a"
        mean, std = finals[name]
        return f"{name} {mean:.2f}+-{std:.2f}"

    eta = 4 if 4 in etas else etas[0]
    print(
        f"staleness ablation: {fmt('sync')}; {fmt(f'eta{eta} decoupled')}; {fmt(f'eta{eta} naive')}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
