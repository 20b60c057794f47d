"""Decode attention by a split-KV Triton kernel (attention_triton_kernel.py), chosen by the run's
`attention_kernel` knob (issue #16): `triton-split-kv` computes with it every attention of one query token per
row (the decode steps, and the prefill of a one-token prompt); longer prefills stay with SDPA or the explicit
path (`attn_implementation`).

Why: at batch 1 SDPA's kernels read a decode step's keys and values far below the bandwidth, the more so the
longer the cache. On the H200 at Llama-3-8B's shapes, per layer (benchmarks/decode_attention.py): cuDNN 10.4 us
at 144 cache slots, 26.5 at 1024, 88.8 at 4096 (0.19 TB/s); the split-KV kernel 4.5, 9.0 and 12.6 us. It is
another reduction order, so other bits: a knob in the config hash, never on by default, refused where it
cannot run (config.validate), and the golden's reference and oracle run without it (golden.py). The chunking
is fixed by the cache length alone, so the bits depend on the shapes only. Soft-capped scores (Gemma 2) are
not computed here: a model with them is refused (Transformer.with_attention_kernel).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..config import TRITON_DTYPE_NAMES
from ..errors import ConfigError
from .triton_ops import INTERPRETED, refuse_unregistrable

BLOCK_S = 64  # cache slots a program reads per step of its loop
TARGET_CHUNKS = 16  # chunks per key/value head: enough programs to keep the SMs reading at batch 1
DTYPES = tuple(getattr(torch, name) for name in TRITON_DTYPE_NAMES)  # those config.validate lets through
ARRIVAL_COUNTERS = 1 << 16  # batch x key/value heads a call may have for its last programs to combine
COMBINE_IN_LAST_PROGRAM = True  # False: always a second kernel (benchmarks/decode_breakdown.py times both)
_OP: dict = {}  # "op": the registered torch op, once prepare() ran on a CUDA device with Triton
_ARRIVALS: dict[torch.device, torch.Tensor] = {}  # each device's counters, zero between calls


def chunk_for(slots: int, target_chunks: int = TARGET_CHUNKS) -> int:
    """Cache slots per program: about `target_chunks` chunks of whole BLOCK_S blocks, fixed by S alone."""
    per = -(-slots // target_chunks)
    return max(BLOCK_S, -(-per // BLOCK_S) * BLOCK_S)


def prepare(kernel: str, device: torch.device | str) -> None:
    """Register the kernel as a torch op for a CUDA device, once, before anything is compiled (triton_ops), and
    allocate the device's arrival counters before any CUDA graph is captured."""
    if kernel != "triton-split-kv" or INTERPRETED:
        return
    refuse_unregistrable("attention_kernel", kernel, "sdpa", device)
    arrival_counters(torch.device(device))
    if "op" in _OP:
        return
    from torch.library import triton_op, wrap_triton

    from . import attention_triton_kernel

    @triton_op("evalrun::split_kv_attention", mutates_args={})
    def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
        return attention_triton_kernel.launch(q, k, v, mask, scale, chunk_for(k.shape[2]), BLOCK_S, wrap_triton,
                                              arrivals=arrivals_for(q, k.shape[1]))

    _OP["op"] = split_kv_attention


def arrivals_for(q: torch.Tensor, kv_heads: int) -> torch.Tensor | None:
    """The counters with which the last program of each head combines its chunks (one kernel a call); None (a
    second kernel combines, the same bits) inside torch.compile's traces, where a buffer the op mutates behind the
    compiler's back has no place (Dynamo's, and Inductor's lowering, which calls the op on fake tensors outside
    Dynamo), for more heads than there are counters, with COMBINE_IN_LAST_PROGRAM off, and inside a CUDA graph
    capture that meets the device's counters before prepare() made them."""
    if (not COMBINE_IN_LAST_PROGRAM or torch.compiler.is_compiling() or is_fake(q)
            or q.shape[0] * kv_heads > ARRIVAL_COUNTERS):
        return None
    return arrival_counters(q.device)


def arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's arrival counters: allocated zeroed once, never inside a CUDA graph capture (a graph replays
    their address; prepare() allocates them before any capture; None if a capture meets them first), and left zero
    by every kernel that uses them, as long as one launch runs at a time on the device (arrivals_left checks)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    arrivals = _ARRIVALS.get(device)
    if arrivals is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        arrivals = _ARRIVALS[device] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return arrivals


def arrivals_left() -> int:
    """Arrival counters not back at zero, over every device (a sync each). Not 0 only if two launches overlapped on
    one device (two streams), which the engine never does: then combines ran early or never, and the run is void."""
    return sum(int(torch.count_nonzero(arrivals)) for arrivals in _ARRIVALS.values())


def applies(grouped: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the kernel computes this attention: one decode token (grouped [B, G, R, D], mask [B, 1, R, S] of
    additive floats, not broadcast), the last dimensions contiguous, keys and values laid out alike, one float
    dtype, on CUDA (or interpreted). The engine's decode steps always qualify (config.validate checked the dtype);
    anything else goes to SDPA."""
    batch, heads, rows, _ = grouped.shape
    return (tuple(mask.shape) == (batch, 1, rows, k.shape[2]) and tuple(k.shape[:2]) == (batch, heads)
            and mask.is_floating_point() and grouped.dtype == k.dtype == v.dtype and grouped.dtype in DTYPES
            and k.stride() == v.stride() and grouped.stride(-1) == k.stride(-1) == mask.stride(-1) == 1
            and (grouped.is_cuda or INTERPRETED))


def decode_attention(grouped: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """grouped [B, G, R, D], k/v [B, G, S, D], mask [B, 1, R, S] additive -> [B, G, R, D]."""
    if INTERPRETED:
        from .attention_triton_kernel import launch

        return launch(grouped, k, v, mask, scale, chunk_for(k.shape[2]), BLOCK_S,
                      arrivals=arrivals_for(grouped, k.shape[1]))
    if "op" not in _OP:  # asked for and never prepared: refused, not run as SDPA
        raise ConfigError("attention_kernel=triton-split-kv needs a CUDA device with Triton; use attention_kernel=sdpa")
    return _OP["op"](grouped, k, v, mask, scale)
