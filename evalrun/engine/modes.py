"""Execution modes: how the engine's forward runs (compilation mode x CUDA graph mode).

`build_execution_mode` turns the effective config into an `ExecutionMode`: the forward to call,
the padded prompt length for a batch (shape buckets), and the evidence of what really happened.
Only eager execution (`compilation_mode=none`, `cudagraph_mode=none`) exists so far; every other
mode is refused with a clear message rather than silently run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import ConfigError
from .transformer import Transformer

AVAILABLE_COMPILATION_MODES = ("none",)
AVAILABLE_CUDAGRAPH_MODES = ("none",)


@dataclass
class ExecutionMode:
    transformer: Transformer
    forward: Callable[..., torch.Tensor]
    compilation_mode: str
    cudagraph_mode: str
    fallbacks: list[str] = field(default_factory=list)

    def padded_length(self, prompts: list[list[int]]) -> int:
        """Eager runs pad to the longest prompt of the batch (no buckets needed: nothing recompiles)."""
        return max(len(ids) for ids in prompts)

    def start_measuring(self) -> None:
        """Called after warm-up: evidence counted from here on describes the measured run."""

    def evidence(self) -> dict[str, Any]:
        return {"compilation_mode": self.compilation_mode, "cudagraph_mode": self.cudagraph_mode,
                "executed": "eager", "dynamo_graphs": 0, "graph_breaks": [], "recompiles": 0,
                "cudagraph_captures": 0, "cudagraph_replays": 0, "fallbacks": list(self.fallbacks)}


def build_execution_mode(transformer: Transformer, effective: dict[str, Any]) -> ExecutionMode:
    compilation, graphs = effective["compilation_mode"], effective["cudagraph_mode"]
    if compilation not in AVAILABLE_COMPILATION_MODES or graphs not in AVAILABLE_CUDAGRAPH_MODES:
        raise ConfigError(
            f"compilation_mode={compilation} / cudagraph_mode={graphs} is not available yet; "
            "use -O0 (or --compilation-mode none --cudagraph-mode none)")
    return ExecutionMode(transformer, transformer.forward, compilation, graphs)
