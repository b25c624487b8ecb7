"""The items a rollout pass runs the agent on: a JSONL file, or any iterable or async iterable
of mappings (:data:`Dataset`), read in order, each with its id (:func:`item_id`)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

from proxima.trainer.rollout.agents import RolloutError

Dataset = str | os.PathLike[str] | Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]]


async def iter_dataset(dataset: Dataset) -> AsyncIterator[dict[str, Any]]:
    """Items of a JSONL file (path) or of any iterable / async iterable of mappings."""
    if isinstance(dataset, str | os.PathLike):
        path = Path(dataset)
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if not isinstance(item, dict):
                    raise RolloutError(f"{path}:{lineno}: a dataset line must be a JSON object")
                yield item
    elif isinstance(dataset, AsyncIterable):
        async for item in dataset:
            yield dict(item)
    else:
        for item in dataset:
            yield dict(item)


def item_id(item: Mapping[str, Any], index: int) -> str:
    """The item's ``id`` (or ``data_id``), else its position in the dataset."""
    value = item.get("id", item.get("data_id"))
    return str(value) if value is not None else str(index)
