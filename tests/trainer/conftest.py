"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from megatron.core import parallel_state


@pytest.fixture(scope="module")
def megatron_process_group() -> Iterator[None]:
    """A module's in-process megatron backends share one gloo group (world size 1).

    The backends create it on first use; it is torn down when the module ends so
    that the next module (or a spawned multi-rank test) starts clean.
    """
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
