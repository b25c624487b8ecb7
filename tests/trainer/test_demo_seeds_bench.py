"""``bench/demo_seeds.py``'s bookkeeping: seeds applied to split and sampling, overrides, the summary line."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from proxima.trainer.config import load_raw_config
from proxima.trainer.pipeline.config import TrainRunConfig

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("demo_seeds", ROOT / "bench" / "demo_seeds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed_config_seeds_split_and_sampling_and_overrides_apply(tmp_path: Path) -> None:
    bench = _bench()
    base = load_raw_config(ROOT / "agents_examples" / "demo.toml")
    bench.apply_set(base, "trainer.ppo.ppo_minibatches=4")
    bench.apply_set(base, "trainer.optim.lr=2e-5")
    bench.apply_set(base, "output_dir=elsewhere")
    with pytest.raises(SystemExit, match="key.path=value"):
        bench.apply_set(base, "no-equals-sign")
    config = bench.seed_config(base, 2, tmp_path / "seed2")
    assert config["data"]["seed"] == config["rollout"]["seed"] == 2
    assert config["output_dir"] == str(tmp_path / "seed2")
    assert base["data"].get("seed", 0) == 0  # the base is not changed
    cfg = TrainRunConfig.model_validate(config)  # still a valid run config
    assert cfg.trainer.ppo.ppo_minibatches == 4 and cfg.trainer.optim.lr == 2e-5
    assert cfg.data.unseen_items > 0  # the demo evaluates unseen phrasings


def test_results_and_summary_line(tmp_path: Path) -> None:
    bench = _bench()
    runs = []
    for seed, (b, a, ub, ua) in enumerate([(0.2, 0.5, 0.1, 0.3), (0.24, 0.4, 0.2, 0.2)]):
        run_dir = tmp_path / f"seed{seed}"
        (run_dir / "trainer").mkdir(parents=True)
        summary = {"before": b, "after": a, "unseen_before": ub, "unseen_after": ua, "steps": 2,
                   "pushed_steps": 1, "seconds_per_step": 30.0, "eval_s": 80.0, "wall_s": 200.0}  # fmt: skip
        (run_dir / "summary.json").write_text(json.dumps(summary))
        (run_dir / "trainer" / "train_log.jsonl").write_text(
            '{"event": "step", "reward_mean": 0.25}\n{"event": "step", "reward_mean": null}\n'
        )
        runs.append(bench.read_result(seed, run_dir))
    assert runs[0]["step_rewards"] == [0.25, 0.0]
    line = bench.seed_line(runs[0])
    assert "first try 20% -> 50% (+30 pt); within the eval's tries n/a; " in line
    assert "unseen phrasings 10% -> 30% (+20 pt); first answers cut n/a; " in line
    assert bench.final_line(runs) == (
        "demo seeds: gains +30, +16 points; mean +23.0; unseen phrasings mean +10.0"
    )
    (tmp_path / "seed0" / "summary.json").write_text(json.dumps({"before": 0.2, "after": 0.5}))
    with pytest.raises(SystemExit, match="no unseen-phrasings figures"):
        bench.read_result(0, tmp_path / "seed0")


def test_lora_arm_reads_its_tenant_and_pairs_with_another_arm(tmp_path: Path) -> None:
    bench = _bench()
    base = load_raw_config(ROOT / "agents_examples" / "demo.toml")
    bench.as_adapter_run(base, "demo")
    bench.apply_set(base, "trainer.lora.rank=16")
    cfg = TrainRunConfig.model_validate(bench.seed_config(base, 1, tmp_path / "seed1"))
    assert [t.adapter for t in cfg.rollout.tenants] == ["demo"]
    assert cfg.trainer.lora.adapters == ("demo",) and cfg.trainer.lora.rank == 16

    timing = {"steps": 4, "seconds_per_step": 30.0, "eval_s": 80.0, "wall_s": 200.0}
    figures = {"before": 0.2, "after": 0.3, "unseen_before": 0.1, "unseen_after": 0.2}
    lora_dir, full_dir = tmp_path / "lora", tmp_path / "full"
    for seed, after in enumerate([0.3, 0.5]):
        run_dir = lora_dir / f"seed{seed}"
        (run_dir / "trainer" / "adapters" / "demo").mkdir(parents=True)
        tenant = {**figures, "after": after, "steps": 2, "pushed_steps": 2}
        (run_dir / "summary.json").write_text(json.dumps({"tenants": {"demo": tenant}, **timing}))
        (run_dir / "trainer" / "adapters" / "demo" / "train_log.jsonl").write_text(
            '{"event": "step", "reward_mean": 0.5}\n'
        )
    (full_dir / "seed0").mkdir(parents=True)
    (full_dir / "seed0" / "summary.json").write_text(
        json.dumps({**figures, "after": 0.4, "pushed_steps": 4, **timing})
    )
    runs = [bench.read_result(s, lora_dir / f"seed{s}") for s in (0, 1)]
    assert runs[0]["adapter"] == "demo" and runs[0]["steps"] == 2  # the tenant's own steps
    assert runs[0]["step_rewards"] == [0.5] and runs[0]["wall_s"] == 200.0
    assert bench.final_line(runs).startswith("demo seeds: gains +10, +30 points; mean +20.0")
    lines = bench.paired_lines(runs, full_dir)
    assert lines[0].startswith("seed 0: +10 pt vs full +20 pt")
    assert lines[1] == "seed 1: +30 pt vs full: not there"
    assert lines[2] == (
        "paired over 1 seeds: this +10.0 +- 0.0 pt; full +20.0 +- 0.0 pt; difference -10.0 +- 0.0 pt"
    )


def test_tenants_demo_config_trains_two_adapters_on_two_tasks() -> None:
    cfg = TrainRunConfig.model_validate(
        load_raw_config(ROOT / "agents_examples" / "tenants_demo.toml")
    )
    tasks = {t.adapter: t.data.difficulty for t in cfg.rollout.tenants if t.data is not None}
    assert tasks == {"tenant-a": "add", "tenant-b": "sub"}
    assert cfg.trainer.lora.adapters == ("tenant-a", "tenant-b")
    assert (cfg.trainer.lora.rank, cfg.trainer.lora.alpha) == (16, 32.0)


def _store(path: Path, sessions: list[tuple[str, str, float, int]]) -> Path:
    """A SQLite file with the columns ``trained_first_answers`` reads: (id, group, reward,
    turns) per trained session."""
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE sessions (id TEXT, group_id TEXT, reward REAL, status TEXT)")
        conn.execute("CREATE TABLE completions (id TEXT, session_id TEXT)")
        for sid, group, reward, turns in sessions:
            conn.execute("INSERT INTO sessions VALUES (?, ?, ?, 'trained')", (sid, group, reward))
            for t in range(turns):
                conn.execute("INSERT INTO completions VALUES (?, ?)", (f"{sid}-{t}", sid))
        conn.execute("INSERT INTO sessions VALUES ('x', 'g', 1.0, 'dropped')")
        conn.commit()
    return path


def test_trained_first_answers_show_whether_a_wrong_first_answer_is_reinforced(
    tmp_path: Path,
) -> None:
    bench = _bench()
    # One group: wrong then right (2 turns, reward 1), right at once, wrong twice (reward 0).
    db = _store(tmp_path / "store.db", [("a", "g", 1.0, 2), ("b", "g", 1.0, 1), ("c", "g", 0.0, 2)])
    # Discount 0.9 (the old demo): the first turn of "a" returns 0.9, above the group mean
    # (0.65): the wrong first answer gets a positive advantage, on average over a and c too.
    old = bench.trained_first_answers(db, {"discount": 0.9, "normalize_std": True})
    assert old["wrong_first_answers"] == 2 and old["right_first_answers"] == 1
    # Returns: a [0.9, 1.0], b [1.0], c [0.0, 0.0]; session-weighted mean and std.
    mu = (0.95 + 1.0 + 0.0) / 3
    sigma = (((0.9 - mu) ** 2 + (1 - mu) ** 2) / 6 + (1 - mu) ** 2 / 3 + mu**2 / 3) ** 0.5
    assert old["wrong_first_mean_advantage"] == pytest.approx(((0.9 - mu) + (0 - mu)) / 2 / sigma)
    assert (0.9 - mu) / sigma > 0  # "a"'s first answer reinforced
    # Discount 0: a wrong first answer returns 0 whatever follows: below the mean.
    new = bench.trained_first_answers(db, {"discount": 0.0, "normalize_std": True})
    assert new["wrong_first_mean_advantage"] < 0 < new["right_first_mean_advantage"]
    # One turn per session (make demo now): every wrong answer is below its group's mean.
    single = _store(
        tmp_path / "one.db",
        [("a", "g", 0.0, 1), ("b", "g", 1.0, 1), ("c", "h", 0.0, 1), ("d", "h", 1.0, 1)],
    )
    assert bench.trained_first_answers(single, {"discount": 0.0}) == {
        "wrong_first_answers": 2, "wrong_first_mean_advantage": -1.0,
        "right_first_answers": 2, "right_first_mean_advantage": 1.0,
    }  # fmt: skip
