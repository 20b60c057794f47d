"""`--engine transformers`: any causal LM transformers loads, run through transformers' own forward, with
evalrun's capture of every step (the same arrays as evalrun's engine: engine.generate.capture_step).

Greedy (or seeded-sampled) decoding over a left-padded batch: each row's prompt sits at the right end of
P slots, the 2D attention mask marks padding slots invalid, and positions count each row's real tokens
(padding at 0), so a row's logits do not depend on its companions beyond kernel rounding. The KV cache
is transformers' own: the DynamicCache when eager; a StaticCache of a fixed size (reset between
batches, one per batch bucket) when compiled, so every call of a shape sees the same shapes.

Execution modes, mapped where transformers supports them:
  none / none                 eager forward, dynamic cache
  stock / none                torch.compile of the forward (guards, breaks, recompiles allowed), static cache
  trace-once / none           torch.compile(fullgraph=True, dynamic=False), static cache; a recompile after
                              warm-up is a fallback, a graph break fails the compile (then: fallback, eager)
  stock|trace-once / full     the same, compiled with Inductor's CUDA graphs (torch.compile's reduce-overhead:
                              transformers' static cache + compile) for prefill and decode (GPU)
  ... / full-decode-only      CUDA graphs for decode steps only; prefill compiled without
Piecewise compilation and piecewise graphs exist only for evalrun's own forward: `config.validate`
refuses them for this engine, as it does CUDA graphs without compilation.

Shapes: B rows (padded to a batch bucket when static), P padded prompt length, S cache slots
(P + steps), V vocabulary.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..config import CompilationMode, CUDAGraphMode, EffectiveConfig
from ..errors import ModelError, UnsupportedModelError
from .generate import BatchOutput, BatchSpec, CaptureBuffers, PaddedBatch, capture_step, row_matrix, stack_outputs
from .modes import allow_recompiles_for, clone_function, dynamo_snapshot
from .shapes import ShapePlan
from .timing import StepClock


# transformers renamed forward's KV-cache argument `past_key_values` to `cache` (5.2x); 5.17 takes the old
# name and drops an unknown keyword into **kwargs, so passing the wrong one decodes every step without
# its history: another model, silently. The name is read from the model's forward, never assumed.
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its KV cache by; refused with one line if it names none."""
    parameters = inspect.signature(type(model).forward).parameters
    for keyword in CACHE_KEYWORDS:
        if keyword in parameters:
            return keyword
    raise UnsupportedModelError(f"{type(model).__name__}.forward takes no KV cache ({' or '.join(CACHE_KEYWORDS)}); "
                                f"--engine transformers decodes through transformers' cache, so it cannot run this "
                                f"model: upgrade transformers or use evalrun's engine")


def forward_for(model: torch.nn.Module, cache_name: str) -> Callable[..., torch.Tensor]:
    """(model, tokens, positions [B, T] int64, mask [B, K] int64, cache) -> last logits [B, V]; K: the cache's
    key length; cache_name: the forward's keyword for it (cache_keyword). `logits_to_keep=1` where the
    forward has it (else the head runs on every position)."""
    parameters = inspect.signature(type(model).forward).parameters
    keywords = {"use_cache": True, **({"logits_to_keep": 1} if "logits_to_keep" in parameters else {})}

    def hf_forward(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                   cache: Any) -> torch.Tensor:
        output = model(input_ids=tokens, attention_mask=mask, position_ids=positions, **{cache_name: cache},
                       **keywords)
        return output.logits[:, -1]

    return hf_forward


class TransformersEngine(ShapePlan):
    """The transformers engine in one execution mode (the engine seam: engine.engines.Engine)."""

    name = "transformers"

    def __init__(self, model: torch.nn.Module, config: EffectiveConfig):
        self.model = model
        self.compilation_mode, self.cudagraph_mode = config.compilation_mode, config.cudagraph_mode
        self.static = config.is_static
        self.batch_invariant = config.batch_invariant
        self.prefill_buckets, self.batch_buckets = config.prefill_buckets, config.batch_buckets
        self.device = next(model.parameters()).device
        self.inductor_graphs = self.cudagraph_mode.has_full_cudagraphs()
        self.calls_to_warm = 2 if self.inductor_graphs else 1  # graph trees record a path on its second call
        self.fallbacks: list[str] = []
        self.cache_name = cache_keyword(model)  # refused here, before anything runs, if the forward takes none
        self.eager_forward = forward_for(model, self.cache_name)
        self.caches: dict[tuple[int, int], Any] = {}
        self.plan_slots: int | None = None
        self.plan_steps: int | None = None
        self.next_decode: tuple | None = None  # inputs of one more decode step of the last batch
        self.launches: tuple[int, int] | None = None  # per decode step: (all launches, CUDA graph launches)
        if self.compilation_mode.is_compiled():
            torch._dynamo.reset()  # never reuse another config's compiled code
            allow_recompiles_for(self.prefill_buckets, self.batch_buckets)
        options = config.inductor_options()
        self.prefill_forward = self._forward("prefill", options, self.cudagraph_mode is CUDAGraphMode.FULL)
        self.decode_forward = self._forward("decode", options, self.inductor_graphs)
        self.started = self.measuring = dynamo_snapshot()

    # ------------------------------------------------------------ compilation

    def _forward(self, tag: str, options: dict[str, Any], graphs: bool) -> Callable[..., torch.Tensor]:
        if not self.compilation_mode.is_compiled():
            return self.eager_forward
        fullgraph, dynamic = (True, False) if self.compilation_mode is CompilationMode.TRACE_ONCE else (False, None)
        name = f"hf_{tag}_{self.compilation_mode.value.replace('-', '_')}"
        compiled = torch.compile(clone_function(self.eager_forward, name),
                                 fullgraph=fullgraph, dynamic=dynamic,
                                 options=dict(options, **{"triton.cudagraphs": graphs}))
        return self._guarded(compiled)

    def _guarded(self, compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Call `compiled`; if Dynamo or Inductor refuses the code, record a fallback and run eagerly from then on."""
        state = {"function": compiled}

        def call(*args):
            try:
                return state["function"](*args)
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as error:
                if state["function"] is self.eager_forward:
                    raise
                self.fallbacks.append(f"compilation_mode={self.compilation_mode} of transformers' forward failed, "
                                      f"ran eagerly: {str(error).splitlines()[0][:200]}")
                state["function"] = self.eager_forward
                return self.eager_forward(*args)

        return call

    # ------------------------------------------------------------ shapes and caches

    def _cache(self, batch: int, slots: int) -> Any:
        """A fresh DynamicCache (eager), or the run's StaticCache for this batch bucket, reset."""
        from transformers import DynamicCache, StaticCache

        config = self.model.config
        if not self.static:
            return DynamicCache(config=config)
        key = (batch, slots)
        if key not in self.caches:
            cache = StaticCache(config=config, max_cache_len=slots)
            self._initialise(cache, batch)
            self.caches[key] = cache
        self.caches[key].reset()
        return self.caches[key]

    @torch.no_grad()
    def _initialise(self, cache: Any, batch: int) -> None:
        """Allocate a static cache's tensors outside compiled code (so their addresses are static, as CUDA
        graphs need): shapes per layer read from one eager token through a throwaway dynamic cache."""
        from transformers import DynamicCache

        probe = DynamicCache(config=self.model.config)
        token = torch.zeros(batch, 1, dtype=torch.int64, device=self.device)
        self.model(input_ids=token, position_ids=token, use_cache=True, **{self.cache_name: probe})
        keys = [layer.keys for layer in probe.layers]
        values = [layer.values for layer in probe.layers]
        for layer, k, v in zip(cache.layers, keys, values):
            layer.lazy_initialization(k, v)

    # ------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, spec: BatchSpec) -> BatchOutput:
        """One batch: left-padded prompts, prefill, `spec.steps - 1` decode steps, capture at every step."""
        if self.batch_invariant and len(spec.prompts) > 1:
            return stack_outputs([self._generate(spec.row(i)) for i in range(len(spec.prompts))], spec.steps)
        return self._generate(spec)

    def _generate(self, spec: BatchSpec) -> BatchOutput:
        if spec.forced_routing is not None:  # verify forces routing only under evalrun's engine
            raise NotImplementedError("forced routing: transformers' MoE blocks choose their own experts")
        prompts = spec.prompts
        padded_length, batch = self.padded_length(prompts), self.padded_batch(len(prompts))
        rows = prompts + [prompts[-1]] * (batch - len(prompts))  # batch-bucket filler rows repeat the last prompt
        steps = max(self.plan_steps or 0, spec.steps) if self.static else spec.steps
        slots = max(self.plan_slots or 0, padded_length + steps) if self.static else padded_length + steps
        padded = PaddedBatch.build(rows, spec.pad_id, padded_length, slots, self.device)
        mask = padded.key_valid.long()  # [B, S]: padding slots 0, prompt and future slots 1 (causality masks the rest)
        seeds = spec.row_seeds or [0] * len(prompts)
        seeds = torch.tensor((seeds + seeds[-1:] * batch)[:batch], dtype=torch.int64, device=self.device)
        forced = (row_matrix(spec.forced_tokens, batch, steps).to(self.device)
                  if spec.forced_tokens is not None else None)
        cache = self._cache(batch, slots)
        width = (lambda length: slots) if self.static else (lambda length: length)  # noqa: E731 - the mask's key length
        step = torch.zeros(1, dtype=torch.int64, device=self.device)
        clock = StepClock(self.device)
        clock.start()
        self._new_step()
        logits = self.prefill_forward(self.model, padded.tokens, padded.positions, mask[:, :width(padded_length)],
                                      cache)  # [B, V]
        if not self.static and cache.get_seq_length() != padded_length:  # the forward must have filled the cache
            raise ModelError(f"transformers' forward left the KV cache at {cache.get_seq_length()} tokens after a "
                             f"{padded_length}-token prefill: it would decode without history; use evalrun's engine")
        buffers = self._buffers(spec, batch, steps, logits)
        token = capture_step(logits, step, buffers, spec.top_k, spec.temperature, seeds, spec.capture)
        clock.mark()
        for index in range(1, spec.steps):
            fed = forced[:, index - 1] if forced is not None else token  # [B]
            positions = (padded.lengths + index - 1)[:, None]  # [B, 1]
            self._new_step()
            logits = self.decode_forward(self.model, fed[:, None], positions,
                                         mask[:, :width(padded_length + index)], cache)
            step.fill_(index)
            token = capture_step(logits, step, buffers, spec.top_k, spec.temperature, seeds, spec.capture)
            clock.mark()
        if spec.steps > 1:  # the inputs of one more decode step (one cache slot is left): what start_measuring profiles
            self.next_decode = (token[:, None], (padded.lengths + spec.steps - 1)[:, None], mask, cache,
                                padded_length + spec.steps)
        return buffers.to_host(len(prompts), spec.steps, clock.elapsed_ms(), padded_length)

    def _buffers(self, spec: BatchSpec, batch: int, steps: int, logits: torch.Tensor) -> CaptureBuffers:
        """Capture buffers in the dtype transformers returns its logits in (some families upcast them)."""
        buffers = CaptureBuffers.allocate(batch, steps, logits.shape[-1], spec, logits.dtype, self.device)
        if spec.probe_ids is not None:
            buffers.probe_ids.copy_(row_matrix(spec.probe_ids, batch, steps))
        return buffers

    def _new_step(self) -> None:
        """Inductor's CUDA graph trees need to know where a step starts (outputs of the last one may be reused)."""
        if self.inductor_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    # ------------------------------------------------------------ evidence

    def start_measuring(self) -> None:
        """Called after warm-up: compile counts from here describe the measured run. On a GPU one decode step
        runs under the profiler first (the profiler changes state Dynamo guards on: a compile it causes
        belongs to warm-up)."""
        if self.device.type == "cuda" and self.next_decode is not None:
            self.launches = self._count_launches()
        self.measuring = dynamo_snapshot()

    def _count_launches(self) -> tuple[int, int]:
        """(kernel and graph launches, CUDA graph launches) the host issues for one decode step.

        The profiler changes state Dynamo guards on, so its first calls may compile (and graph trees record)
        a variant of their own: those run first, unprofiled, each rewinding the cache to where it was."""
        from torch.profiler import ProfilerActivity, profile

        tokens, positions, mask, cache, length = self.next_decode
        width = mask.shape[1] if self.static else length

        def step() -> None:
            self._new_step()
            self.decode_forward(self.model, tokens, positions, mask[:, :width], cache)
            _rewind(cache, length - 1)
            torch.cuda.synchronize()

        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities):
            for _ in range(self.calls_to_warm + 1):
                step()
        with profile(activities=activities) as profiler:
            step()
        names = [event.name for event in profiler.events()]
        launches = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
        return sum(name in launches for name in names), names.count("cudaGraphLaunch")

    def evidence(self) -> dict[str, Any]:
        now, start, measured = dynamo_snapshot(), self.started, self.measuring
        breaks = {reason.splitlines()[0][:200]: count - start["breaks"].get(reason, 0)
                  for reason, count in now["breaks"].items() if count > start["breaks"].get(reason, 0)}
        evidence = {
            "forward": f"transformers {type(self.model).__name__}.forward "
                       f"({self.model.config._attn_implementation} attention)",
            "kv_cache": "StaticCache" if self.static else "DynamicCache",
            "compilation_mode": self.compilation_mode.value, "cudagraph_mode": self.cudagraph_mode.value,
            "cudagraphs": ("Inductor CUDA graph trees (torch.compile triton.cudagraphs) for "
                           + ("prefill and decode" if self.cudagraph_mode is CUDAGraphMode.FULL else "decode")
                           if self.inductor_graphs else None),
            "dynamo_graphs": now["graphs"] - start["graphs"], "frames_compiled": now["frames"] - start["frames"],
            "graph_breaks": [{"reason": reason, "count": count} for reason, count in breaks.items()],
            "recompiles_after_warmup": now["graphs"] - measured["graphs"],
            "compile_s": now["compile_s"] - start["compile_s"],
            "inductor_cudagraph_skips": now["cudagraph_skips"] - start["cudagraph_skips"],
            "kernel_launches_per_decode_step": self.launches[0] if self.launches else None,
            "cudagraph_launches_per_decode_step": self.launches[1] if self.launches else None,
            "prefill_buckets": self.prefill_buckets if self.static else None,
            "batch_buckets": self.batch_buckets if self.static else None,
        }
        evidence["fallbacks"] = self.fallbacks + self._found_fallbacks(evidence)
        return evidence

    def _found_fallbacks(self, evidence: dict[str, Any]) -> list[str]:
        """Where the evidence shows the requested mode did not (fully) happen."""
        found = []
        compilation = self.compilation_mode
        if compilation.is_compiled() and evidence["dynamo_graphs"] == 0 and not self.fallbacks:
            found.append(f"compilation_mode={compilation} but dynamo compiled no graph: everything ran eagerly")
        for entry in evidence["graph_breaks"]:
            found.append(f"graph break ({entry['count']}x): {entry['reason']}")
        if compilation is CompilationMode.TRACE_ONCE and evidence["recompiles_after_warmup"]:
            found.append(f"trace-once recompiled {evidence['recompiles_after_warmup']}x after warm-up")
        if self.inductor_graphs and evidence["cudagraph_launches_per_decode_step"] == 0:
            found.append(f"cudagraph_mode={self.cudagraph_mode} but a decode step launched no CUDA graph")
        if self.inductor_graphs and evidence["inductor_cudagraph_skips"]:
            found.append(f"Inductor skipped CUDA graphs {evidence['inductor_cudagraph_skips']}x "
                         "(those calls ran without graphs)")
        return found


def _rewind(cache: Any, length: int) -> None:
    """Put a cache back to holding `length` tokens (a static cache's counters in place: their addresses stay)."""
    from transformers import StaticCache

    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            layer.cumulative_length.fill_(length)
    elif int(cache.get_seq_length()) > length:
        cache.crop(length - int(cache.get_seq_length()))  # a negative count: tokens to remove
