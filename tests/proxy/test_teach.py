"""Teaching the tiny model: a round's batched replies give the gradients of one-by-one replies.

``teach.py`` trains every sequence that shares a prompt head as one right-padded batch over
the head's keys and values (chunked when long). The claim is checked where it lives: the
gradients one training step leaves, against each sequence run alone with HF's own loss,
the mean over its taught tokens, summed over sequences as ``1/S`` each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from proxima.proxy.testing import teach
from proxima.proxy.testing.tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer.closeness import assert_grads_close

# Two prompt heads; replies of different lengths after each (the batch is padded), one
# sequence alone under its head.
SEQUENCES = [
    [("<|im_start|>user\nlist the files<|im_end|>\n", False), ("ls -la", True),
     ("\noutput: a b c\n", False), ("Done.", True)],
    [("<|im_start|>user\nlist the files<|im_end|>\n", False), ("ls -la", True),
     ("\noutput: nothing here at all, the directory is empty\n", False), ("Done.", True)],
    [("<|im_start|>user\nlist the files<|im_end|>\n", False), ("ls", True),
     ("\n", False), ("Empty directory, nothing to list.", True)],
    [("<|im_start|>user\nwhat is 2 + 2?<|im_end|>\n", False), ("4", True)],
]  # fmt: skip


class _GradientsOf:
    """An optimizer that keeps the gradients ``step`` sees and leaves the weights alone."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def step(self) -> None:
        self.grads = {
            name: p.grad.clone() for name, p in self.model.named_parameters() if p.grad is not None
        }


@pytest.fixture(scope="module")
def model_and_prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[Any]]:
    path = tmp_path_factory.mktemp("teach") / "tiny"
    build_tiny_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, teach._prepare(tokenizer, SEQUENCES)


def _one_by_one(model: Any, prepared: list[Any]) -> dict[str, torch.Tensor]:
    """Each sequence alone: its head's cache, its rest with HF's loss, ``loss / S``."""
    model.zero_grad()
    for head, ids, labels in prepared:
        with torch.no_grad():
            cache = model(input_ids=head, use_cache=True).past_key_values
        start = head.shape[1]
        out = model(
            input_ids=ids,
            past_key_values=cache,
            position_ids=torch.arange(start, start + ids.shape[1])[None],
            labels=labels,
        )
        (out.loss / len(prepared)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scores_per_chunk", [1 << 24, 1])
def test_a_batched_round_leaves_the_gradients_of_one_by_one_replies(
    model_and_prepared: tuple[Any, list[Any]],
    scores_per_chunk: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One chunk per head, and (a budget of 1) one row per chunk: the same gradients."""
    model, prepared = model_and_prepared
    monkeypatch.setattr(teach, "_SCORES_PER_CHUNK", scores_per_chunk)
    batches = teach._batches(prepared)
    assert [len(chunks) for _, chunks in batches] == ([1, 1] if scores_per_chunk > 1 else [3, 1])
    expected = _one_by_one(model, prepared)
    optimizer = _GradientsOf(model)
    teach._teach_round(model, optimizer, batches, len(prepared), steps=1)
    assert optimizer.grads.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad.abs().max() > 0, name
    # Another summation order (a padded batch): the trainer tests' bound, on any CPU.
    assert_grads_close(optimizer.grads, expected)


def test_teaching_makes_every_taught_token_likely(tmp_path: Path) -> None:
    """``teach_texts`` ends only once a full pass gives each taught token ``min_prob``."""
    path = tmp_path / "tiny"
    build_tiny_model(path)
    teach.teach_texts(path, SEQUENCES, min_prob=0.9)
    least = teach.least_taught_probs(path, SEQUENCES)
    assert len(least) == len(SEQUENCES) and min(least) >= 0.9, least
