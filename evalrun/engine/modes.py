"""Execution modes: how the engine runs (compilation mode x CUDA graph mode), and proof that it did.

Compilation modes (vLLM's names in brackets)
  none        eager                                                             [NONE]
  stock       torch.compile of the whole forward; guards, breaks, recompiles   [STOCK_TORCH_COMPILE]
  trace-once  torch.compile(fullgraph=True, dynamic=False) per shape bucket;   [DYNAMO_TRACE_ONCE]
              a recompile after warm-up is a fallback
  piecewise   regional: the pieces (prologue: embedding, rotary, mask; norm +   [VLLM_COMPILE]
              projections + rotary; output projection + MLP or MoE; head) compiled once,
              the layer pieces shared by every layer; attention runs between them, and the
              KV-cache write with it, or inside the norm + projections piece where that
              piece runs without piecewise graphs (pre_attention_writing)
CUDA graph modes
  none                no graphs
  piecewise           a CUDA graph around each call of a compiled piece, attention eager between them
                      (prefill and decode; piece_graphs.py, vLLM's piecewise graphs)
  full                the whole decode step (forward + capture) and each prefill bucket captured
  full-decode-only    decode captured whole; prefill without graphs
  full-and-piecewise  decode captured whole; prefill with piecewise graphs

Static modes (anything but none/none) pad prompts to prefill buckets and batches to batch buckets
and keep one workspace per batch bucket for the whole run, so shapes repeat and graphs replay.

Batch invariance (`batch_invariant=True`): every row of a batch is computed as a batch of one, in a
workspace padded to its own prompt length (ExecutionMode.generate), so each reduction runs in the same
order as when the prompt runs alone, whatever its companions and position. Measured on CPU (MKL,
fp32): a linear layer's row changes bits between 1-3 rows and 4+ rows (gemv/small-M kernels), and
SDPA's output changes with the left padding and the cache length a batch imposes; RMSNorm is
row-local. Rows one at a time removes both causes at once. On a GPU the same mode is correct but
serial; fixed-split kernels (vLLM's and SGLang's batch-invariant matmul, RMSNorm and attention) would
keep the batch's throughput (not built yet).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import CompilationMode, CUDAGraphMode, EffectiveConfig
from . import attention_triton, native_build
from .generate import (BatchOutput, BatchSpec, PaddedBatch, PendingBatch, Workspace, decode_step, load_batch,
                       prefill_step, stack_outputs)
from .piece_graphs import PieceGraphs
from .shapes import ShapePlan
from .timing import StepClock
from .transformer import (StatePieces, Transformer, head, mlp_block, moe_post_attention, output_projection,
                          post_attention, pre_attention, pre_attention_writing, prologue)

DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


def clone_function(function: Callable, tag: str) -> Callable:
    """The same function under a new code object: torch.compile keeps one cache per code object, so
    two differently compiled versions of one function must not share it."""
    code = function.__code__.replace(co_name=f"{function.__name__}_{tag}")
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__,
                              function.__closure__)


def dynamo_snapshot() -> dict[str, Any]:
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv", aggregate=True)
    times = dict(zip(names, values))
    compile_s = float(times.get("_compile.compile_inner", 0.0)) + native_build.build_seconds()  # the engine's C++ built
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "breaks": dict(counters["graph_break"]), "compile_s": compile_s,
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


@dataclass
class ExecutionMode(ShapePlan):
    transformer: Transformer
    compilation_mode: CompilationMode = CompilationMode.NONE
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    prefill_buckets: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    inductor_options: dict[str, Any] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    batch_invariant: bool = False  # rows run one at a time (generate)
    # Compiled pieces without piecewise graphs write the KV cache inside the pre-attention piece
    # (transformer.pre_attention_writing): one kernel fewer per layer. Off only to measure it.
    kv_write_in_piece: bool = True

    def __post_init__(self) -> None:
        self.static = (self.compilation_mode, self.cudagraph_mode) != (CompilationMode.NONE, CUDAGraphMode.NONE)
        # piecewise CUDA graphs (piece_graphs.py): the prefill's pieces (piecewise, full-and-piecewise), the decode's too
        # (piecewise); the weights and each workspace are read in place
        self.piece_graphs: PieceGraphs | None = None
        if self.cudagraph_mode.has_piecewise_cudagraphs():
            self.piece_graphs = PieceGraphs()
            self.piece_graphs.register(self.transformer.weights())
        self.workspaces: dict[tuple, Workspace] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.graph_inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.counts = {"cudagraph_captures": 0, "cudagraph_replays": 0}
        self.last_workspace: Workspace | None = None
        self.plan_slots: int | None = None
        self.plan_steps: int | None = None
        self.kernel_launches_per_decode_step: int | None = None
        self.prefill_forward, self.decode_forward = self._build_forwards()
        self.started = dynamo_snapshot()
        self.measuring = self.started

    # ------------------------------------------------------------ compilation

    def _compile(self, function: Callable, tag: str, fullgraph: bool, dynamic: bool | None) -> Callable:
        options = dict(self.inductor_options, **{"triton.cudagraphs": False})  # graphs are the mode's own
        return torch.compile(clone_function(function, tag), fullgraph=fullgraph, dynamic=dynamic, options=options)

    def _pieces(self, tag: str, graphs: bool) -> Transformer:
        """The transformer with its pieces compiled under `tag`, each call in a CUDA graph of its own if `graphs`.

        The writing piece (the KV write inside the pre-attention piece) serves the pieces without piecewise graphs;
        it takes the layer's cache, so it compiles once per cache length S (as the prologue's mask already does).
        Pieces under piecewise graphs keep the separate write, as they had under Inductor's graph trees: on
        Qwen3-MoE (q/k norms) the writing piece's prefill moved a bfloat16 routing near-tie (the H200's GPU suite,
        stop 18), so the prefill of -O1 and -O2 keeps its earlier kernels and bits."""
        view = copy.copy(self.transformer)
        pieces = {"prologue": prologue, "pre_attention": pre_attention, "post_attention": post_attention,
                  "moe_post_attention": moe_post_attention, "head": head}
        if self.kv_write_in_piece and not graphs:
            pieces["pre_attention_writing"] = pre_attention_writing
        for name, function in pieces.items():
            compiled = self._compile(function, f"{tag}_{name}", True, False)
            setattr(view, name, self.piece_graphs.wrap(name, compiled) if graphs else compiled)
        return view

    def _build_forwards(self) -> tuple[Callable, Callable]:
        compilation, graphs = self.compilation_mode, self.cudagraph_mode
        if not compilation.is_compiled():
            return self.transformer.forward, self.transformer.forward
        if compilation is CompilationMode.PIECEWISE:
            prefill = self._pieces("prefill", graphs.has_piecewise_cudagraphs())
            decode = self._pieces("decode", graphs is CUDAGraphMode.PIECEWISE)
            return prefill.forward, decode.forward
        fullgraph, dynamic = (True, False) if compilation is CompilationMode.TRACE_ONCE else (False, None)
        compiled = self._compile(Transformer.forward, compilation.value.replace("-", "_"), fullgraph, dynamic)
        forward = self._guarded(lambda *args: compiled(self.transformer, *args), self.transformer.forward)
        return forward, forward

    def _guarded(self, compiled: Callable, eager: Callable) -> Callable:
        """Call `compiled`; if Dynamo or Inductor refuses the code, record a fallback and run `eager` from then on."""
        state = {"function": compiled}

        def call(*args):
            try:
                return state["function"](*args)
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as error:
                if state["function"] is eager:
                    raise
                self.fallbacks.append(f"compilation_mode={self.compilation_mode} failed, ran eagerly: "
                                      f"{str(error).splitlines()[0][:200]}")
                state["function"] = eager
                return eager(*args)

        return call

    @torch.no_grad()
    def generate(self, spec: BatchSpec) -> BatchOutput:
        """One batch in this mode (the engine seam's call: engine.engines.Engine): greedy (or seeded-sampled)
        generation with on-device capture of every step. A batch-invariant mode runs each row as a batch of
        one (its own padding, cache length and kernels: the bits of the prompt run alone)."""
        return self.submit(spec).result()

    @torch.no_grad()
    def submit(self, spec: BatchSpec) -> PendingBatch:
        """`generate`, split where the host would wait: enqueue the batch (on CUDA, its copy to the host too) and
        return it pending. The runner enqueues the next batch before it makes this one's results, so the device
        does not idle while the host does that (stop 23)."""
        if self.batch_invariant and len(spec.prompts) > 1:
            output = stack_outputs([self._launch(spec.row(index)).result() for index in range(len(spec.prompts))],
                                   spec.steps)
            return PendingBatch(None, lambda: output)
        return self._launch(spec)

    def _launch(self, spec: BatchSpec) -> PendingBatch:
        """Pad the prompts as the mode wants, take the workspace for that shape, load the batch, then enqueue
        prefill and the decode steps with a step clock that never syncs inside the loop, then the copy to the
        host."""
        prompts, device = spec.prompts, self.transformer.device
        padded_length, batch = self.padded_length(prompts), self.padded_batch(len(prompts))
        rows = prompts + [prompts[-1]] * (batch - len(prompts))  # batch-bucket filler rows repeat the last prompt
        workspace = self.workspace(batch, padded_length, spec)
        _, slots, _ = workspace.shape
        padded = PaddedBatch.build(rows, spec.pad_id, padded_length, slots, device)
        load_batch(workspace, padded, spec)
        clock = StepClock(device)
        clock.start()
        self.prefill(workspace, padded.tokens, padded.positions)
        clock.mark()
        for _ in range(1, spec.steps):
            self.decode(workspace)
            clock.mark()
        return workspace.buffers.copy_to_host(len(prompts), spec.steps, clock.elapsed_ms, padded_length)

    # ------------------------------------------------------------ shapes and workspaces

    def workspace(self, batch: int, padded_length: int, spec: BatchSpec) -> Workspace:
        """A fresh workspace (eager), or the run's one workspace for this batch bucket and layout (static)."""
        if not self.static:
            self.last_workspace = Workspace.allocate(self.transformer, batch, padded_length + spec.steps, spec.steps,
                                                     spec)
            return self.last_workspace
        slots = max(self.plan_slots or 0, padded_length + spec.steps)
        steps = max(self.plan_steps or 0, spec.steps)
        key = (batch, slots, steps, spec.layout())
        if key not in self.workspaces:
            self.workspaces[key] = Workspace.allocate(self.transformer, batch, slots, steps, spec)
            if self.piece_graphs:
                self.piece_graphs.register(self.workspaces[key])  # the KV cache a piece writes, read in place
        return self.workspaces[key]

    # ------------------------------------------------------------ steps

    @property
    def calls_to_warm(self) -> int:
        """Calls per shape before one runs as measured: piecewise graphs run a new shape's pieces as they are on
        its first call (compiling them) and capture them on the second, so they need two."""
        return 2 if self.piece_graphs else 1

    def _new_step(self, key: tuple) -> None:
        """Piecewise graphs number a forward's piece calls from its start, under the step's key."""
        if self.piece_graphs:
            self.piece_graphs.begin(key)

    def prefill(self, workspace: Workspace, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        self._new_step(("prefill", id(workspace), tuple(tokens.shape)))
        if not self.cudagraph_mode.captures_full_prefill():
            prefill_step(self.prefill_forward, workspace, tokens, positions)
            return
        key = ("prefill", id(workspace), tokens.shape)
        if key not in self.graphs:
            self.graph_inputs[key] = (tokens.clone(), positions.clone())
            static_tokens, static_positions = self.graph_inputs[key]
            self._capture(key, workspace, lambda: prefill_step(self.prefill_forward, workspace,
                                                                 static_tokens, static_positions))
        static_tokens, static_positions = self.graph_inputs[key]
        static_tokens.copy_(tokens)
        static_positions.copy_(positions)
        self._replay(key)

    def decode(self, workspace: Workspace) -> None:
        self._new_step(("decode", id(workspace)))
        if not self.cudagraph_mode.has_full_cudagraphs():
            decode_step(self.decode_forward, workspace)
            return
        key = ("decode", id(workspace))
        if key not in self.graphs:
            self._capture(key, workspace, lambda: decode_step(self.decode_forward, workspace))
        self._replay(key)

    def _capture(self, key: tuple, workspace: Workspace, step: Callable[[], None]) -> None:
        """Warm up `step` on a side stream (compiles, autotunes), then capture it in a CUDA graph.

        Warm-up runs mutate the workspace's step counters and token; they are restored afterwards,
        so the captured graph starts from the state the caller left."""
        saved = (workspace.counters.clone(), workspace.token.clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
                workspace.counters.copy_(saved[0])
                workspace.token.copy_(saved[1])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        self.graphs[key] = graph
        self.counts["cudagraph_captures"] += 1

    def _replay(self, key: tuple) -> None:
        self.graphs[key].replay()
        self.counts["cudagraph_replays"] += 1

    # ------------------------------------------------------------ evidence

    def start_measuring(self) -> None:
        """Called after warm-up: counts from here describe the measured run.

        The launch count runs one decode step under the profiler first; the profiler changes global
        state that Dynamo guards on, so any compile it causes belongs to warm-up, not to the run."""
        workspace = next(iter(self.workspaces.values()), self.last_workspace)
        if self.transformer.device.type == "cuda" and workspace is not None:
            self.kernel_launches_per_decode_step = self._count_launches(workspace)
        self.measuring = dynamo_snapshot()
        self.counts = {"cudagraph_captures_warmup": self.counts["cudagraph_captures"], "cudagraph_captures": 0,
                       "cudagraph_replays": 0}
        if self.piece_graphs:
            pieces = self.piece_graphs.counts
            pieces["piece_graph_captures_warmup"] = pieces["piece_graph_captures"]
            pieces.update(piece_graph_captures=0, piece_graph_replays=0, piece_graph_recaptures=0)

    def _count_launches(self, workspace: Workspace) -> int | None:
        """Kernel launches (and graph launches) the host issues for one decode step (profiler); None when the
        workspace holds no decode step (a run of one token: step 1 would lie past its capture buffers)."""
        from torch.profiler import ProfilerActivity, profile

        if workspace.shape[2] < 2:
            return None
        workspace.point_at(1)  # a finished workspace points past its last step; the next prefill resets it
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            self.decode(workspace)
            torch.cuda.synchronize()
        names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
        return sum(1 for event in profiler.events() if event.name in names)

    def evidence(self) -> dict[str, Any]:
        left = attention_triton.arrivals_left()
        if left:  # never stored as a run: its split-KV attention combined early or not at all
            raise RuntimeError(f"split-KV attention left {left} arrival counters non-zero: two of its launches "
                               "overlapped on one device; the run's attention cannot be trusted")
        now, start, measured = dynamo_snapshot(), self.started, self.measuring
        breaks = {reason.splitlines()[0][:200]: count - start["breaks"].get(reason, 0)
                  for reason, count in now["breaks"].items() if count > start["breaks"].get(reason, 0)}
        evidence = {
            "compilation_mode": self.compilation_mode.value, "cudagraph_mode": self.cudagraph_mode.value,
            "dynamo_graphs": now["graphs"] - start["graphs"], "frames_compiled": now["frames"] - start["frames"],
            "graph_breaks": [{"reason": reason, "count": count} for reason, count in breaks.items()],
            "recompiles_after_warmup": now["graphs"] - measured["graphs"],
            "compile_s": now["compile_s"] - start["compile_s"],
            "inductor_cudagraph_skips": now["cudagraph_skips"] - start["cudagraph_skips"],
            **self.counts, **(self.piece_graphs.counts if self.piece_graphs else {}),
            "kernel_launches_per_decode_step": self.kernel_launches_per_decode_step,
            "prefill_buckets": self.prefill_buckets if self.static else None,
            "batch_buckets": self.batch_buckets if self.static else None,
        }
        evidence["fallbacks"] = self.fallbacks + find_fallbacks(evidence)
        return evidence


def find_fallbacks(evidence: dict[str, Any]) -> list[str]:
    """Compare what the mode implies with what happened; each mismatch is a fallback (one line each)."""
    found = []
    compilation, graphs = CompilationMode(evidence["compilation_mode"]), CUDAGraphMode(evidence["cudagraph_mode"])
    if compilation.is_compiled() and evidence["dynamo_graphs"] == 0:
        found.append(f"compilation_mode={compilation} but dynamo compiled no graph: everything ran eagerly")
    for entry in evidence["graph_breaks"]:
        found.append(f"graph break ({entry['count']}x): {entry['reason']}")
    if compilation is CompilationMode.TRACE_ONCE and evidence["recompiles_after_warmup"]:
        found.append(f"trace-once recompiled {evidence['recompiles_after_warmup']}x after warm-up")
    if graphs.has_full_cudagraphs() and evidence["cudagraph_replays"] == 0:
        found.append(f"cudagraph_mode={graphs} but no CUDA graph was replayed")
    if graphs.has_piecewise_cudagraphs() and evidence.get("piece_graph_replays") == 0:
        found.append(f"cudagraph_mode={graphs} but no piece's CUDA graph was replayed (the pieces ran without graphs)")
    if evidence["inductor_cudagraph_skips"]:
        found.append(f"Inductor skipped CUDA graphs {evidence['inductor_cudagraph_skips']}x")
    return found


def eager_mode(transformer: Transformer) -> ExecutionMode:
    return ExecutionMode(transformer)


def allow_recompiles_for(prefill_buckets: tuple[int, ...], batch_buckets: tuple[int, ...]) -> None:
    """Static modes compile each function once per shape: (prefill bucket + decode) x batch bucket, and
    twice where a guard splits (a parameter beside a plain tensor). Dynamo's default limit of 8 per code
    object is below that; with fullgraph=True, hitting it is a hard failure mid-run (found on the H200:
    SmolLM2's 17 prompts span 5 prefill buckets). Raise the limit to cover every shape the config allows."""
    needed = 2 * (len(prefill_buckets) + 1) * len(batch_buckets) + 8
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, needed)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 64 * needed)


def build_execution_mode(transformer: Transformer, config: EffectiveConfig) -> ExecutionMode:
    """The execution mode an effective config asks for (`config.validate` has vouched that it can exist)."""
    if config.compilation_mode.is_compiled():
        torch._dynamo.reset()  # Dynamo's caches are not keyed on Inductor config: never reuse another config's
        allow_recompiles_for(config.prefill_buckets, config.batch_buckets)
    return ExecutionMode(transformer, config.compilation_mode, config.cudagraph_mode, config.prefill_buckets,
                         config.batch_buckets, config.inductor_options(), batch_invariant=config.batch_invariant)


def state_pieces(config: EffectiveConfig) -> StatePieces:
    """The pieces `Transformer.forward_states` runs to show `config`'s per-layer states: eager for
    compilation none; otherwise each piece compiled on its own (fullgraph, static shapes, no CUDA graphs)
    with the config's Inductor options. That is how piecewise compiles, with post_attention split at the
    attention/MLP boundary; stock and trace-once compile the whole forward, whose inner states no one can
    observe, so these pieces stand in for them."""
    if not config.compilation_mode.is_compiled():
        return StatePieces()
    torch._dynamo.reset()
    allow_recompiles_for(config.prefill_buckets, config.batch_buckets)
    options = dict(config.inductor_options(), **{"triton.cudagraphs": False})

    def compiled(function: Callable) -> Callable:
        return torch.compile(clone_function(function, "states"), fullgraph=True, dynamic=False, options=options)

    return StatePieces(compiled(prologue), compiled(pre_attention), compiled(output_projection), compiled(mlp_block),
                       compiled(head))
