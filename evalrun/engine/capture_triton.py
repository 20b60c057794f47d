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

    _OP["op"], _OP["merge"] = capture_chunks, capture_merge


def fused_capture(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, V] -> digest [B, 2] int64, ids [B, K] int64, values [B, K] float32, margin [B] float32.

    The same outputs as `capture.logits_digest` and `capture.topk_sketch` (digests bit-identical; ids
    and values identical except the order of exactly equal values, which this fixes: lower id first).
    """
    k_pow2 = max(2, 1 << (top_k - 1).bit_length())
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if INTERPRETED:
        from .capture_triton_kernel import launch, launch_merge

        partial_digests, keys = launch(logits, k_pow2, CHUNK)  # [B, C, 2], [B, C, k_pow2]
    else:
        partial_digests, keys = _OP["op"](logits, k_pow2)
        launch_merge = _OP["merge"]
    if MERGE_IN_KERNEL and keys.shape[1] * k_pow2 <= MAX_MERGED_CANDIDATES:
        return launch_merge(logits, partial_digests, keys, top_k)
    digest = partial_digests.sum(dim=1)  # [B, 2], wrapping int64
    best = torch.topk(keys.flatten(1), top_k, dim=-1).values  # [B, K] distinct keys, largest first
    ids = _LOW32 - (best & _LOW32)  # [B, K]
    values = logits.gather(1, ids).float()  # [B, K]
    return digest, ids, values, values[:, 0] - values[:, 1]
