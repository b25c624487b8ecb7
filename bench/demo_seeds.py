"""Benchmark: `make demo`'s configuration over seeds, on both held-out sets.

Runs ``proxima train`` with ``agents_examples/demo.toml`` (the real proxy,
embedded CPU engine, rollout controller and trainer process: exactly what
``make demo`` runs) once per seed ``0..N-1``. A seed sets both
``data.seed`` (the train/held-out/unseen split and the order of the training
problems) and ``rollout.seed`` (every training request carries a seed derived
from it, the problem, the run's index in its group and the turn, so the
engine's sampling is seeded too). The splits are paired: any two configs run
with this script see the same problems for the same seed. Evaluation is greedy.

What stays unseeded: which policy version serves a request depends on when
the trainer pushes, so two runs of one seed can still differ a little.

For each seed it prints first-try accuracy before -> after (one answer, no
feedback: the headline of ``proxima train``'s summary) on the held-out problems
in the train phrasing, success within the evaluation's tries beside it, the
first-try accuracy on held-out problems in phrasings the training never used,
and the share of first answers cut at ``max_tokens``; it ends with::

    demo seeds: gains G1, G2, G3 points; mean M; unseen phrasings mean U

(gains in points of first-try accuracy; ``U`` is the mean gain on the unseen
phrasings). ``reward_curves.png`` shows the training reward per step, mean +- 1
std over seeds; ``results.json`` keeps every run's summary and step rewards, and
``--jsonl`` (default ``<out-dir>/results.jsonl``) gets one line per run and a last
summary line, each with the commit. A run whose summary is already there with the
same config is not run again.

Run: ``.venv/bin/python bench/demo_seeds.py`` (3 seeds, one after another,
about as long as three ``make demo``); ``--set trainer.optim.lr=2e-5`` (repeatable)
to measure a variant on the same seeds, ``--parallel 3`` to run the seeds side
by side (wall times are then not speed figures). ``--lora demo`` trains a LoRA
adapter named ``demo`` on the same rollouts instead of the base (one
``[[rollout.tenants]]``; its rank, alpha and lr with ``--set``), and
``--versus runs/other`` prints this config's gain beside another out-dir's per seed,
with mean +- sample std of both and of their paired difference.

``--baselines`` trains nothing: it evaluates the base model (``proxima eval``) on
each seed's sets under the variants of :data:`BASELINES` of the config (a
shorter and a longer ``max_tokens``, a "number only" system prompt), printing one
line per variant (first try, within the eval's tries, unseen phrasings, first
answers cut; mean over seeds) and writing them to the jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxima.trainer.config import load_raw_config  # noqa: E402

from bench.testbed import summary as mean_std  # noqa: E402  (mean, sample std)

NUMBER_ONLY = "Answer with the number only."

# Base-model variants --baselines evaluates beside the config itself: --set assignments.
BASELINES: dict[str, list[str]] = {
    "max_tokens 32": ["rollout.item_fields.max_tokens=32"],
    "max_tokens 256": ["rollout.item_fields.max_tokens=256"],
    "number-only system prompt": [f"rollout.item_fields.system={NUMBER_ONLY}"],
}


def apply_set(config: dict[str, Any], assignment: str) -> None:
    """``a.b.c=VALUE`` (VALUE as JSON, else a string) into the nested ``config``."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {assignment!r}: expected key.path=value")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def seed_config(base: dict[str, Any], seed: int, run_dir: Path) -> dict[str, Any]:
    config = json.loads(json.dumps(base))  # deep copy
    config.setdefault("data", {})["seed"] = seed
    config.setdefault("rollout", {})["seed"] = seed
    config["output_dir"] = str(run_dir)
    return config


def start_run(config: dict[str, Any], run_dir: Path) -> subprocess.Popen[bytes] | None:
    """Start one ``proxima train``; None when an identical run already finished."""
    config_path = run_dir / "run_config.json"
    text = json.dumps(config, indent=2, sort_keys=True)
    done = (run_dir / "summary.json").exists() and config_path.exists()
    if done and config_path.read_text() == text:
        print(f"{run_dir.name}: already done", flush=True)
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").unlink(missing_ok=True)
    config_path.write_text(text)
    cmd = [sys.executable, "-m", "proxima.cli", "--log-format", "text", "--log-level", "warning",
           "train", "--config", str(config_path), "--no-progress"]  # fmt: skip
    print(f"{run_dir.name}: {' '.join(cmd[2:])} (output in {run_dir / 'train.out'})", flush=True)
    log = open(run_dir / "train.out", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def step_rewards(run_dir: Path) -> list[float]:
    """Training-batch reward of every trainer step of one run (``train_log.jsonl``)."""
    logs = sorted(run_dir.rglob("train_log.jsonl"))
    if not logs:
        return []
    rows = [json.loads(line) for line in logs[0].read_text().splitlines() if line.strip()]
    return [float(r.get("reward_mean") or 0.0) for r in rows if r.get("event", "step") == "step"]


def as_adapter_run(config: dict[str, Any], adapter: str) -> None:
    """Turn ``config`` into a one-tenant run: the same rollouts train the LoRA adapter
    ``adapter`` (``[[rollout.tenants]]`` + ``[trainer.lora] adapters``) instead of the base."""
    config.setdefault("rollout", {})["tenants"] = [{"adapter": adapter}]
    config.setdefault("trainer", {}).setdefault("lora", {})["adapters"] = [adapter]


def trained_first_answers(db: Path, advantage: dict[str, Any]) -> dict[str, Any]:
    """The advantages the trainer gave its trained sessions' first answers, recomputed from a
    run's SQLite store (``proxima.trainer.advantages`` with the run's discount, baseline and
    std): count and mean advantage of wrong first answers (the session went on, or ended on
    reward 0) and of right ones. A reward design that reinforces a wrong first answer gives
    the wrong ones a positive mean."""
    from proxima.trainer.advantages import discounted_returns, group_advantages

    with closing(sqlite3.connect(db)) as conn:
        sessions = conn.execute(
            "SELECT id, group_id, reward FROM sessions WHERE status = 'trained'"
        ).fetchall()
        turns = dict(
            conn.execute(
                "SELECT session_id, COUNT(*) FROM completions c JOIN sessions s "
                "ON s.id = c.session_id WHERE s.status = 'trained' GROUP BY session_id"
            ).fetchall()
        )
    returns, group_of, wrong = {}, {}, {}
    for sid, group, reward in sessions:
        n = int(turns.get(sid, 0))
        if n == 0:
            continue
        rewards = [0.0] * (n - 1) + [float(reward or 0.0)]
        returns[sid] = discounted_returns(rewards, float(advantage.get("discount", 1.0)))
        group_of[sid] = group or sid
        wrong[sid] = n > 1 or not reward
    adv = group_advantages(
        returns,
        group_of,
        baseline=advantage.get("baseline", "group_mean"),
        normalize_std=bool(advantage.get("normalize_std", True)),
    )
    out: dict[str, Any] = {}
    for name, flag in (("wrong", True), ("right", False)):
        firsts = [adv[sid][0] for sid in adv if wrong[sid] is flag]
        out[f"{name}_first_answers"] = len(firsts)
        out[f"{name}_first_mean_advantage"] = statistics.fmean(firsts) if firsts else None
    return out


def read_result(seed: int, run_dir: Path) -> dict[str, Any]:
    result = json.loads((run_dir / "summary.json").read_text())
    tenants = result.pop("tenants", None)
    if tenants:  # a one-tenant adapter run: its figures, with the run's timing
        if len(tenants) != 1:
            raise SystemExit(f"{run_dir}: {len(tenants)} tenants; this bench reads one")
        ((adapter, figures),) = tenants.items()
        result = {**result, **figures, "adapter": adapter}
    if result.get("unseen_before") is None:
        raise SystemExit(f"{run_dir}: no unseen-phrasings figures; set data.unseen_items")
    result["seed"] = seed
    result["step_rewards"] = step_rewards(run_dir)
    if (run_dir / "store.db").exists() and (run_dir / "run_config.json").exists():
        config = json.loads((run_dir / "run_config.json").read_text())
        advantage = config.get("trainer", {}).get("advantage", {})
        result["trained_first_answers"] = trained_first_answers(run_dir / "store.db", advantage)
    return result


def _score(r: dict[str, Any], when: str, key: str) -> float | None:
    """``scores[when]["test"][key]`` of a summary (None: not reported)."""
    value = ((r.get("scores") or {}).get(when) or {}).get("test", {}).get(key)
    return None if value is None else float(value)


def _pair(before: float | None, after: float | None) -> str:
    return "n/a" if before is None or after is None else f"{before:.0%} -> {after:.0%}"


def seed_line(r: dict[str, Any]) -> str:
    gain = 100 * (r["after"] - r["before"])
    unseen = 100 * (r["unseen_after"] - r["unseen_before"])
    within = _pair(_score(r, "before", "accuracy"), _score(r, "after", "accuracy"))
    cut = _pair(_score(r, "before", "truncated"), _score(r, "after", "truncated"))
    return (
        f"seed {r['seed']}: first try {r['before']:.0%} -> {r['after']:.0%} ({gain:+.0f} pt); "
        f"within the eval's tries {within}; "
        f"unseen phrasings {r['unseen_before']:.0%} -> {r['unseen_after']:.0%} ({unseen:+.0f} pt); "
        f"first answers cut {cut}; "
        f"{r['steps']} steps ({r.get('pushed_steps', '?')} with an update), "
        f"{r['seconds_per_step']} s/step, {r['eval_s']:.0f} s evaluating, {r['wall_s']:.0f} s in all"
    )


def final_line(results: list[dict[str, Any]]) -> str:
    gains = [100 * (r["after"] - r["before"]) for r in results]
    unseen = [100 * (r["unseen_after"] - r["unseen_before"]) for r in results]
    listed = ", ".join(f"{g:+.0f}" for g in gains)
    return (
        f"demo seeds: gains {listed} points; mean {statistics.fmean(gains):+.1f}; "
        f"unseen phrasings mean {statistics.fmean(unseen):+.1f}"
    )


def git_commit() -> str:
    """The working tree's commit (``-dirty`` with uncommitted changes), or
    ``$PROXIMA_CODE_COMMIT`` when set (a run of a ``bench/_code_at.py`` tree: no git there)."""
    if os.environ.get("PROXIMA_CODE_COMMIT"):
        return os.environ["PROXIMA_CODE_COMMIT"]
    out = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


def write_jsonl(path: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """One ``run`` line per seed and a last ``summary`` line (the ``demo seeds:`` line), each
    with ``meta`` (commit, time, config)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps({"kind": "run", **meta, **r}, default=str) + "\n")
        gains = [gain(r) for r in results]
        unseen = [100 * (r["unseen_after"] - r["unseen_before"]) for r in results]
        summary = {"kind": "summary", **meta, "gains": gains, "unseen_gains": unseen,
                   "line": final_line(results)}  # fmt: skip
        f.write(json.dumps(summary, default=str) + "\n")


def run_baselines(base: dict[str, Any], seeds: list[int], out_dir: Path) -> list[dict[str, Any]]:
    """The base model evaluated per seed under each of :data:`BASELINES`:
    one row per (variant, seed) with the held-out and unseen scores (``eval.json``)."""
    rows = []
    for name, assignments in BASELINES.items():
        for seed in seeds:
            run_dir = out_dir / "baselines" / name.replace(" ", "_") / f"seed{seed}"
            config = seed_config(base, seed, run_dir)
            for assignment in assignments:
                apply_set(config, assignment)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "run_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            cmd = [sys.executable, "-m", "proxima.cli", "--log-format", "text", "--log-level",
                   "warning", "eval", "--config", str(run_dir / "run_config.json")]  # fmt: skip
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{name}, seed {seed}: proxima eval exited {proc.returncode}:\n"
                                 f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")  # fmt: skip
            scores = json.loads((run_dir / "eval.json").read_text())
            rows.append({"variant": name, "set": assignments, "seed": seed, **scores})
            print(f"{name}, seed {seed}: {proc.stdout.strip()}", flush=True)
    return rows


def baseline_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per variant, the mean over seeds of each figure (percent)."""

    def mean(variant: str, part: str, key: str) -> str:
        values = [r[part][key] for r in rows if r["variant"] == variant and r[part]]
        values = [v for v in values if v is not None]
        return f"{100 * statistics.fmean(values):.1f}%" if values else "n/a"

    return [
        f"baseline {v}: first try {mean(v, 'test', 'first_try')}; within the eval's tries "
        f"{mean(v, 'test', 'accuracy')}; unseen phrasings (first try) "
        f"{mean(v, 'unseen', 'first_try')}; first answers cut {mean(v, 'test', 'truncated')}"
        for v in dict.fromkeys(r["variant"] for r in rows)
    ]


def gain(r: dict[str, Any]) -> float:
    """First-try (headline) gain of one run, in points."""
    return 100 * (r["after"] - r["before"])


def paired_lines(results: list[dict[str, Any]], versus_dir: Path) -> list[str]:
    """This config's gains beside those of the runs under ``versus_dir`` (another config of
    this bench on the same seeds: paired splits), per seed and mean +- sample std."""
    lines, ours, theirs = [], [], []
    for r in results:
        other_dir = versus_dir / f"seed{r['seed']}"
        if not (other_dir / "summary.json").exists():
            lines.append(f"seed {r['seed']}: {gain(r):+.0f} pt vs {versus_dir.name}: not there")
            continue
        other = read_result(r["seed"], other_dir)
        ours.append(gain(r))
        theirs.append(gain(other))
        lines.append(
            f"seed {r['seed']}: {gain(r):+.0f} pt vs {versus_dir.name} {gain(other):+.0f} pt "
            f"(unseen phrasings {100 * (r['unseen_after'] - r['unseen_before']):+.0f} vs "
            f"{100 * (other['unseen_after'] - other['unseen_before']):+.0f})"
        )
    if ours:
        (m, s), (mo, so) = mean_std(ours), mean_std(theirs)
        diff = mean_std([a - b for a, b in zip(ours, theirs, strict=True)])
        lines.append(
            f"paired over {len(ours)} seeds: this {m:+.1f} +- {s:.1f} pt; {versus_dir.name} "
            f"{mo:+.1f} +- {so:.1f} pt; difference {diff[0]:+.1f} +- {diff[1]:.1f} pt"
        )
    return lines


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training reward per trainer step, mean +- 1 std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [r["step_rewards"] for r in results if r["step_rewards"]]
    if not curves:
        return
    n = min(len(c) for c in curves)
    steps = list(range(1, n + 1))
    stats = [mean_std([c[i] for c in curves]) for i in range(n)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot(steps, r["step_rewards"][:n], alpha=0.3, linewidth=1)
    (line,) = ax.plot(steps, [m for m, _ in stats], linewidth=2, label=f"mean of {len(curves)}")
    ax.fill_between(
        steps,
        [m - s for m, s in stats],
        [m + s for m, s in stats],
        color=line.get_color(),
        alpha=0.15,
    )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("training reward (mean per step)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "agents_examples" / "demo.toml")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    parser.add_argument("--parallel", type=int, default=1, help="runs side by side")
    parser.add_argument(
        "--lora",
        metavar="ADAPTER",
        help="train a LoRA adapter of this name on the same rollouts instead of the base model "
        "(one [[rollout.tenants]]; rank, alpha, lr with --set trainer.lora.rank=16 ...)",
    )
    parser.add_argument(
        "--versus",
        type=Path,
        metavar="OUT_DIR",
        help="another config's --out-dir (same seeds): print both gains per seed, mean +- std",
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench-demo-seeds")
    parser.add_argument(
        "--jsonl", type=Path, help="raw results, with the commit (default <out-dir>/results.jsonl)"
    )
    parser.add_argument(
        "--baselines", action="store_true", help="evaluate the base model's variants only"
    )
    args = parser.parse_args()
    commit, started_at = git_commit(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    base = load_raw_config(args.config)
    if args.lora:
        as_adapter_run(base, args.lora)
    for assignment in args.set:
        apply_set(base, assignment)
    if not base.get("data", {}).get("unseen_items") and not base.get("data", {}).get("unseen_file"):
        raise SystemExit("the config evaluates no unseen phrasings: set data.unseen_items")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.baselines:
        rows = run_baselines(base, seeds, args.out_dir)
        jsonl = args.jsonl or args.out_dir / "baselines.jsonl"
        with jsonl.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"kind": "baseline", "commit": commit, "started": started_at,
                                    **row}) + "\n")  # fmt: skip
        for line in baseline_lines(rows):
            print(line)
        return 0
    dirs = {s: args.out_dir / f"seed{s}" for s in seeds}
    pending = list(seeds)
    running: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
    results: dict[int, dict[str, Any]] = {}
    while pending or running:
        while pending and len(running) < max(1, args.parallel):
            seed = pending.pop(0)
            proc = start_run(seed_config(base, seed, dirs[seed]), dirs[seed])
            if proc is None:
                results[seed] = read_result(seed, dirs[seed])
                print(f"  {seed_line(results[seed])}", flush=True)
            else:
                running[seed] = (proc, time.monotonic())
        for seed, (proc, started) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[seed]
            if proc.returncode != 0:
                tail = (dirs[seed] / "train.out").read_text(errors="replace")[-2000:]
                raise SystemExit(f"seed {seed}: proxima train exited {proc.returncode}:\n{tail}")
            results[seed] = read_result(seed, dirs[seed])
            results[seed]["bench_wall_s"] = round(time.monotonic() - started, 1)
            print(f"  {seed_line(results[seed])}", flush=True)
        time.sleep(2)
    ordered = [results[s] for s in seeds]
    print()
    changes = ([f"LoRA adapter {args.lora}"] if args.lora else []) + args.set
    overrides = f" with {', '.join(changes)}" if changes else ""
    print(f"config {args.config.name}{overrides}; {len(seeds)} seeds, paired splits")
    for r in ordered:
        print(seed_line(r))
    title = f"{args.config.name}{overrides}: training reward, {len(seeds)} seeds"
    plot(ordered, args.out_dir / "reward_curves.png", title)
    (args.out_dir / "results.json").write_text(
        json.dumps({"config": base, "runs": ordered}, indent=2, default=str)
    )
    jsonl = args.jsonl or args.out_dir / "results.jsonl"
    meta = {"commit": commit, "started": started_at, "config_file": args.config.name,
            "overrides": changes}  # fmt: skip
    write_jsonl(jsonl, ordered, meta)
    print(
        f"curves: {args.out_dir / 'reward_curves.png'}; raw: {args.out_dir / 'results.json'}, {jsonl}"
    )
    if args.versus is not None:
        for line in paired_lines(ordered, args.versus):
            print(line)
    print(final_line(ordered))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
