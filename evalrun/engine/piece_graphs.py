"""Piecewise CUDA graphs: each call of a compiled piece captured in a CUDA graph of its own and replayed, with
attention (and whatever else runs between the pieces) eager in between: vLLM's piecewise mode (its
CUDAGraphWrapper around each piece), not Inductor's CUDA graph trees.

Why not Inductor's trees: each call through them costs the host Dynamo's guards, AOTAutograd's wrappers and the
trees' bookkeeping. On the H200 (random:llama3-8b bf16, -O2, a 16-token prefill bucket, torch 2.11) the prefill's
66 piece calls kept the host busy 15.5 ms for 5.2 ms of kernels (benchmarks/prefill_ttft.py, README): the time
to first token was the host's; here 5.8-6.3 ms. A replay here is one check of the arguments and one graph launch.

How: `begin(key)` starts a forward (key: prefill or decode, the workspace, the shape), and the piece calls that
follow are numbered in order. Under a new key the pieces run as they are (compiling, and recording their
outputs' shapes); the second forward under it captures each call in its own graph; later ones replay. A call
whose arguments no longer match what its graph recorded is captured again (counted).

A piece's tensor arguments are of two kinds. Stable ones (the weights, the workspace's buffers such as the KV
cache, which a piece may write, and this module's own buffers) are read where they are: the graph records the
address, and a replay checks that the call passes the same one. Every other tensor (attention's output, a
prompt's tokens) is copied into a buffer the graph reads, before each replay. A piece's outputs are copied,
inside its graph, into buffers shared by every call of that piece with the same output shape: the residual
stream is one buffer for all layers, so the memory held is a layer's worth, not the model's, and the next
piece reads it in place; the copied arguments' buffers are shared the same way (each replay fills its own first).
All graphs share one memory pool: they replay one after another on one stream, so one's temporaries may reuse
another's (no graph's output lives in the pool: each is copied out inside its graph).

A replay runs what the graph captured, without Dynamo's guards: what the pieces read besides their arguments
(numerics flags, module switches) is what it was at the capture. A mode is built per configuration and its flags
are set before its warm-up, so nothing of that changes under a mode's graphs.

The graphs themselves come from a backend: CUDA graphs on the GPU; tests on the CPU use one that reruns the
captured work (`RerunGraphs`), which exercises everything here but the capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def storages(objects: Any) -> set[int]:
    """The storage addresses of every tensor in `objects` (tensors, dataclasses of them, lists, dicts), recursively."""
    found: set[int] = set()
    pending, seen = [objects], set()
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.add(item.untyped_storage().data_ptr())
        elif is_dataclass(item) and not isinstance(item, type):
            pending += [getattr(item, f.name) for f in fields(item)]
        elif isinstance(item, (list, tuple)):
            pending += list(item)
        elif isinstance(item, dict):
            pending += list(item.values())
        elif hasattr(item, "__dict__") and type(item).__module__.startswith("evalrun."):  # KVCache, RoutingState
            pending += list(vars(item).values())
    return found


def _where(t: torch.Tensor) -> tuple:
    """What a graph recorded of a stable tensor: the address it reads and how."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class CudaGraphs:
    """Real CUDA graphs, captured on a side stream into one shared memory pool."""

    def __init__(self) -> None:
        self.pool, self.stream = None, None  # made at the first capture (a mode is built before any GPU work)

    def capture(self, work: Callable[[], None], device: torch.device) -> Any:
        with torch.cuda.device(device):  # the model's device, whichever is current (cuda:1, a tensor-parallel rank)
            if self.pool is None:
                self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()  # as torch.cuda.graph does: nothing queued before races the capture
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self.pool)
                try:
                    work()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(self.stream)
        return graph, device.index if device.index is not None else torch.cuda.current_device()

    @staticmethod
    def replay(captured: Any) -> None:
        graph, device = captured
        if device == torch.cuda.current_device():
            graph.replay()
        else:
            with torch.cuda.device(device):
                graph.replay()


class RerunGraphs:
    """A stand-in backend for the CPU: "capturing" keeps the work, "replaying" runs it again."""

    @staticmethod
    def capture(work: Callable[[], None], device: torch.device) -> Any:
        return work

    @staticmethod
    def replay(graph: Any) -> None:
        graph()


@dataclass(frozen=True)
class TensorMeta:
    """What a call's output tensor looked like the first time: its shared buffer is made to match."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, leaf: Any) -> Any:
        return cls(tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor) else leaf


@dataclass
class PieceCall:
    """One numbered call of a forward: the piece, what its graph reads, and the buffers its outputs land in."""

    name: str
    outputs_meta: list  # per output leaf: its TensorMeta, or the leaf itself if not a tensor
    outputs_spec: Any  # the outputs' pytree structure
    graph: Any = None
    stable: list = field(default_factory=list)  # (leaf index, _where) of each stable tensor argument
    copied: list = field(default_factory=list)  # (leaf index, buffer) of each copied tensor argument
    constants: list = field(default_factory=list)  # (leaf index, value) of each non-tensor argument
    leaves: int = 0
    outputs: Any = None  # the outputs' structure over the shared buffers


@dataclass
class Sequence:
    """The piece calls of the forwards under one key, in order; `recorded` once a first forward has run them."""

    calls: list[PieceCall] = field(default_factory=list)
    recorded: bool = False


class PieceGraphs:
    """The piecewise graphs of one execution mode: `wrap` each piece, `begin` each forward, `register` the
    tensors that stay put (weights, workspaces)."""

    def __init__(self, backend: Any | None = None) -> None:
        self.backend = backend if backend is not None else CudaGraphs()
        self.sequences: dict[tuple, Sequence] = {}
        self.stable: set[int] = set()  # storage addresses read in place
        self.buffers: dict[tuple, torch.Tensor] = {}  # (in or out, piece, leaf position, TensorMeta) -> shared buffer
        self.sequence: Sequence | None = None
        self.cursor = 0
        self.counts = {"piece_graph_captures": 0, "piece_graph_replays": 0, "piece_graph_recaptures": 0}
        self.copied_storages: list[int] = []  # the storages this forward's replays copied from (tests read it)

    def register(self, objects: Any) -> None:
        """Tensors (or dataclasses, lists of them) that stay where they are: read in place, never copied."""
        self.stable |= storages(objects)

    def begin(self, key: tuple) -> None:
        """A forward starts: its piece calls are numbered from here, under `key`."""
        if self.sequence is not None and self.sequence.calls:
            self.sequence.recorded = True  # the forward before this one ran to its end
        self.sequence = self.sequences.setdefault(key, Sequence())
        self.cursor = 0
        self.copied_storages = []

    def wrap(self, name: str, piece: Callable) -> "GraphedPiece":
        return GraphedPiece(self, name, piece)

    def run(self, name: str, piece: Callable, args: tuple) -> Any:
        sequence = self.sequence
        if sequence is None:  # no forward begun: as it is
            return piece(*args)
        index, self.cursor = self.cursor, self.cursor + 1
        if not sequence.recorded:  # the first forward under this key: run (compiles), record the outputs' shapes
            outputs = piece(*args)
            leaves, spec = tree_flatten(outputs)
            sequence.calls.append(PieceCall(name, [TensorMeta.of(leaf) for leaf in leaves], spec))
            return outputs
        if index >= len(sequence.calls) or sequence.calls[index].name != name:
            recorded = sequence.calls[index].name if index < len(sequence.calls) else "the end"
            raise RuntimeError(f"piecewise graphs: call {index} of this forward is {name}, where the first forward "
                               f"had {recorded}")
        call = sequence.calls[index]
        leaves, spec = tree_flatten(args)
        if call.graph is None or not self._matches(call, leaves):
            self._capture(call, piece, leaves, spec)
        else:
            for position, buffer in call.copied:
                source = leaves[position]
                self.copied_storages.append(source.untyped_storage().data_ptr())
                buffer.copy_(source)
        self.backend.replay(call.graph)
        self.counts["piece_graph_replays"] += 1
        return call.outputs

    @staticmethod
    def _matches(call: PieceCall, leaves: list) -> bool:
        """Whether this call's arguments are what its graph recorded: stable tensors where they were, copied ones
        of the same shape and dtype, the same non-tensor values."""
        if len(leaves) != call.leaves:
            return False
        for position, where in call.stable:
            leaf = leaves[position]
            if not isinstance(leaf, torch.Tensor) or _where(leaf) != where:
                return False
        for position, buffer in call.copied:
            leaf = leaves[position]
            if not isinstance(leaf, torch.Tensor) or leaf.shape != buffer.shape or leaf.dtype != buffer.dtype:
                return False
        return all(leaves[position] == value for position, value in call.constants)

    def _capture(self, call: PieceCall, piece: Callable, leaves: list, spec: Any) -> None:
        """Capture `call`: stable arguments read in place, the others from the piece's shared argument buffers
        (filled now), the outputs copied into its shared output buffers inside the graph."""
        if call.graph is not None:
            self.counts["piece_graph_recaptures"] += 1
        call.stable, call.copied, call.constants, call.leaves = [], [], [], len(leaves)
        inputs = list(leaves)
        for position, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                call.constants.append((position, leaf))
            elif leaf.untyped_storage().data_ptr() in self.stable:
                call.stable.append((position, _where(leaf)))
            else:  # a buffer shared by this argument of every call of the piece: each replay fills it first
                buffer = self._buffer(("in", call.name, position), TensorMeta.of(leaf))
                buffer.copy_(leaf)
                call.copied.append((position, buffer))
                inputs[position] = buffer
        captured_args = tree_unflatten(inputs, spec)
        targets = [self._buffer(("out", call.name, position), meta) if isinstance(meta, TensorMeta) else None
                   for position, meta in enumerate(call.outputs_meta)]
        device = next(leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor))

        def work() -> None:
            outputs, _ = tree_flatten(piece(*captured_args))
            for target, output in zip(targets, outputs):
                if target is not None:
                    target.copy_(output)

        call.graph = self.backend.capture(work, device)
        call.outputs = tree_unflatten([meta if target is None else target
                                       for target, meta in zip(targets, call.outputs_meta)], call.outputs_spec)
        self.counts["piece_graph_captures"] += 1

    def _buffer(self, role: tuple, meta: TensorMeta) -> torch.Tensor:
        """The buffer shared by every call of a piece for one argument or output (`role`: in or out, the piece, the
        position) that looks like `meta`."""
        key = (*role, meta)
        if key not in self.buffers:
            self.buffers[key] = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device)
            self.stable.add(self.buffers[key].untyped_storage().data_ptr())
        return self.buffers[key]


@dataclass(frozen=True)
class GraphedPiece:
    """A piece whose calls run through `graphs` (what `PieceGraphs.wrap` returns)."""

    graphs: PieceGraphs
    name: str
    piece: Callable

    def __call__(self, *args: Any) -> Any:
        return self.graphs.run(self.name, self.piece, args)
