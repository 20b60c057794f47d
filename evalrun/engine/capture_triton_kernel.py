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
def merge_kernel(logits_ptr, vocab, row_stride, digest_parts_ptr, keys_ptr, chunks, top_k, step_ptr, steps,
                 digest_ptr, digest_row, ids_ptr, ids_row, values_ptr, values_row, margin_ptr, margin_row, tokens_ptr,
                 tokens_row, next_token_ptr, CHUNKS_POW2: tl.constexpr, CANDIDATES_POW2: tl.constexpr,
                 K: tl.constexpr, AT_STEP: tl.constexpr, WRITE_TOKEN: tl.constexpr):
    """One program per row: the chunks' digest sums added (wrapping int64, so any order gives the same bits), the
    top-k of their candidate keys (distinct, so one order), those ids' logits and the margin between the first two:
    what capture_triton's torch merge computes, in one kernel instead of seven.

    Each output is written at `row * <its row stride>`; with AT_STEP, into the capture buffers at the step that
    `step_ptr` holds (the buffers' step stride: 2 for the digest, top_k for ids and values, 1 for the margin), and
    with WRITE_TOKEN the top-1 id also as the step's token and the next step's input: the five index copies and
    the token copy that capture_step would otherwise launch (stop 23). A step at or past `steps` (the buffers' N)
    writes nothing: the buffers' bounds, which index copies checked."""
    row = tl.program_id(0)
    step = tl.load(step_ptr) if AT_STEP else 0
    held = step < steps  # [] bool: the step lies inside the buffers
    out_row = row.to(tl.int64)  # offsets in int64: B x N x K may pass 2^31
    c = tl.arange(0, CHUNKS_POW2)
    parts = digest_parts_ptr + (row * chunks + c) * 2  # [C]
    digest_out = digest_ptr + out_row * digest_row + step * 2
    tl.store(digest_out, tl.sum(tl.load(parts, mask=c < chunks, other=0), axis=0), mask=held)
    tl.store(digest_out + 1, tl.sum(tl.load(parts + 1, mask=c < chunks, other=0), axis=0), mask=held)
    j = tl.arange(0, CANDIDATES_POW2)
    keys = tl.load(keys_ptr + row * chunks * K + j, mask=j < chunks * K, other=-9223372036854775807 - 1)  # [C*K]
    best = tl.topk(keys, K)  # [K], largest first
    ids = 4294967295 - (best & 4294967295)
    logits_row = logits_ptr + row.to(tl.int64) * row_stride
    values = tl.load(logits_row + ids, mask=ids < vocab, other=0.0).to(tl.float32)  # [K]
    r = tl.arange(0, K)
    tl.store(ids_ptr + out_row * ids_row + step * top_k + r, ids, mask=(r < top_k) & held)
    tl.store(values_ptr + out_row * values_row + step * top_k + r, values, mask=(r < top_k) & held)
    first = tl.max(keys, axis=0)  # the first two ids again as scalars (integer maxima: exact), for the margin
    second = tl.max(tl.where(keys == first, -9223372036854775807 - 1, keys), axis=0)
    id_1, id_2 = 4294967295 - (first & 4294967295), 4294967295 - (second & 4294967295)
    value_1 = tl.load(logits_row + id_1, mask=id_1 < vocab, other=0.0).to(tl.float32)  # masked: a padding key
    value_2 = tl.load(logits_row + id_2, mask=id_2 < vocab, other=0.0).to(tl.float32)
    tl.store(margin_ptr + out_row * margin_row + step, value_1 - value_2, mask=held)
    if WRITE_TOKEN:  # argmax's choice (capture_triton: the lowest id among equal values, NaN first)
        tl.store(tokens_ptr + out_row * tokens_row + step, id_1, mask=held)
        tl.store(next_token_ptr + row, id_1)


def launch_merge(logits: torch.Tensor, digest_parts: torch.Tensor, keys: torch.Tensor, top_k: int,
                 wrap=lambda kernel: kernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V], partial digests [B, C, 2], candidate keys [B, C, K] -> digest [B, 2] int64, ids [B, top_k]
    int64, values [B, top_k] float32, margin [B] float32."""
    rows, device = logits.shape[0], logits.device
    digest = torch.empty(rows, 2, dtype=torch.int64, device=device)
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=device)
    values = torch.empty(rows, top_k, dtype=torch.float32, device=device)
    margin = torch.empty(rows, dtype=torch.float32, device=device)
    _merge(logits, digest_parts, keys, top_k, digest, ids, values, margin, wrap=wrap)
    return digest, ids, values, margin


def launch_merge_at_step(logits: torch.Tensor, digest_parts: torch.Tensor, keys: torch.Tensor, step: torch.Tensor,
                         digests: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, margins: torch.Tensor,
                         tokens: torch.Tensor, next_token: torch.Tensor, write_token: bool,
                         wrap=lambda kernel: kernel) -> None:
    """The merge written into capture buffers at `step` [1] int64: digests [B, N, 2], ids [B, N, K], values
    [B, N, K], margins [B, N]; with `write_token`, the top-1 id into tokens [B, N] at the step and next_token [B]."""
    _merge(logits, digest_parts, keys, ids.shape[-1], digests, ids, values, margins, step, tokens, next_token,
           write_token, wrap)


def _merge(logits, digest_parts, keys, top_k, digest, ids, values, margin, step=None, tokens=None, next_token=None,
           write_token=False, wrap=lambda kernel: kernel) -> None:
    rows, chunks, k_pow2 = keys.shape
    at_step = step is not None
    wrap(merge_kernel)[(rows,)](
        logits, logits.shape[1], logits.stride(0), digest_parts, keys, chunks, top_k, step if at_step else digest,
        digest.shape[1] if at_step else 1, digest, digest.stride(0), ids, ids.stride(0), values, values.stride(0),
        margin, margin.stride(0), tokens if write_token else digest, tokens.stride(0) if write_token else 0,
        next_token if write_token else digest, CHUNKS_POW2=triton.next_power_of_2(chunks),
        CANDIDATES_POW2=triton.next_power_of_2(chunks * k_pow2), K=k_pow2, AT_STEP=at_step, WRITE_TOKEN=write_token)
