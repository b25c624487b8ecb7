"""Seeded arithmetic datasets: deterministic, disjoint splits, right answers, CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from proxima.agents_examples.datasets import (
    DIFFICULTIES,
    arithmetic_problems,
    arithmetic_splits,
    read_jsonl,
    write_arithmetic_splits,
)

QUESTION = re.compile(r"^What is (\d+) ([+\-*]) (\d+)\?$")


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTIES))
def test_problems_are_well_formed_and_answers_right(difficulty: str) -> None:
    level = DIFFICULTIES[difficulty]
    problems = arithmetic_problems(60, difficulty=difficulty, seed=3)
    assert len({p["question"] for p in problems}) == len({p["id"] for p in problems}) == 60
    for p in problems:
        match = QUESTION.match(p["question"])
        assert match is not None, p
        a, op, b = match.groups()
        a_int, b_int = int(a), int(b)
        assert op in level.operators
        assert p["answer"] == {"+": a_int + b_int, "-": a_int - b_int, "*": a_int * b_int}[op]
        assert p["answer"] >= 0 and p["difficulty"] == difficulty


def test_generation_is_deterministic_and_seeded() -> None:
    first = arithmetic_splits(difficulty="easy", n_train=100, n_test=20, seed=0)
    assert first == arithmetic_splits(difficulty="easy", n_train=100, n_test=20, seed=0)
    assert first != arithmetic_splits(difficulty="easy", n_train=100, n_test=20, seed=1)
    # The held-out part does not depend on how many train problems are drawn.
    assert (
        first["test"] == arithmetic_splits(difficulty="easy", n_train=10, n_test=20, seed=0)["test"]
    )


def test_splits_are_disjoint_and_sized() -> None:
    splits = arithmetic_splits(difficulty="tiny", n_train=60, n_test=20, seed=0)
    train_q = {p["question"] for p in splits["train"]}
    test_q = {p["question"] for p in splits["test"]}
    assert len(train_q) == 60 and len(test_q) == 20 and not train_q & test_q
    assert {p["split"] for p in splits["train"]} == {"train"}
    assert {p["split"] for p in splits["test"]} == {"test"}


def test_too_few_distinct_problems_and_unknown_level_are_errors() -> None:
    with pytest.raises(ValueError, match="fewer than 82"):
        arithmetic_problems(82, difficulty="tiny")  # 9 x 9 single-digit sums exist
    with pytest.raises(ValueError, match="unknown difficulty"):
        arithmetic_problems(1, difficulty="impossible")


def test_write_and_cli_give_the_same_files(tmp_path: Path) -> None:
    paths = write_arithmetic_splits(
        tmp_path / "api", difficulty="medium", n_train=30, n_test=10, seed=5
    )
    assert [p["id"] for p in read_jsonl(paths["test"])] == [
        p["id"]
        for p in arithmetic_splits(difficulty="medium", n_train=30, n_test=10, seed=5)["test"]
    ]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxima.agents_examples.datasets",
            "--out-dir",
            str(tmp_path / "cli"),
            "--difficulty",
            "medium",
            "--train",
            "30",
            "--test",
            "10",
            "--seed",
            "5",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "arith-medium-train.jsonl" in out
    for name in ("train", "test"):
        cli_file = tmp_path / "cli" / f"arith-medium-{name}.jsonl"
        assert cli_file.read_bytes() == paths[name].read_bytes()
    assert len(list(read_jsonl(paths["train"]))) == 30
