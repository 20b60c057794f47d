"""A run, end to end: effective config -> model -> prompts -> batches on the engine -> store.

`prepare` resolves everything a run needs without generating (what `evalrun fingerprint` shows);
`execute_run` generates, captures and stores. Both are library calls; the CLI only wraps them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .config import RunConfig, keep_logits_steps, resolve
from .engine.generate import BatchOutput, generate_batch
from .engine.modes import ExecutionMode, build_execution_mode
from .engine.timing import latency_summary, peak_memory_bytes, reset_peak_memory
from .engine.transformer import Transformer
from .errors import ConfigError, DeviceError
from .fingerprint import apply_numerics_flags, baseline_backend_flags, environment, environment_hash
from .hashing import hash_bytes, hash_value
from .models import LoadedModel, load_model, model_identity
from .prompts import PromptSet, load_prompt_set
from .store import PromptResult, Store

Progress = Callable[[int], None]


@dataclass
class Forcing:
    """Forced decoding: per prompt index, the tokens to feed [N] and the ids to probe each step [N, K]."""

    tokens: dict[int, np.ndarray]
    probe_ids: dict[int, np.ndarray] | None = None


@dataclass
class Prepared:
    """Everything resolved before generation: the header stored with a run."""

    effective: dict[str, Any]
    applied_flags: dict[str, Any]
    loaded: LoadedModel
    prompt_set: PromptSet
    header: dict[str, Any]
    load_seconds: float
    mode: ExecutionMode | None = None  # built on first use, then reused (forced runs reuse compiled code)

    def execution_mode(self) -> ExecutionMode:
        if self.mode is None:
            transformer = Transformer(self.loaded.model, self.effective["attn_implementation"])
            self.mode = build_execution_mode(transformer, self.effective)
        return self.mode


@dataclass
class RunOutcome:
    run_id: str | None
    header: dict[str, Any]
    results: list[PromptResult]
    timings: dict[str, Any]
    evidence: dict[str, Any]
    batches: list[dict[str, Any]] = field(default_factory=list)
    tokens_digest: str = ""
    logits_digest: str = ""


def check_device(effective: dict[str, Any]) -> None:
    device = effective["device"]
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device} was asked for but this machine has no CUDA GPU; use --device cpu")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) here; use cuda:0")
    elif effective["cudagraph_mode"] != "none":
        raise ConfigError(f"cudagraph_mode={effective['cudagraph_mode']} needs a GPU; on CPU use --cudagraph-mode none")
    if effective["dtype"] == "float16" and not device.startswith("cuda"):
        raise ConfigError("dtype float16 is not supported on CPU here; use float32 or bfloat16")


def effective_config(config: RunConfig) -> dict[str, Any]:
    effective = resolve(config, torch.cuda.is_available())
    check_device(effective)
    return effective


def build_header(effective: dict[str, Any], applied: dict[str, Any], loaded: LoadedModel,
                 prompt_set: PromptSet) -> dict[str, Any]:
    env = environment(effective["device"])
    return {
        "config": effective, "config_hash": hash_value(effective),
        "environment": env, "environment_hash": environment_hash(env),
        "model": model_identity(loaded), "prompt_set": prompt_set.as_dict(), "applied_flags": applied,
    }


def _same_model(effective: dict[str, Any], dtype: str, other: Prepared) -> bool:
    keys = ("model", "device", "attn_implementation", "prompts")
    return all(effective[k] == other.effective[k] for k in keys) and getattr(torch, dtype) == other.loaded.model.dtype


def prepare(config: RunConfig, dtype_override: str | None = None, reuse: Prepared | None = None) -> Prepared:
    """Resolve the effective config, apply numerics flags, load the model and the prompts.

    `dtype_override` loads the model in another dtype (the oracle's float64) without touching the
    effective config that fingerprints hash. `reuse` shares an already loaded model and prompt set
    when model, device, dtype and prompts are the same (several configs in one process).
    """
    effective = effective_config(config)
    baseline_backend_flags()  # read the environment's own flags before the config changes any
    applied = apply_numerics_flags(effective)  # before anything initialises CUDA
    dtype = dtype_override or effective["dtype"]
    started = time.perf_counter()
    if reuse is not None and _same_model(effective, dtype, reuse):
        loaded, prompt_set = reuse.loaded, reuse.prompt_set
    else:
        loaded = load_model(effective["model"], effective["device"], dtype, effective["attn_implementation"])
        prompt_set = load_prompt_set(effective["prompts"], loaded.tokenizer)
    load_seconds = time.perf_counter() - started
    return Prepared(effective, applied, loaded, prompt_set, build_header(effective, applied, loaded, prompt_set),
                    load_seconds)


def plan_batches(prompt_set: PromptSet, effective: dict[str, Any]) -> list[list[int]]:
    """Prompt indices per batch: file order, `batch_size` at a time (batch composition is recorded)."""
    size, count = effective["batch_size"], len(prompt_set.records)
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def row_seed(prompt_id: str, seed: int) -> int:
    return int(hash_value([prompt_id, seed])[:15], 16)


def steps_for(prompt_set: PromptSet, index: int, effective: dict[str, Any]) -> int:
    """A prompt's own max_new_tokens wins over the config's."""
    return prompt_set.records[index].max_new_tokens or effective["max_new_tokens"]


def _pad_id(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def run_batch(prepared: Prepared, mode: ExecutionMode, indices: list[int], forced: Forcing | None = None) -> BatchOutput:
    """Generate one batch under the execution mode (forced along given tokens, probed, when `forced`)."""
    effective, prompt_set = prepared.effective, prepared.prompt_set
    steps = max(steps_for(prompt_set, index, effective) for index in indices)
    prompts = [prompt_set.token_ids[index] for index in indices]
    return generate_batch(
        mode.transformer, prompts, steps, pad_id=_pad_id(prepared.loaded), top_k=effective["top_k"],
        temperature=effective["temperature"],
        row_seeds=[row_seed(prompt_set.records[i].id, effective["seed"]) for i in indices],
        keep_logits=any(keep_logits_steps(effective["keep_logits"], prompt_set.records[i].id, steps) for i in indices),
        forced_tokens=[forced.tokens[i] for i in indices] if forced else None,
        probe_ids=[forced.probe_ids[i] for i in indices] if forced and forced.probe_ids else None, mode=mode)


def to_results(prepared: Prepared, batch_index: int, indices: list[int], output: BatchOutput) -> list[PromptResult]:
    """Split a batch's arrays into per-prompt results, each cut to its own step count."""
    tokenizer, eos = prepared.loaded.tokenizer, prepared.loaded.tokenizer.eos_token_id
    results = []
    for row, index in enumerate(indices):
        steps = steps_for(prepared.prompt_set, index, prepared.effective)
        arrays = {"input_ids": np.asarray(prepared.prompt_set.token_ids[index], dtype=np.int64),
                  "tokens": output.tokens[row, :steps], "digests": output.digests[row, :steps],
                  "topk_ids": output.topk_ids[row, :steps], "topk_values": output.topk_values[row, :steps],
                  "margins": output.margins[row, :steps]}
        kept = keep_logits_steps(prepared.effective["keep_logits"], prepared.prompt_set.records[index].id, steps)
        if output.logits is not None and kept:
            arrays["logits"] = output.logits[row, kept]  # raw bits of the model dtype [n_kept, V]
            arrays["logits_steps"] = np.asarray(kept, dtype=np.int64)
        if output.probe_values is not None:
            arrays["probe_values"] = output.probe_values[row, :steps]
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


def run_digests(results: list[PromptResult]) -> tuple[str, str]:
    return (hash_bytes(*[r.tokens_digest.encode() for r in results]),
            hash_bytes(*[r.logits_digest.encode() for r in results]))


def _timings(prepared: Prepared, outputs: list[BatchOutput], warmup_seconds: float, compile_seconds: float,
             generate_seconds: float, device: torch.device, cold_ttft_ms: float | None) -> dict[str, Any]:
    """Load, compile (Dynamo + Inductor, wherever it happened), warm-up, TTFT, step latency, throughput, memory.

    `ttft_ms.first_request` is the time to first token of the process's first batch, the warm-up's
    when one ran: the latency a user sees when serving starts cold (warmup = 0), compile and graph
    capture included. `ttft_ms.p50` and `mean` are over the measured batches, after warm-up."""
    ttft = np.array([output.step_ms[0] for output in outputs])
    cold_ttft_ms = float(ttft[0]) if cold_ttft_ms is None else cold_ttft_ms
    decode = np.concatenate([output.step_ms[1:] for output in outputs])
    generated = sum(output.tokens.size for output in outputs)
    return {
        "load_s": prepared.load_seconds, "compile_s": compile_seconds, "warmup_s": warmup_seconds,
        "ttft_ms": {"mean": float(ttft.mean()), "p50": float(np.median(ttft)), "first_request": cold_ttft_ms},
        "step_latency": latency_summary(decode), "generate_s": generate_seconds,
        "tokens_per_s": generated / generate_seconds if generate_seconds > 0 else 0.0,
        "tokens_generated": int(generated), "peak_memory": peak_memory_bytes(device),
    }


def warmup_batches(batches: list[list[int]], prepared: Prepared, mode: ExecutionMode) -> list[list[int]]:
    """One batch per distinct shape (batch bucket, prefill bucket): warm-up compiles and captures each
    shape the run will use, so a trace-once run never compiles while it is measured."""
    chosen: dict[tuple[int, int], list[int]] = {}
    for indices in batches:
        prompts = [prepared.prompt_set.token_ids[i] for i in indices]
        chosen.setdefault((mode.padded_batch(len(indices)), mode.padded_length(prompts)), indices)
    return list(chosen.values()) if mode.static else batches[:1]


def generate_all(prepared: Prepared, progress: Progress | None = None,
                 forced: Forcing | None = None) -> tuple[list[PromptResult], dict[str, Any], dict, list]:
    """Warm up, then run every batch; returns results, timings, evidence and the batch plan.

    `forced` feeds given tokens instead of the model's own choices (forced decoding) and records
    the logits at given ids (probing).
    """
    effective = prepared.effective
    device = torch.device(effective["device"])
    batches = plan_batches(prepared.prompt_set, effective)
    mode = prepared.execution_mode()
    prompt_set = prepared.prompt_set
    mode.plan(max(len(ids) for ids in prompt_set.token_ids),
              max(steps_for(prompt_set, i, effective) for i in range(len(prompt_set.records))))
    started, cold_ttft_ms = time.perf_counter(), None
    for _ in range(effective["warmup"]):  # discarded: compile, capture, autotune and allocator warm-up
        for indices in warmup_batches(batches, prepared, mode):
            for _ in range(mode.calls_to_warm):
                output = run_batch(prepared, mode, indices, forced)
                cold_ttft_ms = float(output.step_ms[0]) if cold_ttft_ms is None else cold_ttft_ms
    warmup_seconds = time.perf_counter() - started
    reset_peak_memory(device)
    mode.start_measuring()
    results, outputs = [], []
    started = time.perf_counter()
    for batch_index, indices in enumerate(batches):
        output = run_batch(prepared, mode, indices, forced)
        outputs.append(output)
        results += to_results(prepared, batch_index, indices, output)
        if progress:
            progress(len(indices))
    generate_seconds = time.perf_counter() - started
    evidence = mode.evidence()
    timings = _timings(prepared, outputs, warmup_seconds, evidence["compile_s"], generate_seconds, device, cold_ttft_ms)
    plan = [{"batch": i, "prompt_ids": [prepared.prompt_set.records[j].id for j in indices],
             "padded_length": int(outputs[i].padded_length)} for i, indices in enumerate(batches)]
    return results, timings, evidence, plan


def execute_run(config: RunConfig, store: Store | None, label: str | None = None,
                progress_factory: Callable[[int], Any] | None = None, prepared: Prepared | None = None) -> RunOutcome:
    """Do a run and (when `store` is given) record it: running -> complete, or failed on error."""
    prepared = prepared or prepare(config)
    run_id = store.begin_run(prepared.header, label) if store else None
    try:
        bar = progress_factory(len(prepared.prompt_set.records)) if progress_factory else None
        with (bar if bar is not None else _NullBar()) as active:
            results, timings, evidence, plan = generate_all(prepared, active.update)
        tokens_digest, logits_digest = run_digests(results)
        if store:
            store.finish_run(run_id, results, {"timings": timings, "evidence": evidence, "batches": plan},
                             tokens_digest, logits_digest)
    except BaseException as error:
        if store:
            store.fail_run(run_id, f"{type(error).__name__}: {error}")
        raise
    return RunOutcome(run_id, prepared.header, results, timings, evidence, plan, tokens_digest, logits_digest)


class _NullBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, count: int) -> None:
        pass
