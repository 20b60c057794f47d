"""The Triton GEMV of linear.py: y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) (+ residual [M, N]), for 1-4 rows.

One program computes BLOCK_N outputs of every row: it streams its BLOCK_N rows of the weight once,
BLOCK_K columns at a time, and keeps a float32 product per (row, output, column lane), summed over the
lanes at the end. K is a compile-time constant (a model has a few), so the loop is static. Each output's
reduction order is fixed by the block sizes (no atomics, no split over programs), so a run's bits depend
on the shapes only. A residual is added after the product is rounded to the output dtype, in float32,
and rounded again: the bits of adding it with torch after the product. Imported only where it runs
(linear.prepare on a CUDA device, or under TRITON_INTERPRET=1).

`gemv_glu_kernel` (linear_kernel=triton-gemv-glu) is the same GEMV over a stacked gate/up weight [2I, K] that
returns silu(gate) * up [M, I] instead of gate and up: each program streams BLOCK_N gate rows and the BLOCK_N up
rows of the same outputs, and its epilogue applies the activation, so the MLP's activation is no kernel of its
own. It rounds where eager rounds: gate and up to the output dtype as the product's, silu(gate), then the
product (the values may still differ: Triton's exp is not torch's, and the interpreter truncates its casts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gemv_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, y_ptr, rows, n, x_stride, w_stride, y_stride,
                k: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN: tl.constexpr,
                ROWS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ms = tl.arange(0, ROWS_POW2)  # [R]
    lanes = tl.arange(0, BLOCK_K)  # [BK]
    w_rows = w_ptr + outs.to(tl.int64)[:, None] * w_stride  # [BN, 1]
    x_rows = x_ptr + ms[:, None] * x_stride  # [R, 1]
    acc = tl.zeros((ROWS_POW2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in tl.range(0, k, BLOCK_K, num_stages=STAGES):  # STAGES - 1 tiles in flight (1 in the engine)
        ks = start + lanes
        if EVEN:  # n and k multiples of the blocks: unmasked, vectorised weight loads
            w = tl.load(w_rows + ks[None, :])  # [BN, BK]
        else:
            w = tl.load(w_rows + ks[None, :], mask=(outs[:, None] < n) & (ks[None, :] < k), other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=(ms[:, None] < rows) & (ks[None, :] < k), other=0.0)  # [R, BK]
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
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
           stages: int = 1) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [N, K] (rows contiguous), bias [N] or None, residual [M, N] (contiguous)
    or None -> y [M, N]."""
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    even = n % block_n == 0 and k % block_k == 0
    wrap(gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, weight, x if bias is None else bias, x if residual is None else residual, y, rows, n, x.stride(0),
        weight.stride(0), y.stride(0), k, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, EVEN=even,
        ROWS_POW2=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=num_warps)
    return y


@triton.jit
def gemv_glu_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, rows, n, x_stride, w_stride, y_stride, k: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, ROWS_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]: outputs j, from gate row j and up row n + j
    ms = tl.arange(0, ROWS_POW2)  # [R]
    lanes = tl.arange(0, BLOCK_K)  # [BK]
    gate_rows = w_ptr + outs.to(tl.int64)[:, None] * w_stride  # [BN, 1]
    up_rows = w_ptr + (outs + n).to(tl.int64)[:, None] * w_stride  # [BN, 1]
    x_rows = x_ptr + ms[:, None] * x_stride  # [R, 1]
    gate_acc = tl.zeros((ROWS_POW2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    up_acc = tl.zeros((ROWS_POW2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in tl.range(0, k, BLOCK_K, num_stages=STAGES):  # STAGES - 1 tiles in flight (1 in the engine)
        ks = start + lanes
        if EVEN:  # n and k multiples of the blocks: unmasked, vectorised weight loads
            wg = tl.load(gate_rows + ks[None, :])  # [BN, BK]
            wu = tl.load(up_rows + ks[None, :])  # [BN, BK]
        else:
            inside_w = (outs[:, None] < n) & (ks[None, :] < k)
            wg = tl.load(gate_rows + ks[None, :], mask=inside_w, other=0.0)
            wu = tl.load(up_rows + ks[None, :], mask=inside_w, other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=(ms[:, None] < rows) & (ks[None, :] < k), other=0.0)  # [R, BK]
        xf = x.to(tl.float32)[:, None, :]
        gate_acc += xf * wg.to(tl.float32)[None, :, :]
        up_acc += xf * wu.to(tl.float32)[None, :, :]
    gate = tl.sum(gate_acc, axis=2)  # [R, BN]
    up = tl.sum(up_acc, axis=2)  # [R, BN]
    if HAS_BIAS:
        gate += tl.load(bias_ptr + outs, mask=outs < n, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + n + outs, mask=outs < n, other=0.0).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)  # as the product's outputs are stored
    up = up.to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # silu, rounded as F.silu rounds it
    into = ms[:, None] * y_stride + outs[None, :]  # [R, BN]
    tl.store(y_ptr + into, (activated * up).to(dtype), mask=(ms[:, None] < rows) & (outs[None, :] < n))


def launch_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int, block_k: int,
               num_warps: int, wrap=lambda kernel: kernel, stages: int = 1) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [2I, K] (gate rows, then up rows; rows contiguous), bias [2I] or None ->
    silu(gate) * up [M, I]."""
    rows, k = x.shape
    n = weight.shape[0] // 2
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    even = n % block_n == 0 and k % block_k == 0
    wrap(gemv_glu_kernel)[(triton.cdiv(n, block_n),)](
        x, weight, x if bias is None else bias, y, rows, n, x.stride(0), weight.stride(0), y.stride(0), k,
        HAS_BIAS=bias is not None, EVEN=even, ROWS_POW2=triton.next_power_of_2(rows), BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=stages, num_warps=num_warps)
    return y
