"""Calibrate the verdict on a labelled corpus, judged by evalrun and by the field's two usual rules.

    python benchmarks/calibrate.py --device cpu --dtype float32 --golden O0            # CPU, SmolLM2-135M
    python benchmarks/calibrate.py --device cuda --dtype bfloat16 --golden O2,O0       # the H200
    python benchmarks/calibrate.py --model random:llama3-8b --prompts smoke --device cuda --golden O2 --only drift

For each golden (pinned at the given -O level, created with full logits kept), every case verifies a
candidate against it, in-process (or in a child process where the environment itself is the case:
another CPU instruction set, another thread count):
  drift    same model, other numerics: compilation x CUDA-graph modes, -O levels, dtypes, batch sizes,
           TF32, attention kernel, threads, ATEN_CPU_CAPABILITY
  change   the model computes another function from the same files (engine fault injection, planted in
           every run the verification prepares): one tensor scaled 1e-5 ... 1e-1, a layer fake-quantized
           to int8, rotary theta +-1% and +-0.1%, RMSNorm eps x10, a masked position, a sign flip, two
           layers swapped
  exec     the model is fine but one execution computes it wrongly (the fault planted only in the
           candidate's compiled run): what the execution check is for
The function check runs in its statistical form throughout (as in any environment but the golden's,
where evalrun demands bit-for-bit reproduction instead), so the table shows the rule that travels.

Output: a row per case (evalrun's verdict and distances, vLLM's check_logprobs_close, PyTorch's same()),
then the detection limit per fault kind and the largest drift / smallest change ratio per check, and a
JSON file with everything (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evalrun.compare import bits_to_float  # noqa: E402
from evalrun.config import CUDAGraphMode, CompilationMode, build_config  # noqa: E402
from evalrun.engine.faults import Fault, fault_hook  # noqa: E402
from evalrun.field_rules import torch_same, vllm_logprobs_close  # noqa: E402
from evalrun.golden import create_golden, oracle_config, open_golden  # noqa: E402
from evalrun.runner import execute, prepare  # noqa: E402
from evalrun.verify import candidate_config, verify_golden  # noqa: E402

MAGNITUDE_KINDS = ("scale", "rope_theta")


@dataclass
class Case:
    name: str
    side: str  # drift | change | exec
    flags: dict = field(default_factory=dict)
    fault: Fault | None = None
    env: dict | None = None  # a child process with these environment variables


@dataclass
class Outcome:
    golden: str
    case: str
    side: str
    verdict: str
    function_distance: float
    execution_distance: float
    function_ratio_max: float
    execution_ratio_max: float
    prompts_with_flips: int
    vllm: str
    torch_same: str
    seconds: float
    cause: str = ""
    fault: dict | None = None
    # the raw, multiplier-free figures behind each check, worst over prompts: re-judge offline with other thresholds
    raw: dict = field(default_factory=dict)


def drift_cases(on_gpu: bool, dtype: str) -> list[Case]:
    cases = [Case(f"batch {b}", "drift", {"batch_size": b}) for b in (4, 16)]
    cases += [Case("tf32 on", "drift", {"sets": ["tf32=true"]}), Case("attention eager", "drift",
                                                                     {"sets": ["attn_implementation=eager"]})]
    cases += [Case(f"dtype {d}", "drift", {"dtype": d}) for d in (("float32", "bfloat16", "float16") if on_gpu
                                                                   else ("float32", "bfloat16")) if d != dtype]
    if on_gpu:
        cases += [Case(f"-O{level}", "drift", {"opt_level": level}) for level in range(4)]
        for compilation in CompilationMode:
            for graphs in CUDAGraphMode:
                if graphs.requires_piecewise_compilation() and compilation is not CompilationMode.PIECEWISE:
                    continue
                cases.append(Case(f"{compilation}/{graphs}", "drift",
                                  {"compilation_mode": compilation.value, "cudagraph_mode": graphs.value}))
    else:
        cases += [Case(f"compile {mode}", "drift", {"compilation_mode": mode})
                  for mode in ("stock", "trace-once", "piecewise")]
        cases += [Case(f"ISA {isa}", "drift", env={"ATEN_CPU_CAPABILITY": isa}) for isa in ("default", "avx2", "avx512")]
        cases += [Case("1 thread", "drift", env={"OMP_NUM_THREADS": "1"})]
    return cases


def change_cases(flags: dict | None = None) -> list[Case]:
    """Planted model changes, verified with `flags` on top of the golden's config (none: its own config).
    A change below the run dtype's resolution leaves a bfloat16 run bit-identical, and identical it is;
    a candidate whose bits differ anyway (another -O level) is what makes the function check run."""
    faults = [Fault("scale", m) for m in (1e-5, 3e-5, 1e-4, 1e-3, 1e-2, 1e-1)]
    faults += [Fault("rope_theta", m) for m in (1e-3, -1e-3, 1e-2, -1e-2)]
    faults += [Fault("int8"), Fault("norm_eps", 10.0), Fault("mask_position"), Fault("sign_flip"), Fault("swap_layers")]
    return [Case(fault.describe(), "change", dict(flags or {}), fault=fault) for fault in faults]


def exec_cases(on_gpu: bool) -> list[Case]:
    flags = {"opt_level": 2} if on_gpu else {"compilation_mode": "stock"}
    faults = [Fault("scale", m) for m in (1e-2, 1e-1, 0.5)] + [Fault("mask_position"), Fault("swap_layers")]
    return [Case(f"{fault.describe()} in the compiled run only", "exec", flags, fault) for fault in faults]


# ---------------------------------------------------------------- one case

def _full_logits(result) -> np.ndarray | None:
    """[N, V] float64 of a result's kept logits (every step), or None."""
    if "logits" not in result.arrays:
        return None
    return bits_to_float(result.arrays["logits"], _dtype_of_bits(result.arrays["logits"]))


def _dtype_of_bits(bits: np.ndarray) -> str:
    return {np.dtype(np.int16): "bfloat16", np.dtype(np.int32): "float32", np.dtype(np.int64): "float64"}[bits.dtype]


def field_rules(golden, runs: dict, oracle_logits: dict, candidate_dtype: str) -> tuple[str, str]:
    """vLLM's rule on the free runs, PyTorch's same() on whole logits along the golden's tokens."""
    pinned = {r.prompt_index: r for r in golden.results("pinned")}
    free = runs["candidate"].by_index()
    forced = dict(free)
    if "forced" in runs:
        forced.update(runs["forced"].by_index())
    vllm_failed = [pinned[i].prompt_id for i in pinned
                   if not vllm_logprobs_close(pinned[i].arrays["tokens"], pinned[i].arrays["topk_ids"],
                                              free[i].arrays["tokens"], free[i].arrays["topk_ids"])[0]]
    same_failed, unknown = [], False
    for index, golden_result in pinned.items():
        ref, res = _full_logits(golden_result), _full_logits(forced[index])
        if ref is None or res is None or index not in oracle_logits:
            unknown = True
            continue
        dtype = "bfloat16" if candidate_dtype == "bfloat16" else candidate_dtype
        if not torch_same(ref, res, oracle_logits[index], dtype):
            same_failed.append(golden_result.prompt_id)
    vllm = f"changed ({len(vllm_failed)})" if vllm_failed else "pass"
    same = "n/a" if unknown else (f"changed ({len(same_failed)})" if same_failed else "pass")
    return vllm, same


def run_case(golden_dir: Path, golden_name: str, case: Case, oracle_logits: dict) -> Outcome:
    golden = open_golden(golden_name, golden_dir)
    runs: dict = {}
    flags = dict(case.flags)
    sets = tuple(flags.pop("sets", ()))
    config = candidate_config(golden, None, flags, sets)
    hook = None
    if case.fault is not None:
        only = (lambda p: p.config.compilation_mode.is_compiled()) if case.side == "exec" else None
        hook = fault_hook(case.fault, only=only)
    started = time.perf_counter()
    verdict = verify_golden(golden, config, hook=hook, function_check="statistical",
                            observe=lambda phase, run: runs.setdefault(phase, run))
    seconds = time.perf_counter() - started
    functions = [p.function for p in verdict.prompts if p.function]
    executions = [p.execution for p in verdict.prompts if p.execution]
    vllm, same = field_rules(golden, runs, oracle_logits, verdict.candidate_config["dtype"])
    raw = {f"{name}_{key}": max([getattr(r, key) for r in reports], default=0.0)
           for name, reports in (("function", functions), ("execution", executions))
           for key in ("ratio", "step_ratio", "flip_ratio")}
    raw["prompts"] = [{"prompt": p.prompt_id, **{f"{name}_{key}": getattr(report, key)
                                                  for name, report in (("function", p.function), ("execution", p.execution))
                                                  if report for key in ("candidate_error", "envelope_error", "ratio",
                                                                        "step_ratio", "flip_ratio")}}
                      for p in verdict.prompts]
    return Outcome(golden_name, case.name, case.side, verdict.verdict,
                   max([f.distance for f in functions], default=0.0), max([e.distance for e in executions], default=0.0),
                   max([f.ratio for f in functions], default=0.0), max([e.ratio for e in executions], default=0.0),
                   sum(1 for p in verdict.prompts if p.flips), vllm, same, seconds,
                   next((c for c in verdict.causes if "check failed" in c or "model identity" in c
                         or "no longer reproduces" in c), ""), asdict(case.fault) if case.fault else None, raw)


def run_case_in_child(golden_dir: Path, golden_name: str, case: Case, args) -> Outcome:
    command = [sys.executable, __file__, "--child", json.dumps(asdict(case) | {"fault": None}), "--golden-dir",
               str(golden_dir), "--golden-name", golden_name]
    process = subprocess.run(command, env=dict(os.environ, **case.env), capture_output=True, text=True)
    if process.returncode != 0:
        raise RuntimeError(f"case {case.name} failed in its child process: {process.stderr.strip()[-2000:]}")
    return Outcome(**json.loads(process.stdout.strip().splitlines()[-1]))


def distinct(cases: list[Case], golden) -> list[Case]:
    """Drop drift cases whose candidate config is the golden's own or one already listed (-O2 is
    piecewise/full-and-piecewise): the same config is the same case."""
    from evalrun.config import resolve

    seen = {resolve(candidate_config(golden, None, {}, ()), True).compute_hash()}
    kept = []
    for case in cases:
        if case.side != "drift" or case.env:
            kept.append(case)
            continue
        flags = dict(case.flags)
        sets = tuple(flags.pop("sets", ()))
        key = resolve(candidate_config(golden, None, flags, sets), True).compute_hash()
        if key not in seen:
            seen.add(key)
            kept.append(case)
    return kept


# ---------------------------------------------------------------- goldens and the oracle's full logits

def make_golden(args, level: str, directory: Path) -> tuple[str, dict]:
    name = f"calib-{level.lower()}"
    if args.reuse and (directory / f"{name}.db").exists() and (directory / f"{name}.oracle.npz").exists():
        return name, load_oracle_logits(directory, name)
    flags = {"model": args.model, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
             "device": args.device, "dtype": args.dtype, "opt_level": level}
    sets = ["keep_logits=all"] + (["deterministic=true"] if level == "O0" else [])
    started = time.perf_counter()
    golden = create_golden(name, build_config(flags=flags, sets=sets), directory, force=True)
    print(f"golden {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    oracle_logits = full_oracle_logits(golden)
    np.savez(directory / f"{name}.oracle.npz", **{str(k): v for k, v in oracle_logits.items()})
    return name, oracle_logits


def full_oracle_logits(golden) -> dict[int, np.ndarray]:
    """The oracle's whole logits along the pinned tokens ([N, V] float64 per prompt), for same()."""
    config = oracle_config(golden.config("pinned"), golden.pinned.json["model"]["parameters"]).replace(keep_logits="all")
    tokens = {r.prompt_index: r.arrays["tokens"] for r in golden.results("pinned")}
    run = execute(prepare(config), forced=tokens, timed=False)
    return {r.prompt_index: bits_to_float(r.arrays["logits"], "float64") for r in run.results}


def load_oracle_logits(directory: Path, name: str) -> dict[int, np.ndarray]:
    with np.load(directory / f"{name}.oracle.npz", allow_pickle=False) as data:
        return {int(k): data[k] for k in data.files}


# ---------------------------------------------------------------- summary

def detection_limits(outcomes: list[Outcome]) -> dict[str, str]:
    """Per fault kind: the smallest magnitude called changed (all larger ones too), or detected / missed."""
    limits: dict[str, str] = {}
    for kind in sorted({o.fault["kind"] for o in outcomes if o.side == "change" and o.fault}):
        cases = [o for o in outcomes if o.side == "change" and o.fault and o.fault["kind"] == kind]
        if kind in MAGNITUDE_KINDS:
            sizes = sorted({abs(o.fault["magnitude"]) for o in cases})
            caught = [s for s in sizes if all(o.verdict == "changed" for o in cases if abs(o.fault["magnitude"]) >= s)]
            limits[kind] = f"{min(caught):g}" if caught else "missed"
        else:
            limits[kind] = "detected" if all(o.verdict == "changed" for o in cases) else "MISSED"
    return limits


def print_table(outcomes: list[Outcome]) -> None:
    header = ["golden", "side", "case", "evalrun", "function x", "execution x", "flips", "vLLM top-5", "torch same()", "s"]
    rows = [[o.golden, o.side, o.case, o.verdict, f"{o.function_distance:.3g}", f"{o.execution_distance:.3g}",
             o.prompts_with_flips, o.vllm, o.torch_same, f"{o.seconds:.0f}"] for o in outcomes]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def summary(outcomes: list[Outcome]) -> dict:
    drift = [o for o in outcomes if o.side == "drift"]
    change = [o for o in outcomes if o.side == "change"]
    exec_faults = [o for o in outcomes if o.side == "exec"]
    return {
        "drift_called_changed": [f"{o.golden}: {o.case}" for o in drift if o.verdict == "changed"],
        "max_drift_function_ratio": max((o.function_ratio_max for o in drift), default=0.0),
        "max_drift_execution_ratio": max((o.execution_ratio_max for o in drift), default=0.0),
        "max_drift_distance": max((max(o.function_distance, o.execution_distance) for o in drift), default=0.0),
        "detection_limits": detection_limits(outcomes),
        "exec_faults_caught": [f"{o.case}: {o.verdict}" for o in exec_faults],
        "changes_missed": [f"{o.golden}: {o.case}" for o in change if o.verdict != "changed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", default="default")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--golden", default="O0", help="Comma-separated -O levels to pin goldens at.")
    parser.add_argument("--only", default="drift,change,exec", help="Which sides of the corpus to run.")
    parser.add_argument("--cases", default=None, help="Comma-separated case names to run (default: all).")
    parser.add_argument("--change-opt", default=None, help="Verify the planted changes at this -O level "
                        "(default: the golden's own config).")
    parser.add_argument("--out", type=Path, default=None, help="Write every outcome and the summary as JSON.")
    parser.add_argument("--workdir", type=Path, default=None, help="Where goldens go (default: a temp folder).")
    parser.add_argument("--reuse", action="store_true", help="Reuse a golden (and its oracle logits) already in --workdir.")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--golden-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--golden-name", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case = Case(**json.loads(args.child))
        outcome = run_case(args.golden_dir, args.golden_name, case, load_oracle_logits(args.golden_dir, args.golden_name))
        print(json.dumps(asdict(outcome)))
        return
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    on_gpu = args.device.startswith("cuda")
    sides = set(args.only.split(","))
    change_flags = {"opt_level": args.change_opt} if args.change_opt else {}
    cases = [c for c in drift_cases(on_gpu, args.dtype) + change_cases(change_flags) + exec_cases(on_gpu)
             if c.side in sides]
    if args.cases:  # in the order given: the most needed first, should a time limit cut the corpus short
        order: dict[str, int] = {}
        for name in args.cases.split(","):
            order.setdefault(name, len(order))
        cases = sorted((c for c in cases if c.name in order), key=lambda c: order[c.name])
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="evalrun-calibrate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    for level in args.golden.split(","):
        name, oracle_logits = make_golden(args, level, workdir)
        for case in distinct(cases, open_golden(name, workdir)):
            print(f"case {name} / {case.side} / {case.name}", file=sys.stderr, flush=True)
            try:
                outcome = (run_case_in_child(workdir, name, case, args) if case.env
                           else run_case(workdir, name, case, oracle_logits))
            except Exception as error:  # noqa: BLE001 - a failed case is a row saying so; the corpus goes on
                outcome = Outcome(name, case.name, case.side, f"ERROR: {str(error).splitlines()[-1][:120]}",
                                  0.0, 0.0, 0.0, 0.0, 0, "-", "-", 0.0)
            outcomes.append(outcome)
            print(json.dumps(asdict(outcome)), file=sys.stderr, flush=True)
            if args.out:
                args.out.write_text(json.dumps({"outcomes": [asdict(o) for o in outcomes]}, indent=1))
    print_table(outcomes)
    result = summary(outcomes)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "outcomes": [asdict(o) for o in outcomes], "summary": result}, indent=1))


if __name__ == "__main__":
    main()
