"""The RMSNorm of norm_triton.py: y [M, n] = RMSNorm(x [M, n]) scaled by w [n], one program a row.

Each program reads its whole row once (BLOCK, the next power of two of n, lanes), sums the squares in float32 in
one reduction whose order is fixed by BLOCK and the warps (so by the shapes alone), and writes the row. It rounds
where the engine's eager norms round (transformer.py): Llama's normalised row to the model dtype, then times w and
rounded again (weight * F.rms_norm(x)); Gemma's (OFFSET) x * rsqrt * (1 + w) in float32, rounded once. Imported
only where it runs (norm_triton.prepare on a CUDA device, or under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_stride, y_stride, n: tl.constexpr, EPS: tl.constexpr,
                    OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    inside = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / n + EPS)  # one row's rsqrt(mean(x^2) + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if OFFSET:  # Gemma: scaled by 1 + w in float32, rounded once
        y = x * scale * (1.0 + w)
    else:  # Llama: the normalised row rounded to the model dtype, then times w
        y = (x * scale).to(y_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


def warps_for(block: int) -> int:
    """Fixed by the row length, so the reduction order is too: 8 warps from 4096 lanes, 4 below."""
    return 8 if block >= 4096 else 4


def launch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool,
           wrap=lambda kernel: kernel) -> torch.Tensor:
    """x [M, n] (each row contiguous, rows x.stride(0) apart), weight [n] (contiguous) -> y [M, n] (contiguous) in
    x's dtype."""
    rows, n = x.shape
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    wrap(rms_norm_kernel)[(rows,)](x, weight, y, x.stride(0), y.stride(0), n, EPS=float(eps), OFFSET=offset,
                                   BLOCK=block, num_warps=warps_for(block))
    return y
