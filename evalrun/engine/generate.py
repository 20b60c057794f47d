"""Prefill + decode with on-device capture, gpt-fast style.

A `Workspace` holds every buffer a batch needs, allocated once: KV cache, capture buffers, the
key-validity mask, and the decode step's inputs as device tensors (last token, prompt lengths,
first decode slot, step counter). `decode_step` reads and advances only those tensors, so it has
static shapes, never touches the host, and can be compiled with `fullgraph=True` or captured in a
CUDA graph and replayed with no inputs at all. Results reach the host once, at the end of a batch.

Every prompt is decoded for exactly `max_new_tokens` steps (static shapes): an end-of-sequence
token does not stop the loop; the runner records where it first appeared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..capture import BITS_VIEW, logits_digest, topk_sketch
from ..models import splitmix64
from .timing import StepClock
from .transformer import KVCache, Transformer

Forward = Callable[..., torch.Tensor]  # (tokens [B,T], positions [B,T], slots [T], key_valid [B,S], cache) -> [B,V]


@dataclass
class BatchOutput:
    """Host arrays for one batch. B rows, N steps, K top-k entries."""

    tokens: np.ndarray  # [B, N] int64
    digests: np.ndarray  # [B, N, 2] int64
    topk_ids: np.ndarray  # [B, N, K] int64
    topk_values: np.ndarray  # [B, N, K] float32
    margins: np.ndarray  # [B, N] float32
    logits: np.ndarray | None  # [B, N, V] raw bits of the model dtype, when kept
    step_ms: np.ndarray  # [N] wall time of each step; step 0 is prefill + first token (TTFT)
    padded_length: int = 0  # P, the prompt length the batch was padded to
    probe_values: np.ndarray | None = None  # [B, N, K'] float64 logits at the probe ids, when probed


@dataclass
class CaptureBuffers:
    """Preallocated device buffers the step writes into at index `step` (a tensor)."""

    tokens: torch.Tensor  # [B, N] int64
    digests: torch.Tensor  # [B, N, 2] int64
    topk_ids: torch.Tensor  # [B, N, K] int64
    topk_values: torch.Tensor  # [B, N, K] float32
    margins: torch.Tensor  # [B, N] float32
    logits: torch.Tensor | None  # [B, N, V] model dtype
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

    def to_host(self, rows: int, steps: int, step_ms: np.ndarray, padded_length: int) -> BatchOutput:
        """The first `rows` rows and `steps` steps, copied to the host (the one sync of a batch)."""
        cut = lambda t: t[:rows, :steps].to("cpu", copy=True)  # noqa: E731 - a copy: the buffers are reused
        logits = cut(self.logits).view(BITS_VIEW[self.logits.dtype]).numpy() if self.logits is not None else None
        probe = cut(self.probe_values).numpy() if self.probe_values is not None else None
        return BatchOutput(cut(self.tokens).numpy(), cut(self.digests).numpy(), cut(self.topk_ids).numpy(),
                           cut(self.topk_values).numpy(), cut(self.margins).numpy(), logits, step_ms,
                           padded_length, probe)


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
    buffers.tokens.index_copy_(1, step, token[:, None])
    if not capture:
        return token
    ids, values, margin = topk_sketch(logits, top_k)
    buffers.digests.index_copy_(1, step, logits_digest(logits)[:, None])
    buffers.topk_ids.index_copy_(1, step, ids[:, None])
    buffers.topk_values.index_copy_(1, step, values[:, None])
    buffers.margins.index_copy_(1, step, margin[:, None])
    if buffers.logits is not None:
        buffers.logits.index_copy_(1, step, logits[:, None])
    if buffers.probe_ids is not None:
        probe = buffers.probe_ids.index_select(1, step)[:, 0]  # [B, K']
        buffers.probe_values.index_copy_(1, step, logits.gather(1, probe).double()[:, None])
    return token


@dataclass
class Workspace:
    """Everything one batch shape needs on the device, allocated once and reused batch after batch."""

    cache: KVCache  # [layers, B, G, S, D]
    buffers: CaptureBuffers
    key_valid: torch.Tensor  # [B, S] bool, False on padding slots
    token: torch.Tensor  # [B] int64: the token fed to the next decode step
    lengths: torch.Tensor  # [B] int64: real prompt lengths
    slot_base: torch.Tensor  # [1] int64: P, the cache slot of the first decode input
    step: torch.Tensor  # [1] int64: the step index the next call writes
    seeds: torch.Tensor  # [B] int64 per-row sampling seeds
    forced: torch.Tensor | None  # [B, N] int64 tokens to feed instead of the model's choices
    top_k: int
    temperature: float
    capture: bool = True

    @classmethod
    def allocate(cls, model: Transformer, batch: int, slots: int, steps: int, top_k: int, temperature: float,
                 keep_logits: bool = False, forced: bool = False, probe_width: int | None = None,
                 capture: bool = True) -> "Workspace":
        device = model.device
        buffers = CaptureBuffers.allocate(batch, steps, top_k, model.vocab_size, keep_logits, model.dtype, device)
        if probe_width:
            buffers.probe_ids = torch.zeros(batch, steps, probe_width, dtype=torch.int64, device=device)
            buffers.probe_values = torch.zeros(batch, steps, probe_width, dtype=torch.float64, device=device)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        return cls(model.new_cache(batch, slots), buffers, torch.zeros(batch, slots, dtype=torch.bool, device=device),
                   zeros(batch), zeros(batch), zeros(1), zeros(1), zeros(batch),
                   zeros(batch, steps) if forced else None, top_k, temperature, capture)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, S, N): batch rows, cache slots, capture steps."""
        return self.key_valid.shape[0], self.key_valid.shape[1], self.buffers.tokens.shape[1]


@dataclass
class PaddedBatch:
    """Left-padded prompts on the device. P = padded prompt length, S = cache slots."""

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


def row_matrix(rows: list[np.ndarray], batch: int, steps: int) -> torch.Tensor:
    """Per-row arrays [N_i, ...] -> one [B, N, ...] int64 tensor; short or missing rows repeat the last entry."""
    matrix = np.zeros((batch, steps) + np.asarray(rows[0]).shape[1:], dtype=np.int64)
    for row in range(batch):
        values = rows[min(row, len(rows) - 1)]
        count = min(len(values), steps)
        matrix[row, :count] = values[:count]
        if 0 < count < steps:
            matrix[row, count:] = values[count - 1]
    return torch.from_numpy(matrix)


def load_batch(workspace: Workspace, padded: PaddedBatch, seeds: list[int], forced: list[np.ndarray] | None,
               probe_ids: list[np.ndarray] | None) -> None:
    """Copy one batch's inputs into the workspace's static buffers."""
    batch, _, steps = workspace.shape
    workspace.key_valid.copy_(padded.key_valid)
    workspace.lengths.copy_(padded.lengths)
    workspace.slot_base.fill_(padded.tokens.shape[1])
    workspace.seeds.copy_(torch.tensor((seeds + seeds[-1:] * batch)[:batch], dtype=torch.int64))
    if forced is not None:
        workspace.forced.copy_(row_matrix(forced, batch, steps))
    if probe_ids is not None:
        workspace.buffers.probe_ids.copy_(row_matrix(probe_ids, batch, steps))


def prefill_step(forward: Forward, workspace: Workspace, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """tokens, positions [B, P]: fill cache slots [0, P), capture step 0, set up the first decode step."""
    ws = workspace
    slots = torch.arange(tokens.shape[1], device=tokens.device)
    logits = forward(tokens, positions, slots, ws.key_valid, ws.cache)
    ws.step.zero_()
    ws.token.copy_(capture_step(logits, ws.step, ws.buffers, ws.top_k, ws.temperature, ws.seeds, ws.capture))
    ws.step.add_(1)


def decode_step(forward: Forward, workspace: Workspace) -> None:
    """One decode step from the workspace's device state alone: feed, forward, capture, advance."""
    ws = workspace
    previous = ws.step - 1  # [1]
    fed = ws.forced.index_select(1, previous)[:, 0] if ws.forced is not None else ws.token  # [B]
    position = (ws.lengths + previous)[:, None]  # [B, 1]
    logits = forward(fed[:, None], position, ws.slot_base + previous, ws.key_valid, ws.cache)
    ws.token.copy_(capture_step(logits, ws.step, ws.buffers, ws.top_k, ws.temperature, ws.seeds, ws.capture))
    ws.step.add_(1)


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, pad_id: int,
                   top_k: int = 8, temperature: float = 0.0, row_seeds: list[int] | None = None,
                   keep_logits: bool = False, forced_tokens: list[np.ndarray] | None = None,
                   probe_ids: list[np.ndarray] | None = None, capture: bool = True,
                   mode=None) -> BatchOutput:
    """Greedy (or seeded-sampled) generation of one batch with on-device capture of every step.

    `mode` (an `ExecutionMode`) decides padding, workspaces, and how prefill and decode steps run
    (eager, compiled, CUDA graphs); without one the batch runs eagerly in a fresh workspace.
    `forced_tokens` (one array per row) feeds those tokens instead of the model's choices: forced
    decoding along another run's path; the buffers still record the model's own choice.
    `probe_ids` (one [N, K'] array per row) records the exact logits at those ids each step.
    """
    from .modes import eager_mode

    mode = mode or eager_mode(model)
    padded_length, batch = mode.padded_length(prompts), mode.padded_batch(len(prompts))
    rows = prompts + [prompts[-1]] * (batch - len(prompts))  # batch-bucket filler rows repeat the last prompt
    workspace = mode.workspace(batch, padded_length, max_new_tokens, top_k=top_k, temperature=temperature,
                               keep_logits=keep_logits, forced=forced_tokens is not None,
                               probe_width=probe_ids[0].shape[-1] if probe_ids is not None else None, capture=capture)
    _, slots, _ = workspace.shape
    padded = PaddedBatch.build(rows, pad_id, padded_length, slots, model.device)
    load_batch(workspace, padded, row_seeds or [0] * len(prompts), forced_tokens, probe_ids)
    clock = StepClock(model.device)
    clock.start()
    mode.prefill(workspace, padded.tokens, padded.positions)
    clock.mark()
    for _ in range(1, max_new_tokens):
        mode.decode(workspace)
        clock.mark()
    return workspace.buffers.to_host(len(prompts), max_new_tokens, clock.elapsed_ms(), padded_length)
