"""The capture of one decode step fused into one Triton kernel: digest, top-k and margin in one read.

`capture.py` computes the same three things with torch ops (the CPU and reference implementation):
the digest reads the logits once, the top-k a second time. Here each program reads one chunk of one
row once and writes (a) the chunk's two digest lane sums and (b) the chunk's `K` largest elements as
packed keys; a few small torch ops then add the partial sums (wrapping int64: the digest is a sum, so
it is bit-identical to `capture.logits_digest` whatever the chunking) and take the top-k of the
candidates. The merge reads `chunks x K` keys and gathers the `k` winning logits, not the row.

Packed key (int64): the float32 value's bits made order-preserving as a signed int32, in the high
half; `2^32 - 1 - index` in the low half. Keys are distinct, so the order is total: larger value
first, and among equal values the lower index first (as `argmax` breaks ties). Values are gathered
from the logits by id, so they are the logits' own bits. NaN ranks above everything (as in
`torch.topk`). At exact ties `torch.topk` does not define which index comes first; this kernel does.

The kernel is registered as a `torch.library.triton_op`, so `torch.compile(fullgraph=True)` traces
through it and a CUDA graph captures its launch. Run on CPU under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import os

import torch

from .capture import _INDEX_MULTIPLIER, _LANE_SEEDS, _LANE_STEP, _WORD_MULTIPLIER
from .mixing import _MIX_2, _MIX_3

CHUNK = 1024  # elements of one row each program reads (tuned on the H200: benchmarks/capture_overhead.py)
MAX_FUSED_TOP_K = 128  # larger top-k: the torch path (a program's bitonic top-k is sized by K)
_LOW32 = (1 << 32) - 1


def capture_kernel(device: torch.device | str, dtype: torch.dtype, top_k: int) -> str:
    """Which implementation captures a step: "triton-fused" on a CUDA device with Triton, else "torch"."""
    fused = (torch.device(device).type == "cuda" and triton is not None and not INTERPRETED
             and dtype in _BITS and 2 <= top_k <= MAX_FUSED_TOP_K)
    return "triton-fused" if fused else "torch"


def fused_capture_supported(logits: torch.Tensor, top_k: int) -> bool:
    return capture_kernel(logits.device, logits.dtype, top_k) == "triton-fused"


_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16, torch.float64: 64}  # float dtype -> bit width
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton runs kernels on the CPU (tests)


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path in capture.py is the only one
    triton = None

if triton is not None:
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


def _launch(logits: torch.Tensor, k_pow2: int, wrap=lambda kernel: kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] -> partial digests [B, C, 2] int64, candidate keys [B, C, k_pow2] int64 (C chunks)."""
    rows, vocab = logits.shape
    chunks = -(-vocab // CHUNK)
    digests = torch.empty(rows, chunks, 2, dtype=torch.int64, device=logits.device)
    keys = torch.empty(rows, chunks, k_pow2, dtype=torch.int64, device=logits.device)
    wrap(capture_chunk_kernel)[(rows, chunks)](logits, vocab, logits.stride(0), digests, keys, chunks,
                                               BITS=_BITS[logits.dtype], CHUNK_SIZE=CHUNK, K=k_pow2)
    return digests, keys


capture_chunks = None  # `_launch` as a torch op, so torch.compile traces through it (CUDA installs)
if triton is not None and not INTERPRETED:
    # Registered at import, never while Dynamo traces (it cannot trace a registration). Registering makes
    # Inductor settle its cache folder into TORCHINDUCTOR_CACHE_DIR; where nobody had chosen one, the
    # choice is left to evalrun's compile_cache (EVALRUN_CACHE/compile/...), made later, before compiling.
    _cache_folder_chosen = "TORCHINDUCTOR_CACHE_DIR" in os.environ
    from torch.library import triton_op, wrap_triton

    @triton_op("evalrun::capture_chunks", mutates_args={})
    def capture_chunks(logits: torch.Tensor, k_pow2: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch(logits, k_pow2, wrap_triton)

    if not _cache_folder_chosen:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def fused_capture(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, V] -> digest [B, 2] int64, ids [B, K] int64, values [B, K] float32, margin [B] float32.

    The same outputs as `capture.logits_digest` and `capture.topk_sketch` (digests bit-identical; ids
    and values identical except the order of exactly equal values, which this fixes: lower id first).
    """
    k_pow2 = max(2, 1 << (top_k - 1).bit_length())
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    partial_digests, keys = (_launch if INTERPRETED else capture_chunks)(logits, k_pow2)  # [B, C, 2], [B, C, k_pow2]
    digest = partial_digests.sum(dim=1)  # [B, 2], wrapping int64
    best = torch.topk(keys.flatten(1), top_k, dim=-1).values  # [B, K] distinct keys, largest first
    ids = _LOW32 - (best & _LOW32)  # [B, K]
    values = logits.gather(1, ids).float()  # [B, K]
    return digest, ids, values, values[:, 0] - values[:, 1]
