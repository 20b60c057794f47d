"""A run, end to end: effective config -> model -> prompts -> batches on the engine -> one `Run` value.

`prepare` resolves everything a run needs without generating (what `evalrun fingerprint` shows);
`execute` generates and captures; `record` wraps an execution in the store's running -> complete
(or failed) lifecycle. `run`, `golden create`, `golden verify`, bench and bisect all go through these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import distributed
from .compile_cache import cache_counters, cache_evidence, use_evalrun_cache
from .config import (EffectiveConfig, RunConfig, inert_inductor_knobs, is_server_engine, keep_logits_problem,
                     keep_logits_steps, resolve, validate)
from .engine.engines import Engine, build_engine, check_model, submit
from .engine.capture_triton import capture_kernel
from .engine.generate import BatchOutput, BatchSpec, PendingBatch, prompt_slots
from .engine.timing import latency_summary, peak_memory_bytes, reset_peak_memory
from .errors import ConfigError, FallbackError
from .fingerprint import apply_numerics_flags, baseline_backend_flags, environment, environment_hash
from .hashing import hash_bytes, hash_value
from .models import LoadedModel, load_model, model_identity
from .prompts import PromptSet, load_prompt_set
from .routing import PROMPT_ARRAY, RoutingPath
from .store import PromptResult, Store, check_store_path

Progress = Callable[[int], None]
# True: once the device has finished a batch, the runner enqueues the next one, then makes the finished one's results
# (copy out, step clock readout, text, hashes) while the device computes (stop 23). The next batch still starts on an
# idle device, so its TTFT means what it meant. False: each batch's results before the next is enqueued (before stop
# 23), for benchmarks/outside_steps.py beside
OVERLAP_BATCHES = True


@dataclass
class Probes:
    """Ids whose exact logits a run records each step: per prompt index [N, K'] (along that prompt's
    steps), and/or the first `own_topk` columns filled by each step's own top-k (an oracle's choice)."""

    ids: dict[int, np.ndarray]
    own_topk: int = 0


@dataclass
class Prepared:
    """Everything resolved before generation: the header stored with a run."""

    config: EffectiveConfig
    applied_flags: dict[str, Any]
    loaded: LoadedModel
    prompt_set: PromptSet
    header: dict[str, Any]
    load_seconds: float
    mode: Engine | None = None  # built on first use, then reused (forced runs reuse compiled code)

    def execution_mode(self) -> Engine:
        """The config's engine in its execution mode (engine.engines.build_engine: the one place engines plug in)."""
        if self.mode is None:
            shard = None
            if self.config.tensor_parallel > 1:
                here = distributed.world()
                shard = (here.rank, here.size, distributed.model_group())
            self.mode = build_engine(self.loaded.model, self.config, shard, self.loaded.gguf_path)
        return self.mode


@dataclass
class Run:
    """One run: the header (config, environment, model, prompt set), per-prompt results, timings,
    evidence that the config took effect, and the batch plan. `run_id` is set once stored."""

    header: dict[str, Any]
    results: list[PromptResult]
    timings: dict[str, Any]
    evidence: dict[str, Any]
    plan: list[dict[str, Any]] = field(default_factory=list)
    run_id: str | None = None

    @property
    def tokens_digest(self) -> str:
        return hash_bytes(*[r.tokens_digest.encode() for r in self.results])

    @property
    def logits_digest(self) -> str:
        return hash_bytes(*[r.logits_digest.encode() for r in self.results])

    def by_index(self) -> dict[int, PromptResult]:
        return {r.prompt_index: r for r in self.results}


def effective_config(config: RunConfig) -> EffectiveConfig:
    """Resolve for this machine (`config.resolve` validates the result against it)."""
    effective = resolve(config, torch.cuda.is_available())
    if effective.on_gpu:
        validate(effective, True, torch.cuda.device_count())
    return effective


def build_header(config: EffectiveConfig, applied: dict[str, Any], loaded: LoadedModel,
                 prompt_set: PromptSet) -> dict[str, Any]:
    env = environment(config.device)
    return {"config": config.as_dict(), "config_hash": config.compute_hash(), "environment": env,
            "environment_hash": environment_hash(env), "model": model_identity(loaded),
            "prompt_set": prompt_set.as_dict(), "applied_flags": applied}


def shares_model(config: EffectiveConfig, other: Prepared) -> bool:
    """Whether `other`'s loaded model and prompt set serve `config` too (what `prepare(reuse=...)` shares)."""
    keys = ("model", "device", "dtype", "attn_implementation", "prompts", "engine", "tensor_parallel")  # TP: weights split
    return all(getattr(config, k) == getattr(other.config, k) for k in keys)


def prepare(config: RunConfig | EffectiveConfig, reuse: Prepared | None = None) -> Prepared:
    """Resolve the effective config, apply numerics flags, load the model and the prompts.

    `reuse` shares an already loaded model and prompt set when model, device, dtype and prompts are
    the same (several configs in one process).
    """
    use_evalrun_cache()  # before anything reads Inductor's cache folder (the first read fixes it for the process)
    effective = config if isinstance(config, EffectiveConfig) else effective_config(config)
    if is_server_engine(effective.engine):  # a server computes those runs: server_run, not this engine
        raise ConfigError(f"engine={effective.engine[:80]!r} is a server, which `evalrun run` and `golden create` or "
                          "`verify` reach, not this command; give it --engine evalrun or transformers")
    baseline_backend_flags()  # read the environment's own flags before the config changes any
    applied = apply_numerics_flags(effective)  # before anything initialises CUDA
    distributed.join(effective.device)  # under torchrun: the process group, this rank's GPU
    started = time.perf_counter()
    if reuse is not None and shares_model(effective, reuse):
        loaded, prompt_set = reuse.loaded, reuse.prompt_set
    else:
        loaded = load_model(effective.model, effective.device, effective.dtype, effective.attn_implementation,
                            engine=effective.engine)
        check_model(effective.engine, loaded.model)  # before any prompt is read or token computed
        prompt_set = load_prompt_set(effective.prompts, loaded.tokenizer, context_limit=loaded.context_limit,
                                     new_tokens=effective.max_new_tokens)
    load_seconds = time.perf_counter() - started
    vocab = loaded.vocab_size
    if effective.top_k > vocab:
        raise ConfigError(f"top_k={effective.top_k} is larger than the model's vocabulary ({vocab}); use a smaller top_k")
    kept = keep_logits_problem(effective.keep_logits, {record.id: steps_for(prompt_set, index, effective)
                                                       for index, record in enumerate(prompt_set.records)},
                               prompt_set.name)
    if kept:
        raise ConfigError(kept)
    inert = inert_inductor_knobs(effective)
    if effective.strict_config and inert:  # a fallback known before anything runs
        raise FallbackError(f"the requested mode falls back ({'; '.join(inert)}); drop --strict-config or fix the cause")
    return Prepared(effective, applied, loaded, prompt_set, build_header(effective, applied, loaded, prompt_set),
                    load_seconds)


def plan_batches(prompt_set: PromptSet, config: EffectiveConfig) -> list[list[int]]:
    """Prompt indices per batch: file order, `batch_size` at a time (batch composition is recorded)."""
    size, count = config.batch_size, len(prompt_set.records)
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


@dataclass(frozen=True)
class Placement:
    """A batch plan chosen by the caller (`evalrun invariance`): prompt indices per batch in row order,
    and per batch the one row whose result the run records (its companions only share the batch)."""

    batches: list[list[int]]
    recorded_rows: list[int]


def row_seed(prompt_id: str, seed: int) -> int:
    return int(hash_value([prompt_id, seed])[:15], 16)


def steps_for(prompt_set: PromptSet, index: int, config: EffectiveConfig) -> int:
    """A prompt's own max_new_tokens wins over the config's."""
    return prompt_set.records[index].max_new_tokens or config.max_new_tokens


def _pad_id(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def batch_spec(prepared: Prepared, indices: list[int], forced: dict[int, np.ndarray] | None = None,
               probes: Probes | None = None, routing: dict[int, RoutingPath] | None = None) -> BatchSpec:
    """The engine's description of one batch of the run."""
    config, prompt_set = prepared.config, prepared.prompt_set
    row_steps = [steps_for(prompt_set, index, config) for index in indices]
    steps = max(row_steps)
    return BatchSpec(
        [prompt_set.token_ids[index] for index in indices], steps, _pad_id(prepared.loaded), config.top_k,
        config.temperature, [row_seed(prompt_set.records[i].id, config.seed) for i in indices],
        any(keep_logits_steps(config.keep_logits, prompt_set.records[i].id, steps) for i in indices),
        [forced[i] for i in indices] if forced else None,
        [routing[i].steps for i in indices] if routing else None,
        [routing[i].prompt for i in indices] if routing else None,
        [probes.ids[i] for i in indices] if probes else None, probes.own_topk if probes else 0,
        row_steps=row_steps if len(set(row_steps)) > 1 else None)


def to_results(prepared: Prepared, batch_index: int, indices: list[int], output: BatchOutput) -> list[PromptResult]:
    """Split a batch's arrays into per-prompt results, each cut to its own step count."""
    tokenizer, eos = prepared.loaded.tokenizer, prepared.loaded.tokenizer.eos_token_id
    results = []
    for row, index in enumerate(indices):
        steps = steps_for(prepared.prompt_set, index, prepared.config)
        arrays = {"input_ids": np.asarray(prepared.prompt_set.token_ids[index], dtype=np.int64),
                  "tokens": output.tokens[row, :steps], "digests": output.digests[row, :steps],
                  "topk_ids": output.topk_ids[row, :steps], "topk_values": output.topk_values[row, :steps],
                  "margins": output.margins[row, :steps]}
        kept = keep_logits_steps(prepared.config.keep_logits, prepared.prompt_set.records[index].id, steps)
        if output.logits is not None and kept:
            arrays["logits"] = output.logits[row, kept]  # raw bits of the model dtype [n_kept, V]
            arrays["logits_steps"] = np.asarray(kept, dtype=np.int64)
        if output.probe_values is not None:
            arrays["probe_ids"] = output.probe_ids[row, :steps]
            arrays["probe_values"] = output.probe_values[row, :steps]
            if output.probe_logsumexp is not None:  # log-probabilities at the probes: probe_values - this
                arrays["probe_logsumexp"] = output.probe_logsumexp[row, :steps]
        if output.routing_experts is not None:  # MoE models: [steps, L, k] experts (int16), [steps, L] margins
            arrays["routing_experts"] = output.routing_experts[row, :steps].astype(np.int16)
            arrays["routing_margins"] = output.routing_margins[row, :steps]
        if output.prompt_routing is not None:  # [P - 1, L, k]: the prompt's tokens before its last
            slots = prompt_slots(output.padded_length, len(prepared.prompt_set.token_ids[index]))
            arrays[PROMPT_ARRAY] = output.prompt_routing[row, slots]
        tokens = arrays["tokens"]
        eos_hits = np.flatnonzero(tokens == eos) if eos is not None else np.array([])
        eos_step = int(eos_hits[0]) if eos_hits.size else -1
        text = tokenizer.decode(tokens[: eos_step if eos_step >= 0 else steps].tolist(), skip_special_tokens=False)
        record = prepared.prompt_set.records[index]
        results.append(PromptResult(
            index, record.id, record.as_dict(), batch_index, row, len(prepared.prompt_set.token_ids[index]), steps,
            eos_step, text, hash_bytes(tokens.astype("<i8").tobytes()),
            hash_bytes(arrays["digests"].astype("<i8").tobytes()), arrays))
    return results


def _timings(prepared: Prepared, outputs: list[BatchOutput], warmup_seconds: float, compile_seconds: float,
             generate_seconds: float, device: torch.device, cold_ttft_ms: float | None,
             generated: int) -> dict[str, Any]:
    """Load, compile (Dynamo + Inductor, wherever it happened), warm-up, TTFT, step latency, throughput, memory.

    `ttft_ms.first_request` is the time to first token of the process's first batch, the warm-up's
    when one ran: the latency a user sees when serving starts cold (warmup = 0), compile and graph
    capture included. `ttft_ms.p50` and `mean` are over the measured batches, after warm-up."""
    ttft = np.array([output.step_ms[0] for output in outputs])
    cold_ttft_ms = float(ttft[0]) if cold_ttft_ms is None else cold_ttft_ms
    decode = np.concatenate([output.step_ms[1:] for output in outputs])
    clocked = sum(float(output.step_ms.sum()) for output in outputs) / 1000  # prefills and decode steps, clocked
    return {
        "load_s": prepared.load_seconds, "compile_s": compile_seconds, "warmup_s": warmup_seconds,
        "ttft_ms": {"mean": float(ttft.mean()), "p50": float(np.median(ttft)), "first_request": cold_ttft_ms},
        "step_latency": latency_summary(decode), "generate_s": generate_seconds,
        # generate_s the step clock did not see: each batch's setup, its copy to the host, its results (tokens/s
        # counts it; the step latencies do not)
        "outside_steps_s": max(0.0, generate_seconds - clocked),
        "tokens_per_s": generated / generate_seconds if generate_seconds > 0 else 0.0,
        "tokens_generated": int(generated), "peak_memory": peak_memory_bytes(device),
    }


def warmup_batches(batches: list[list[int]], prepared: Prepared, mode: Engine) -> list[list[int]]:
    """One batch per distinct shape (batch bucket, prefill bucket): warm-up compiles and captures each
    shape the run will use, so a trace-once run never compiles while it is measured."""
    chosen: dict[tuple[int, int], list[int]] = {}
    if mode.batch_invariant:  # rows run as batches of one: those are the shapes to warm
        batches = [[index] for indices in batches for index in indices]
    for indices in batches:
        prompts = [prepared.prompt_set.token_ids[i] for i in indices]
        chosen.setdefault((mode.padded_batch(len(indices)), mode.padded_length(prompts)), indices)
    return list(chosen.values()) if mode.static else batches[:1]


def execute(prepared: Prepared, forced: dict[int, np.ndarray] | None = None, probes: Probes | None = None,
            progress: Progress | None = None, only: set[int] | None = None, timed: bool = True,
            placement: Placement | None = None, routing: dict[int, RoutingPath] | None = None) -> Run:
    """Warm up, then run every batch of the plan (or only those holding a prompt index in `only`).

    `forced` feeds given tokens per prompt index instead of the model's own choices (forced
    decoding); `routing` (MoE models, with `forced`) applies given experts per prompt index (a RoutingPath: at
    the decode steps and the prompt's tokens) instead of the model's own choices (forced routing; evalrun's engine
    only); `probes` records the logits at given ids. Batch composition is always the plan's, so a partial re-run
    computes the same bits as the full one would. `timed=False` skips the warm-up of eager modes (runs made for
    their numbers, not their timings); static modes always warm up, since that is where they compile and capture.
    `placement` replaces the plan: each batch then records one row's result (a prompt placed among companions).
    """
    config = prepared.config
    device = torch.device(config.device)
    plan = placement.batches if placement else plan_batches(prepared.prompt_set, config)
    kept = placement.recorded_rows if placement else [None] * len(plan)
    chosen = [number for number, b in enumerate(plan) if only is None or set(b) & only]
    batches = [plan[number] for number in chosen]
    cache_folders, cache_before = use_evalrun_cache(), cache_counters()  # before anything compiles
    mode = prepared.execution_mode()
    prompt_set = prepared.prompt_set
    mode.plan(max(len(ids) for ids in prompt_set.token_ids),
              max(steps_for(prompt_set, i, config) for i in range(len(prompt_set.records))))
    apply_numerics_flags(config)  # another config's prepare may have changed the process's flags since
    started, cold_ttft_ms = time.perf_counter(), None
    for _ in range(config.warmup if timed or mode.static else 0):  # discarded: compile, capture, autotune and allocator warm-up
        for indices in warmup_batches(batches, prepared, mode):
            for _ in range(mode.calls_to_warm):
                output = mode.generate(batch_spec(prepared, indices, forced, probes, routing))
                cold_ttft_ms = float(output.step_ms[0]) if cold_ttft_ms is None else cold_ttft_ms
    warmup_seconds = time.perf_counter() - started
    reset_peak_memory(device)
    mode.start_measuring()
    results, outputs, generated = [], [], []

    def collect(number: int, indices: list[int], pending: PendingBatch) -> None:
        output = pending.result()
        outputs.append(output)
        batch_results = to_results(prepared, number, indices, output)
        # the tokens to_results keeps, each row cut to its prompt's own steps: a batch's steps past a row's own are
        # padding, computed for static shapes and never returned, so tokens/s does not count them
        generated.append(sum(len(result.arrays["tokens"]) for result in batch_results))
        results.extend(batch_results if kept[number] is None else [batch_results[kept[number]]])
        if progress:
            progress(len(indices) if kept[number] is None else 1)

    started = time.perf_counter()
    waiting = None  # the batch enqueued last: its results are made once the next one is enqueued
    for number, indices in zip(chosen, batches):
        spec = batch_spec(prepared, indices, forced, probes, routing)
        if waiting:  # the next batch starts on an idle device, as it would alone: its TTFT means what it did
            waiting[2].wait()
        pending = submit(mode, spec)
        if waiting:
            collect(*waiting)
        waiting = (number, indices, pending)
        if not OVERLAP_BATCHES:
            collect(*waiting)
            waiting = None
    if waiting:
        collect(*waiting)
    generate_seconds = time.perf_counter() - started
    evidence = {"engine": config.engine, **mode.evidence()}
    evidence["config_adjustments"] = list(config.adjustments)
    # this rank's share of a tensor-parallel model (evalrun's engine; other engines have no split)
    evidence["tensor_parallel"] = getattr(getattr(mode, "transformer", None), "tensor_parallel", None)
    evidence["compile_cache"] = cache_evidence(cache_before, cache_folders)
    evidence["capture_kernel"] = capture_kernel(device, getattr(torch, config.dtype), config.top_k)
    timings = _timings(prepared, outputs, warmup_seconds, evidence["compile_s"], generate_seconds, device, cold_ttft_ms,
                       sum(generated))
    batch_plan = [{"batch": number, "prompt_ids": [prompt_set.records[j].id for j in indices],
                   "padded_length": int(output.padded_length)}
                  | ({"recorded_row": kept[number]} if kept[number] is not None else {})
                  for number, indices, output in zip(chosen, batches, outputs)]
    evidence["fallbacks"] = evidence["fallbacks"] + inert_inductor_knobs(config)
    run = Run(prepared.header, results, timings, evidence, batch_plan)
    if config.strict_config and evidence["fallbacks"]:
        raise FallbackError("the requested mode fell back (" + "; ".join(evidence["fallbacks"])
                            + "); drop --strict-config or fix the cause")
    return run


def open_when_good(store: Store | Callable[[], Store] | None) -> Store | None:
    """A store, or the function that opens it: a command opens its store only once its input is known to be good,
    so a typo in a model or prompt file leaves no new store file behind."""
    return store() if callable(store) else store


def record(store: Store | None, header: dict[str, Any], produce: Callable[[], Run], label: str | None = None) -> Run:
    """Store a run's lifecycle: `running` before `produce()` starts, `complete` with its results, or
    `failed` with the error; without a store, just produce."""
    if store is None:
        return produce()
    run_id = store.begin_run(header, label)
    try:
        run = produce()
        store.finish_run(run_id, run.results, {"timings": run.timings, "evidence": run.evidence,
                                               "batches": run.plan}, run.tokens_digest, run.logits_digest)
    except KeyboardInterrupt as error:  # Ctrl-C, or a torchrun rank gone (distributed.RankInterrupted)
        store.fail_run(run_id, f"interrupted: {str(error)[:500]}", status="interrupted")
        raise
    except BaseException as error:
        store.fail_run(run_id, f"{type(error).__name__}: {str(error)[:500]}")
        raise
    run.run_id = run_id
    return run


def execute_run(config: RunConfig | EffectiveConfig, store: Store | None, label: str | None = None,
                progress_factory: Callable[[int], Any] | None = None, prepared: Prepared | None = None) -> Run:
    """`evalrun run`: prepare, build the engine, execute with a progress bar, record in the store. The engine is
    built before the run is stored, so one that refuses its config (exit 2) stores nothing."""
    prepared = prepared or prepare(config)
    prepared.execution_mode()

    def produce() -> Run:
        bar = progress_factory(len(prepared.prompt_set.records)) if progress_factory else None
        with (bar if bar is not None else NullBar()) as active:
            return execute(prepared, progress=active.update)

    return record(store, prepared.header, produce, label)


class KeptCandidate:
    """The `observe` hook of a verification that stores its candidate run as `evalrun run` would (`label`),
    so `evalrun diff` and `store show` read it (`golden verify --store`, the pytest plugin). The store is
    checked at once, so one that cannot be used is refused before any model runs, and created with the run."""

    def __init__(self, path: Path | str, label: str):
        self.path, self.label, self.run_id = Path(path).resolve(), label, None
        check_store_path(self.path)

    def observe(self, phase: str, run: Run) -> None:
        if phase != "candidate" or self.run_id is not None:
            return
        store = Store(self.path)
        try:
            self.run_id = record(store, run.header, lambda: run, label=self.label).run_id
        finally:
            store.close()


class NullBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, count: int) -> None:
        pass
