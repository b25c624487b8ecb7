"""Benchmark: ``make demo-tools``'s configuration over paired seeds.

Runs ``proxima train`` on ``agents_examples/tools_demo.toml`` (or ``--config``) once per seed
``0..N-1`` (``--first-seed`` F: ``F..F+N-1``); a seed sets ``data.seed`` (the train/held-out
split of 3-digit x 2-digit products, disjoint by unordered operand pair) and ``rollout.seed``
(the engine's sampling of every training request). Before and after are the same held-out problems, greedy: the seeds are
paired. For each seed it prints::

    seed 0: first try 4% -> 40% (+36 pt); well-formed calls 10% -> 96%; mean turns 1.2 -> 2.0; 12 steps, 1500 s; warm start 14/16 kept, first try 30% after it

and last::

    tool demo seeds: gains +36, +20, +30 points; mean +28.7; min +20; well-formed after 96% (min 94%)

(the last part with a ``[warm_start]``: its runs kept and the first try measured right after it,
from the run's ``warm_start.json``). It writes one ``run`` line per seed (its summary, step
rewards, the warm start's figures, the commit) and a ``summary``
line to a dated ``demo_tools_seeds`` jsonl in ``bench/results/``, and the reward curves of the seeds
(mean +- std) beside it as a ``.png``. A seed whose run already finished with the same config
is read, not run again; a run that failed is reported and left out.

Run: ``nice -n 19 .venv/bin/python bench/demo_tools_seeds.py`` (``--seeds 3``, ``--parallel 3``
to run the seeds side by side, ``--set steps=8`` to change the config, ``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxima.trainer.config import load_raw_config  # noqa: E402

from bench.demo_seeds import (  # noqa: E402
    apply_set,
    git_commit,
    plot,
    seed_config,
    start_run,
    step_rewards,
)


def _test(r: dict[str, Any], when: str, key: str) -> float | None:
    value = ((r.get("scores") or {}).get(when) or {}).get("test", {}).get(key)
    return None if value is None else float(value)


def read_result(seed: int, run_dir: Path) -> dict[str, Any] | None:
    """The seed's summary with its step rewards; None when the run left no summary."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    result: dict[str, Any] = json.loads(path.read_text())
    result["seed"] = seed
    result["step_rewards"] = step_rewards(run_dir)
    for when in ("before", "after"):
        result[f"well_formed_{when}"] = _test(result, when, "well_formed")
        result[f"turns_{when}"] = _test(result, when, "turns")
    warm = run_dir / "warm_start.json"
    if warm.exists():  # the warm start's own figures (proxima.trainer.pipeline.warm_start)
        result["warm_start"] = json.loads(warm.read_text())
    return result


def _warm(r: dict[str, Any]) -> str:
    """``; warm start 14/16 kept, first try 60% after it`` (empty without a warm start)."""
    warm = r.get("warm_start")
    if not warm:
        return ""
    after = (warm.get("after") or {}).get("headline")
    shown = "" if after is None else f", first try {after:.0%} after it"
    return f"; warm start {warm['kept']}/{warm['runs']} kept{shown}"


def gain(r: dict[str, Any]) -> float:
    """First-try held-out gain in points."""
    return 100 * (float(r["after"]) - float(r["before"]))


def seed_line(r: dict[str, Any]) -> str:
    def pct(key: str) -> str:
        return "n/a" if r.get(key) is None else f"{r[key]:.0%}"

    def num(key: str) -> str:
        return "n/a" if r.get(key) is None else f"{r[key]:.2f}"

    return (
        f"seed {r['seed']}: first try {r['before']:.0%} -> {r['after']:.0%} "
        f"({gain(r):+.0f} pt); well-formed calls {pct('well_formed_before')} -> "
        f"{pct('well_formed_after')}; mean turns {num('turns_before')} -> {num('turns_after')}; "
        f"{r.get('steps')} steps, {r.get('wall_s')} s{_warm(r)}"
    )


def final_line(results: list[dict[str, Any]]) -> str:
    if not results:
        return "tool demo seeds: no run finished"
    gains = [gain(r) for r in results]
    formed = [r["well_formed_after"] for r in results if r.get("well_formed_after") is not None]
    after = (
        f"; well-formed after {statistics.fmean(formed):.0%} (min {min(formed):.0%})"
        if formed
        else ""
    )
    listed = ", ".join(f"{g:+.0f}" for g in gains)
    return (
        f"tool demo seeds: gains {listed} points; mean {statistics.fmean(gains):+.1f}; "
        f"min {min(gains):+.0f}{after}"
    )


def write_jsonl(path: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps({"kind": "run", **meta, **r}, default=str) + "\n")
        summary = {"kind": "summary", **meta, "gains": [gain(r) for r in results],
                   "line": final_line(results)}  # fmt: skip
        f.write(json.dumps(summary, default=str) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "agents_examples" / "tools_demo.toml")
    parser.add_argument("--seeds", type=int, default=3, help="seeds FIRST..FIRST+N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=1, help="runs side by side")
    parser.add_argument("--set", action="append", default=[], help="key.path=value (JSON)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench-demo-tools")
    parser.add_argument("--results", type=Path, default=None, help="jsonl (default: dated)")
    args = parser.parse_args()

    base = load_raw_config(args.config)
    for assignment in args.set:
        apply_set(base, assignment)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    started = time.monotonic()
    pending = list(seeds)
    running: list[tuple[int, Any]] = []
    while pending or running:
        while pending and len(running) < args.parallel:
            seed = pending.pop(0)
            run_dir = args.out_dir / f"seed{seed}"
            proc = start_run(seed_config(base, seed, run_dir), run_dir)
            if proc is not None:
                running.append((seed, proc))
        for seed, proc in list(running):
            if proc.poll() is not None:
                running.remove((seed, proc))
                print(f"seed{seed}: exit {proc.returncode}", flush=True)
        time.sleep(2)

    results = []
    for seed in seeds:
        result = read_result(seed, args.out_dir / f"seed{seed}")
        if result is None:
            print(f"seed {seed}: no summary (see {args.out_dir / f'seed{seed}' / 'train.out'})")
            continue
        results.append(result)
        print(seed_line(result), flush=True)
    print(final_line(results), flush=True)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    path = args.results or ROOT / "bench" / "results" / f"demo_tools_seeds-{day}.jsonl"
    meta = {"commit": git_commit(), "time": day, "config": str(args.config), "set": args.set,
            "bench_wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
    write_jsonl(path, results, meta)
    plot(results, path.with_suffix(".png"), f"make demo-tools over {len(results)} seeds")
    print(f"results: {path}")
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
