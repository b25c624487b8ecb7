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

Run: ``.venv/bin/python bench/demo_staleness.py`` (two demo runs, about 30
minutes on 2 cores); ``--steps N`` for a shorter comparison, ``--staleness
0,1,2`` for more bounds, ``--config FILE`` for another run config.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxima.trainer.config import load_raw_config  # noqa: E402


def run_one(base: dict[str, Any], eta: int, steps: int | None, out_dir: Path) -> dict[str, Any]:
    """One ``proxima train`` run with ``trainer.max_staleness = eta``; its summary.json."""
    run_dir = out_dir / f"staleness-{eta}"
    config = json.loads(json.dumps(base))  # deep copy
    config.setdefault("trainer", {})["max_staleness"] = eta
    config["output_dir"] = str(run_dir)
    if steps is not None:
        config["steps"] = steps
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / f"staleness-{eta}.json"
    config_path.write_text(json.dumps(config, indent=2))
    log_path = run_dir / "train.out"
    cmd = [sys.executable, "-m", "proxima.cli", "--log-format", "text", "--log-level", "warning",
           "train", "--config", str(config_path)]  # fmt: skip
    print(f"max_staleness {eta}: {' '.join(cmd[2:])} (output in {log_path})", flush=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise SystemExit(f"max_staleness {eta}: proxima train exited {proc.returncode}:\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["bench_wall_s"] = time.monotonic() - started
    print(
        f"  done in {summary['bench_wall_s']:.0f} s: {summary['steps']} steps, "
        f"{summary['seconds_per_step']} s/step, held-out {summary['before']:.1%} -> "
        f"{summary['after']:.1%}",
        flush=True,
    )
    return summary


def table(results: dict[int, dict[str, Any]]) -> str:
    base = results[min(results)]
    lines = [
        f"{'max_staleness':>13} {'steps':>5} {'s/step':>7} {'vs ' + str(min(results)):>6} "
        f"{'train s':>8} {'before':>7} {'after':>7} {'gain':>6}"
    ]
    for eta, s in sorted(results.items()):
        speed = base["seconds_per_step"] / s["seconds_per_step"]
        gain = 100 * (s["after"] - s["before"])
        lines.append(
            f"{eta:>13} {s['steps']:>5} {s['seconds_per_step']:>7.1f} {speed:>5.2f}x "
            f"{s['train_s']:>8.0f} {s['before']:>7.1%} {s['after']:>7.1%} {gain:>+5.0f}pt"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "agents_examples" / "demo.toml")
    parser.add_argument("--staleness", default="0,2", help="comma-separated bounds to compare")
    parser.add_argument("--steps", type=int, default=None, help="override the config's steps")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench-staleness")
    args = parser.parse_args()
    base = load_raw_config(args.config)
    bounds = [int(x) for x in args.staleness.split(",") if x.strip()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {eta: run_one(base, eta, args.steps, args.out_dir) for eta in bounds}
    print()
    print(f"demo config {args.config.name}, {results[bounds[0]]['steps']} steps per run")
    print(table(results))
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
