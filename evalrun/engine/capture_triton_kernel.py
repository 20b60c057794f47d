"""The Triton kernels of the fused capture (see capture_triton.py): one program per (row, chunk), then one per row
merging its chunks.

Imported only where it runs (capture_triton.prepare on a CUDA device, or under TRITON_INTERPRET=1):
importing Triton costs a CPU-only command a second it never needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .capture import _INDEX_MULTIPLIER, _LANE_SEEDS, _LANE_STEP, _WORD_MULTIPLIER, BITS_VIEW
from .mixing import _MIX_2, _MIX_3

WORD_MULTIPLIER = tl.constexpr(_WORD_MULTIPLIER)
INDEX_MULTIPLIER = tl.constexpr(_INDEX_MULTIPLIER)
LANE_0 = tl.constexpr(_LANE_SEEDS[0])
LANE_1 = tl.constexpr(_LANE_SEEDS[0] + _LANE_STEP)
MIX_2 = tl.constexpr(_MIX_2)
MIX_3 = tl.constexpr(_MIX_3)


@triton.jit
def _logical_shift_right(x, bits: tl.constexpr):
    return (x >> bits) & ((1 << (64 - bits)) - 1)

@triton.jit
def _splitmix64(x):
    x = (x ^ _logical_shift_right(x, 30)) * MIX_2
    x = (x ^ _logical_shift_right(x, 27)) * MIX_3
    return x ^ _logical_shift_right(x, 31)

@triton.jit
def capture_chunk_kernel(logits_ptr, vocab, row_stride, digest_ptr, keys_ptr, chunks,
                         BITS: tl.constexpr, CHUNK_SIZE: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    index = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)  # [CHUNK]
    inside = index < vocab
    # int64 row offset: a row stride of T x V (logits of every position) passes 2^31 within a batch
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + index, mask=inside, other=0.0)  # [CHUNK]
    # Digest terms, as capture.logits_digest: raw bits sign-extended to int64, mixed with the index.
    if BITS == 16:
        words = x.to(tl.int16, bitcast=True).to(tl.int64)
    elif BITS == 32:
        words = x.to(tl.int32, bitcast=True).to(tl.int64)
    else:
        words = x.to(tl.int64, bitcast=True)
    base = words * WORD_MULTIPLIER + index.to(tl.int64) * INDEX_MULTIPLIER  # [CHUNK] int64
    lane0 = tl.where(inside, _splitmix64(base + LANE_0), 0)
    lane1 = tl.where(inside, _splitmix64(base + LANE_1), 0)
    out = digest_ptr + (row * chunks + chunk) * 2
    tl.store(out, tl.sum(lane0, axis=0))
    tl.store(out + 1, tl.sum(lane1, axis=0))
    # Packed keys: order-preserving float32 bits (high half), then the reversed index (low half).
    value = x.to(tl.float32)
    signed = value.to(tl.int32, bitcast=True)
    ordered = tl.where(signed >= 0, signed, signed ^ 0x7FFFFFFF)
    ordered = tl.where(value != value, 0x7FFFFFFF, ordered)  # NaN above +inf
    ordered = tl.where(value == 0.0, 0, ordered)  # -0.0 equals 0.0: their order goes by index too
    keys = ordered.to(tl.int64) * 4294967296 + (4294967295 - index.to(tl.int64))
    keys = tl.where(inside, keys, -9223372036854775807 - 1)
    best = tl.topk(keys, K)  # [K], largest first
    tl.store(keys_ptr + (row * chunks + chunk) * K + tl.arange(0, K), best)


def launch(logits: torch.Tensor, k_pow2: int, chunk: int, wrap=lambda kernel: kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] -> partial digests [B, C, 2] int64, candidate keys [B, C, k_pow2] int64 (C chunks)."""
    rows, vocab = logits.shape
    chunks = -(-vocab // chunk)
    digests = torch.empty(rows, chunks, 2, dtype=torch.int64, device=logits.device)
    keys = torch.empty(rows, chunks, k_pow2, dtype=torch.int64, device=logits.device)
    wrap(capture_chunk_kernel)[(rows, chunks)](logits, vocab, logits.stride(0), digests, keys, chunks,
                                               BITS=BITS_VIEW[logits.dtype].itemsize * 8, CHUNK_SIZE=chunk, K=k_pow2)
    return digests, keys


@triton.jit
def merge_kernel(logits_ptr, vocab, row_stride, digest_parts_ptr, keys_ptr, chunks, top_k, digest_ptr, ids_ptr,
                 values_ptr, margin_ptr, CHUNKS_POW2: tl.constexpr, CANDIDATES_POW2: tl.constexpr, K: tl.constexpr):
    """One program per row: the chunks' digest sums added (wrapping int64, so any order gives the same bits), the
    top-k of their candidate keys (distinct, so one order), those ids' logits and the margin between the first two:
    what capture_triton's torch merge computes, in one kernel instead of seven."""
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_POW2)
    parts = digest_parts_ptr + (row * chunks + c) * 2  # [C]
    tl.store(digest_ptr + row * 2, tl.sum(tl.load(parts, mask=c < chunks, other=0), axis=0))
    tl.store(digest_ptr + row * 2 + 1, tl.sum(tl.load(parts + 1, mask=c < chunks, other=0), axis=0))
    j = tl.arange(0, CANDIDATES_POW2)
    keys = tl.load(keys_ptr + row * chunks * K + j, mask=j < chunks * K, other=-9223372036854775807 - 1)  # [C*K]
    best = tl.topk(keys, K)  # [K], largest first
    ids = 4294967295 - (best & 4294967295)
    logits_row = logits_ptr + row.to(tl.int64) * row_stride
    values = tl.load(logits_row + ids, mask=ids < vocab, other=0.0).to(tl.float32)  # [K]
    r = tl.arange(0, K)
    tl.store(ids_ptr + row * top_k + r, ids, mask=r < top_k)
    tl.store(values_ptr + row * top_k + r, values, mask=r < top_k)
    first = tl.max(keys, axis=0)  # the first two ids again as scalars (integer maxima: exact), for the margin
    second = tl.max(tl.where(keys == first, -9223372036854775807 - 1, keys), axis=0)
    id_1, id_2 = 4294967295 - (first & 4294967295), 4294967295 - (second & 4294967295)
    value_1 = tl.load(logits_row + id_1, mask=id_1 < vocab, other=0.0).to(tl.float32)  # masked: a padding key
    value_2 = tl.load(logits_row + id_2, mask=id_2 < vocab, other=0.0).to(tl.float32)
    tl.store(margin_ptr + row, value_1 - value_2)


def launch_merge(logits: torch.Tensor, digest_parts: torch.Tensor, keys: torch.Tensor, top_k: int,
                 wrap=lambda kernel: kernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V], partial digests [B, C, 2], candidate keys [B, C, K] -> digest [B, 2] int64, ids [B, top_k]
    int64, values [B, top_k] float32, margin [B] float32."""
    rows, chunks, k_pow2 = keys.shape
    device = logits.device
    digest = torch.empty(rows, 2, dtype=torch.int64, device=device)
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=device)
    values = torch.empty(rows, top_k, dtype=torch.float32, device=device)
    margin = torch.empty(rows, dtype=torch.float32, device=device)
    wrap(merge_kernel)[(rows,)](logits, logits.shape[1], logits.stride(0), digest_parts, keys, chunks, top_k, digest,
                                ids, values, margin, CHUNKS_POW2=triton.next_power_of_2(chunks),
                                CANDIDATES_POW2=triton.next_power_of_2(chunks * k_pow2), K=k_pow2)
    return digest, ids, values, margin
