"""Benchmark: the `make demo` run with ``max_staleness 0`` and ``2``, side by side.

Runs ``proxima train`` (the real proxy, embedded CPU engine, rollout
controller, trainer process: exactly what ``make demo`` runs) once per
staleness bound on the same config, the same seeds and the same held-out
items, and prints for each: PPO steps, seconds per step (training phase only,
from the first rollout to the last push), held-out accuracy before and after.

``max_staleness 0`` is synchronous RL: the proxy admits a step's sessions only
when the policy that will train on them is the one serving, so the agents wait
for every push and the trainer waits for every batch. ``2`` lets agents run up
to two versions ahead of the trainer (decoupled PPO corrects for the lag).
On this project's 2-core CI machine the engine and the trainer share the same
cores, so overlap buys less than on a cluster where they own separate GPUs;
``bench/async_vs_sync.py`` measures the cluster case with a timing model.

``--seeds N`` repeats each bound with dataset seeds ``0..N-1`` (the seed picks
the train/held-out split and the order of training problems; the engine's
sampling is not seeded), paired across bounds, and prints mean +- sample std
over seeds, the paired held-out gap, and ``reward_curves.png`` (training reward
per step with a band of one std). Finished runs are kept and not run again.

Run: ``.venv/bin/python bench/demo_staleness.py --seeds 3`` (six demo runs,
about 9 minutes each on 2 quiet cores); ``--steps N`` for a shorter
comparison, ``--staleness 0,1,2`` for more bounds, ``--config FILE`` for
another run config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxima.trainer.config import load_raw_config  # noqa: E402

from bench.testbed import summary  # noqa: E402  (mean and sample std)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import step_rewards  # noqa: E402  (one reader of a run's train_log.jsonl)


def run_one(
    base: dict[str, Any], eta: int, seed: int, steps: int | None, out_dir: Path
) -> dict[str, Any]:
    """One ``proxima train`` run with ``trainer.max_staleness = eta`` and dataset ``seed``.

    Returns its ``summary.json`` plus the per-step training rewards; a run whose
    summary is already there is not run again (so an interrupted grid resumes).
    """
    run_dir = out_dir / f"staleness-{eta}-seed{seed}"
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
        summary["step_rewards"] = step_rewards(run_dir)
        print(f"max_staleness {eta} seed {seed}: already done ({run_dir})", flush=True)
        return summary
    config = json.loads(json.dumps(base))  # deep copy
    config.setdefault("trainer", {})["max_staleness"] = eta
    config.setdefault("data", {})["seed"] = seed
    config["output_dir"] = str(run_dir)
    if steps is not None:
        config["steps"] = steps
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / f"staleness-{eta}-seed{seed}.json"
    config_path.write_text(json.dumps(config, indent=2))
    log_path = run_dir / "train.out"
    cmd = [sys.executable, "-m", "proxima.cli", "--log-format", "text", "--log-level", "warning",
           "train", "--config", str(config_path)]  # fmt: skip
    print(
        f"max_staleness {eta} seed {seed}: {' '.join(cmd[2:])} (output in {log_path})", flush=True
    )
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise SystemExit(
            f"max_staleness {eta} seed {seed}: proxima train exited {proc.returncode}:\n{tail}"
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["bench_wall_s"] = time.monotonic() - started
    summary["step_rewards"] = step_rewards(run_dir)
    print(
        f"  done in {summary['bench_wall_s']:.0f} s: {summary['steps']} steps, "
        f"{summary['seconds_per_step']} s/step, held-out {summary['before']:.1%} -> "
        f"{summary['after']:.1%}",
        flush=True,
    )
    return summary


def table(results: dict[int, list[dict[str, Any]]]) -> str:
    """One line per staleness bound, mean +- sample std over seeds, then the paired gap."""
    lines = [
        f"{'max_staleness':>13} {'seeds':>5} {'s/step':>12} {'before':>7} "
        f"{'after':>15} {'gain (pt)':>12}  per seed (before -> after)"
    ]
    for eta, runs in sorted(results.items()):
        sps = summary([r["seconds_per_step"] for r in runs])
        after = summary([r["after"] for r in runs])
        gain = summary([100 * (r["after"] - r["before"]) for r in runs])
        before = statistics.fmean(r["before"] for r in runs)
        per_seed = ", ".join(f"{r['before']:.0%}->{r['after']:.0%}" for r in runs)
        lines.append(
            f"{eta:>13} {len(runs):>5} {sps[0]:>6.1f}+-{sps[1]:<4.1f} {before:>7.1%} "
            f"{after[0]:>7.1%}+-{after[1]:<6.1%} {gain[0]:>+5.1f}+-{gain[1]:<5.1f}  {per_seed}"
        )
    bounds = sorted(results)
    for eta in bounds[1:]:
        pairs = list(zip(results[bounds[0]], results[eta], strict=False))
        gap = summary([100 * (b["after"] - a["after"]) for a, b in pairs])
        lines.append(
            f"paired held-out gap, max_staleness {eta} - {bounds[0]} (same seeds): "
            f"{gap[0]:+.1f} +- {gap[1]:.1f} pt over {len(pairs)} seeds"
        )
    return "\n".join(lines)


def plot(results: dict[int, list[dict[str, Any]]], path: Path) -> None:
    """Training reward per PPO step, mean +- 1 std over seeds, one band per bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for eta, runs in sorted(results.items()):
        curves = [r["step_rewards"] for r in runs if r.get("step_rewards")]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        steps = list(range(1, n + 1))
        stats = [summary([c[i] for c in curves]) for i in range(n)]
        mean = [m for m, _ in stats]
        (line,) = ax.plot(steps, mean, label=f"max_staleness {eta} ({len(curves)} seeds)")
        ax.fill_between(
            steps,
            [m - s for m, s in stats],
            [m + s for m, s in stats],
            color=line.get_color(),
            alpha=0.15,
        )
    ax.set_xlabel("PPO step")
    ax.set_ylabel("training reward (16 sessions per step)")
    ax.set_title("make demo (SmolLM2-135M): mean +- 1 std over seeds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "agents_examples" / "demo.toml")
    parser.add_argument("--staleness", default="0,2", help="comma-separated bounds to compare")
    parser.add_argument("--seeds", type=int, default=1, help="dataset seeds 0..N-1 per bound")
    parser.add_argument("--steps", type=int, default=None, help="override the config's steps")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench-staleness")
    args = parser.parse_args()
    base = load_raw_config(args.config)
    bounds = [int(x) for x in args.staleness.split(",") if x.strip()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[int, list[dict[str, Any]]] = {eta: [] for eta in bounds}
    for seed in range(args.seeds):  # seed-major: an interrupted grid still has paired runs
        for eta in bounds:
            results[eta].append(run_one(base, eta, seed, args.steps, args.out_dir))
    print()
    first = results[bounds[0]][0]
    print(f"demo config {args.config.name}, {first['steps']} steps per run, {args.seeds} seeds")
    print(table(results))
    plot(results, args.out_dir / "reward_curves.png")
    print(f"curves: {args.out_dir / 'reward_curves.png'}")
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
