"""``bench/_gloo_floor.py``, the weight-push bench's floor arm: the bucket sizes it sends are
the model's bytes (a tied tensor once, a tensor past the bucket size alone), and a push
reaches every receiver process and can be repeated before a clean stop."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _floor_module():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("_gloo_floor", ROOT / "bench" / "_gloo_floor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bucket_sizes_cover_every_byte_once() -> None:
    floor = _floor_module()
    mib = 2**20
    embedding = torch.zeros(3 * mib, dtype=torch.uint8)  # past a 2 MiB bucket: alone
    tensors = [
        ("embed", embedding),
        ("w1", torch.zeros(mib // 4, dtype=torch.float32)),  # 1 MiB
        ("w2", torch.zeros(mib // 2, dtype=torch.uint8)),
        ("w3", torch.zeros(mib, dtype=torch.uint8)),  # 2.5 MiB with the two before: a new bucket
        ("lm_head", embedding),  # tied: sent once
    ]
    assert floor.bucket_sizes(tensors, bucket_mb=2) == [3 * mib, mib + mib // 2, mib]


def test_a_push_reaches_both_receivers_twice_then_stops() -> None:
    floor = _floor_module()
    sizes = [1000, 4096]
    sender = floor.GlooFloor(sizes, receivers=2)
    try:
        assert sender.push() > 0.0
        assert sender.push() > 0.0  # the receivers loop: a second push is received too
    finally:
        sender.close()
    assert [p.returncode for p in sender.procs] == [0, 0]  # they received the stop and exited
