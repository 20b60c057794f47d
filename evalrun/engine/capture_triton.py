"""The capture of one decode step fused into one Triton kernel: digest, top-k and margin in one read.

`capture.py` computes the same three things with torch ops (the CPU and reference implementation):
the digest reads the logits once, the top-k a second time. Here each program reads one chunk of one
row once and writes (a) the chunk's two digest lane sums and (b) the chunk's `K` largest elements as
packed keys; a second kernel, one program per row, then adds the partial sums (wrapping int64: the digest is
a sum, so it is bit-identical to `capture.logits_digest` whatever the chunking) and takes the top-k of the
candidates (torch ops do this where the candidates are too many for one program). The merge reads
`chunks x K` keys and gathers the `k` winning logits, not the row.

Packed key (int64): the float32 value's bits made order-preserving as a signed int32, in the high
half; `2^32 - 1 - index` in the low half. Keys are distinct, so the order is total: larger value
first, and among equal values the lower index first (as `argmax` breaks ties). Values are gathered
from the logits by id, so they are the logits' own bits. NaN ranks above everything (as in
`torch.topk`). At exact ties `torch.topk` does not define which index comes first; this kernel does.

The kernel (capture_triton_kernel.py) is registered as a `torch.library.triton_op`, so
`torch.compile(fullgraph=True)` traces through it and a CUDA graph captures its launch. Run on CPU under
`TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch

from .capture import BITS_VIEW  # the logits dtypes the kernel reads
from .triton_ops import INTERPRETED, can_register

CHUNK = 1024  # elements of one row each program reads (tuned on the H200: benchmarks/capture_overhead.py)
MAX_FUSED_TOP_K = 128  # larger top-k: the torch path (a program's bitonic top-k is sized by K)
# The chunks' candidates one merge program sorts (Llama-3's vocabulary at top-k 32: 126 chunks x 32); more: torch's
# topk merges them. The merge kernel replaced seven kernels of torch ops, about 30 us of an 8B decode step (stop 22).
MAX_MERGED_CANDIDATES = 4096
MERGE_IN_KERNEL = True  # False: the torch merge (before stop 22), for benchmarks/decode_breakdown.py beside
# True: the merge writes a decode step's outputs into the capture buffers itself (stop 23); False: it returns them and
# capture_step copies them in (five index copies and the token's copy), for benchmarks/decode_breakdown.py beside
MERGE_INTO_BUFFERS = True
_LOW32 = (1 << 32) - 1
_OP: dict = {}  # "op": the registered torch op, once prepare() ran on a CUDA device with Triton


def capture_kernel(device: torch.device | str, dtype: torch.dtype, top_k: int) -> str:
    """Which implementation captures a step: "triton-fused" on a CUDA device once `prepare` registered the
    kernel, else "torch"."""
    fused = (torch.device(device).type == "cuda" and "op" in _OP and dtype in BITS_VIEW
             and 2 <= top_k <= MAX_FUSED_TOP_K)
    return "triton-fused" if fused else "torch"


def fused_capture_supported(logits: torch.Tensor, top_k: int) -> bool:
    return capture_kernel(logits.device, logits.dtype, top_k) == "triton-fused"


def prepare(device: torch.device | str) -> None:
    """Import the kernel and register it as a torch op, once, for a CUDA device (else nothing). Called
    eagerly where capture buffers are allocated, so before any step that Dynamo could trace (triton_ops)."""
    if "op" in _OP or not can_register(device):
        return
    from torch.library import triton_op, wrap_triton

    from . import capture_triton_kernel

    @triton_op("evalrun::capture_chunks", mutates_args={})
    def capture_chunks(logits: torch.Tensor, k_pow2: int) -> tuple[torch.Tensor, torch.Tensor]:
        return capture_triton_kernel.launch(logits, k_pow2, CHUNK, wrap_triton)

    @triton_op("evalrun::capture_merge", mutates_args={})
    def capture_merge(logits: torch.Tensor, digest_parts: torch.Tensor, keys: torch.Tensor,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return capture_triton_kernel.launch_merge(logits, digest_parts, keys, top_k, wrap_triton)

    @triton_op("evalrun::capture_merge_at_step",
               mutates_args={"digests", "ids", "values", "margins", "tokens", "next_token"})
    def capture_merge_at_step(logits: torch.Tensor, digest_parts: torch.Tensor, keys: torch.Tensor, step: torch.Tensor,
                              digests: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, margins: torch.Tensor,
                              tokens: torch.Tensor, next_token: torch.Tensor, write_token: bool) -> None:
        capture_triton_kernel.launch_merge_at_step(logits, digest_parts, keys, step, digests, ids, values, margins,
                                                   tokens, next_token, write_token, wrap_triton)

    _OP["op"], _OP["merge"], _OP["merge_at_step"] = capture_chunks, capture_merge, capture_merge_at_step


def fused_capture(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, V] -> digest [B, 2] int64, ids [B, K] int64, values [B, K] float32, margin [B] float32.

    The same outputs as `capture.logits_digest` and `capture.topk_sketch` (digests bit-identical; ids
    and values identical except the order of exactly equal values, which this fixes: lower id first).
    """
    k_pow2 = _k_pow2(top_k)
    logits, partial_digests, keys = _chunk_candidates(logits, k_pow2)
    if merged_in_kernel(keys.shape[1], k_pow2):
        return _kernel("merge")(logits, partial_digests, keys, top_k)
    digest = partial_digests.sum(dim=1)  # [B, 2], wrapping int64
    best = torch.topk(keys.flatten(1), top_k, dim=-1).values  # [B, K] distinct keys, largest first
    ids = _LOW32 - (best & _LOW32)  # [B, K]
    values = logits.gather(1, ids).float()  # [B, K]
    return digest, ids, values, values[:, 0] - values[:, 1]


def merged_in_kernel(chunks: int, k_pow2: int) -> bool:
    """Whether one merge program takes a row's `chunks x k_pow2` candidates (else torch's topk merges them)."""
    return MERGE_IN_KERNEL and chunks * k_pow2 <= MAX_MERGED_CANDIDATES


def fused_capture_at_step(logits: torch.Tensor, step: torch.Tensor, digests: torch.Tensor, ids: torch.Tensor,
                          values: torch.Tensor, margins: torch.Tensor, tokens: torch.Tensor,
                          next_token: torch.Tensor | None) -> bool:
    """The fused capture of logits [B, V] written into capture buffers at `step` [1] int64 by the merge kernel
    itself: digests [B, N, 2], ids and values [B, N, K], margins [B, N]; with `next_token` [B], the top-1 id (argmax's
    choice) into tokens [B, N] at the step and into next_token. The bits of `fused_capture` then index copies.

    Returns False, writing nothing, where the merge kernel does not apply (too many candidates, MERGE_INTO_BUFFERS
    off, buffers not laid out [B, N, ...] contiguous in their last dims): the caller then copies them in."""
    top_k = ids.shape[-1]
    k_pow2 = _k_pow2(top_k)
    chunks = -(-logits.shape[-1] // CHUNK)
    laid_out = (digests.stride()[1:] == (2, 1) and ids.stride()[1:] == (top_k, 1) and values.stride()[1:] == (top_k, 1)
                and margins.stride(1) == 1 and tokens.stride(1) == 1 and values.shape == ids.shape)
    if not (MERGE_INTO_BUFFERS and merged_in_kernel(chunks, k_pow2) and laid_out):
        return False
    logits, partial_digests, keys = _chunk_candidates(logits, k_pow2)
    write_token = next_token is not None
    _kernel("merge_at_step")(logits, partial_digests, keys, step, digests, ids, values, margins, tokens,
                             next_token if write_token else tokens.new_empty(0), write_token)
    return True


def _k_pow2(top_k: int) -> int:
    """The candidates each chunk keeps: top_k rounded up to a power of two (at least 2: a bitonic top-k's size)."""
    return max(2, 1 << (top_k - 1).bit_length())


def _chunk_candidates(logits: torch.Tensor, k_pow2: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk kernel over [B, V] logits: (the logits as it read them, rows contiguous; partial digests [B, C, 2];
    candidate keys [B, C, k_pow2])."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if INTERPRETED:
        from .capture_triton_kernel import launch

        return (logits, *launch(logits, k_pow2, CHUNK))
    return (logits, *_OP["op"](logits, k_pow2))


def _kernel(name: str):
    """The merge ("merge") or the merge into the buffers ("merge_at_step"): the registered op, or under the
    interpreter its launch function itself."""
    if INTERPRETED:
        from . import capture_triton_kernel

        return getattr(capture_triton_kernel, f"launch_{name}")
    return _OP[name]
