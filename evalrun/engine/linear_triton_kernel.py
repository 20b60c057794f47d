"""The Triton GEMV of linear.py: y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) (+ residual [M, N]), for 1-4 rows.

One program computes BLOCK_N outputs of every row: it streams its BLOCK_N rows of the weight once,
BLOCK_K columns at a time, and keeps a float32 product per (row, output, column lane), summed over the
lanes at the end. K is a compile-time constant (a model has a few), so the loop is static. Each output's
reduction order is fixed by the block sizes (no atomics, no split over programs), so a run's bits depend
on the shapes only. A residual is added after the product is rounded to the output dtype, in float32,
and rounded again: the bits of adding it with torch after the product. Imported only where it runs
(linear.prepare on a CUDA device, or under TRITON_INTERPRET=1).

A prologue computes the kernel's input from what the step's previous kernel wrote, in place of a kernel of
its own (PROLOGUE):
  NORM    x is the RMSNorm of the rows read: each program first sums their squares in float32 (BLOCK_K columns
          at a time, then over the lanes), then scales each chunk as it reads it, rounding as torch does
          (x * rstd rounded to the model dtype, times the norm's weight, rounded again): weight * F.rms_norm(x).
  GATED   the rows read are [gate | up], 2K wide; x = silu(gate) rounded, times up, rounded: F.silu(gate) * up.
Each program repeats the prologue's arithmetic for its own outputs (the input is a few KB read from L2); the
sum of squares runs in a fixed order, so the bits still depend on the shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAIN, NORM, GATED = 0, 1, 2  # PROLOGUE


@triton.jit
def gemv_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, norm_ptr, y_ptr, rows, n, x_stride, w_stride, y_stride, eps,
                k: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PROLOGUE: tl.constexpr,
                EVEN: tl.constexpr, ROWS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ms = tl.arange(0, ROWS_POW2)  # [R]
    lanes = tl.arange(0, BLOCK_K)  # [BK]
    w_rows = w_ptr + outs.to(tl.int64)[:, None] * w_stride  # [BN, 1]
    x_rows = x_ptr + ms[:, None] * x_stride  # [R, 1]
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:  # NORM: rstd [R] of the rows read
        squares = tl.zeros((ROWS_POW2, BLOCK_K), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + lanes
            xs = tl.load(x_rows + ks[None, :], mask=(ms[:, None] < rows) & (ks[None, :] < k), other=0.0)
            squares += xs.to(tl.float32) * xs.to(tl.float32)
        # [R]; eps cast, since Inductor passes a Python float as float64
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / k + tl.cast(eps, tl.float32))
    acc = tl.zeros((ROWS_POW2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + lanes
        if EVEN:  # n and k multiples of the blocks: unmasked, vectorised weight loads
            w = tl.load(w_rows + ks[None, :])  # [BN, BK]
        else:
            w = tl.load(w_rows + ks[None, :], mask=(outs[:, None] < n) & (ks[None, :] < k), other=0.0)
        inside_k = (ms[:, None] < rows) & (ks[None, :] < k)  # [R, BK]
        x = tl.load(x_rows + ks[None, :], mask=inside_k, other=0.0).to(tl.float32)  # [R, BK]
        if PROLOGUE == 1:
            scale = tl.load(norm_ptr + ks, mask=ks < k, other=0.0).to(tl.float32)  # [BK]
            x = (x * rstd[:, None]).to(dtype).to(tl.float32)
            x = (scale[None, :] * x).to(dtype).to(tl.float32)
        if PROLOGUE == 2:  # GATED: x is the gate, the up half follows K columns later
            up = tl.load(x_rows + k + ks[None, :], mask=inside_k, other=0.0).to(tl.float32)
            x = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
            x = (x * up).to(dtype).to(tl.float32)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [R, BN]
    if HAS_BIAS:
        y += tl.load(bias_ptr + outs, mask=outs < n, other=0.0).to(tl.float32)[None, :]
    into = ms[:, None] * y_stride + outs[None, :]  # [R, BN]
    inside = (ms[:, None] < rows) & (outs[None, :] < n)
    if HAS_RESIDUAL:  # [R, BN]: rounded product + residual, as torch adds two tensors of the output dtype
        residual = tl.load(residual_ptr + into, mask=inside, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + residual
    tl.store(y_ptr + into, y.to(y_ptr.dtype.element_ty), mask=inside)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int, block_k: int,
           num_warps: int, wrap=lambda kernel: kernel, residual: torch.Tensor | None = None,
           norm: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False) -> torch.Tensor:
    """x [M, K] (rows contiguous; [M, 2K] gate then up with `gated`), weight [N, K] (rows contiguous), bias [N] or
    None, residual [M, N] (contiguous) or None, norm [K] (the RMSNorm weight x is normalised by first, with eps) or
    None -> y [M, N]."""
    rows = x.shape[0]
    n, k = weight.shape
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    even = n % block_n == 0 and k % block_k == 0
    prologue = GATED if gated else NORM if norm is not None else PLAIN
    wrap(gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, weight, x if bias is None else bias, x if residual is None else residual, x if norm is None else norm, y,
        rows, n, x.stride(0), weight.stride(0), y.stride(0), float(eps), k, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, PROLOGUE=prologue, EVEN=even, ROWS_POW2=triton.next_power_of_2(rows),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y
