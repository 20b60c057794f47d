"""The Triton kernel of l2_prefetch.py: read a weight once so that its bytes sit in the L2 cache.

Each of PROGRAMS programs reads a contiguous share of the weight's 32-bit words, BLOCK words at a time,
and folds them with xor into one word it stores in `sink` (so the loads cannot be dropped); nothing else
is written, so no computation anywhere sees what it did. A share is a compile-time constant: a model has
few weight sizes (one compile each), and the loop is static. Imported only where it runs (a CUDA device, or
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def prefetch_kernel(words_ptr, sink_ptr, count, per_program: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    start = program.to(tl.int64) * per_program
    lanes = tl.arange(0, BLOCK)
    folded = tl.zeros((BLOCK,), dtype=tl.int32)
    for offset in range(0, per_program, BLOCK):
        index = start + offset + lanes
        folded ^= tl.load(words_ptr + index, mask=(offset + lanes < per_program) & (index < count), other=0,
                          cache_modifier=".cg")
    tl.store(sink_ptr + program, tl.reduce(folded, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def launch(words: torch.Tensor, sink: torch.Tensor, block: int, num_warps: int) -> None:
    """words [W] int32 (a weight's bytes), sink [P] int32: P programs read W words."""
    programs = sink.numel()
    per_program = triton.cdiv(triton.cdiv(words.numel(), programs), block) * block
    prefetch_kernel[(programs,)](words, sink, words.numel(), per_program, BLOCK=block, num_warps=num_warps)
