"""Compact byte encoding of token arrays.

Token ids and policy versions are stored as little-endian ``int32``, logprobs
as little-endian ``float32``, in ``LargeBinary`` columns. A float64 logprob
therefore round-trips to its nearest float32; every float32 value (and every
int32) round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")
_INT32_MIN = int(np.iinfo(_INT32).min)
_INT32_MAX = int(np.iinfo(_INT32).max)


def encode_int32(values: Sequence[int]) -> bytes:
    """Pack integers as little-endian int32 bytes.

    Raises:
        ValueError: a value does not fit into int32.
    """
    if not values:
        return b""
    array = np.asarray(values, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"expected a flat sequence of ints, got shape {array.shape}")
    if int(array.min()) < _INT32_MIN or int(array.max()) > _INT32_MAX:
        raise ValueError("value out of int32 range")
    return array.astype(_INT32).tobytes()


def decode_int32(data: bytes | None) -> list[int]:
    """Unpack little-endian int32 bytes into Python ints."""
    if not data:
        return []
    return [int(v) for v in np.frombuffer(data, dtype=_INT32).tolist()]


def encode_float32(values: Sequence[float]) -> bytes:
    """Pack floats as little-endian float32 bytes (rounded to nearest float32)."""
    if not values:
        return b""
    array = np.asarray(values, dtype=_FLOAT32)
    if array.ndim != 1:
        raise ValueError(f"expected a flat sequence of floats, got shape {array.shape}")
    return array.tobytes()


def decode_float32(data: bytes | None) -> list[float]:
    """Unpack little-endian float32 bytes into Python floats."""
    if not data:
        return []
    return [float(v) for v in np.frombuffer(data, dtype=_FLOAT32).tolist()]
