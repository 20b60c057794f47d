"""Step clocks that never sync inside the loop, and latency summaries.

On CUDA each `mark` records an event (asynchronous); `elapsed_ms` synchronises once, at the end.
On CPU kernels run synchronously, so a wall clock read at each mark is exact and costs nothing.
"""

from __future__ import annotations

import resource
import sys
import time

import numpy as np
import torch


class StepClock:
    """Marks the end of each step; `elapsed_ms()` gives [N] durations after the last mark."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))  # the model's device, which need not be the current one
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [self._now()]

    def mark(self) -> None:
        self.marks.append(self._now())

    def elapsed_ms(self) -> np.ndarray:
        if self.cuda:
            self.marks[-1].synchronize()
            return np.array([a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])], dtype=np.float64)
        return np.diff(np.array(self.marks, dtype=np.float64)) * 1000.0


def latency_summary(step_ms: np.ndarray) -> dict[str, float]:
    """Percentiles of decode-step latency in milliseconds ([N] array, prefill step excluded by caller)."""
    if step_ms.size == 0:
        return {"p50_ms": 0.0, "p95_ms": 0.0, "p99_ms": 0.0}
    p50, p95, p99 = np.percentile(step_ms, [50, 95, 99])
    return {"p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99)}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> dict[str, float | str]:
    """CUDA max allocated bytes, or the process's peak RSS on CPU (which includes the model load)."""
    if device.type == "cuda":
        return {"kind": "cuda_max_allocated", "bytes": float(torch.cuda.max_memory_allocated(device))}
    scale = 1 if sys.platform == "darwin" else 1024
    return {"kind": "peak_rss", "bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)}
