"""Arithmetic datasets for the example agents, generated offline and deterministically.

A difficulty level fixes the operators and the operand range. Problems are
drawn with a seeded ``random.Random``, duplicates removed, and split into a
held-out part (drawn first) and a train part with no question in common, so
the same ``(difficulty, seed, sizes)`` always gives the same files. Items::

    {"id": "arith-easy-00042", "question": "What is 7 + 5?", "answer": 12,
     "split": "train", "difficulty": "easy"}

Levels, chosen for SmolLM2-135M-Instruct (the demo model): ``tiny``
(single-digit sums), ``easy`` (sums and differences up to 20), ``medium``
(two-digit ``+ - *``), ``tool`` (three-digit by two-digit products, for the
calculator agent).

CLI: ``python -m proxima.agents_examples.datasets --out-dir data --difficulty easy --train 400 --test 50``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Draws per requested problem before giving up (the level has too few distinct problems).
MAX_DRAWS_PER_PROBLEM = 50


@dataclass(frozen=True, slots=True)
class Difficulty:
    """Operators and operand ranges of one level; ``b <= a`` for subtraction (no negatives)."""

    name: str
    operators: tuple[str, ...]
    a_range: tuple[int, int]
    b_range: tuple[int, int]


DIFFICULTIES: dict[str, Difficulty] = {
    d.name: d
    for d in (
        Difficulty("tiny", ("+",), (1, 9), (1, 9)),
        Difficulty("easy", ("+", "-"), (1, 20), (1, 20)),
        Difficulty("medium", ("+", "-", "*"), (10, 99), (2, 99)),
        Difficulty("tool", ("*",), (100, 999), (11, 99)),
    )
}

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _draw(rng: random.Random, level: Difficulty) -> tuple[str, int]:
    op = rng.choice(level.operators)
    a, b = rng.randint(*level.a_range), rng.randint(*level.b_range)
    if op == "-" and b > a:
        a, b = b, a
    return f"What is {a} {op} {b}?", _APPLY[op](a, b)


def arithmetic_problems(n: int, *, difficulty: str = "easy", seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct problems of a level, in a seeded order (without a split)."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {sorted(DIFFICULTIES)}")
    level = DIFFICULTIES[difficulty]
    rng = random.Random(f"{difficulty}:{seed}")
    seen: set[str] = set()
    items: list[dict[str, Any]] = []
    for _ in range(MAX_DRAWS_PER_PROBLEM * max(n, 1)):
        if len(items) == n:
            break
        question, answer = _draw(rng, level)
        if question in seen:
            continue
        seen.add(question)
        items.append(
            {
                "id": f"arith-{difficulty}-{len(items):05d}",
                "question": question,
                "answer": answer,
                "difficulty": difficulty,
            }
        )
    if len(items) < n:
        raise ValueError(
            f"difficulty {difficulty!r} has fewer than {n} distinct problems ({len(items)} found)"
        )
    return items


def arithmetic_splits(
    *, difficulty: str = "easy", n_train: int = 400, n_test: int = 50, seed: int = 0
) -> dict[str, list[dict[str, Any]]]:
    """Disjoint ``{"train": [...], "test": [...]}``; the held-out problems come first."""
    problems = arithmetic_problems(n_train + n_test, difficulty=difficulty, seed=seed)
    test = [{**p, "split": "test"} for p in problems[:n_test]]
    train = [{**p, "split": "train"} for p in problems[n_test:]]
    return {"train": train, "test": test}


def write_jsonl(path: str | Path, items: Iterable[Mapping[str, Any]]) -> Path:
    """Write one JSON object per line (atomically: a temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The objects of a JSONL file, in order."""
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_arithmetic_splits(
    out_dir: str | Path,
    *,
    difficulty: str = "easy",
    n_train: int = 400,
    n_test: int = 50,
    seed: int = 0,
) -> dict[str, Path]:
    """Write ``arith-{difficulty}-{train,test}.jsonl`` under ``out_dir``; returns the paths."""
    splits = arithmetic_splits(difficulty=difficulty, n_train=n_train, n_test=n_test, seed=seed)
    return {
        name: write_jsonl(Path(out_dir) / f"arith-{difficulty}-{name}.jsonl", items)
        for name, items in splits.items()
    }


def main(argv: list[str] | None = None) -> None:
    """Write a seeded arithmetic train/held-out split as JSONL."""
    parser = argparse.ArgumentParser(
        prog="python -m proxima.agents_examples.datasets", description=main.__doc__
    )
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--difficulty", choices=sorted(DIFFICULTIES), default="easy")
    parser.add_argument("--train", type=int, default=400, help="train problems")
    parser.add_argument("--test", type=int, default=50, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = write_arithmetic_splits(
        args.out_dir,
        difficulty=args.difficulty,
        n_train=args.train,
        n_test=args.test,
        seed=args.seed,
    )
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
