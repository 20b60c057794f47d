"""The Triton kernels of attention_triton.py: split-KV attention for one decode token (flash-decoding).

q [B, G, R, D]: the R query heads that share key/value head g, as R rows (the engine's grouped layout); keys
and values [B, G, S, D]; an additive mask [B, 1, R, S]. Each program of the first kernel takes one key/value
head and one chunk of CHUNK cache slots (whole blocks of BLOCK_S), and keeps, in float32 for each of the R
rows, the running maximum of the scaled scores, the sum of their exponentials and the exponential-weighted sum
of the values (the rows padded to 16 for tl.dot, the head dimension to a power of two). Then a head's chunks
are combined in a fixed order: by the last program of the head to finish (it counts the head's finished programs
in an arrival counter, and sets it back to 0), or, where no counters are given (inside torch.compile's traces;
see attention_triton.arrivals_for for the other cases), by a second kernel. Both combine with the same code in the
same order, so the same bits; the first saves a kernel launch per layer. Why the last program sees every other
program's partials: each program's stores, a barrier of its threads, then one thread's atomic add with
acquire-release semantics at GPU scope, whose result the barrier after it hands to every thread
(tests/test_attention_triton.py reads this order in the PTX). The counters assume one launch at a time per
device (one stream), as the engine runs. The chunking is fixed by S alone (attention_triton.chunk_for), and the
counter only decides which program combines, never the order, so a run's bits depend on the shapes only. The
probabilities are rounded to the values' dtype before their product with the values, as flash attention does;
float32 products are computed in full float32 (input_precision="ieee"), never TF32 (the 16-bit dtypes keep
Triton's default, which is exact for them). CHUNK and CHUNKS are compile-time constants: one compile per chunk
count a run meets. Imported only where it runs (a CUDA device, or under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr, out_ptr, arrivals_ptr, scale, slots,
                   q_stride_b, q_stride_g, q_stride_r, kv_stride_b, kv_stride_g, kv_stride_s, mask_stride_b,
                   mask_stride_r, out_stride_b, out_stride_g, out_stride_r, kv_heads, R: tl.constexpr,
                   ROWS: tl.constexpr, D: tl.constexpr, DIMS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                   BLOCK_S: tl.constexpr, PRECISION: tl.constexpr, COMBINE: tl.constexpr):
    head = tl.program_id(0)  # b * G + g
    chunk = tl.program_id(1)
    scale = tl.cast(scale, tl.float32)  # Inductor passes a Python float as float64; Triton's own launch as float32
    b = head // kv_heads
    g = head % kv_heads
    rows = tl.arange(0, ROWS)  # [RS]
    dims = tl.arange(0, DIMS)  # [DP]
    live, real = rows < R, dims < D
    q = tl.load(q_ptr + b * q_stride_b + g * q_stride_g + rows[:, None] * q_stride_r + dims[None, :],
                mask=live[:, None] & real[None, :], other=0.0)  # [RS, DP]
    kv_base = b * kv_stride_b + g * kv_stride_g
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIMS), tl.float32)
    for offset in range(0, CHUNK, BLOCK_S):
        at = chunk * CHUNK + offset + tl.arange(0, BLOCK_S)  # [BS]
        inside = at < slots
        k = tl.load(k_ptr + kv_base + at[:, None] * kv_stride_s + dims[None, :], mask=inside[:, None] & real[None, :],
                    other=0.0)  # [BS, DP]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [RS, BS] float32
        bias = tl.load(mask_ptr + b * mask_stride_b + rows[:, None] * mask_stride_r + at[None, :],
                       mask=live[:, None] & inside[None, :], other=float("-inf"))
        scores = scores + bias.to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen no key yet
        p = tl.exp(scores - safe_max[:, None])
        alpha = tl.exp(running_max - safe_max)
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_base + at[:, None] * kv_stride_s + dims[None, :], mask=inside[:, None] & real[None, :],
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    part = head * CHUNKS + chunk
    tl.store(acc_ptr + (part * ROWS + rows[:, None]) * DIMS + dims[None, :], acc)
    tl.store(max_ptr + part * ROWS + rows, running_max)
    tl.store(sum_ptr + part * ROWS + rows, running_sum)
    if COMBINE:  # the head's last program to finish combines its chunks
        tl.debug_barrier()  # every thread's stores above, then the release of the count (acq_rel: PTX's cumulativity)
        finished = tl.atomic_add(arrivals_ptr + head, 1, sem="acq_rel", scope="gpu")
        if finished == CHUNKS - 1:
            combine_head(head, acc_ptr, max_ptr, sum_ptr, out_ptr, out_stride_b, out_stride_g, out_stride_r,
                         kv_heads, R, ROWS, D, DIMS, CHUNKS)
            tl.store(arrivals_ptr + head, 0)  # for the next launch, which on one stream starts after this kernel ends


@triton.jit
def combine_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, out_stride_b, out_stride_g, out_stride_r, kv_heads,
                   R: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, DIMS: tl.constexpr, CHUNKS: tl.constexpr):
    combine_head(tl.program_id(0), acc_ptr, max_ptr, sum_ptr, out_ptr, out_stride_b, out_stride_g, out_stride_r,
                 kv_heads, R, ROWS, D, DIMS, CHUNKS)


@triton.jit
def combine_head(head, acc_ptr, max_ptr, sum_ptr, out_ptr, out_stride_b, out_stride_g, out_stride_r, kv_heads,
                 R: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, DIMS: tl.constexpr, CHUNKS: tl.constexpr):
    """One head's chunks in a fixed order. Read at L2 (.cg), where other SMs' stores land; their visibility comes
    from the barrier and the acquire-release count in partial_kernel."""
    b = head // kv_heads
    g = head % kv_heads
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIMS)
    overall = tl.full((ROWS,), float("-inf"), tl.float32)
    for chunk in range(CHUNKS):
        overall = tl.maximum(overall, tl.load(max_ptr + (head * CHUNKS + chunk) * ROWS + rows, cache_modifier=".cg"))
    safe = tl.where(overall == float("-inf"), 0.0, overall)  # padding rows only: every query sees itself
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIMS), tl.float32)
    for chunk in range(CHUNKS):  # a fixed order
        part = head * CHUNKS + chunk
        weight = tl.exp(tl.load(max_ptr + part * ROWS + rows, cache_modifier=".cg") - safe)  # saw no key: 0
        total += tl.load(sum_ptr + part * ROWS + rows, cache_modifier=".cg") * weight
        partial = tl.load(acc_ptr + (part * ROWS + rows[:, None]) * DIMS + dims[None, :], cache_modifier=".cg")
        acc += partial * weight[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + b * out_stride_b + g * out_stride_g + rows[:, None] * out_stride_r + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows < R)[:, None] & (dims < D)[None, :])


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, chunk: int,
           block_s: int, wrap=lambda kernel: kernel, num_warps: int = 4,
           arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, G, R, D], k/v [B, G, S, D], mask [B, 1, R, S] (each with its last dimension contiguous) -> [B, G, R, D].

    arrivals: int32 counters, at least B * G of them, all 0 (and left 0): the last program of each head combines
    its chunks. None: a second kernel combines them (the same bits)."""
    batch, kv_heads, rows, dim = q.shape
    slots = k.shape[2]
    chunks = triton.cdiv(slots, chunk)
    padded_rows, padded_dim = max(16, triton.next_power_of_2(rows)), max(16, triton.next_power_of_2(dim))
    parts = batch * kv_heads * chunks * padded_rows
    acc = torch.empty(parts * padded_dim, dtype=torch.float32, device=q.device)
    maxes = torch.empty(parts, dtype=torch.float32, device=q.device)
    sums = torch.empty(parts, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    shape = dict(R=rows, ROWS=padded_rows, D=dim, DIMS=padded_dim, CHUNKS=chunks)
    combine = arrivals is not None
    if combine and not (arrivals.dtype == torch.int32 and arrivals.device == q.device and arrivals.is_contiguous()
                        and arrivals.numel() >= batch * kv_heads):
        raise ValueError(f"arrival counters must be {batch * kv_heads} or more contiguous int32 on {q.device}")
    wrap(partial_kernel)[(batch * kv_heads, chunks)](
        q, k, v, mask, acc, maxes, sums, out, arrivals if combine else maxes,  # maxes: a pointer never read
        scale, slots, q.stride(0), q.stride(1),
        q.stride(2), k.stride(0), k.stride(1), k.stride(2), mask.stride(0), mask.stride(2), out.stride(0),
        out.stride(1), out.stride(2), kv_heads, CHUNK=chunk, BLOCK_S=block_s,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", COMBINE=combine, num_warps=num_warps, **shape)
    if not combine:
        wrap(combine_kernel)[(batch * kv_heads,)](acc, maxes, sums, out, out.stride(0), out.stride(1), out.stride(2),
                                                  kv_heads, num_warps=num_warps, **shape)
    return out
