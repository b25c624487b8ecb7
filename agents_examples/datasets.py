"""Arithmetic datasets for the example agents, generated offline and deterministically.

A difficulty level fixes the operators and the operand range. Problems are
drawn with a seeded ``random.Random``, duplicates removed, and split into a
held-out part (drawn first) and a train part with no problem in common, so
the same ``(difficulty, seed, sizes)`` always gives the same files. Two
questions are the same problem when :func:`problem_key` says so: the same
operator and operands, unordered for ``+`` and ``*`` ("16 + 17" is "17 + 16"),
so no held-out problem is trained with its operands swapped. Items::

    {"id": "arith-easy-00042", "question": "What is 7 + 5?", "answer": 12,
     "split": "train", "difficulty": "easy"}

Levels, chosen for SmolLM2-135M-Instruct (the demo model): ``tiny``
(single-digit sums), ``easy`` (sums and differences up to 20), ``medium``
(two-digit ``+ - *``), ``tool`` (three-digit by two-digit products, for the
calculator agent).

Train phrasings (``train_phrasings``, default 1): with 1 every train and
held-out item is asked ``"What is A op B?"``; with ``k`` each is asked in one of
the first ``k`` wordings of :data:`TRAIN_PHRASINGS` of its operator (a seeded
choice per item, drawn apart from the problems, so the problems of a seed are
the same for every ``k``), and carries ``operator``, ``operands`` and
``phrasing`` ("+2": the operator's wording 2).

Unseen phrasings (``n_unseen``): a second held-out set that tests whether a
policy trained on the train items learned the arithmetic or the prompt. Its
problems are in neither the train nor the held-out part (not even with the
operands of a sum or product swapped), and each is asked in one of
:data:`UNSEEN_PHRASINGS`, wordings no train item uses whatever ``k``
("Subtract 4 from 17.", "Tom has 12 marbles and finds 5 more. ..."); the answer
is still the last integer of the reply. The unseen set of a seed does not depend
on ``k`` either.

CLI: ``python -m proxima.agents_examples.datasets --out-dir data --difficulty easy --train 400 --test 50``
(``--unseen 50`` adds ``arith-easy-unseen.jsonl``, ``--train-phrasings 6`` mixes the wordings).
"""

from __future__ import annotations

import argparse
import json
import random
import re
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
        # easy's two operators apart: two tasks for two tenants' adapters (210 problems each).
        Difficulty("add", ("+",), (1, 20), (1, 20)),
        Difficulty("sub", ("-",), (1, 20), (1, 20)),
    )
}

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# The one phrasing of train and held-out items.
TRAIN_PHRASING = "What is {a} {op} {b}?"
_TRAIN_QUESTION = re.compile(r"^What is (\d+) ([+\-*]) (\d+)\?$")

# Wordings of train and held-out items with train_phrasings=k: the first k of the
# operator's (the first is TRAIN_PHRASING). Symbols, words and one story kind (a bag,
# a bus); none is a wording of UNSEEN_PHRASINGS, whose stories are other ones.
TRAIN_PHRASINGS: dict[str, tuple[str, ...]] = {
    "+": (
        "What is {a} + {b}?",
        "Work out {a} + {b}.",
        "What do you get when you put {a} and {b} together?",
        "What is the total of {a} and {b}?",
        "A bag holds {a} red balls and {b} blue balls. How many balls are in the bag?",
        "A bus has {a} people on it and {b} more get on. How many people are on the bus now?",
    ),
    "-": (
        "What is {a} - {b}?",
        "Work out {a} - {b}.",
        "What do you get when you take {b} away from {a}?",
        "By how much is {a} greater than {b}?",
        "A bag holds {a} balls and {b} of them are red. How many balls are not red?",
        "A bus has {a} people on it and {b} get off. How many people are on the bus now?",
    ),
    "*": (
        "What is {a} * {b}?",
        "Work out {a} * {b}.",
        "What do you get with {a} groups of {b}?",
        "What is {a} lots of {b}?",
        "A bag holds {a} packs of {b} balls. How many balls are in the bag?",
        "A bus has {a} rows with {b} people in each. How many people can it seat?",
    ),
}

# Wordings of the unseen-phrasings set, per operator: none is a train phrasing or
# contains an operator symbol; the answer is always a nonnegative integer.
UNSEEN_PHRASINGS: dict[str, tuple[str, ...]] = {
    "+": (
        "Add {a} and {b}.",
        "Compute the sum of {a} and {b}.",
        "{a} plus {b} makes how many?",
        "Tom has {a} marbles and finds {b} more. How many marbles does he have now?",
        "A shelf holds {a} books and {b} more are put on it. How many books are on the shelf?",
    ),
    "-": (
        "Subtract {b} from {a}.",
        "Compute the difference when {b} is taken from {a}.",
        "{a} minus {b} leaves how many?",
        "Tom has {a} marbles and gives {b} to a friend. How many marbles does he have left?",
        "A shelf holds {a} books and {b} are taken off it. How many books are left on the shelf?",
    ),
    "*": (
        "Multiply {a} by {b}.",
        "Compute the product of {a} and {b}.",
        "{a} times {b} makes how many?",
        "There are {a} boxes with {b} pens in each. How many pens are there in all?",
        "A hall has {a} rows of {b} seats. How many seats does the hall have?",
    ),
}


def _draw_operands(rng: random.Random, level: Difficulty) -> tuple[str, int, int]:
    op = rng.choice(level.operators)
    a, b = rng.randint(*level.a_range), rng.randint(*level.b_range)
    if op == "-" and b > a:
        a, b = b, a
    return op, a, b


def _draw(rng: random.Random, level: Difficulty) -> tuple[str, int]:
    op, a, b = _draw_operands(rng, level)
    return TRAIN_PHRASING.format(a=a, op=op, b=b), _APPLY[op](a, b)


def problem_key(op: str, a: int, b: int) -> tuple[str, int, int]:
    """What makes two problems the same: the operator and operands, unordered for ``+`` and ``*``."""
    return (op, min(a, b), max(a, b)) if op in "+*" else (op, a, b)


def _parsed(question: str) -> tuple[str, int, int]:
    match = _TRAIN_QUESTION.match(question)
    if match is None:
        raise ValueError(f"not a train-phrased arithmetic question: {question!r}")
    a, op, b = match.groups()
    return op, int(a), int(b)


def train_problem_key(question: str) -> tuple[str, int, int]:
    """:func:`problem_key` of a ``"What is A op B?"`` question."""
    return problem_key(*_parsed(question))


def item_problem_key(item: Mapping[str, Any]) -> tuple[str, int, int]:
    """:func:`problem_key` of an item: its ``operator`` and ``operands`` where it has them
    (other wordings), else its ``"What is A op B?"`` question."""
    if "operands" in item:
        a, b = item["operands"]
        return problem_key(str(item["operator"]), int(a), int(b))
    return train_problem_key(str(item["question"]))


def arithmetic_problems(n: int, *, difficulty: str = "easy", seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct problems (by :func:`problem_key`) of a level, in a seeded order (without
    a split)."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {sorted(DIFFICULTIES)}")
    level = DIFFICULTIES[difficulty]
    rng = random.Random(f"{difficulty}:{seed}")
    seen: set[tuple[str, int, int]] = set()
    items: list[dict[str, Any]] = []
    for _ in range(MAX_DRAWS_PER_PROBLEM * max(n, 1)):
        if len(items) == n:
            break
        question, answer = _draw(rng, level)
        key = train_problem_key(question)
        if key in seen:
            continue
        seen.add(key)
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


def unseen_phrasings(
    n: int,
    *,
    exclude: Iterable[Mapping[str, Any]],
    difficulty: str = "easy",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """``n`` distinct problems of a level, none of them (operands swapped or not) in ``exclude``
    (train and held-out items), each asked in one of :data:`UNSEEN_PHRASINGS` (seeded choice)."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {sorted(DIFFICULTIES)}")
    level = DIFFICULTIES[difficulty]
    rng = random.Random(f"{difficulty}:{seed}:unseen")
    taken = {item_problem_key(item) for item in exclude}
    items: list[dict[str, Any]] = []
    for _ in range(MAX_DRAWS_PER_PROBLEM * max(n, 1)):
        if len(items) == n:
            break
        op, a, b = _draw_operands(rng, level)
        key = problem_key(op, a, b)
        if key in taken:
            continue
        taken.add(key)
        phrasing = rng.randrange(len(UNSEEN_PHRASINGS[op]))
        items.append(
            {
                "id": f"arith-{difficulty}-unseen-{len(items):05d}",
                "question": UNSEEN_PHRASINGS[op][phrasing].format(a=a, b=b),
                "answer": _APPLY[op](a, b),
                "difficulty": difficulty,
                "split": "unseen",
                "operator": op,
                "operands": [a, b],
                "phrasing": f"{op}{phrasing}",
            }
        )
    if len(items) < n:
        raise ValueError(
            f"difficulty {difficulty!r} has fewer than {n} problems outside the train and held-out "
            f"parts ({len(items)} found): lower the unseen items or the train items"
        )
    return items


def rephrased(
    problems: Iterable[Mapping[str, Any]], k: int, *, difficulty: str = "easy", seed: int = 0
) -> list[dict[str, Any]]:
    """``"What is A op B?"`` items each asked in one of the first ``k`` wordings of
    :data:`TRAIN_PHRASINGS` of its operator (seeded choice; ``k = 1`` changes nothing)."""
    if not 1 <= k <= min(len(w) for w in TRAIN_PHRASINGS.values()):
        raise ValueError(
            f"train_phrasings must be 1 to {min(len(w) for w in TRAIN_PHRASINGS.values())}, not {k}"
        )
    if k == 1:
        return [dict(p) for p in problems]
    rng = random.Random(f"{difficulty}:{seed}:phrasing")
    items = []
    for p in problems:
        op, a, b = _parsed(str(p["question"]))
        phrasing = rng.randrange(k)
        items.append(
            {
                **p,
                "question": TRAIN_PHRASINGS[op][phrasing].format(a=a, b=b),
                "operator": op,
                "operands": [a, b],
                "phrasing": f"{op}{phrasing}",
            }
        )
    return items


def arithmetic_splits(
    *,
    difficulty: str = "easy",
    n_train: int = 400,
    n_test: int = 50,
    seed: int = 0,
    n_unseen: int = 0,
    train_phrasings: int = 1,
) -> dict[str, list[dict[str, Any]]]:
    """Disjoint ``{"train": [...], "test": [...]}``; the held-out problems come first, both
    asked in the first ``train_phrasings`` wordings of :data:`TRAIN_PHRASINGS`.

    With ``n_unseen``, also ``"unseen"``: :func:`unseen_phrasings` outside both parts.
    """
    problems = arithmetic_problems(n_train + n_test, difficulty=difficulty, seed=seed)
    asked = rephrased(problems, train_phrasings, difficulty=difficulty, seed=seed)
    test = [{**p, "split": "test"} for p in asked[:n_test]]
    train = [{**p, "split": "train"} for p in asked[n_test:]]
    splits = {"train": train, "test": test}
    if n_unseen:
        splits["unseen"] = unseen_phrasings(
            n_unseen, exclude=problems, difficulty=difficulty, seed=seed
        )
    return splits


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
    n_unseen: int = 0,
    train_phrasings: int = 1,
) -> dict[str, Path]:
    """Write ``arith-{difficulty}-{train,test[,unseen]}.jsonl`` under ``out_dir``; returns the paths."""
    splits = arithmetic_splits(
        difficulty=difficulty,
        n_train=n_train,
        n_test=n_test,
        seed=seed,
        n_unseen=n_unseen,
        train_phrasings=train_phrasings,
    )
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
    parser.add_argument(
        "--unseen", type=int, default=0, help="held-out problems in unseen phrasings"
    )
    parser.add_argument(
        "--train-phrasings", type=int, default=1, help="wordings of train and held-out items"
    )
    args = parser.parse_args(argv)
    paths = write_arithmetic_splits(
        args.out_dir,
        difficulty=args.difficulty,
        n_train=args.train,
        n_test=args.test,
        seed=args.seed,
        n_unseen=args.unseen,
        train_phrasings=args.train_phrasings,
    )
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
