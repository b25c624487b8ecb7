"""``bench/weight_push.py``'s floor arm: the same bytes over gloo alone, nothing else.

A broadcast push cannot be faster than its transport. This arm measures the transport by
itself, in the same run as the disk and broadcast pushes: this process is rank 0 of a gloo
group (the project's ``init_custom_process_group``, as the trainer's sink joins one) with two
receiver processes (as many as the engines), and one "push" is one ``broadcast`` per bucket
of preallocated uint8 buffers of the sizes the broadcast arm's buckets have, then a barrier
(every receiver holds every byte). No tensor is copied into a bucket, screened or swapped
in, no HTTP call is made: what is left is gloo moving the bytes over loopback TCP.

Receiver: ``python bench/_gloo_floor.py PORT RANK WORLD SIZE [SIZE ...]``; it receives a
one-number header (1: a push follows, 0: stop) and then the buckets, until told to stop.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxima.proxy.embedded.process_group import (  # noqa: E402
    bucket_nbytes,
    destroy_process_group,
    init_custom_process_group,
)
from proxima.proxy.serving import free_port  # noqa: E402
from proxima.trainer.weight_buckets import memory_specs, plan_buckets  # noqa: E402

GROUP = "weight-push-floor"
TIMEOUT_S = 600.0


def bucket_sizes(
    named: Iterable[tuple[str, torch.Tensor]], bucket_mb: float, dtype: torch.dtype | None = None
) -> list[int]:
    """Byte sizes of the buckets the broadcast push sends for these tensors: the trainer's own
    plan (``memory_specs``: a tied tensor once, floating point as ``dtype``; ``plan_buckets``:
    a tensor larger than a bucket alone)."""
    tensors = list(named)
    specs, _ = memory_specs(lambda: tensors, dtype)
    return [bucket_nbytes(b) for b in plan_buckets(specs, int(bucket_mb * 2**20))]


class GlooFloor:
    """Rank 0 of a gloo group with ``receivers`` processes, and one timed push of ``sizes``."""

    def __init__(self, sizes: list[int], receivers: int = 2) -> None:
        self.sizes = sizes
        port = free_port()
        world = receivers + 1
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, str(port), str(rank), str(world), *map(str, sizes)]
            )
            for rank in range(1, world)
        ]
        self.group = init_custom_process_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            world_size=world,
            rank=0,
            group_name=GROUP,
            timeout_s=TIMEOUT_S,
        )
        self.buffers = [torch.ones(n, dtype=torch.uint8) for n in sizes]

    def push(self) -> float:
        """Seconds for every bucket to reach every receiver."""
        started = time.monotonic()
        dist.broadcast(torch.ones(1, dtype=torch.int64), src=0, group=self.group)
        for buf in self.buffers:
            dist.broadcast(buf, src=0, group=self.group)
        dist.barrier(group=self.group)
        return time.monotonic() - started

    def close(self) -> None:
        try:
            dist.broadcast(torch.zeros(1, dtype=torch.int64), src=0, group=self.group)
            destroy_process_group(self.group)
        finally:
            for p in self.procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()


def receive(port: int, rank: int, world: int, sizes: list[int]) -> None:
    group = init_custom_process_group(
        backend="gloo",
        master_address="127.0.0.1",
        master_port=port,
        world_size=world,
        rank=rank,
        group_name=GROUP,
        timeout_s=TIMEOUT_S,
    )
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    header = torch.empty(1, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=group)
        if int(header.item()) == 0:
            break
        for buf in buffers:
            dist.broadcast(buf, src=0, group=group)
        dist.barrier(group=group)
    destroy_process_group(group)


if __name__ == "__main__":
    port_, rank_, world_, *sizes_ = sys.argv[1:]
    receive(int(port_), int(rank_), int(world_), [int(s) for s in sizes_])
