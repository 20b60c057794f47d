"""Warming the L2 cache with the next projection's weight while the GPU runs small kernels (issue #16).

At batch 1 a decode step reads every weight once, and the memory bus idles while the kernels between the
projections run: rotary, the KV write, attention (about 10 us a layer on the H200, against 11 us for the
output projection that follows). A prefetcher starts, on a side stream, a kernel that reads the output
projection's weight into L2 as soon as q/k/v is launched, so the projection finds its weight in L2
(H100/H200: 50 MB) instead of HBM. The kernel writes only its own sink, so no computed value changes:
not a numerics knob. It runs where the decode step is captured whole in one CUDA graph (the extra launches
cost nothing on the host there) on a CUDA device with Triton; `ExecutionMode(l2_prefetch=...)` names what
to prefetch, for benchmarks to compare side by side (benchmarks/decode_breakdown.py).

Inside a graph capture the side stream forks from the capturing stream and joins it before the forward
returns, so the captured graph holds the prefetch as a branch running beside attention.
"""

from __future__ import annotations

import torch

PROGRAMS = 132  # one per SM of an H100/H200: leaves each SM room for the attention kernels beside it
BLOCK = 8192  # 32-bit words (32 KB) a program has in flight per iteration
WARPS = 8
TARGETS = ("o", "qkv")  # what a prefetcher may warm: a layer's output projection, the next layer's q/k/v


class L2Prefetcher:
    """Reads named weights into L2 on its own stream; `join` makes the current stream wait for it."""

    def __init__(self, device: torch.device, targets: tuple[str, ...], programs: int = PROGRAMS,
                 block: int = BLOCK, warps: int = WARPS):
        unknown = set(targets) - set(TARGETS)
        assert not unknown, f"unknown prefetch targets {sorted(unknown)}"
        from . import l2_prefetch_kernel

        self.kernel = l2_prefetch_kernel
        self.targets, self.block, self.warps = targets, block, warps
        self.stream = torch.cuda.Stream(device)
        self.sink = torch.zeros(programs, dtype=torch.int32, device=device)
        self.forked = False

    def prefetch(self, target: str, weight: torch.Tensor | None) -> None:
        """Start reading `weight` into L2 after everything launched so far, if `target` is one to warm."""
        if target not in self.targets or weight is None or not weight.is_contiguous() or weight.nbytes % 4:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.kernel.launch(weight.reshape(-1).view(torch.int32), self.sink, self.block, self.warps)
        self.forked = True

    def join(self) -> None:
        """The current stream waits for the prefetches (a graph capture must end joined)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False
