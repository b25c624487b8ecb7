"""Seeded arithmetic datasets: deterministic, disjoint splits, right answers, CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from proxima.agents_examples.datasets import (
    DIFFICULTIES,
    TRAIN_PHRASING,
    TRAIN_PHRASINGS,
    UNSEEN_PHRASINGS,
    arithmetic_problems,
    arithmetic_splits,
    item_problem_key,
    problem_key,
    read_jsonl,
    write_arithmetic_splits,
)

QUESTION = re.compile(r"^What is (\d+) ([+\-*]) (\d+)\?$")


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTIES))
def test_problems_are_well_formed_and_answers_right(difficulty: str) -> None:
    level = DIFFICULTIES[difficulty]
    problems = arithmetic_problems(40, difficulty=difficulty, seed=3)
    assert len({p["question"] for p in problems}) == len({p["id"] for p in problems}) == 40
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


@pytest.mark.parametrize("difficulty", ["tiny", "easy"])
def test_splits_are_disjoint_by_problem_and_sized(difficulty: str) -> None:
    # Disjoint by problem, not by string: "7 + 5" held out means "5 + 7" is not trained.
    splits = arithmetic_splits(difficulty=difficulty, n_train=25, n_test=20, seed=0)
    train_q = {problem_key(*_parsed(p["question"])) for p in splits["train"]}
    test_q = {problem_key(*_parsed(p["question"])) for p in splits["test"]}
    assert len(train_q) == 25 and len(test_q) == 20 and not train_q & test_q
    # Every problem of the level, drawn: each appears once, whichever way its operands are written.
    every = arithmetic_problems(
        210 if difficulty == "easy" else 45, difficulty="add" if difficulty == "easy" else "tiny"
    )
    assert len({problem_key(*_parsed(p["question"])) for p in every}) == len(every)
    assert {p["split"] for p in splits["train"]} == {"train"}
    assert {p["split"] for p in splits["test"]} == {"test"}


def _parsed(question: str) -> tuple[str, int, int]:
    a, op, b = QUESTION.match(question).groups()  # type: ignore[union-attr]
    return op, int(a), int(b)


def test_too_few_distinct_problems_and_unknown_level_are_errors() -> None:
    with pytest.raises(ValueError, match="fewer than 46"):
        arithmetic_problems(46, difficulty="tiny")  # 45 single-digit sums exist (a + b = b + a)
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


# --------------------------------------------------------------------------- unseen phrasings


def _operands(item: dict) -> tuple[str, int, int]:
    a, b = item["operands"]
    return item["operator"], a, b


@pytest.mark.parametrize(("difficulty", "n_train"), [("easy", 300), ("medium", 400), ("tiny", 30)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unseen_problems_and_phrasings_never_meet_the_training(
    difficulty: str, n_train: int, seed: int
) -> None:
    n_unseen = 5 if difficulty == "tiny" else 50
    splits = arithmetic_splits(
        difficulty=difficulty, n_train=n_train, n_test=10, seed=seed, n_unseen=n_unseen
    )
    unseen = splits["unseen"]
    assert len(unseen) == n_unseen and {p["split"] for p in unseen} == {"unseen"}
    assert len({p["id"] for p in unseen}) == n_unseen
    # No problem of the train or held-out part, even with a sum's or product's operands swapped.
    seen = set()
    for p in splits["train"] + splits["test"]:
        a, op, b = QUESTION.match(p["question"]).groups()  # type: ignore[union-attr]
        seen.add((op, int(a), int(b)))
        if op in "+*":
            seen.add((op, int(b), int(a)))
    keys = [_operands(p) for p in unseen]
    assert not seen & set(keys)
    assert len({problem_key(*k) for k in keys}) == n_unseen  # distinct among themselves too
    level = DIFFICULTIES[difficulty]
    for p, (op, a, b) in zip(unseen, keys, strict=True):
        # Never the train phrasing, nor any operator symbol: words only.
        assert not QUESTION.match(p["question"]) and not re.search(r"[+\-*=]", p["question"])
        assert p["phrasing"][0] == op
        assert p["question"] == UNSEEN_PHRASINGS[op][int(p["phrasing"][1:])].format(a=a, b=b)
        assert sorted(int(x) for x in re.findall(r"\d+", p["question"])) == sorted((a, b))
        assert op in level.operators and p["answer"] >= 0
        assert p["answer"] == {"+": a + b, "-": a - b, "*": a * b}[op]
    # The same seed gives the same set; adding it leaves the other parts unchanged.
    assert splits == arithmetic_splits(
        difficulty=difficulty, n_train=n_train, n_test=10, seed=seed, n_unseen=n_unseen
    )
    plain = arithmetic_splits(difficulty=difficulty, n_train=n_train, n_test=10, seed=seed)
    assert set(plain) == {"train", "test"}
    assert (plain["train"], plain["test"]) == (splits["train"], splits["test"])


def test_unseen_phrasings_are_not_the_train_phrasing_and_mix_in_a_set() -> None:
    templates = [t for ts in UNSEEN_PHRASINGS.values() for t in ts]
    assert len(set(templates)) == len(templates)
    for t in templates:
        assert not t.startswith("What is {a}") and "{op}" not in t
        assert t.format(a=3, b=4) != TRAIN_PHRASING.format(a=3, op="+", b=4)
    unseen = arithmetic_splits(difficulty="easy", n_train=300, n_test=50, n_unseen=50)["unseen"]
    assert len({p["phrasing"] for p in unseen}) >= 8  # many wordings, not one rewritten template
    assert {p["phrasing"][0] for p in unseen} == {"+", "-"}


def test_too_few_unseen_problems_is_an_error() -> None:
    # 45 distinct single-digit sums (a + b = b + a): 40 train and held-out leave at most 5.
    with pytest.raises(ValueError, match="outside the train and held-out parts"):
        arithmetic_splits(difficulty="tiny", n_train=36, n_test=4, n_unseen=20)


def test_cli_writes_the_unseen_set(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "proxima.agents_examples.datasets", "--out-dir", str(tmp_path),
         "--train", "300", "--test", "50", "--unseen", "50", "--seed", "4"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    written = list(read_jsonl(tmp_path / "arith-easy-unseen.jsonl"))
    expected = arithmetic_splits(difficulty="easy", n_train=300, n_test=50, seed=4, n_unseen=50)
    assert written == expected["unseen"]


# --------------------------------------------------------------------------- train phrasings


def test_train_phrasings_are_disjoint_from_the_unseen_ones() -> None:
    for op, wordings in TRAIN_PHRASINGS.items():
        assert wordings[0] == TRAIN_PHRASING.replace("{op}", op)
        assert len(set(wordings)) == len(wordings)
        assert not set(wordings) & set(UNSEEN_PHRASINGS[op])
        for w in wordings:
            # Both operands once each; no train question is ever an unseen one.
            assert w.count("{a}") == w.count("{b}") == 1
            assert w.format(a=3, b=4) not in {u.format(a=3, b=4) for u in UNSEEN_PHRASINGS[op]}


@pytest.mark.parametrize("seed", [0, 1])
def test_several_train_phrasings_keep_the_problems_and_the_unseen_set(seed: int) -> None:
    one = arithmetic_splits(difficulty="easy", n_train=250, n_test=50, seed=seed, n_unseen=100)
    six = arithmetic_splits(
        difficulty="easy", n_train=250, n_test=50, seed=seed, n_unseen=100, train_phrasings=6
    )
    assert six["unseen"] == one["unseen"]  # the unseen set does not depend on the wordings
    used = set()
    for part in ("train", "test"):
        assert len(six[part]) == len(one[part])
        for plain, worded in zip(one[part], six[part], strict=True):
            op, a, b = _parsed(plain["question"])
            assert (worded["id"], worded["answer"], worded["split"]) == (
                plain["id"],
                plain["answer"],
                part,
            )
            assert (worded["operator"], worded["operands"]) == (op, [a, b])
            k = int(worded["phrasing"][1:])
            assert worded["phrasing"][0] == op and 0 <= k < 6
            assert worded["question"] == TRAIN_PHRASINGS[op][k].format(a=a, b=b)
            assert item_problem_key(worded) == problem_key(op, a, b)
            used.add(worded["phrasing"])
    assert used == {f"{op}{k}" for op in "+-" for k in range(6)}  # every wording is asked
    # Operand-disjoint from the unseen problems, as with one wording.
    keys = {item_problem_key(p) for p in six["train"] + six["test"]}
    assert not keys & {item_problem_key(p) for p in six["unseen"]}
    assert not {p["question"] for p in six["test"]} & {p["question"] for p in six["train"]}


def test_train_phrasings_out_of_range_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train_phrasings must be 1 to 6, not 7"):
        arithmetic_splits(difficulty="easy", n_train=10, n_test=5, train_phrasings=7)
    with pytest.raises(ValueError, match="train_phrasings must be 1 to 6, not 0"):
        arithmetic_splits(difficulty="easy", n_train=10, n_test=5, train_phrasings=0)
    paths = write_arithmetic_splits(
        tmp_path, difficulty="medium", n_train=30, n_test=10, seed=2, train_phrasings=3
    )
    assert {p["phrasing"][1:] for p in read_jsonl(paths["train"])} <= {"0", "1", "2"}
