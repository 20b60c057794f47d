"""The driver above the execution modes: one batch from prompts to host arrays.

`generate_batch` pads the prompts as the mode wants, takes the mode's workspace for that shape,
loads the batch into it, then runs prefill and the decode steps through the mode (eager, compiled,
CUDA graphs) with a step clock that never syncs inside the loop. A batch-invariant mode runs each row
as a batch of one (its own padding, cache length and kernels: the bits of the prompt run alone).
"""

from __future__ import annotations

import torch

from .generate import BatchOutput, BatchSpec, PaddedBatch, load_batch, stack_outputs
from .modes import ExecutionMode, eager_mode
from .timing import StepClock
from .transformer import Transformer


@torch.no_grad()
def generate_batch(model: Transformer, spec: BatchSpec, mode: ExecutionMode | None = None) -> BatchOutput:
    """Greedy (or seeded-sampled) generation of one batch with on-device capture of every step.

    `mode` decides padding, workspaces, and how prefill and decode steps run; without one the batch
    runs eagerly in a fresh workspace.
    """
    mode = mode or eager_mode(model)
    if mode.batch_invariant and len(spec.prompts) > 1:
        rows = [_generate(model, spec.row(index), mode) for index in range(len(spec.prompts))]
        return stack_outputs(rows, spec.steps)
    return _generate(model, spec, mode)


def _generate(model: Transformer, spec: BatchSpec, mode: ExecutionMode) -> BatchOutput:
    prompts = spec.prompts
    padded_length, batch = mode.padded_length(prompts), mode.padded_batch(len(prompts))
    rows = prompts + [prompts[-1]] * (batch - len(prompts))  # batch-bucket filler rows repeat the last prompt
    workspace = mode.workspace(batch, padded_length, spec)
    _, slots, _ = workspace.shape
    padded = PaddedBatch.build(rows, spec.pad_id, padded_length, slots, model.device)
    load_batch(workspace, padded, spec)
    clock = StepClock(model.device)
    clock.start()
    mode.prefill(workspace, padded.tokens, padded.positions)
    clock.mark()
    for _ in range(1, spec.steps):
        mode.decode(workspace)
        clock.mark()
    return workspace.buffers.to_host(len(prompts), spec.steps, clock.elapsed_ms(), padded_length)
