"""On-device capture of each decode step's logits: exact-bytes digest, top-k sketch, top1-top2 margin.

All functions here are pure tensor functions with static shapes: they run inside the decode step,
compile with `fullgraph=True`, and are captured in CUDA graphs. Nothing syncs with the host.

The digest is a sum, over elements, of a 64-bit bijective mix of (element bits, element index),
in wrapping int64 arithmetic. Integer addition is associative, so the result does not depend on
reduction order: a CPU and a GPU give the same digest for the same bytes, and flipping any single
bit of any element changes that element's term and so the sum. Two lanes give 128 bits.
"""

from __future__ import annotations

import numpy as np
import torch

from .mixing import splitmix64

_LANE_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)  # pi digits; lane separation
_LANE_STEP = _LANE_SEEDS[1] - _LANE_SEEDS[0]  # fits in int64: lane seed = lane * step + first seed
_INDEX_MULTIPLIER = -7046029254386353131  # odd, so index * M is a bijection mod 2^64
_WORD_MULTIPLIER = -4658895280553007687  # odd
BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float64: torch.int64}  # float dtype -> the integer dtype of the same width
_MASK64 = (1 << 64) - 1


def raw_bits(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] floats -> [B, V] int64 holding each element's raw bit pattern (sign-extended)."""
    return logits.view(BITS_VIEW[logits.dtype]).to(torch.int64)


def logits_digest(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] floats -> [B, 2] int64: a 128-bit digest of each row's exact bytes (both lanes in one pass)."""
    words = raw_bits(logits)  # [B, V]
    device = words.device
    index = torch.arange(words.shape[-1], device=device, dtype=torch.int64) * _INDEX_MULTIPLIER  # [V]
    # The lane seeds, made on the device (no host copy, so a CUDA graph can hold this): [2]
    seeds = torch.arange(2, device=device, dtype=torch.int64) * _LANE_STEP + _LANE_SEEDS[0]
    terms = (words * _WORD_MULTIPLIER + index)[..., None] + seeds  # [B, V, 2]
    return splitmix64(terms).sum(dim=1)  # [B, 2]


def topk_sketch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, V] -> ids [B, K] int64, values [B, K] float32, margin [B] float32 (top1 - top2)."""
    values, ids = torch.topk(logits.float(), k, dim=-1)
    return ids, values, values[:, 0] - values[:, 1]


# ---------------------------------------------------------------- host side

def digest_hex(digest: np.ndarray) -> str:
    """[2] int64 -> 32 hex characters."""
    return "".join(f"{int(word) & _MASK64:016x}" for word in digest)


def _splitmix64_int(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def reference_digest(row_bits: np.ndarray) -> str:
    """The digest of one row computed in plain Python integers, independent of torch.

    `row_bits`: [V] signed integers (the raw bit patterns as `raw_bits` gives them). Slow; for tests.
    """
    lanes = []
    for seed in _LANE_SEEDS:
        total = 0
        for position, word in enumerate(row_bits.tolist()):
            term = (int(word) * (_WORD_MULTIPLIER & _MASK64) + position * (_INDEX_MULTIPLIER & _MASK64) + seed)
            total = (total + _splitmix64_int(term)) & _MASK64
        lanes.append(total)
    return "".join(f"{lane:016x}" for lane in lanes)
