"""What attention costs in a decode step, by SDPA backend, before anyone builds a decode kernel (issue #16).

  python benchmarks/decode_attention.py [--layers 32] [--json PATH]

The engine's decode attention at batch 1 on Llama-3-8B's shapes: the 4 query heads that share a key/value
head stacked as 4 query rows of that head (q [1, 8, 4, 128]), keys and values [1, 8, S, 128] of distinct
caches per layer, and the engine's additive mask [1, 1, 4, S] (transformer.build_mask). Each SDPA backend
that takes the mask (cuDNN, memory-efficient, math) is timed per layer over `--layers` layers replayed from
one CUDA graph, at several cache lengths S, beside the bytes of keys and values it must read.

A candidate beside them, measured before anyone builds it into the engine: split-KV decode attention
(flash-decoding) in Triton. SDPA's time grows with the cache far slower than its bytes allow (the first run:
88.9 us a layer for 16.8 MB at 4096 slots, 0.19 TB/s), as if a few programs walked each head's whole cache;
here each head's cache is split into about 8, 16 or 32 chunks of whole 64-slot blocks, one program each
(partial maximum, sum and weighted values in float32), and a second kernel combines the chunks in a fixed
order, so the bits depend on the shapes alone.
Prototype only: nothing here is reachable from a config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_breakdown import graphed_ms, per_layer_arguments  # noqa: E402
from evalrun.engine.transformer import build_mask  # noqa: E402

@triton.jit
def split_kv_partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr, scale, slots,
                            q_stride_b, q_stride_g, q_stride_r, kv_stride_b, kv_stride_g, kv_stride_s,
                            mask_stride_b, mask_stride_r, kv_heads,
                            R: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                            CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr):
    head = tl.program_id(0)  # b * G + g
    chunk = tl.program_id(1)
    b = head // kv_heads
    g = head % kv_heads
    rows = tl.arange(0, ROWS)  # [RS]: the R query rows of this key/value head, padded for tl.dot
    dims = tl.arange(0, D)
    live = rows < R
    q = tl.load(q_ptr + b * q_stride_b + g * q_stride_g + rows[:, None] * q_stride_r + dims[None, :],
                mask=live[:, None], other=0.0)  # [RS, D]
    kv_base = b * kv_stride_b + g * kv_stride_g
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for offset in range(0, CHUNK, BLOCK_S):
        at = chunk * CHUNK + offset + tl.arange(0, BLOCK_S)  # [BS]
        inside = at < slots
        k = tl.load(k_ptr + kv_base + at[:, None] * kv_stride_s + dims[None, :], mask=inside[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale  # [RS, BS] float32
        bias = tl.load(mask_ptr + b * mask_stride_b + rows[:, None] * mask_stride_r + at[None, :],
                       mask=live[:, None] & inside[None, :], other=float("-inf"))
        scores = scores + bias.to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(scores - safe_max[:, None])
        alpha = tl.exp(running_max - safe_max)
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_base + at[:, None] * kv_stride_s + dims[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
    part = head * CHUNKS + chunk
    tl.store(acc_ptr + (part * ROWS + rows[:, None]) * D + dims[None, :], acc)
    tl.store(max_ptr + part * ROWS + rows, running_max)
    tl.store(sum_ptr + part * ROWS + rows, running_sum)


@triton.jit
def split_kv_combine_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, out_stride_b, out_stride_g, out_stride_r, kv_heads,
                            R: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, CHUNKS: tl.constexpr):
    head = tl.program_id(0)
    b = head // kv_heads
    g = head % kv_heads
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, D)
    overall = tl.full((ROWS,), float("-inf"), tl.float32)
    for chunk in range(CHUNKS):
        overall = tl.maximum(overall, tl.load(max_ptr + (head * CHUNKS + chunk) * ROWS + rows))
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for chunk in range(CHUNKS):  # a fixed order: the bits depend on the shapes only
        part = head * CHUNKS + chunk
        weight = tl.exp(tl.load(max_ptr + part * ROWS + rows) - overall)  # a chunk that saw nothing: 0
        total += tl.load(sum_ptr + part * ROWS + rows) * weight
        acc += tl.load(acc_ptr + (part * ROWS + rows[:, None]) * D + dims[None, :]) * weight[:, None]
    out = acc / total[:, None]
    tl.store(out_ptr + b * out_stride_b + g * out_stride_g + rows[:, None] * out_stride_r + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows < R)[:, None])


def chunk_for(slots: int, block_s: int = 64, target_chunks: int = 16) -> int:
    """Slots per program: about `target_chunks` chunks of whole blocks (fixed by the cache length alone)."""
    per = triton.cdiv(slots, target_chunks)
    return max(block_s, triton.cdiv(per, block_s) * block_s)


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float | None = None, block_s: int = 64, target_chunks: int = 16,
                       num_warps: int = 4) -> torch.Tensor:
    """q [B, G, R, D] (one decode token: R query rows per key/value head), k/v [B, G, S, D] (rows contiguous),
    mask [B, 1, R, S] additive -> [B, G, R, D]."""
    batch, kv_heads, rows, dim = q.shape
    slots = k.shape[2]
    chunk = chunk_for(slots, block_s, target_chunks)
    chunks = triton.cdiv(slots, chunk)
    padded = max(16, triton.next_power_of_2(rows))
    heads = batch * kv_heads
    acc = torch.empty(heads * chunks * padded * dim, dtype=torch.float32, device=q.device)
    maxes = torch.empty(heads * chunks * padded, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    out = torch.empty_like(q)
    scale = dim ** -0.5 if scale is None else scale
    split_kv_partial_kernel[(heads, chunks)](
        q, k, v, mask, acc, maxes, sums, scale, slots, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), mask.stride(0), mask.stride(2), kv_heads, R=rows, ROWS=padded, D=dim,
        CHUNK=chunk, CHUNKS=chunks, BLOCK_S=block_s, num_warps=num_warps)
    split_kv_combine_kernel[(heads,)](acc, maxes, sums, out, out.stride(0), out.stride(1), out.stride(2), kv_heads,
                                      R=rows, ROWS=padded, D=dim, CHUNKS=chunks, num_warps=num_warps)
    return out


HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def main() -> None:
    args = per_layer_arguments(__doc__)
    bf16, cuda = torch.bfloat16, "cuda"
    rows_per_head = HEADS // KV_HEADS
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "us_per_layer": {}}
    for slots in (144, 256, 1024, 4096):  # 144: a 16-slot prompt bucket + 128 steps, the bench's context
        q = torch.randn(1, KV_HEADS, rows_per_head, HEAD_DIM, dtype=bf16, device=cuda)
        caches = [(torch.randn(1, KV_HEADS, slots, HEAD_DIM, dtype=bf16, device=cuda),
                   torch.randn(1, KV_HEADS, slots, HEAD_DIM, dtype=bf16, device=cuda)) for _ in range(args.layers)]
        used = slots // 2  # half the cache written so far; the rest hidden by the mask
        key_valid = torch.zeros(1, slots, dtype=torch.bool, device=cuda)
        key_valid[:, :used] = True
        mask = build_mask(torch.tensor([used - 1], device=cuda), key_valid, rows_per_head, bf16)
        reference = F.scaled_dot_product_attention(q, *caches[0], attn_mask=mask)
        for name, backend in BACKENDS.items():
            def attend(k, v, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            try:
                us = graphed_ms(attend, caches, warmups=2) * 1000
                difference = float((attend(*caches[0]).float() - reference.float()).abs().max())
            except RuntimeError as error:  # a backend that refuses these shapes or the mask
                us, difference = None, str(error).splitlines()[0][:120]
            report["us_per_layer"][f"S={slots} {name}"] = {"us": us, "max_abs_difference_from_default": difference,
                                                           "kv_mb": 2 * caches[0][0].nbytes / 1e6}
        for target in (8, 16, 32):
            def split(k, v, target=target):
                return split_kv_attention(q, k, v, mask, target_chunks=target)
            us = graphed_ms(split, caches, warmups=2) * 1000
            difference = float((split(*caches[0]).float() - reference.float()).abs().max())
            report["us_per_layer"][f"S={slots} triton split-KV ~{target} chunks"] = {
                "us": us, "max_abs_difference_from_default": difference, "kv_mb": 2 * caches[0][0].nbytes / 1e6,
                "chunk": chunk_for(slots, 64, target)}
    print(f"{report['device']}  torch {report['torch']}  per layer, one CUDA graph over {args.layers} layers")
    for name, row in report["us_per_layer"].items():
        us = f"{row['us']:7.2f} us" if row["us"] is not None else "refused"
        print(f"  {name:36s} {us}  ({row['kv_mb']:.1f} MB of keys and values)  {row['max_abs_difference_from_default']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
