"""The compact token-array codec."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from proxima.proxy.store.codec import decode_float32, decode_int32, encode_float32, encode_int32


def test_int32_round_trip_is_exact() -> None:
    values = [0, 1, -1, 151_643, 2**31 - 1, -(2**31), 7]
    data = encode_int32(values)
    assert len(data) == 4 * len(values)
    assert decode_int32(data) == values


def test_int32_is_little_endian() -> None:
    assert encode_int32([1, 258]) == struct.pack("<ii", 1, 258)


def test_int32_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="int32"):
        encode_int32([2**31])
    with pytest.raises(ValueError, match="int32"):
        encode_int32([-(2**31) - 1])


def test_float32_round_trip_is_exact_for_float32_values() -> None:
    rng = np.random.default_rng(0)
    values = [float(v) for v in rng.normal(-2.0, 1.5, size=257).astype(np.float32)]
    values += [0.0, -0.0, float("-inf"), -(2.0**-130)]  # incl. a float32 subnormal
    data = encode_float32(values)
    assert data == struct.pack(f"<{len(values)}f", *values)
    assert decode_float32(data) == values


def test_float64_values_round_to_nearest_float32() -> None:
    value = -0.1234567890123
    (decoded,) = decode_float32(encode_float32([value]))
    assert decoded == struct.unpack("<f", struct.pack("<f", value))[0]
    assert abs(decoded - value) < 1e-8


@pytest.mark.parametrize("empty", [b"", None])
def test_empty_arrays(empty: bytes | None) -> None:
    assert encode_int32([]) == b""
    assert encode_float32([]) == b""
    assert decode_int32(empty) == []
    assert decode_float32(empty) == []


def test_decoded_values_are_python_scalars() -> None:
    assert all(type(v) is int for v in decode_int32(encode_int32([1, 2])))
    assert all(type(v) is float for v in decode_float32(encode_float32([0.5])))
