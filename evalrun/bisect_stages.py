"""Stages 2-4 of `evalrun bisect`: inside the compiler, the layer, the prompt and step of a culprit.

All three compare GOOD with the culprit config (GOOD with only the culprit knobs of BAD: the smallest
config the knob ladder proved bad), in this process.

Stage 4, prompt and step (`locate_step`): the first prompt, in file order, whose stored logits digests
differ between the two runs, its first differing step, and both runs' tokens and top1-top2 margins at
the first step whose token differs (else at that step). Under --until verdict, the first prompt the
culprit's verdict calls changed, with its first flip (golden token, candidate token, margins).

Stage 3, layer (`layer_stage`): one forward at batch 1 over that prompt followed by GOOD's tokens,
unpadded, under GOOD's execution, the culprit's, and a float64 eager reference (the golden's oracle
config), keeping the residual stream after every attention and every MLP sub-block
(`Transformer.forward_states`). A sub-block leaves the drift envelope when the culprit's error against
float64 exceeds m x GOOD's + floor (m and floor of `rules.EXECUTION_RULE`: 3 x, 1 epsilon of the run
dtype, errors relative to the float64 state's RMS), PyTorch's accuracy rule applied per sub-block. One
pass captures every sub-block (no binary search needed); the first sub-block whose bits differ is
reported too. Compiled configs run their pieces compiled one by one with their Inductor options (for
stock and trace-once, whose whole-forward graph hides its inner states, a stand-in, and the report
says so); CUDA graphs, batching and padding do not act here.

Stage 2, inside the compiler (`compiler_stage`): when the culprit is one compilation knob,
`torch._inductor.compiler_bisector.CompilerBisector.do_bisect` runs the culprit config on the failing
prompt again and again, switching backends (eager, aot_eager, ..., inductor) and Inductor's subsystems
(passes, lowerings) off, and names the backend, subsystem and application number where the
difference appears. Under `bits` the reference is GOOD under the same compiler state when GOOD
compiles (an Inductor knob: the knob's own effect), else the culprit config under Dynamo's eager
backend, the bisector's first state (what compiling changes at all); under `verdict` the golden's
verdict itself. Not run for CUDA-graph modes, other knobs, interactions or `cmd:` predicates.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .bisect_probe import Probe, Prober
from .bisect_search import Knob
from .compare import digest_mismatch_steps, first_divergence
from .config import CompilationMode, EffectiveConfig
from .engine.modes import state_pieces
from .fingerprint import apply_numerics_flags
from .golden import oracle_config
from .rules import EPSILON, EXECUTION_RULE
from .runner import Prepared, execute, prepare
from .store import PromptResult

BACKENDS = {"eager": "Dynamo's graph capture, run eagerly (no compiler)",
            "aot_eager": "AOTAutograd's tracing and functionalization, no decompositions",
            "aot_eager_decomp_partition": "AOTAutograd with Inductor's decompositions and partitioner",
            "aot_eager_decomp_partition_crossref": "AOTAutograd with decompositions, cross-checked",
            "inductor": "Inductor's passes, lowerings and code generation"}


@dataclass
class StepReport:
    """Stage 4: where the culprit's run first parts from GOOD's."""

    prompt_id: str
    prompt_index: int
    step: int  # first step whose logits digest differs (-1: none)
    token_step: int  # first step whose token differs (-1: none)
    shown_step: int  # the step the tokens and margins are shown at
    good_token: str
    bad_token: str
    good_margin: float  # GOOD's top1 - top2 there (the golden's, under verdict)
    bad_margin: float
    prompts_differing: int
    compared: str
    verdict_reason: str = ""  # --until verdict: why this prompt's verdict is changed
    oracle_gap: float | None = None  # --until verdict: the oracle's gap between the two tokens


@dataclass
class LayerPoint:
    name: str
    layer: int  # -1 for the head
    block: str  # attention | MLP | head
    good_error: float  # relative RMS error against float64
    bad_error: float
    allowed: float  # m x good_error + floor
    bits_equal: bool


@dataclass
class LayerReport:
    """Stage 3: per sub-block errors against float64, the first sub-block out of the envelope."""

    prompt_id: str
    tokens: int
    rule: str
    observed: dict[str, str]  # how each execution's states were observed
    points: list[LayerPoint]
    first_out: LayerPoint | None
    first_bits: LayerPoint | None
    summary: str
    notes: list[str] = field(default_factory=list)


@dataclass
class CompilerReport:
    """Stage 2: torch's CompilerBisector driven with our predicate."""

    status: str  # found | before the compiler (eager backend already differs) | nothing found | not run | failed
    summary: str
    backend: str | None = None
    subsystem: str | None = None
    bisect_number: int | None = None
    debug_info: str | None = None
    calls: int = 0
    reference: str = ""
    notes: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


def analyse(prober: Prober, culprit: Probe, knobs: list[Knob], stages: tuple[str, ...]):
    """(step, layer, compiler) reports for the culprit probe; a stage that is not asked for, or that
    cannot run, comes back None or says why."""
    say = prober.options.progress or (lambda line: None)
    step = _step_stage(prober, culprit)
    index = step.prompt_index if step else 0
    layer = compiler = None
    if "layer" in stages:
        say("stage 3: per-layer states of GOOD, the culprit and float64")
        layer = layer_stage(prober, culprit.config, index)
    if "compiler" in stages:
        say("stage 2: CompilerBisector")
        compiler = compiler_stage(prober, culprit.config, knobs, index)
    return step, layer, compiler


# ---------------------------------------------------------------- stage 4: prompt and step

def _decoder(prober: Prober):
    tokenizer = prober.good_prepared.loaded.tokenizer
    return lambda token: tokenizer.decode([int(token)])


def _results(prober: Prober, run_id: str | None) -> list[PromptResult]:
    return prober.store.load_results(run_id, names=("tokens", "digests", "margins")) if run_id else []


def prompt_step(good: PromptResult, bad: PromptResult, decode, compared: str) -> StepReport | None:
    """Where two runs of one prompt part: None when every digest and token agree."""
    mismatches = digest_mismatch_steps(good.arrays["digests"], bad.arrays["digests"])
    divergence = first_divergence(good.arrays["tokens"], bad.arrays["tokens"])
    if mismatches.size == 0 and divergence < 0:
        return None
    step = int(mismatches[0]) if mismatches.size else divergence
    shown = divergence if divergence >= 0 else step
    return StepReport(good.prompt_id, good.prompt_index, step, divergence, shown, decode(good.arrays["tokens"][shown]),
                      decode(bad.arrays["tokens"][shown]), float(good.arrays["margins"][shown]),
                      float(bad.arrays["margins"][shown]), 0, compared)


def locate_step(good: list[PromptResult], bad: list[PromptResult], decode, compared: str,
                prompt_id: str | None = None) -> StepReport | None:
    """The first prompt (or `prompt_id`) where the runs part, and how many prompts differ at all."""
    found, differing = None, 0
    by_index = {r.prompt_index: r for r in bad}
    for result in good:
        if result.prompt_index not in by_index:
            continue
        report = prompt_step(result, by_index[result.prompt_index], decode, compared)
        differing += report is not None
        if report and found is None and prompt_id in (None, result.prompt_id):
            found = report
    if found:
        found.prompts_differing = differing
    return found


def _step_stage(prober: Prober, culprit: Probe) -> StepReport | None:
    good_id = prober.good_record.id if prober.good_record else None
    compared = f"GOOD run {str(good_id)[:12]} vs culprit run {str(culprit.report.run_id)[:12]}"
    failure = _verdict_failure(prober, culprit) if prober.predicate.kind == "verdict" else None
    report = locate_step(_results(prober, good_id), _results(prober, culprit.report.run_id), _decoder(prober), compared,
                         failure["prompt_id"] if failure else None)
    if failure and report is None:
        index = next((i for i, r in enumerate(prober.good_prepared.prompt_set.records)
                      if r.id == failure["prompt_id"]), 0)
        report = StepReport(failure["prompt_id"], index, -1, -1, -1, "", "", math.nan, math.nan, 0, compared)
    if failure and report is not None:
        report.verdict_reason = failure["reason"]
        flip = failure.get("flip")
        if flip:
            report.shown_step, report.good_token = flip["step"], flip["golden_token"]
            report.bad_token = flip["candidate_token"]
            report.good_margin, report.oracle_gap = flip["golden_margin"], flip["oracle_gap"]
    return report


def _verdict_failure(prober: Prober, culprit: Probe) -> dict[str, Any] | None:
    """The culprit's first changed prompt: from its probe, or (a reused probe) from verifying it here."""
    if "failure" in culprit.details:
        return culprit.details["failure"]
    from .bisect_probe import verdict_failure
    from .golden import open_golden
    from .verify import verify_golden

    golden = open_golden(prober.predicate.golden or "", prober.predicate.golden_dir)
    return verdict_failure(verify_golden(golden, culprit.config, hook=prober.options.hook))


# ---------------------------------------------------------------- stage 3: layer

def _prepared(prober: Prober, config: EffectiveConfig) -> Prepared:
    prepared = prepare(config, reuse=prober.good_prepared)
    if prober.options.hook:
        prober.options.hook(prepared)
    return prepared


@torch.no_grad()
def forward_states(prepared: Prepared, ids: list[int]) -> list[torch.Tensor]:
    """The states of one unpadded batch-1 forward over `ids` under the prepared config's execution (its
    transformer with any planted fault; its pieces compiled one by one when it compiles)."""
    transformer = prepared.execution_mode().transformer
    apply_numerics_flags(prepared.config)
    pieces = state_pieces(prepared.config)
    device, count = transformer.device, len(ids)
    tokens = torch.tensor([ids], dtype=torch.int64, device=device)
    positions = torch.arange(count, device=device)[None]
    key_valid = torch.ones(1, count, dtype=torch.bool, device=device)
    return transformer.forward_states(tokens, positions, positions[0], key_valid, transformer.new_cache(1, count),
                                      pieces)


def relative_error(state: torch.Tensor, reference: torch.Tensor, rows: int = 256) -> float:
    """RMS of (state - reference) over RMS of reference, in float64, a few rows at a time."""
    a, b = state.reshape(-1, state.shape[-1]), reference.reshape(-1, reference.shape[-1])
    squared_error = squared_reference = 0.0
    for start in range(0, a.shape[0], rows):
        wide = b[start:start + rows].double().cpu()
        delta = a[start:start + rows].double().cpu() - wide
        squared_error += float((delta * delta).sum())
        squared_reference += float((wide * wide).sum())
    return math.sqrt(squared_error / squared_reference) if squared_reference > 0 else math.sqrt(squared_error)


def _observed(config: EffectiveConfig) -> str:
    if not config.compilation_mode.is_compiled():
        return "eager pieces"
    text = f"pieces compiled one by one with its Inductor options ({config.compilation_mode})"
    if config.compilation_mode is not CompilationMode.PIECEWISE:
        text += f": {config.compilation_mode} compiles the whole forward, whose inner states cannot be observed"
    return text


def layer_points(names: list[tuple[str, int, str]], good: list[torch.Tensor], bad: list[torch.Tensor],
                 oracle: list[torch.Tensor], floor: float) -> list[LayerPoint]:
    """Per sub-block: both errors against the oracle, the envelope, and whether GOOD's and BAD's bits agree."""
    points = []
    for (name, layer, block), g, b, o in zip(names, good, bad, oracle):
        good_error, bad_error = relative_error(g, o), relative_error(b, o)
        same = (g.dtype, g.shape, g.device) == (b.dtype, b.shape, b.device) and torch.equal(g, b)
        points.append(LayerPoint(name, layer, block, good_error, bad_error,
                                 EXECUTION_RULE.multiplier * good_error + floor, same))
    return points


def layer_stage(prober: Prober, culprit: EffectiveConfig, prompt_index: int) -> LayerReport:
    good_prepared = prober.good_prepared
    record = prober.store.load_results(prober.good_record.id, names=("tokens",))[prompt_index]
    sides = (("GOOD", prober.good), ("the culprit", culprit))
    outside = [f"{who} runs --engine {config.engine}" for who, config in sides if config.engine != "evalrun"]
    if outside:  # per-sub-block states exist only in evalrun's own forward (Transformer.forward_states)
        return LayerReport(record.prompt_id, 0, "", {}, [], None, None,
                           "not run: per-layer states are observed in evalrun's own forward only, and "
                           + " and ".join(outside))
    ids = list(good_prepared.prompt_set.token_ids[prompt_index]) + [int(t) for t in record.arrays["tokens"][:-1]]
    oracle_prepared = _prepared(prober, oracle_config(prober.good, good_prepared.header["model"]["parameters"]))
    states = {"good": forward_states(good_prepared, ids), "bad": forward_states(_prepared(prober, culprit), ids),
              "oracle": forward_states(oracle_prepared, ids)}
    layers = len(good_prepared.execution_mode().transformer.layers)
    names = [(f"layer {i} {block}", i, block) for i in range(layers) for block in ("attention", "MLP")]
    names.append(("final norm + head", -1, "head"))
    floor = EXECUTION_RULE.floor_ulps * max(EPSILON[prober.good.dtype], EPSILON[culprit.dtype])
    points = layer_points(names, states["good"], states["bad"], states["oracle"], floor)
    first_out = next((p for p in points if p.bad_error > p.allowed), None)
    first_bits = next((p for p in points if not p.bits_equal), None)
    return LayerReport(record.prompt_id, len(ids), f"culprit error <= {EXECUTION_RULE.multiplier:g} x GOOD error + "
                       f"{floor:.3g} (relative RMS against {oracle_prepared.config.dtype} eager)",
                       {"GOOD": _observed(prober.good), "culprit": _observed(culprit), "reference": "eager, "
                        f"{oracle_prepared.config.dtype}"}, points, first_out, first_bits,
                       _layer_summary(first_out, first_bits), _layer_notes(prober.good, culprit))


def _layer_summary(first_out: LayerPoint | None, first_bits: LayerPoint | None) -> str:
    if first_out is not None:
        where = "the final norm and head" if first_out.layer < 0 else f"layer {first_out.layer}'s {first_out.block}"
        return (f"{where} leaves the envelope first: culprit error {first_out.bad_error:.3g} against float64, "
                f"allowed {first_out.allowed:.3g} (GOOD's {first_out.good_error:.3g})")
    if first_bits is not None:
        return (f"no sub-block leaves the envelope (drift spread over the layers); the bits first differ at "
                f"{first_bits.name}")
    return "every sub-block's state is bit-identical between GOOD and the culprit in this forward"


def _layer_notes(good: EffectiveConfig, culprit: EffectiveConfig) -> list[str]:
    changed = [key for key in ("cudagraph_mode", "batch_size", "prefill_buckets", "batch_buckets")
               if getattr(good, key) != getattr(culprit, key)]
    notes = [] if not changed else [
        f"{', '.join(changed)} act through graph capture, batching or padding, which this unpadded batch-1 "
        "forward without CUDA graphs does not reproduce"]
    if good.linear_kernel != culprit.linear_kernel:  # engine/linear.py: the GEMV takes 1-4 rows (long rows: 1)
        gemv = culprit.linear_kernel if culprit.linear_kernel != "aten" else good.linear_kernel
        notes.append(f"linear_kernel={gemv} computes projections of 1-4 rows (decode steps); this forward runs the "
                     "whole sequence at once, so it acts here only on a sequence of at most 4 tokens: the step stage "
                     "shows its effect")
    if good.attention_kernel != culprit.attention_kernel:  # engine/attention_triton.py: one query token per row
        kernel = culprit.attention_kernel if culprit.attention_kernel != "sdpa" else good.attention_kernel
        notes.append(f"attention_kernel={kernel} computes the attention of decode steps (one token per row); this "
                     "forward runs the whole sequence at once, so it acts here only on a one-token prompt: the step "
                     "stage shows its effect")
    return notes


# ---------------------------------------------------------------- stage 2: inside the compiler

def _not_run(reason: str) -> CompilerReport:
    return CompilerReport("not run", reason)


def _skip_reason(prober: Prober, culprit: EffectiveConfig, knobs: list[Knob]) -> str | None:
    if len(knobs) != 1:
        return "the culprit is a set of knobs; CompilerBisector follows one knob's effect into the compiler"
    knob = knobs[0]
    if knob.name == "cudagraph_mode":
        return ("the culprit is the CUDA-graph mode: capture and replay run the kernels the compiler made, and "
                "CompilerBisector bisects compiler passes (its cudagraphs subsystem covers only Inductor's graph "
                "trees)")
    if not knob.is_compilation:
        return f"the culprit {knob.name} is not a compilation knob"
    if prober.predicate.kind == "cmd":
        return "a cmd: predicate judges runs outside this process; CompilerBisector needs the predicate in-process"
    if not culprit.compilation_mode.is_compiled():
        return "the culprit config does not compile"
    return None


def compiler_stage(prober: Prober, culprit: EffectiveConfig, knobs: list[Knob], prompt_index: int) -> CompilerReport:
    reason = _skip_reason(prober, culprit, knobs)
    if reason:
        return _not_run(reason)
    return _run_compiler_bisector(prober, culprit, prompt_index, against_good=True)


def compiler_alone_stage(prober: Prober, bad: EffectiveConfig, prompt_index: int) -> CompilerReport:
    """CompilerBisector on BAD as a whole, as a user of torch's bisector alone would run it: no knob ladder,
    and its reference is BAD under Dynamo's eager backend (its first state), not GOOD. For the comparison
    `--compare-compiler-bisector` prints beside evalrun's own stages."""
    if prober.predicate.kind == "cmd":
        return _not_run("a cmd: predicate judges runs outside this process; CompilerBisector needs it in-process")
    if not bad.compilation_mode.is_compiled():
        return _not_run("BAD does not compile: CompilerBisector has nothing to bisect")
    return _run_compiler_bisector(prober, bad, prompt_index, against_good=False)


def _run_compiler_bisector(prober: Prober, culprit: EffectiveConfig, prompt_index: int,
                           against_good: bool) -> CompilerReport:
    from torch._inductor.compiler_bisector import CompilerBisector

    fn, state = _bisect_function(prober, culprit, prompt_index, against_good)
    log, error, result = io.StringIO(), None, None
    with contextlib.redirect_stdout(log), _quiet_eager_backend():  # the bisector prints; our stdout may be JSON
        try:
            result = CompilerBisector.do_bisect(fn, cli_interface=False)
        except Exception as caught:  # noqa: BLE001 - a stage that stops is reported, the bisect goes on
            error = f"{type(caught).__name__}: {(str(caught).splitlines() or [''])[0][:300]}"
        gc.collect()  # the bisector cleans its state up when its own objects go away: here, not mid-JSON
    lines = [line for line in log.getvalue().splitlines() if line.strip()][-20:]
    if error:
        return CompilerReport("failed", f"CompilerBisector stopped: {error}", calls=state["calls"],
                              reference=state["reference_text"], notes=state["notes"], log=lines)
    return _compiler_report(result, state, lines)


@contextlib.contextmanager
def _quiet_eager_backend():
    """Dynamo's eager backends warn, once per graph, that they ignore the Inductor options every piece is
    compiled with: expected while the bisector swaps backends, so not shown."""
    loggers = [logging.getLogger(f"torch._dynamo.backends.{name}") for name in ("debugging", "common")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _bisect_function(prober: Prober, culprit: EffectiveConfig, prompt_index: int, against_good: bool = True):
    """fn() -> True when good under the bisector's current state, and the state it keeps. With `against_good`
    and a compiled GOOD, each state runs both and compares them; else the first state (Dynamo's eager
    backend) is the reference."""
    good, hook = prober.good, prober.options.hook
    state: dict[str, Any] = {"calls": 0, "reference": None, "notes": []}
    if prober.predicate.kind == "verdict":
        from .golden import open_golden
        from .verify import verify_golden

        golden = open_golden(prober.predicate.golden or "", prober.predicate.golden_dir)
        state["reference_text"] = f"the golden {golden.name}'s verdict (not changed = good)"

        def verdict_fn() -> bool:
            state["calls"] += 1
            return verify_golden(golden, culprit, hook=hook).verdict != "changed"

        return verdict_fn, state

    def digests(config: EffectiveConfig) -> np.ndarray:
        prepared = _prepared(prober, config)
        return execute(prepared, only={prompt_index}, timed=False).by_index()[prompt_index].arrays["digests"]

    both = against_good and good.compilation_mode.is_compiled()
    state["reference_text"] = ("GOOD (the knob off) under the same compiler state" if both else
                               "the culprit config under Dynamo's eager backend (the bisector's first state)")

    def bits_fn() -> bool:
        state["calls"] += 1
        ours = digests(culprit)
        if both:
            return bool(np.array_equal(ours, digests(good)))
        if state["reference"] is None:  # do_bisect's first call runs under the eager backend
            state["reference"] = ours
            if against_good:
                _note_static_shapes(prober, ours, prompt_index, state)
            return True
        return bool(np.array_equal(ours, state["reference"]))

    return bits_fn, state


def _note_static_shapes(prober: Prober, reference: np.ndarray, prompt_index: int, state: dict[str, Any]) -> None:
    good = prober.store.load_results(prober.good_record.id, names=("digests",))[prompt_index].arrays["digests"]
    if not np.array_equal(good, reference):
        state["notes"].append("under Dynamo's eager backend the culprit config already differs from GOOD: what "
                              "compiling changes outside the compiler (static shapes: prompts padded to buckets) "
                              "changes the bits too")


def _compiler_report(result, state: dict[str, Any], lines: list[str]) -> CompilerReport:
    common = dict(calls=state["calls"], reference=state["reference_text"], notes=state["notes"], log=lines)
    if result is None:
        return CompilerReport("nothing found", "every backend and subsystem reproduces the reference: the difference "
                              "is not made by a compiler pass", **common)
    backend, subsystem = result.backend, result.subsystem
    meaning = BACKENDS.get(backend, backend)
    if backend == "eager":
        summary = (f"the difference is already there under {meaning}: it is not made by a compiler pass; the knob "
                   "changes the program itself or what runs around the compiled code")
    elif subsystem is None:
        summary = f"the difference appears with the {backend} backend ({meaning}); no subsystem switch removes it"
    elif result.debug_info == subsystem:  # a config switch (torch's ConfigChange)
        summary = f"the {backend} backend's {subsystem} switch removes the difference"
    else:
        summary = (f"{backend} / {subsystem}, application #{result.bisect_number}: "
                   f"{result.debug_info or 'no debug info recorded'}")
    status = "before the compiler" if backend == "eager" else "found"
    return CompilerReport(status, summary, backend, subsystem, result.bisect_number, result.debug_info, **common)
