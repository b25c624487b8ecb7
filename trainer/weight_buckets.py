"""A broadcast push's tensors and buckets: what the trainer sends, and how it fills them.

The specs of a push (:class:`~proxima.proxy.embedded.process_group.TensorSpec`: name, dtype,
shape) come from the trainer's memory (:func:`memory_specs`: a model's tensors, tied ones
once, cast to the dtype the backends serve) or from a version's export (:func:`read_specs`:
its safetensors headers). :func:`plan_buckets` cuts them into buckets of at most a size,
each ordered so every flattened offset is aligned, and a :class:`Filler` writes a bucket's
bytes into its flat buffer (:class:`MemoryPacker` copies tensors, :class:`ExportReader`
reads the export's files; a bucket of one tensor already in the wire's dtype is sent from
the tensor's own memory, no copy). :class:`BucketBuffers` keeps two flat buffers across
pushes: a fresh buffer costs a page fault per page, as much as the transfer on a loaded CPU.
``proxima.trainer.weight_broadcast`` sends the buckets.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from proxima.proxy.embedded.process_group import (
    TensorSpec,
    aligned_order,
    dtype_name,
    flat_offsets,
)
from safetensors import safe_open

_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class BroadcastFailed(RuntimeError):
    """A broadcast push did not land (the message says where it failed)."""


def read_specs(path: Path) -> tuple[list[TensorSpec], dict[str, Path]]:
    """Every tensor of an HF export (name order) and the safetensors file holding each."""
    specs: list[TensorSpec] = []
    files: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise BroadcastFailed(f"{name}: dtype {piece.get_dtype()} cannot be broadcast")
                specs.append(TensorSpec(name, dtype, tuple(piece.get_shape())))
                files[name] = file
    if not specs:
        raise BroadcastFailed(f"no *.safetensors tensors in {path}")
    specs.sort(key=lambda s: s.name)
    return specs, files


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors up to ``bucket_bytes`` a bucket (a larger tensor alone), each
    bucket ordered so its flattened offsets are aligned."""
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > bucket_bytes:
            buckets.append(aligned_order(current))
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(aligned_order(current))
    return buckets


def bucket_body(bucket: Sequence[TensorSpec]) -> dict[str, Any]:
    """A bucket as ``POST /admin/weights`` lists it."""
    return {
        "names": [s.name for s in bucket],
        "dtypes": [s.dtype for s in bucket],
        "shapes": [list(s.shape) for s in bucket],
    }


class ExportReader:
    """Reads tensors' bytes from an export's safetensors files into a bucket's flat buffer
    (one copy from the page cache; the layout of ``flat_offsets``)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files
        self._open: dict[Path, tuple[io.BufferedReader, int, dict[str, Any]]] = {}

    def _entry(self, name: str) -> tuple[io.BufferedReader, int, int]:
        file = self._files[name]
        if file not in self._open:
            handle = open(file, "rb")  # noqa: SIM115 (closed by close())
            size = int.from_bytes(handle.read(8), "little")
            self._open[file] = (handle, 8 + size, json.loads(handle.read(size)))
        handle, base, header = self._open[file]
        begin, end = header[name]["data_offsets"]
        return handle, base + begin, end - begin

    def fill(self, bucket: Sequence[TensorSpec], flat: torch.Tensor) -> None:
        """Read ``bucket``'s bytes into ``flat`` (a CPU uint8 buffer of its size)."""
        view = flat.numpy().data  # a writable memoryview of the buffer
        for spec, (start, end) in zip(bucket, flat_offsets(bucket), strict=True):
            handle, position, size = self._entry(spec.name)
            if size != end - start:
                raise BroadcastFailed(
                    f"{spec.name}: {size} bytes in the export, {end - start} planned"
                )
            handle.seek(position)
            done = 0
            while done < size:
                got = handle.readinto(view[start + done : end])
                if not got:
                    raise BroadcastFailed(f"{spec.name}: the export ends early")
                done += got

    def in_place(self, bucket: Sequence[TensorSpec], device: str) -> torch.Tensor | None:
        """Never: an export is read into a buffer."""
        return None

    def close(self) -> None:
        for handle, _, _ in self._open.values():
            handle.close()
        self._open.clear()


TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""The trainer's weights in memory by HF name (a model's ``state_dict``, tied ones once or
more), read at each push."""


def memory_specs(
    source: TensorSource, dtype: torch.dtype | None = None
) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
    """The specs of an in-memory push and its tensors by name: a tensor that shares another's
    memory (tied weights) is sent once, under its first name (as ``save_pretrained`` stores
    it); floating-point tensors travel as ``dtype`` (None: their own)."""
    specs: list[TensorSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in source():
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        if key in seen:
            continue
        seen.add(key)
        wire = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        specs.append(TensorSpec(name, dtype_name(wire), tuple(tensor.shape)))
        tensors[name] = tensor
    if not specs:
        raise BroadcastFailed("the in-memory weights hold no tensor")
    return specs, tensors


class MemoryPacker:
    """Copies in-memory tensors into a bucket's flat buffer (cast to the wire's dtype); a
    bucket of one tensor that needs no cast goes from the tensor's own memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def in_place(self, bucket: Sequence[TensorSpec], device: str) -> torch.Tensor | None:
        """The bucket's bytes as they are in memory (no copy), when it is one contiguous
        tensor of the wire's dtype on ``device``; else None."""
        if len(bucket) != 1:
            return None
        tensor = self._tensors[bucket[0].name].detach()
        if (
            tensor.dtype != bucket[0].torch_dtype
            or tensor.device.type != device
            or not tensor.is_contiguous()
        ):
            return None
        return tensor.reshape(-1).view(torch.uint8)

    @torch.no_grad()
    def fill(self, bucket: Sequence[TensorSpec], flat: torch.Tensor) -> None:
        for spec, (start, end) in zip(bucket, flat_offsets(bucket), strict=True):
            target = flat[start:end].view(spec.torch_dtype).view(spec.shape)
            target.copy_(self._tensors[spec.name].detach())

    def close(self) -> None:
        self._tensors = {}


class Filler(Protocol):
    """Fills a bucket's flat buffer: :class:`MemoryPacker`, :class:`ExportReader`."""

    def in_place(self, bucket: Sequence[TensorSpec], device: str) -> torch.Tensor | None: ...

    def fill(self, bucket: Sequence[TensorSpec], flat: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class BucketBuffers:
    """Two flat buffers kept across pushes: one is filled while the other is on the wire
    (a fresh buffer would cost a page fault per page at every push)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """Buffer ``index % 2``, at least ``nbytes`` long (grown if not), as ``nbytes``."""
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        slot = index % 2
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[slot][:nbytes]

    def clear(self) -> None:
        self._buffers = []
