"""Workspaces and the prefill and decode steps, with on-device capture, gpt-fast style.

A `Workspace` holds every buffer a batch needs, allocated once: KV cache, capture buffers, the
key-validity mask, and the decode step's inputs as device tensors (last token, prompt lengths,
first decode slot, step counter). `decode_step` reads and advances only those tensors, so it has
static shapes, never touches the host, and can be compiled with `fullgraph=True` or captured in a
CUDA graph and replayed with no inputs at all. Results reach the host once, at the end of a batch.

Every prompt is decoded for exactly `max_new_tokens` steps (static shapes): an end-of-sequence
token does not stop the loop; the runner records where it first appeared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .capture import BITS_VIEW, logits_digest, topk_sketch
from .capture_triton import fused_capture, fused_capture_at_step, fused_capture_supported
from .capture_triton import prepare as prepare_fused_capture
from .mixing import splitmix64
from .transformer import KVCache, Transformer

Forward = Callable[..., torch.Tensor]  # (tokens [B,T], positions [B,T], slots [T], key_valid [B,S], cache) -> [B,V]


@dataclass(frozen=True)
class BatchSpec:
    """What to generate for one batch: the prompts and every option of the decode loop.

    `forced_tokens` (one [N] array per row) feeds those tokens instead of the model's choices:
    forced decoding along another run's path; the capture still records the model's own choice.
    `forced_routing` (MoE models; one [N, L, k] array per row) likewise applies, at each step, those experts
    to the step's token in every MoE layer (another run's routing); the capture records the model's own.
    `forced_prompt_routing` (with it; one [P_i - 1, L, k] array per row, or None) applies those experts to the
    tokens of each row's prompt before its last (whose experts are step 0's); without it they route freely.
    `probe_ids` (one [N, K'] array per row) records the exact logits at those ids each step; with
    `probe_own_topk` = k the first k probe columns of each step are that step's own top-k ids
    (an oracle run chooses the ids later runs are probed at).
    """

    prompts: list[list[int]]
    steps: int
    pad_id: int
    top_k: int = 8
    temperature: float = 0.0
    row_seeds: list[int] | None = None
    keep_logits: bool = False
    forced_tokens: list[np.ndarray] | None = None
    forced_routing: list[np.ndarray] | None = None
    forced_prompt_routing: list[np.ndarray] | None = None
    probe_ids: list[np.ndarray] | None = None
    probe_own_topk: int = 0
    capture: bool = True
    row_steps: list[int] | None = None  # each row's own step count (<= steps), where rows differ

    def row(self, index: int) -> "BatchSpec":
        """Row `index` as a batch of one, decoded for its own step count (batch-invariant execution)."""
        pick = lambda values: [values[index]] if values is not None else None  # noqa: E731
        steps = self.row_steps[index] if self.row_steps is not None else self.steps
        return dataclasses.replace(self, prompts=[self.prompts[index]], steps=steps, row_seeds=pick(self.row_seeds),
                                   forced_tokens=pick(self.forced_tokens), forced_routing=pick(self.forced_routing),
                                   forced_prompt_routing=pick(self.forced_prompt_routing),
                                   probe_ids=pick(self.probe_ids),
                                   row_steps=None)

    def layout(self) -> tuple:
        """What fixes a workspace's buffers, besides its shape: batches with equal layouts share one."""
        probe_width = self.probe_ids[0].shape[-1] if self.probe_ids is not None else 0
        return (self.top_k, self.temperature, self.keep_logits, self.forced_tokens is not None, probe_width,
                self.probe_own_topk, self.capture, self.forced_routing is not None)


@dataclass
class BatchOutput:
    """Host arrays for one batch. B rows, N steps, K top-k entries, K' probe ids."""

    tokens: np.ndarray  # [B, N] int64
    digests: np.ndarray  # [B, N, 2] int64
    topk_ids: np.ndarray  # [B, N, K] int64
    topk_values: np.ndarray  # [B, N, K] float32
    margins: np.ndarray  # [B, N] float32
    logits: np.ndarray | None  # [B, N, V] raw bits of the model dtype, when kept
    step_ms: np.ndarray  # [N] wall time of each step; step 0 is prefill + first token (TTFT)
    padded_length: int = 0  # P, the prompt length the batch was padded to
    probe_ids: np.ndarray | None = None  # [B, N, K'] int64, when probed
    probe_values: np.ndarray | None = None  # [B, N, K'] float64 logits at the probe ids, when probed
    routing_experts: np.ndarray | None = None  # [B, N, L, k] int64: MoE models, each MoE layer's chosen experts
    routing_margins: np.ndarray | None = None  # [B, N, L] float32: their router margins (k-th - (k+1)-th prob)
    probe_logsumexp: np.ndarray | None = None  # [B, N] float64 logsumexp over the whole vocabulary, when probed
    # [B, P, L, k] int16: MoE models, each prompt token's experts in every MoE layer; rows left-padded like the prompts
    prompt_routing: np.ndarray | None = None


def stack_outputs(outputs: list[BatchOutput], steps: int) -> BatchOutput:
    """Batches of one row each -> one batch of `steps` steps (a row's steps past its own stay zero).

    step_ms sums the rows' step times: the rows ran one after another, so that is the batch's wall time."""
    def stacked(name: str) -> np.ndarray | None:
        arrays = [getattr(output, name) for output in outputs]
        if arrays[0] is None:
            return None
        full = np.zeros((len(arrays), steps) + arrays[0].shape[2:], dtype=arrays[0].dtype)
        for row, array in enumerate(arrays):
            full[row, :array.shape[1]] = array[0]
        return full

    step_ms = np.zeros(steps)
    for output in outputs:
        step_ms[:len(output.step_ms)] += output.step_ms
    padded = max(o.padded_length for o in outputs)
    return BatchOutput(stacked("tokens"), stacked("digests"), stacked("topk_ids"), stacked("topk_values"),
                       stacked("margins"), stacked("logits"), step_ms, padded,
                       stacked("probe_ids"), stacked("probe_values"), stacked("routing_experts"),
                       stacked("routing_margins"), probe_logsumexp=stacked("probe_logsumexp"),
                       prompt_routing=left_padded([o.prompt_routing for o in outputs], padded))


def left_padded(rows: list[np.ndarray | None], length: int) -> np.ndarray | None:
    """Batches of one row, [1, P_i, ...] each, left-padded to their own P_i -> [B, length, ...], each row's last P_i
    entries its own (so a row's prompt keeps its distance from the end, as in a batch padded to `length`)."""
    if rows[0] is None:
        return None
    full = np.zeros((len(rows), length) + rows[0].shape[2:], dtype=rows[0].dtype)
    for row, array in enumerate(rows):
        full[row, length - array.shape[1]:] = array[0]
    return full


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
    probe_own_topk: int = 0  # the first k probe columns are filled by the step's own top-k ids
    routing_experts: torch.Tensor | None = None  # [B, N, L, k] int64: MoE models, the step token's experts
    routing_margins: torch.Tensor | None = None  # [B, N, L] float32: its router margin in each MoE layer
    probe_logsumexp: torch.Tensor | None = None  # [B, N] float64: turns probe logits into log-probabilities
    prompt_routing: torch.Tensor | None = None  # [B, S, L, k] int16: the cache's record of a prefill's experts

    @classmethod
    def allocate(cls, batch: int, steps: int, vocab: int, spec: BatchSpec, dtype: torch.dtype,
                 device: torch.device, routing_shape: tuple[int, int] | None = None) -> "CaptureBuffers":
        """`routing_shape` (L MoE layers, k experts per token): capture routing too (MoE models only)."""
        prepare_fused_capture(device)  # eagerly, before any step Dynamo could trace (CUDA: the Triton op)
        probe_width = spec.probe_ids[0].shape[-1] if spec.probe_ids is not None else 0
        routing = routing_shape is not None and spec.capture
        zeros = lambda *shape, kind=torch.int64: torch.zeros(*shape, dtype=kind, device=device)  # noqa: E731
        return cls(
            tokens=zeros(batch, steps), digests=zeros(batch, steps, 2), topk_ids=zeros(batch, steps, spec.top_k),
            topk_values=zeros(batch, steps, spec.top_k, kind=torch.float32),
            margins=zeros(batch, steps, kind=torch.float32),
            logits=zeros(batch, steps, vocab, kind=dtype) if spec.keep_logits else None,
            probe_ids=zeros(batch, steps, probe_width) if probe_width else None,
            probe_values=zeros(batch, steps, probe_width, kind=torch.float64) if probe_width else None,
            probe_own_topk=spec.probe_own_topk,
            routing_experts=zeros(batch, steps, *routing_shape) if routing else None,
            routing_margins=zeros(batch, steps, routing_shape[0], kind=torch.float32) if routing else None,
            probe_logsumexp=zeros(batch, steps, kind=torch.float64) if probe_width else None,
        )

    def to_host(self, rows: int, steps: int, step_ms: np.ndarray, padded_length: int) -> BatchOutput:
        """The first `rows` rows and `steps` steps, copied to the host (the one sync of a batch)."""
        return self.copy_to_host(rows, steps, lambda: step_ms, padded_length).result()

    def copy_to_host(self, rows: int, steps: int, step_ms: Callable[[], np.ndarray],
                     padded_length: int) -> "PendingBatch":
        """Start copying the first `rows` rows and `steps` steps to the host: the batch, pending until its copy is done.

        On CUDA the copies go into pinned host memory without waiting (non_blocking, in stream order, so a later batch
        that overwrites these buffers cannot overtake them), so the host can make the previous batch's results while
        the device computes this one (runner.execute). Copies larger than PINNED_COPY_BYTES (kept logits of long
        batches), and any off CUDA, are made at once: page-locked memory is the system's, not the process's."""
        tensors = {name: getattr(self, name)[:rows, :steps] for name in OUTPUT_NAMES if getattr(self, name) is not None}
        if self.prompt_routing is not None:
            tensors["prompt_routing"] = self.prompt_routing[:rows, :padded_length]
        device = self.tokens.device
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        done = None
        if device.type == "cuda" and size <= PINNED_COPY_BYTES:
            hosts = {name: torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                     for name, tensor in tensors.items()}
            for name, tensor in tensors.items():
                hosts[name].copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))  # the copies' stream: the device's, not the current device's
        else:
            hosts = {name: tensor.to("cpu", copy=True) for name, tensor in tensors.items()}

        def make() -> BatchOutput:
            # copied out of pinned memory, so a run's arrays never hold page-locked memory (pinned blocks are reused)
            own = np.copy if done is not None else (lambda array: array)  # noqa: E731
            arrays = {name: own(host.numpy()) for name, host in hosts.items() if name != "logits"}
            if "logits" in hosts:  # raw bits of the model dtype
                arrays["logits"] = own(hosts["logits"].view(BITS_VIEW[hosts["logits"].dtype]).numpy())
            return BatchOutput(step_ms=step_ms(), padded_length=padded_length,
                               prompt_routing=arrays.get("prompt_routing"),
                               **{name: arrays.get(name) for name in OUTPUT_NAMES})

        return PendingBatch(done, make)


OUTPUT_NAMES = ("tokens", "digests", "topk_ids", "topk_values", "margins", "logits", "probe_ids", "probe_values",
                "routing_experts", "routing_margins", "probe_logsumexp")  # CaptureBuffers' arrays, BatchOutput's too
PINNED_COPY_BYTES = 256 << 20  # a batch's copy to the host up to this size goes through pinned memory, without a wait


@dataclass
class PendingBatch:
    """A batch enqueued on the device: `wait()` returns once the device has finished it (its copy to the host
    included), `result()` then makes its BatchOutput on the host."""

    done: "torch.cuda.Event | None"  # recorded after the batch's last copy to the host; None: nothing to wait for
    make: Callable[[], BatchOutput]

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def result(self) -> BatchOutput:
        self.wait()
        return self.make()


GREEDY_FROM_CAPTURE = True  # False: a separate argmax (before stop 22), for benchmarks/decode_breakdown.py beside
# Logits dtypes whose every value the fused kernel's float32 keys hold exactly (float64 values may share a key)
GREEDY_FROM_CAPTURE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
                 temperature: float, row_seeds: torch.Tensor, capture: bool = True,
                 next_token: torch.Tensor | None = None) -> torch.Tensor:
    """Capture one step's logits [B, V] into the buffers at `step` [1]; return the next token [B], also written into
    `next_token` [B] when given (the workspace's input of the next step).

    `capture=False` only chooses and records the token: the baseline the capture-overhead
    benchmark compares against. A greedy step captured by the fused kernel takes its token from the kernel's
    top-1 (the largest value, the lowest id among equal ones, NaN above all: argmax's choice; float64 logits
    excepted, whose float32 keys may tie), so the logits are not read a second time (an argmax over Llama-3's
    128,256 logits: about 35 us, 0.8% of an 8B step). The fused kernel's merge writes its outputs (and that token)
    into the buffers itself, so a step launches no copy kernels (stop 23: six fewer kernels, same bits).
    """
    fused = capture and fused_capture_supported(logits, top_k)
    from_capture = (fused and temperature == 0.0 and GREEDY_FROM_CAPTURE
                    and logits.dtype in GREEDY_FROM_CAPTURE_DTYPES)
    token_out = None if not from_capture else next_token if next_token is not None else torch.empty(
        logits.shape[0], dtype=torch.int64, device=logits.device)  # [B]: where the kernel writes the token
    if fused and fused_capture_at_step(logits, step, buffers.digests, buffers.topk_ids, buffers.topk_values,
                                       buffers.margins, buffers.tokens, token_out):
        token = token_out if from_capture else _record_token(choose_token(logits, temperature, row_seeds, step),
                                                             step, buffers, next_token)
        _capture_extras(logits, step, buffers)
        return token
    if fused:  # CUDA: one Triton kernel, one read of the logits
        digest, ids, values, margin = fused_capture(logits, top_k)
    token = _record_token(ids[:, 0] if from_capture else choose_token(logits, temperature, row_seeds, step), step,
                          buffers, next_token)
    if not capture:
        return token
    if not fused:
        ids, values, margin = topk_sketch(logits, top_k)
        digest = logits_digest(logits)
    buffers.digests.index_copy_(1, step, digest[:, None])
    buffers.topk_ids.index_copy_(1, step, ids[:, None])
    buffers.topk_values.index_copy_(1, step, values[:, None])
    buffers.margins.index_copy_(1, step, margin[:, None])
    _capture_extras(logits, step, buffers)
    return token


def _record_token(token: torch.Tensor, step: torch.Tensor, buffers: CaptureBuffers,
                  next_token: torch.Tensor | None) -> torch.Tensor:
    """token [B] into the buffers at `step` [1] and into `next_token` when given; returns the token."""
    buffers.tokens.index_copy_(1, step, token[:, None])
    if next_token is None:
        return token
    next_token.copy_(token)
    return next_token


def _capture_extras(logits: torch.Tensor, step: torch.Tensor, buffers: CaptureBuffers) -> None:
    """What a run keeps beyond the sketch: the raw logits, and an oracle's probes, at `step` [1]."""
    if buffers.logits is not None:
        buffers.logits.index_copy_(1, step, logits[:, None])
    if buffers.probe_ids is not None:
        if buffers.probe_own_topk:  # an oracle chooses its own probe ids: its top-k at this step
            own = torch.topk(logits, buffers.probe_own_topk, dim=-1).indices  # [B, k]
            buffers.probe_ids[:, :, :buffers.probe_own_topk].index_copy_(1, step, own[:, None])
        probe = buffers.probe_ids.index_select(1, step)[:, 0]  # [B, K']
        buffers.probe_values.index_copy_(1, step, logits.gather(1, probe).double()[:, None])
        buffers.probe_logsumexp.index_copy_(1, step, torch.logsumexp(logits.double(), dim=-1)[:, None])


def capture_routing(cache: KVCache, step: torch.Tensor, buffers: CaptureBuffers) -> None:
    """Copy the forward's routing of each row's last token (every MoE layer) into the buffers at `step` [1]."""
    if buffers.routing_experts is not None:
        buffers.routing_experts.index_copy_(1, step, cache.routing.experts[:, None])  # [B, 1, L, k]
        buffers.routing_margins.index_copy_(1, step, cache.routing.margins[:, None])  # [B, 1, L]


def force_routing(workspace: "Workspace") -> None:
    """Forced routing: give the next forward the experts of the step it computes (`workspace.step`)."""
    if workspace.forced_routing is not None:
        workspace.cache.routing.forced.copy_(workspace.forced_routing.index_select(1, workspace.step)[:, 0])


@dataclass
class Workspace:
    """Everything one batch shape needs on the device, allocated once and reused batch after batch."""

    cache: KVCache  # [layers, B, G, S, D]
    buffers: CaptureBuffers
    key_valid: torch.Tensor  # [B, S] bool, False on padding slots
    token: torch.Tensor  # [B] int64: the token fed to the next decode step
    lengths: torch.Tensor  # [B] int64: real prompt lengths
    slot_base: torch.Tensor  # [1] int64: P, the cache slot of the first decode input
    # [4 + B] int64: the counters a decode step reads, advanced together by one add (`decode_step`): the step index
    # the next call writes, the step before it, that step's cache slot, padding, then each row's position. Views of
    # it below (slot and positions at 16-byte offsets: Inductor copies an input that is not aligned).
    counters: torch.Tensor
    seeds: torch.Tensor  # [B] int64 per-row sampling seeds
    forced: torch.Tensor | None  # [B, N] int64 tokens to feed instead of the model's choices
    top_k: int
    temperature: float
    capture: bool = True
    forced_routing: torch.Tensor | None = None  # [B, N, L, k] int64 experts to apply instead of the model's choices

    @property
    def step(self) -> torch.Tensor:
        """[1] int64: the step index the next call writes."""
        return self.counters[0:1]

    @property
    def previous(self) -> torch.Tensor:
        """[1] int64: the step before `step`, whose token the next decode step feeds."""
        return self.counters[1:2]

    @property
    def slot(self) -> torch.Tensor:
        """[1] int64: the cache slot of that token: slot_base + previous."""
        return self.counters[2:3]

    @property
    def position(self) -> torch.Tensor:
        """[B, 1] int64: each row's position of that token: lengths + previous."""
        return self.counters[4:, None]

    def point_at(self, step: int) -> None:
        """Set the counters for a decode step that writes `step` (>= 1), from the batch's lengths and slot base."""
        self.step.fill_(step)  # fills, not a copy from the host: a prefill captured in a CUDA graph runs this
        self.previous.fill_(step - 1)
        torch.add(self.slot_base, step - 1, out=self.slot)
        torch.add(self.lengths[:, None], step - 1, out=self.position)

    @classmethod
    def allocate(cls, model: Transformer, batch: int, slots: int, steps: int, spec: BatchSpec) -> "Workspace":
        device = model.device
        buffers = CaptureBuffers.allocate(batch, steps, model.vocab_size, spec, model.dtype, device,
                                          getattr(model, "routing_shape", None))  # MoE models only
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        routing = spec.forced_routing is not None and getattr(model, "routing_shape", None) is not None
        cache = model.new_cache(batch, slots, routing, prompt_routing=buffers.routing_experts is not None)
        buffers.prompt_routing = cache.routing.prompt if cache.routing is not None else None
        return cls(cache, buffers,
                   torch.zeros(batch, slots, dtype=torch.bool, device=device), zeros(batch), zeros(batch), zeros(1),
                   zeros(4 + batch), zeros(batch), zeros(batch, steps) if spec.forced_tokens is not None else None,
                   spec.top_k,
                   spec.temperature, spec.capture,
                   zeros(batch, steps, *model.routing_shape) if routing else None)

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
        return cls(to_device(tokens, device), to_device(positions, device), to_device(valid, device),
                   to_device(lengths, device))


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA from pinned memory, without the stream sync of a copy from pageable memory."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


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


def prompt_slots(padded_length: int, length: int) -> slice:
    """The cache slots of a prompt's tokens before its last, in a batch padded to `padded_length` (prompts are
    left-padded: a prompt of `length` tokens fills the last `length` slots)."""
    return slice(padded_length - length, padded_length - 1)


def prompt_matrix(rows: list[np.ndarray] | None, prompts: list[list[int]], shape: tuple[int, ...]) -> torch.Tensor:
    """Per-row experts of each prompt's tokens before its last, [P_i - 1, L, k] (or None: free) -> the [B, P, L, k]
    int16 matrix a prefill padded to P = shape[1] reads: row i's at the slots of those tokens (prompts are
    left-padded), -1 (free routing) everywhere else, rows past the batch's free."""
    matrix = np.full(shape, -1, dtype=np.int16)
    for row, (ids, experts) in enumerate(zip(prompts, rows or [])):
        if experts is not None and len(ids) > 1:
            if experts.shape != (len(ids) - 1,) + shape[2:]:
                raise ValueError(f"prompt routing of shape {experts.shape} for a prompt of {len(ids)} tokens")
            matrix[row, prompt_slots(shape[1], len(ids))] = experts
    return torch.from_numpy(matrix)


def load_batch(workspace: Workspace, padded: PaddedBatch, spec: BatchSpec) -> None:
    """Copy one batch's inputs into the workspace's static buffers."""
    batch, _, steps = workspace.shape
    seeds, forced, probe_ids = spec.row_seeds or [0] * len(spec.prompts), spec.forced_tokens, spec.probe_ids
    workspace.key_valid.copy_(padded.key_valid)
    workspace.lengths.copy_(padded.lengths)
    workspace.slot_base.fill_(padded.tokens.shape[1])
    device = workspace.seeds.device
    workspace.seeds.copy_(to_device(torch.tensor((seeds + seeds[-1:] * batch)[:batch], dtype=torch.int64), device))
    if forced is not None:
        workspace.forced.copy_(to_device(row_matrix(forced, batch, steps), device))
    if workspace.forced_routing is not None:
        workspace.forced_routing.copy_(to_device(row_matrix(spec.forced_routing, batch, steps), device))
        padded_length = padded.tokens.shape[1]  # a prefill of P tokens reads the first P - 1 slots
        prompt = workspace.cache.routing.prompt_forced[:, :padded_length]  # [B, P, L, k]: -1 (free) but given experts
        prompt.copy_(to_device(prompt_matrix(spec.forced_prompt_routing, spec.prompts, prompt.shape), device))
    if probe_ids is not None:
        workspace.buffers.probe_ids.copy_(to_device(row_matrix(probe_ids, batch, steps), device))


def prefill_step(forward: Forward, workspace: Workspace, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """tokens, positions [B, P]: fill cache slots [0, P), capture step 0, set up the first decode step."""
    ws = workspace
    slots = torch.arange(tokens.shape[1], device=tokens.device)
    ws.step.zero_()
    force_routing(ws)
    logits = forward(tokens, positions, slots, ws.key_valid, ws.cache)
    capture_step(logits, ws.step, ws.buffers, ws.top_k, ws.temperature, ws.seeds, ws.capture, ws.token)
    capture_routing(ws.cache, ws.step, ws.buffers)
    ws.point_at(1)


def decode_step(forward: Forward, workspace: Workspace) -> None:
    """One decode step from the workspace's device state alone: feed, forward, capture, advance."""
    ws = workspace
    fed = ws.forced.index_select(1, ws.previous)[:, 0] if ws.forced is not None else ws.token  # [B]
    force_routing(ws)
    logits = forward(fed[:, None], ws.position, ws.slot, ws.key_valid, ws.cache)
    capture_step(logits, ws.step, ws.buffers, ws.top_k, ws.temperature, ws.seeds, ws.capture, ws.token)
    capture_routing(ws.cache, ws.step, ws.buffers)
    ws.counters.add_(1)  # step, previous, slot and positions: one kernel (stop 23; it was four)
