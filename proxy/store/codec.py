"""Compact byte encoding of token arrays.

Token ids and policy versions are stored as little-endian ``int32``, logprobs
as little-endian ``float32``, in ``LargeBinary`` columns. A float64 logprob
therefore round-trips to its nearest float32; every float32 value (and every
int32) round-trips exactly.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")
_BIG_ENDIAN = sys.byteorder == "big"
if array("i").itemsize != 4 or array("f").itemsize != 4:
    raise ImportError("the token codec needs a platform whose C int and float are 32 bits")


def encode_int32(values: Sequence[int]) -> bytes:
    """Pack integers as little-endian int32 bytes.

    Raises:
        ValueError: a value does not fit into int32.
    """
    if not values:
        return b""
    try:
        packed = array("i", values)  # C loop; a C int is 32 bits (checked at import)
    except OverflowError as exc:
        raise ValueError("value out of int32 range") from exc
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def decode_int32(data: bytes | None) -> list[int]:
    """Unpack little-endian int32 bytes into Python ints."""
    if not data:
        return []
    return [int(v) for v in np.frombuffer(data, dtype=_INT32).tolist()]


def encode_float32(values: Sequence[float]) -> bytes:
    """Pack floats as little-endian float32 bytes (rounded to nearest float32)."""
    if not values:
        return b""
    packed = array("f", values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def decode_float32(data: bytes | None) -> list[float]:
    """Unpack little-endian float32 bytes into Python floats."""
    if not data:
        return []
    return [float(v) for v in np.frombuffer(data, dtype=_FLOAT32).tolist()]
