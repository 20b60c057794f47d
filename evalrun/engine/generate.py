"""Prefill + decode with on-device capture, gpt-fast style.

`generate_batch` runs one padded batch: prefill writes the prompts into a static KV cache, then
`max_new_tokens` decode steps each produce logits that are captured on the device (digest, top-k,
margin) into preallocated buffers. Nothing in the loop touches the host; results are copied to the
host once, at the end of the batch.

Every prompt is decoded for exactly `max_new_tokens` steps (static shapes): an end-of-sequence
token does not stop the loop; `BatchOutput.eos_step` records where it first appeared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..capture import logits_digest, topk_sketch
from ..models import splitmix64
from .timing import StepClock
from .transformer import KVCache, Transformer


@dataclass
class BatchOutput:
    """Host arrays for one batch. B rows, N steps, K top-k entries."""

    tokens: np.ndarray  # [B, N] int64
    digests: np.ndarray  # [B, N, 2] int64
    topk_ids: np.ndarray  # [B, N, K] int64
    topk_values: np.ndarray  # [B, N, K] float32
    margins: np.ndarray  # [B, N] float32
    logits: np.ndarray | None  # [B, N, V] in the model dtype's bits, when kept
    step_ms: np.ndarray  # [N] wall time of each step; step 0 is prefill + first token (TTFT)
    padded_length: int = 0  # P, the prompt length the batch was padded to
    probe_values: np.ndarray | None = None  # [B, N, K'] float64 logits at the probe ids, when probed


@dataclass
class CaptureBuffers:
    """Preallocated device buffers the decode step writes into at index `step` (a tensor)."""

    tokens: torch.Tensor
    digests: torch.Tensor
    topk_ids: torch.Tensor
    topk_values: torch.Tensor
    margins: torch.Tensor
    logits: torch.Tensor | None
    probe_ids: torch.Tensor | None = None  # [B, N, K'] int64: ids whose logits each step records exactly
    probe_values: torch.Tensor | None = None  # [B, N, K'] float64

    @classmethod
    def allocate(cls, batch: int, steps: int, top_k: int, vocab: int, keep_logits: bool,
                 dtype: torch.dtype, device: torch.device) -> "CaptureBuffers":
        return cls(
            tokens=torch.zeros(batch, steps, dtype=torch.int64, device=device),
            digests=torch.zeros(batch, steps, 2, dtype=torch.int64, device=device),
            topk_ids=torch.zeros(batch, steps, top_k, dtype=torch.int64, device=device),
            topk_values=torch.zeros(batch, steps, top_k, dtype=torch.float32, device=device),
            margins=torch.zeros(batch, steps, dtype=torch.float32, device=device),
            logits=torch.zeros(batch, steps, vocab, dtype=dtype, device=device) if keep_logits else None,
        )

    def to_host(self, step_ms: np.ndarray, padded_length: int) -> BatchOutput:
        logits = None
        if self.logits is not None:
            logits = self.logits.cpu().view(_bits_dtype(self.logits.dtype)).numpy()
        probe = self.probe_values.cpu().numpy() if self.probe_values is not None else None
        return BatchOutput(self.tokens.cpu().numpy(), self.digests.cpu().numpy(), self.topk_ids.cpu().numpy(),
                           self.topk_values.cpu().numpy(), self.margins.cpu().numpy(), logits, step_ms,
                           padded_length, probe)


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}[dtype]


def choose_token(logits: torch.Tensor, temperature: float, row_seeds: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] next token: argmax, or Gumbel-max sampling with counter-based noise.

    The noise is a pure function of (row seed, step, vocab id): the same on every device, with no
    RNG state, so a sampled run is reproducible and can live inside a CUDA graph.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    vocab = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int64)  # [V]
    counter = (row_seeds[:, None] * 1_000_003 + step * 65_537) * 2_654_435_761 + vocab  # [B, V]
    bits = (splitmix64(counter) >> 11) & ((1 << 53) - 1)
    uniform = (bits.double() + 0.5) / 2.0**53  # (0, 1)
    gumbel = -torch.log(-torch.log(uniform))
    return (logits.double() / temperature + gumbel).argmax(dim=-1)


def capture_step(logits: torch.Tensor, step: torch.Tensor, buffers: CaptureBuffers, top_k: int,
                 temperature: float, row_seeds: torch.Tensor, capture: bool = True) -> torch.Tensor:
    """Capture one step's logits [B, V] into the buffers at `step` [1]; return the next token [B].

    `capture=False` only chooses and records the token: the baseline the capture-overhead
    benchmark compares against.
    """
    token = choose_token(logits, temperature, row_seeds, step)
    if not capture:
        buffers.tokens.index_copy_(1, step, token[:, None])
        return token
    ids, values, margin = topk_sketch(logits, top_k)
    buffers.digests.index_copy_(1, step, logits_digest(logits)[:, None])
    buffers.topk_ids.index_copy_(1, step, ids[:, None])
    buffers.topk_values.index_copy_(1, step, values[:, None])
    buffers.margins.index_copy_(1, step, margin[:, None])
    buffers.tokens.index_copy_(1, step, token[:, None])
    if buffers.logits is not None:
        buffers.logits.index_copy_(1, step, logits[:, None])
    if buffers.probe_ids is not None:
        probe = buffers.probe_ids.index_select(1, step)[:, 0]  # [B, K']
        buffers.probe_values.index_copy_(1, step, logits.gather(1, probe).double()[:, None])
    return token


@dataclass
class PaddedBatch:
    """Left-padded prompts on the device. P = padded prompt length."""

    tokens: torch.Tensor  # [B, P] int64
    positions: torch.Tensor  # [B, P] int64 (padding at position 0)
    key_valid: torch.Tensor  # [B, S] bool, False on padding slots
    lengths: torch.Tensor  # [B] int64 real prompt lengths

    @classmethod
    def build(cls, prompts: list[list[int]], pad_id: int, padded_length: int, slots: int,
              device: torch.device) -> "PaddedBatch":
        batch = len(prompts)
        tokens = torch.full((batch, padded_length), pad_id, dtype=torch.int64)
        valid = torch.zeros(batch, slots, dtype=torch.bool)
        valid[:, padded_length:] = True
        for row, ids in enumerate(prompts):
            tokens[row, padded_length - len(ids):] = torch.tensor(ids, dtype=torch.int64)
            valid[row, padded_length - len(ids):padded_length] = True
        positions = (valid[:, :padded_length].long().cumsum(-1) - 1).clamp(min=0)
        lengths = torch.tensor([len(ids) for ids in prompts], dtype=torch.int64)
        return cls(tokens.to(device), positions.to(device), valid.to(device), lengths.to(device))


DecodeStep = Callable[..., torch.Tensor]


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, pad_id: int,
                   top_k: int = 8, temperature: float = 0.0, row_seeds: list[int] | None = None,
                   keep_logits: bool = False, padded_length: int | None = None,
                   forward: Callable[..., torch.Tensor] | None = None,
                   forced_tokens: list[np.ndarray] | None = None, capture: bool = True,
                   probe_ids: list[np.ndarray] | None = None) -> BatchOutput:
    """Greedy (or seeded-sampled) generation of one batch with on-device capture of every step.

    `padded_length` pads the prompts to a fixed length (a shape bucket); `forward` replaces
    `model.forward` (a compiled version of it, say). Step 0's logits come from prefill.
    `forced_tokens` (one array per row) feeds those tokens back instead of the model's choices:
    forced decoding, to compare logits step by step along another run's path. The buffers still
    record the model's own choice at each step. `probe_ids` (one [N, K'] array per row) records the
    exact logits at those ids each step, so two runs can be compared on the same ids.
    """
    device, batch = model.device, len(prompts)
    padded_length = padded_length or max(len(ids) for ids in prompts)
    slots = padded_length + max_new_tokens
    forward = forward or model.forward
    cache: KVCache = model.new_cache(batch, slots)
    padded = PaddedBatch.build(prompts, pad_id, padded_length, slots, device)
    buffers = CaptureBuffers.allocate(batch, max_new_tokens, top_k, model.vocab_size, keep_logits, model.dtype, device)
    if probe_ids is not None:
        buffers.probe_ids = _row_matrix(probe_ids, batch, max_new_tokens, device)
        buffers.probe_values = torch.zeros(buffers.probe_ids.shape, dtype=torch.float64, device=device)
    seeds = torch.tensor(row_seeds or [0] * batch, dtype=torch.int64, device=device)
    steps = torch.arange(max_new_tokens, dtype=torch.int64, device=device)  # step index tensors, made once
    decode_slots = steps + padded_length  # [N]: cache slot of each decode step's input token
    clock = StepClock(device)
    forced = _row_matrix(forced_tokens, batch, max_new_tokens, device) if forced_tokens is not None else None

    clock.start()
    logits = forward(padded.tokens, padded.positions, torch.arange(padded_length, device=device),
                     padded.key_valid, cache)
    token = capture_step(logits, steps[0:1], buffers, top_k, temperature, seeds, capture)
    clock.mark()
    for step in range(1, max_new_tokens):
        if forced is not None:
            token = forced[:, step - 1]
        position = (padded.lengths + (step - 1))[:, None]  # [B, 1]
        logits = forward(token[:, None], position, decode_slots[step - 1:step], padded.key_valid, cache)
        token = capture_step(logits, steps[step:step + 1], buffers, top_k, temperature, seeds, capture)
        clock.mark()
    return buffers.to_host(clock.elapsed_ms(), padded_length)


def _row_matrix(rows: list[np.ndarray], batch: int, steps: int, device: torch.device) -> torch.Tensor:
    """Per-row arrays [N_i, ...] -> one [B, N, ...] int64 tensor; short rows repeat their last entry."""
    matrix = np.zeros((batch, steps) + np.asarray(rows[0]).shape[1:], dtype=np.int64)
    for row, values in enumerate(rows):
        count = min(len(values), steps)
        matrix[row, :count] = values[:count]
        if 0 < count < steps:
            matrix[row, count:] = values[count - 1]
    return torch.from_numpy(matrix).to(device)
