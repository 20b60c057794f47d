"""Generate one batch with evalrun's engine from a bare `Transformer`: the mode's `generate`, eager when no
mode is given (tests, benchmarks and the bisect probes call this; the runner calls the engine seam)."""

from __future__ import annotations

from .generate import BatchOutput, BatchSpec
from .modes import ExecutionMode, eager_mode
from .transformer import Transformer


def generate_batch(model: Transformer, spec: BatchSpec, mode: ExecutionMode | None = None) -> BatchOutput:
    """Greedy (or seeded-sampled) generation of one batch with on-device capture of every step;
    without a mode the batch runs eagerly in a fresh workspace."""
    return (mode or eager_mode(model)).generate(spec)
