"""The process group weights travel over, and the layout of one bucket on the wire.

Both ends of a broadcast weight push use this module: the trainer (rank 0, the sender,
``proxima.trainer.weight_broadcast``) and the embedded engine (a receiver,
``proxima.proxy.embedded.weight_groups``); an SGLang server is a receiver with its own copy
of the same code, so everything here follows SGLang 0.5.23 exactly:

- :func:`init_custom_process_group` is SGLang's (``utils/common.py``): a TCP rendezvous at
  ``tcp://master_address:master_port`` (rank 0 hosts the store), the store prefixed with the
  group's name, and a process group outside torch's default one, so neither side needs
  (or disturbs) a default group of its own (the trainer under torchrun has one).
- A bucket is a list of ``(name, dtype, shape)``. Sent one tensor at a time
  (``load_format`` None) each tensor is one ``broadcast(src=0)`` in the listed order; as a
  ``"flattened_bucket"`` it is one broadcast of a uint8 buffer holding the tensors' bytes back
  to back in the listed order, each starting at a multiple of its dtype's size (no padding:
  SGLang refuses an unaligned offset, so senders order a bucket by dtype size, largest first).

Failures: a rendezvous that does not complete within ``timeout`` raises (torch's
``DistStoreError``); a broadcast whose peer died raises at once (gloo: "Connection closed
by peer"), one whose peer is alive but silent raises after ``timeout``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    PrefixStore,
    _new_process_group_helper,
    _world,
)
from torch.distributed.rendezvous import rendezvous

FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = (None, FLATTENED_BUCKET)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a bucket as the wire names it: HF name, torch dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.torch_dtype.itemsize


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (SGLang's ``getattr(torch, dtype)``); ValueError
    for a name that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def specs_of(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorSpec]:
    """The bucket a request lists (its three parallel lists); ValueError when they disagree,
    a dtype is unknown or a dimension is negative."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError("names, dtypes and shapes must be non-empty and of one length")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if any(dim < 0 for dim in shape):
            raise ValueError(f"negative dimension in tensor {name}: {list(shape)}")
        torch_dtype(dtype)
        specs.append(TensorSpec(name, dtype, tuple(int(d) for d in shape)))
    return specs


def flat_offsets(specs: Sequence[TensorSpec]) -> list[tuple[int, int]]:
    """Byte ranges of each tensor in a flattened bucket; ValueError for an unaligned one."""
    offsets = []
    offset = 0
    for spec in specs:
        itemsize = spec.torch_dtype.itemsize
        if offset % itemsize:
            raise ValueError(
                f"unaligned tensor {spec.name}: byte offset {offset}, dtype {spec.dtype}"
            )
        offsets.append((offset, offset + spec.nbytes))
        offset += spec.nbytes
    return offsets


def aligned_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """``specs`` ordered so every flattened offset is aligned: larger dtypes first (stable)."""
    return sorted(specs, key=lambda s: -s.torch_dtype.itemsize)


def init_custom_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join ``group_name`` as ``rank`` of ``world_size`` (SGLang's helper; rank 0 hosts the
    TCP store at ``master_address:master_port``). Blocks until every rank joined; raises
    after ``timeout_s`` otherwise."""
    timeout = datetime.timedelta(seconds=timeout_s)
    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    group: dist.ProcessGroup
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        prefixed,
        group_name=GroupName(group_name),
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_process_group(group: dist.ProcessGroup) -> None:
    """Release a group (its connections close: peers blocked in it fail at once)."""
    dist.destroy_process_group(group)


def send_bucket(
    group: dist.ProcessGroup,
    tensors: Sequence[torch.Tensor],
    load_format: str | None,
) -> None:
    """Broadcast one bucket from rank 0 (``tensors`` in the bucket's order)."""
    if load_format == FLATTENED_BUCKET:
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
        dist.broadcast(flat, src=0, group=group)
        return
    works: list[Any] = [
        dist.broadcast(t.contiguous(), src=0, group=group, async_op=True) for t in tensors
    ]
    for work in works:
        work.wait()


def bucket_nbytes(specs: Sequence[TensorSpec]) -> int:
    """Bytes of ``specs`` flattened (ValueError for an unaligned bucket)."""
    offsets = flat_offsets(specs)
    return offsets[-1][1] if offsets else 0


def receive_bucket(
    group: dist.ProcessGroup,
    specs: Sequence[TensorSpec],
    load_format: str | None,
    device: str = "cpu",
    out: torch.Tensor | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket from rank 0: ``(name, tensor)`` in the bucket's order.

    A flattened bucket is received into ``out`` when given (a uint8 buffer of exactly
    :func:`bucket_nbytes` bytes, reused across pushes: a fresh buffer costs a page fault
    per page), else into a new buffer; the tensors returned are views of it."""
    if load_format == FLATTENED_BUCKET:
        offsets = flat_offsets(specs)
        nbytes = offsets[-1][1] if offsets else 0
        if out is None:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        elif out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous():
            raise ValueError(f"a bucket of {nbytes} bytes cannot be received into {out.shape}")
        else:
            flat = out
        dist.broadcast(flat, src=0, group=group)
        return [
            (spec.name, flat[start:end].view(spec.torch_dtype).reshape(spec.shape))
            for spec, (start, end) in zip(specs, offsets, strict=True)
        ]
    if load_format is not None:
        raise ValueError(f"unsupported load_format {load_format!r}")
    received = [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in specs]
    works: list[Any] = [dist.broadcast(t, src=0, group=group, async_op=True) for t in received]
    for work in works:
        work.wait()
    return [(spec.name, tensor) for spec, tensor in zip(specs, received, strict=True)]
