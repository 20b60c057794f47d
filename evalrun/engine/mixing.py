"""Counter-based integer mixing on int64 tensors: the splitmix64 finalizer.

Used wherever evalrun needs bits that are a pure function of a counter, identical on every device:
the logits digest (capture), Gumbel noise for seeded sampling (generate), seeded random weights
(models). Wrapping int64 arithmetic; no RNG state, so it can live inside a CUDA graph.
"""

from __future__ import annotations

import torch

GOLDEN_GAMMA = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (golden ratio): counter stride
_MIX_2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_MIX_3 = -7723592293110705685  # 0x94D049BB133111EB as int64


def logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >>> bits for int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 tensors: a bijection on 64 bits."""
    x = (x ^ logical_shift_right(x, 30)) * _MIX_2
    x = (x ^ logical_shift_right(x, 27)) * _MIX_3
    return x ^ logical_shift_right(x, 31)
