"""Canonical bytes and xxh3-128 hashes: the one way evalrun turns values into fingerprints."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xxhash


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and compact separators, so equal values give equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def hash_bytes(*chunks: bytes) -> str:
    """xxh3-128 hex digest of the concatenated chunks, each length-prefixed (no ambiguity)."""
    hasher = xxhash.xxh3_128()
    for chunk in chunks:
        hasher.update(len(chunk).to_bytes(8, "little"))
        hasher.update(chunk)
    return hasher.hexdigest()


def hash_value(value: Any) -> str:
    """xxh3-128 hex digest of a JSON-able value's canonical JSON."""
    return hash_bytes(canonical_json(value).encode())


def array_to_bytes(array: np.ndarray) -> bytes:
    """Raw little-endian bytes of an array in C order (never pickle)."""
    array = np.ascontiguousarray(array)
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def array_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """Inverse of `array_to_bytes`; `dtype` is a numpy name such as 'int64' or 'float32'."""
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape).astype(dtype, copy=False)
