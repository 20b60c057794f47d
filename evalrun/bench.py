"""`evalrun bench`: a matrix of configurations, each in a fresh process, measured side by side.

Each configuration is one `evalrun run --json` subprocess (so no config reuses another's compiled
artefacts); transformers' own `generate` (eager, and static cache + torch.compile) runs on the same
model and prompts through `evalrun.hf_baseline`, also in fresh processes. One table comes out:
compile time, peak memory, time to first token, tokens/s with p50/p95/p99 step latency, and whether
the run's logits are bit-identical to the first (the -O0) run. With `--repeats N` the whole matrix runs N times in
rounds (every row once a round, in order, so a machine's drift reaches each row alike), each row's figures are the
medians of its N runs, beside its tokens/s of each run and their spread; identical to first means every run was.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .child import run_json_child
from .config import RunConfig, normalize, parse_engine, parse_set_option
from .errors import ConfigError


GPU_MATRIX = [("-O0", ["-O0"]), ("-O1", ["-O1"]), ("-O2", ["-O2"]), ("-O3", ["-O3"])]
CPU_MATRIX = [("-O0", ["-O0"]), ("stock", ["--compilation-mode", "stock"]),
              ("trace-once", ["--compilation-mode", "trace-once"]), ("piecewise", ["--compilation-mode", "piecewise"])]
BASELINES = ("eager", "static-compile")
TIMEOUT_HINT = " (raise --config-timeout)"


@dataclass(frozen=True)
class BenchRequest:
    """The options of `evalrun bench`: the common run options, the matrix (names, each optionally @ENGINE),
    baselines, the per-config limit."""

    model: str | None = None
    prompts: str | None = None
    dtype: str | None = None
    device: str | None = None
    max_new_tokens: int | None = None
    batch_size: int | None = None
    matrix_names: str | None = None
    baselines: tuple[str, ...] = BASELINES  # transformers' generate kinds to run beside (none: ())
    timeout: float = 3600
    repeats: int = 1  # rounds of the whole matrix; figures are each row's medians

    def common_options(self, baseline: bool = False) -> list[str]:
        """Options for every evalrun configuration (`baseline`: for transformers' baselines, batch 1)."""
        options = []
        pairs = [("--model", self.model), ("--prompts", self.prompts), ("--dtype", self.dtype),
                 ("--device", self.device), ("--max-new-tokens", self.max_new_tokens)]
        for flag, value in pairs + ([] if baseline else [("--batch-size", self.batch_size)]):
            if value is not None:
                options += [flag, str(value)]
        return options

    def on_gpu(self) -> bool:
        import torch

        return (self.device or "auto") != "cpu" and torch.cuda.is_available()

    def matrix(self, on_gpu: bool) -> list[tuple[str, list[str]]]:
        """The configurations to measure: the named ones, else (no --matrix) the device's default matrix."""
        if self.matrix_names is None:
            return GPU_MATRIX if on_gpu else CPU_MATRIX
        if not self.matrix_names.replace(",", "").strip():
            raise ConfigError(f"--matrix {self.matrix_names!r} names no configuration; name some, e.g. --matrix O0,O2, "
                              "or leave --matrix out for the device's default matrix")
        known = {name: options for name, options in GPU_MATRIX + CPU_MATRIX}
        known.update({"none": ["--compilation-mode", "none"]})
        known.update({name.lstrip("-"): options for name, options in GPU_MATRIX})
        names = split_matrix(self.matrix_names, known)
        unknown = [name for name in names if base_name(name) not in known]
        if unknown:
            raise ConfigError(f"unknown bench config {unknown[0]!r}; use {', '.join(sorted(known))}, each optionally "
                              "with @ENGINE and +KEY=VALUE knobs (e.g. O2@transformers, O2+blas_library=cublaslt)")
        twice = [name for index, name in enumerate(names) if name in names[:index]]
        if twice:  # two rows of one name: a baseline of them is refused (bench_compare.load_baseline)
            raise ConfigError(f"--matrix names {twice[0][:80]!r} twice; name each configuration once")
        return [(name, known[base_name(name)] + engine_options(name) + knob_options(name)) for name in names]


# Knobs a matrix entry may not set with +KEY=VALUE: what makes the rows comparable (bench's own options)
# and what the entry's name already says (the -O level, @ENGINE).
ROW_FIXED_KNOBS = {"opt_level": "name the level (O0..O3)", "engine": "use NAME@ENGINE",
                   "model": "use --model for every row", "prompts": "use --prompts for every row",
                   "device": "use --device for every row", "max_new_tokens": "use --max-new-tokens for every row",
                   "batch_size": "use --batch-size for every row", "dtype": "use --dtype for every row",
                   "tensor_parallel": "bench runs each row as one process; measure tensor parallelism under torchrun",
                   "warmup": "the warm-up keeps compile time out of the measured figures",
                   "keep_logits": "bench measures speed; keep logits with evalrun run --keep-logits"}
COMPILATION_NAMES = ("none", "stock", "trace-once", "piecewise")  # names that already say the compilation mode
LIST_KNOBS = ("prefill_buckets", "batch_buckets")  # values with commas: a matrix piece may continue them


def split_matrix(text: str, known: dict) -> list[str]:
    """'O2,O2+prefill_buckets=16,32,O3' -> ['O2', 'O2+prefill_buckets=16,32', 'O3']: a comma-separated piece
    that names no configuration continues the value of a list knob (LIST_KNOBS) just before it."""
    names: list[str] = []
    for piece in text.split(","):
        piece = "+".join(part.strip() for part in piece.split("+"))
        before = names[-1] if names else ""
        last_knob = before.rpartition("+")[2].partition("=")[0].strip().replace("-", "_") if "+" in before else ""
        if base_name(piece) not in known and last_knob in LIST_KNOBS:
            names[-1] += "," + piece
        else:
            names.append(piece)
    return names


def base_name(name: str) -> str:
    """'O2@transformers+blas_library=cublaslt' -> 'O2'."""
    return name.partition("+")[0].partition("@")[0].strip()


def engine_options(name: str) -> list[str]:
    """`NAME@ENGINE` runs configuration NAME on that engine (`--engine`), e.g. O2@transformers."""
    _, at, engine = name.partition("+")[0].partition("@")
    return ["--engine", parse_engine(engine)] if at else []


def knob_options(name: str) -> list[str]:
    """`NAME+KEY=VALUE+...` sets config knobs on top of NAME (`--set`), e.g. O2+linear_kernel=triton-gemv:
    a lever measured side by side with the configuration without it. Keys and values are checked here."""
    options, engine = [], (engine_options(name)[1:] or ["evalrun"])[0]
    for item in name.split("+")[1:]:
        key, value = parse_set_option(item)
        if key in ROW_FIXED_KNOBS or (key == "compilation_mode" and base_name(name) in COMPILATION_NAMES):
            raise ConfigError(f"bench config {name!r} sets {key}, which every row shares or its name says; "
                              f"{ROW_FIXED_KNOBS.get(key, 'name the compilation mode')}")
        normalize(RunConfig(engine=engine, **{key: value}))  # one line naming the fix for a value no run takes
        options += ["--set", item.strip()]
    return options


def run_bench(request: BenchRequest, on_start: Callable[[str], None]) -> list[dict[str, Any]]:
    """The whole bench: each configuration and baseline in a fresh process, then the table's rows."""
    rows = run_matrix(request.common_options(), request.matrix(request.on_gpu()), request.baselines, on_start,
                      request.timeout, baseline_options=request.common_options(baseline=True),
                      repeats=request.repeats)
    return table_rows(rows)


@dataclass
class BenchRow:
    """One configuration or baseline: its runs' results (one a round), or the first error one of them met."""

    name: str
    results: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def result(self) -> dict[str, Any] | None:
        return self.results[0] if self.results and self.error is None else None

    def add(self, result: dict[str, Any] | None, error: str | None) -> None:
        if error is not None or result is None:
            self.error = self.error or error or "no result"
        else:
            self.results.append(result)


def run_matrix(common: list[str], matrix: list[tuple[str, list[str]]], baselines: tuple[str, ...],
               on_start: Callable[[str], None], timeout: float = 3600,
               baseline_options: list[str] | None = None, repeats: int = 1) -> list[BenchRow]:
    """Run every configuration and baseline in its own process, `repeats` rounds of all of them; failures become
    rows with an error (a row that failed once is not run again). Interrupted (Ctrl-C), the rows measured so far are
    kept: the running row and those never run say so in their error."""
    with tempfile.TemporaryDirectory() as directory:
        store = str(Path(directory) / "bench.db")
        children = [(name, ["evalrun", "run", "--json", "--quiet", "--store", store, *common, *options])
                    for name, options in matrix]
        children += [(f"transformers {kind}", ["evalrun.hf_baseline", "--kind", kind, *(baseline_options or [])])
                     for kind in baselines]
        rows = [BenchRow(name) for name, _ in children]
        running = None
        try:
            for round_index in range(repeats):
                for running, (name, command) in zip(rows, children):
                    if running.error is not None:
                        continue
                    on_start(name if repeats == 1 else f"{name} (run {round_index + 1} of {repeats})")
                    running.add(*run_json_child(command, timeout, timeout_hint=TIMEOUT_HINT))
        except KeyboardInterrupt:
            for row in rows:
                if row is running:
                    row.add(None, "interrupted (Ctrl-C) before its run finished")
                elif not row.results:
                    row.add(None, "not run: the bench was interrupted (Ctrl-C)")
    return rows


def workload(result: dict[str, Any]) -> dict[str, Any]:
    """What an evalrun row measured, beside its config: the model, prompts and tokens, dtype, device and batch size.
    `bench --compare` refuses a baseline row of another workload (its ratio would say nothing of the config)."""
    config = result["config"]
    return {"model": result["model"]["hash"], "prompt_set": result["prompt_set"]["hash"],
            **{key: config.get(key) for key in ("max_new_tokens", "dtype", "device", "batch_size")}}


def table_rows(rows: list[BenchRow]) -> list[dict[str, Any]]:
    """One dict per row with the figures of the table (the medians of its runs); `identical_to_first` against the
    first evalrun row's first run, for every run of the row, and `identical_to` naming that row (not the first row
    of the matrix where that one failed in its first round)."""
    # the first evalrun row's first run, even where a later run of that row failed (the row shows its error)
    first = next((r for r in rows if r.results and "logits_digest" in r.results[0]), None)
    reference = first.results[0] if first else None
    table = []
    for row in rows:
        entry: dict[str, Any] = {"config": row.name, "error": row.error}
        if row.result:
            figures = [_figures(result) for result in row.results]
            entry.update({key: _median([f[key] for f in figures]) for key in figures[0]})
            if len(figures) > 1:
                speeds = [f["tokens_per_s"] for f in figures]
                entry.update(repeats=len(figures), tokens_per_s_runs=speeds,
                             tokens_per_s_spread_percent=(max(speeds) - min(speeds)) / entry["tokens_per_s"] * 100
                             if entry["tokens_per_s"] else None)
            entry["batch_size"] = row.result["config"]["batch_size"] if "config" in row.result else 1
            if row.result.get("compiled_graphs") == 0 and row.name.endswith("static-compile"):
                entry["fallbacks"] = ["transformers compiled nothing (it compiles a static cache on GPUs only): "
                                      "a static cache, eagerly"]
            if "logits_digest" in row.result and reference:
                entry["identical_to_first"] = all(r["logits_digest"] == reference["logits_digest"]
                                                  for r in row.results)
                entry["identical_to"] = first.name
                entry["fallbacks"] = row.result["evidence"]["fallbacks"]
                entry["kernel_launches_per_decode_step"] = row.result["evidence"].get("kernel_launches_per_decode_step")
                entry["workload"] = workload(row.result)
        table.append(entry)
    return table


def _median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _figures(result: dict[str, Any]) -> dict[str, float | None]:
    """The numbers of one run the table shows."""
    timings = result["timings"]
    latency = timings["step_latency"]
    return {"compile_s": timings.get("compile_s"), "peak_memory_gib": timings["peak_memory"]["bytes"] / 2**30,
            "ttft_ms": timings["ttft_ms"]["p50"], "first_request_ms": timings["ttft_ms"]["first_request"],
            "tokens_per_s": timings["tokens_per_s"], "p50_ms": latency["p50_ms"], "p95_ms": latency["p95_ms"],
            "p99_ms": latency["p99_ms"], "outside_steps_ms": timings.get("outside_steps_s", 0.0) * 1000}
