"""Where a decode step's time goes on the GPU: the bandwidth ceiling, each projection's bandwidth,
and the engine's decode step under three modes with its kernel time by kind.

  python benchmarks/decode_breakdown.py --model random:llama3-8b --dtype bfloat16 [--json PATH] [--gemv-grid]

1. Ceiling: a device-to-device copy of 4 GiB (bytes read + written per second).
2. Each projection's matrix-vector product at batch 1, over every layer's weights in turn (so the
   L2 cache never holds them), replayed from one CUDA graph: time per layer and bytes read per second,
   by cuBLAS, cuBLASLt and the Triton GEMV (`linear_kernel=triton-gemv`, engine/linear.py) at the
   engine's block sizes; `--gemv-grid` also at other block sizes (how GEMV_BLOCKS is chosen).
3. One decode step (batch 1) in eager, piecewise-compiled without graphs, and -O2 (piecewise pieces,
   whole decode step in one CUDA graph), and -O2 with the Triton GEMV: step time p50, kernels per step,
   GPU kernel time by kind (profiler), and the share of the step with no kernel running; last, that step
   again with the KV cache written by a separate index_copy per layer (before the write moved into the
   pre-attention piece), with the MLP's residual added by its own kernel (before the GEMV's epilogue
   took it), with attention by the split-KV kernel (`attention_kernel=triton-split-kv`), with Inductor's
   combo kernels, and those levers together: as they are, with split-KV's chunks combined by a second kernel
   (before stop 19), with -O3's Inductor options (max-autotune, coordinate descent), those in Inductor's
   deterministic mode (no kernel chosen by timing where it changes numerics), with gate/up and the MLP's
   activation by one GEMV (`linear_kernel=triton-gemv-glu`; and with -O3's options, and with only its coordinate
   descent; with `--glu-grid`, that
   GEMV's blocks timed alone over GLU_GRID), those two with the norms by one Triton kernel (`norm_kernel=triton`),
   and with the greedy token
   by its own argmax instead of the fused capture's top-1, with the capture's chunks merged by torch ops instead
   of its merge kernel, and with both (before stop 22), side by side.
   Each row also gives the time to first token of four more batches and one profiled prefill: host wall
   time against the GPU's kernel time (is the prefill bound by the host?) and its longest kernels.
   `--skip` leaves parts out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evalrun.compile_cache import use_evalrun_cache  # noqa: E402
from evalrun.engine import attention_triton, capture_triton, linear  # noqa: E402
from evalrun.engine import generate as generate_module  # noqa: E402
from evalrun.engine.driver import generate_batch  # noqa: E402
from evalrun.engine.generate import BatchSpec  # noqa: E402
from evalrun.config import CompilationMode, CUDAGraphMode  # noqa: E402
from evalrun.engine.modes import ExecutionMode  # noqa: E402
from evalrun.engine.timing import StepClock  # noqa: E402
from evalrun.engine import transformer as transformer_module  # noqa: E402
from evalrun.engine.transformer import Transformer  # noqa: E402
from evalrun.hashing import hash_bytes  # noqa: E402
from evalrun.models import load_model  # noqa: E402


def timed_ms(function, repeats: int) -> float:
    """Mean device time of `function` over `repeats` calls, after one untimed call."""
    function()
    clock = StepClock(torch.device("cuda"))
    clock.start()
    for _ in range(repeats):
        function()
    clock.mark()
    return float(clock.elapsed_ms()[0]) / repeats


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy, in TB/s."""
    source = torch.empty(2**32, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = timed_ms(lambda: target.copy_(source), 10)
    return 2 * source.numel() / ms / 1e9


GEMV_GRID = [(8, 256, 4), (8, 512, 4), (8, 512, 2), (8, 512, 8), (8, 1024, 4), (16, 512, 4), (4, 512, 4), (4, 512, 2),
             (4, 1024, 4), (32, 128, 4)]
# The gate/up GEMV's blocks (linear_kernel=triton-gemv-glu): BLOCK_N outputs read 2 * BLOCK_N weight rows.
GLU_GRID = [(2, 512, 4), (4, 256, 4), (4, 512, 4), (4, 512, 8), (4, 1024, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 4),
            (8, 512, 8), (16, 256, 8)]


def graphed_ms(step, inputs: list[tuple], warmups: int = 1) -> float:
    """Mean device time of step(*args) over every args in `inputs`, all replayed from one CUDA graph (after
    `warmups` passes on a side stream: compiles, autotunes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            for args in inputs:
                step(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            step(*args)
    return timed_ms(graph.replay, 20) / len(inputs)


def per_layer_arguments(doc: str) -> argparse.Namespace:
    """`--layers` and `--json`: the command line of the per-layer benchmarks (fusion_candidates.py,
    decode_attention.py); seeds torch, so their random weights repeat."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.manual_seed(0)
    return args


def projection_bandwidth(weights: list[torch.Tensor], product=F.linear) -> dict[str, float]:
    """weights: L matrices [N, K]; product(x [1, K], each), in one graph. Time per matrix and read TB/s."""
    x = torch.randn(1, weights[0].shape[1], dtype=weights[0].dtype, device="cuda")
    ms = graphed_ms(product, [(x, w) for w in weights])
    nbytes = weights[0].numel() * weights[0].element_size()
    return {"shape": list(weights[0].shape), "us": ms * 1000, "tb_per_s": nbytes / ms / 1e9}


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    if any(tag in name for tag in ("gemv", "gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk")):
        return "matmul"
    if any(tag in name for tag in ("fmha", "attention", "flash", "efficient")):
        return "attention"
    if name.startswith("triton"):
        return "triton (fused)"
    return "other"


def profile_decode(mode: ExecutionMode, workspace, steps: int) -> tuple[dict[str, dict[str, float]], list]:
    """Kernel count and GPU time by kind over `steps` decode steps, per step; the most launched kernels."""
    from torch.profiler import ProfilerActivity, profile

    workspace.point_at(1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            mode.decode(workspace)
        torch.cuda.synchronize()
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"kernels": 0.0, "ms": 0.0})
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("Memcpy"):
            ms = event.time_range.elapsed_us() / 1000 / steps
            kinds[kind_of(event.name)]["kernels"] += 1 / steps
            kinds[kind_of(event.name)]["ms"] += ms
            names[event.name[:90]][0] += 1 / steps
            names[event.name[:90]][1] += ms
    top = sorted(names.items(), key=lambda item: -item[1][0])[:30]
    return dict(kinds), [{"kernel": name, "per_step": round(n, 1), "ms": round(ms, 4)} for name, (n, ms) in top]


def profile_prefill(mode: ExecutionMode, transformer: Transformer, prompt: list[int]) -> dict:
    """One prefill (a batch of one step) under the profiler: its host wall time, the GPU's kernel time and
    count, the CUDA graphs the host launched, and the host operations that took longest (self time)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        started = time.perf_counter()
        generate_batch(transformer, BatchSpec([prompt], 1, pad_id=0), mode)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1000
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in kernels:
        by_name[event.name[:90]][0] += 1
        by_name[event.name[:90]][1] += event.time_range.elapsed_us() / 1000
    host = defaultdict(float)
    for event in profiler.key_averages():
        host[event.key[:80]] += event.self_cpu_time_total / 1000
    return {"wall_ms_profiled": wall_ms, "kernels": len(kernels),
            "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1000,
            "graph_launches": sum(1 for e in profiler.events() if e.name == "cudaGraphLaunch"),
            "host_self_ms_top": dict(sorted(host.items(), key=lambda item: -item[1])[:10]),
            "kernels_top": [{"kernel": name, "count": n, "ms": round(ms, 4)}
                            for name, (n, ms) in sorted(by_name.items(), key=lambda item: -item[1][1])[:15]]}


def measure_decode(transformer: Transformer, compilation: str, graphs: str, prompt: list[int], steps: int,
                   **mode_options) -> dict:
    mode = ExecutionMode(transformer, CompilationMode(compilation), CUDAGraphMode(graphs), **mode_options)
    mode.plan(len(prompt), steps)
    for _ in range(1 + mode.calls_to_warm):  # compile, record, then one more warm pass
        output = generate_batch(transformer, BatchSpec([prompt], steps, pad_id=0), mode)
    ttfts = [float(generate_batch(transformer, BatchSpec([prompt], steps, pad_id=0), mode).step_ms[0])
             for _ in range(4)]  # after warm-up: is the time to first token steady from batch to batch?
    row = {"mode": f"{compilation}/{graphs}", "step_p50_ms": float(np.median(output.step_ms[1:])),
           "ttft_ms": float(output.step_ms[0]), "ttft_ms_next": ttfts,
           "digests_hash": hash_bytes(output.digests.astype("<i8").tobytes()),  # rows of equal bits: equal hashes
           "tokens_hash": hash_bytes(output.tokens.astype("<i8").tobytes()),
           "prefill": profile_prefill(mode, transformer, prompt)}
    workspace = next(iter(mode.workspaces.values()), mode.last_workspace)
    kinds, top = profile_decode(mode, workspace, 8)
    kernel_ms = sum(k["ms"] for k in kinds.values())
    row.update(kernels_per_step=round(sum(k["kernels"] for k in kinds.values()), 1), kernel_ms=kernel_ms,
               idle_share=max(0.0, 1 - kernel_ms / row["step_p50_ms"]),
               by_kind={name: {"kernels": round(k["kernels"], 1), "ms": round(k["ms"], 4)} for name, k in kinds.items()},
               top_kernels=top)
    return row


def projections_report(report: dict, transformer: Transformer, gemv_grid: bool) -> None:
    """Each projection's bandwidth by cuBLAS, cuBLASLt and the Triton GEMV (and its block grid, if asked)."""
    layers = transformer.layers
    report["projections"] = {name: projection_bandwidth([getattr(w, name) for w in layers])
                             for name in ("qkv", "o", "gate_up", "down")}
    report["projections"]["lm_head"] = projection_bandwidth([transformer.lm_head] * 2)
    default_blas = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the other cuBLAS front end, for comparison
    report["projections_cublaslt"] = {name: projection_bandwidth([getattr(w, name) for w in layers])
                                      for name in ("qkv", "o", "gate_up", "down")}
    torch.backends.cuda.preferred_blas_library(default_blas)
    linear.prepare("triton-gemv", "cuda")
    gemv = lambda x, w: linear.linear(x, w, None, "triton-gemv")  # noqa: E731
    report["gemv_blocks"] = {name: "x".join(map(str, linear.blocks(1, getattr(layers[0], name))))
                             for name in ("qkv", "o", "down")}  # the weights the GEMV takes at batch 1
    report["projections_triton_gemv"] = {name: projection_bandwidth([getattr(w, name) for w in layers], gemv)
                                         for name in ("qkv", "o", "gate_up", "down")}
    report["projections_triton_gemv"]["lm_head"] = projection_bandwidth([transformer.lm_head] * 2, gemv)
    if gemv_grid:
        from evalrun.engine.linear_triton_kernel import launch

        report["gemv_grid"] = {
            name: {f"{bn}x{bk}x{warps}": projection_bandwidth(
                [getattr(w, name) for w in layers], lambda x, w, c=(bn, bk, warps): launch(x, w, None, *c))["tb_per_s"]
                for bn, bk, warps in GEMV_GRID} for name in ("qkv", "o", "gate_up", "down")}


def glu_grid_report(report: dict, transformer: Transformer) -> None:
    """The gate/up GEMV (linear_kernel=triton-gemv-glu) at batch 1 at each GLU_GRID blocks, over every layer's
    gate/up weight in one graph: read TB/s into report["glu_grid"] (how GLU_BLOCKS is chosen; a row cannot try
    other blocks in this process: Inductor's graph cache keeps the blocks the op was first compiled with)."""
    from evalrun.engine.linear_triton_kernel import launch_glu

    weights = [w.gate_up for w in transformer.layers]
    grid = {f"{bn}x{bk}x{warps}": projection_bandwidth(
        weights, lambda x, w, c=(bn, bk, warps): launch_glu(x, w, None, *c)) for bn, bk, warps in GLU_GRID}
    report["glu_grid"] = {"gate_up": {name: row["tb_per_s"] for name, row in grid.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--gemv-grid", action="store_true", help="time the Triton GEMV at other block sizes too")
    parser.add_argument("--glu-grid", action="store_true", help="time the gate/up GEMV (triton-gemv-glu) at GLU_GRID's "
                        "blocks")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: projections, eager "
                        "(the eager and graphless steps), o2 (-O2 without the GEMV), gemv (-O2 with it), split-kv (the "
                        "step with the split-KV attention), residual, kv-write (the step with the MLP's residual add, or "
                        "the KV write, separate), pdl-inductor, combo, levers, levers-glu, "
                        "levers-combine-kernel, levers-o3, levers-o3-deterministic, levers-glu-o3, levers-glu-descent, "
                        "levers-glu-norm-kernel, levers-glu-o3-norm-kernel, "
                        "levers-argmax, levers-torch-merge, levers-both, levers-copies")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    use_evalrun_cache()  # Inductor's caches keyed by the engine code, as a run's: no graph compiled by other code
    loaded = load_model(args.model, "cuda", args.dtype)
    transformer = Transformer(loaded.model)
    weights_bytes = sum(p.numel() * p.element_size() for name, p in loaded.model.named_parameters()
                        if "embed_tokens" not in name)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "dtype": args.dtype, "weights_read_per_step_gb": weights_bytes / 1e9, "copy_tb_per_s": copy_bandwidth()}
    report["bandwidth_limit_tokens_per_s"] = report["copy_tb_per_s"] * 1e12 / weights_bytes
    if "projections" not in skip:
        projections_report(report, transformer, args.gemv_grid)
    prompt = loaded.tokenizer("The capital of France is")["input_ids"]
    report.update(prompt_tokens=len(prompt), steps=args.steps)  # what the rows' digests were computed over
    modes = (("none", "none"), ("piecewise", "none")) if "eager" not in skip else ()
    modes = (*modes, ("piecewise", "full-and-piecewise")) if "o2" not in skip else modes
    report["decode"] = [measure_decode(transformer, c, g, prompt, args.steps) for c, g in modes]
    gemv = transformer.with_linear_kernel("triton-gemv")
    # -O2 with the GEMV, then that step again side by side with one thing changed (each row skippable by name):
    # attention by the split-KV kernel; the MLP's residual added by its own kernel, not the GEMV's epilogue; the KV
    # cache written by its own index_copy; Inductor's kernels launched with programmatic dependent launch (torch 2.11 on
    # the H200: 0.2% faster, other digests, so no knob offers it); Inductor's combo kernels (independent kernels of a
    # piece launched as one). Then the levers together (split-KV, combo kernels), and those with -O3's Inductor options.
    # Each row's digests say whether its bits changed. (Measured here and dropped, stop 17: the GEMV computing the
    # RMSNorm before q/k/v and silu(gate) * up before down itself, h200-decode-breakdown-prologues*.json; gate/up and
    # the head by the GEMV, h200-decode-breakdown-gemv-large.json.)
    pdl = {"inductor_options": {"triton.enable_pdl": True}}  # Inductor's kernels with programmatic dependent launch
    combo = {"inductor_options": {"combo_kernels": True}}
    o3 = {"inductor_options": {"combo_kernels": True, "max_autotune": True, "coordinate_descent_tuning": True}}
    split_kv = gemv.with_attention_kernel("triton-split-kv")
    split_kv_glu = transformer.with_linear_kernel("triton-gemv-glu").with_attention_kernel("triton-split-kv")
    split_kv_glu_norm = split_kv_glu.with_norm_kernel("triton")  # the norms by norm_triton's kernel
    o3_deterministic = {"inductor_options": {**o3["inductor_options"], "deterministic": True}}
    descent = {"inductor_options": {**o3["inductor_options"], "max_autotune": False}}  # -O3 less max-autotune
    separate_residual = ((transformer_module, "RESIDUAL_IN_PROJECTION", False),)
    separate_combine = ((attention_triton, "COMBINE_IN_LAST_PROGRAM", False),)  # split-KV's second kernel (stop 19)
    own_argmax = ((generate_module, "GREEDY_FROM_CAPTURE", False),)  # the greedy token by argmax (before stop 22)
    torch_merge = ((capture_triton, "MERGE_IN_KERNEL", False),)  # the capture's chunks merged by torch ops (before 22)
    copies = ((capture_triton, "MERGE_INTO_BUFFERS", False),)  # the merge's outputs copied into the buffers (before 23)
    if args.glu_grid:
        glu_grid_report(report, transformer)
    rows = [("gemv", "", gemv, {}, ()),
            ("split-kv", " +triton-split-kv", split_kv, {}, ()),
            ("residual", ", residual add separate", gemv, {}, separate_residual),
            ("kv-write", ", KV write separate", gemv, {"kv_write_in_piece": False}, ()),
            ("pdl-inductor", " +Inductor PDL", gemv, pdl, ()),
            ("combo", " +Inductor combo kernels", gemv, combo, ()),
            ("levers", " +split-kv +combo", split_kv, combo, ()),
            ("levers-glu", " +split-kv +combo, gate/up and the activation by one GEMV", split_kv_glu,
             combo, ()),
            ("levers-combine-kernel", " +split-kv +combo, split-KV's chunks combined by a second kernel", split_kv,
             combo, separate_combine),
            ("levers-o3", " +split-kv +combo, -O3's Inductor options", split_kv, o3, ()),
            ("levers-o3-deterministic", " +split-kv +combo, -O3's Inductor options in its deterministic mode", split_kv,
             o3_deterministic, ()),
            ("levers-glu-o3", " +split-kv +combo, -O3's Inductor options", split_kv_glu, o3, ()),
            ("levers-glu-descent", " +split-kv +combo, coordinate descent without max-autotune", split_kv_glu, descent,
             ()),
            ("levers-glu-norm-kernel", " +split-kv +combo, gate/up by one GEMV, the norms by one Triton kernel",
             split_kv_glu_norm, combo, ()),
            ("levers-glu-o3-norm-kernel", " +split-kv +combo, -O3's Inductor options, the norms by one Triton kernel",
             split_kv_glu_norm, o3, ()),
            ("levers-argmax", " +split-kv +combo, the greedy token by its own argmax (before stop 22)", split_kv, combo,
             own_argmax),
            ("levers-torch-merge", " +split-kv +combo, the capture's chunks merged by torch ops (before stop 22)",
             split_kv, combo, torch_merge),
            ("levers-both", " +split-kv +combo, argmax and the torch merge (before stop 22)", split_kv, combo,
             own_argmax + torch_merge),
            ("levers-copies", " +split-kv +combo, the capture's outputs copied into its buffers (before stop 23)",
             split_kv, combo, copies)]
    for name, label, forward, options, flags in rows:
        if name in skip:
            continue
        torch._dynamo.reset()
        saved = [(module, flag, getattr(module, flag)) for module, flag, _ in flags]
        for module, flag, value in flags:
            setattr(module, flag, value)
        try:
            row = measure_decode(forward, "piecewise", "full-and-piecewise", prompt, args.steps, **options)
        except Exception as error:  # one row failing (a knob this torch lacks) leaves the others measured
            report.setdefault("failed_rows", {})[name] = f"{type(error).__name__}: {str(error)[:300]}"
            print(f"row {name} failed: {report['failed_rows'][name]}", file=sys.stderr)
            continue
        finally:
            for module, flag, value in saved:
                setattr(module, flag, value)
        kernel = forward.variant.linear_kernel  # triton-gemv, or triton-gemv-glu for the levers-glu rows
        report["decode"].append({**row, "mode": f"piecewise/full-and-piecewise +{kernel}{label}"})
        if args.json:  # after each row: a run cut short by a deadline keeps the rows it measured
            Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"{report['device']}  torch {report['torch']}  {args.model} {args.dtype}")
    print(f"copy bandwidth {report['copy_tb_per_s']:.2f} TB/s -> limit {report['bandwidth_limit_tokens_per_s']:.0f} tok/s "
          f"({report['weights_read_per_step_gb']:.2f} GB read per step)")
    for name, row in report.get("projections", {}).items():
        lt, tg = report["projections_cublaslt"].get(name), report["projections_triton_gemv"][name]
        print(f"  {name:8s} {str(row['shape']):16s} {row['us']:8.1f} us  {row['tb_per_s']:.2f} TB/s"
              + (f"   cublaslt {lt['us']:8.1f} us  {lt['tb_per_s']:.2f} TB/s" if lt else "")
              + f"   linear_kernel=triton-gemv {tg['us']:8.1f} us  {tg['tb_per_s']:.2f} TB/s")
    for name, grid in report.get("gemv_grid", {}).items():
        best = max(grid, key=grid.get)
        print(f"  gemv grid {name:8s} best {best} {grid[best]:.2f} TB/s  ("
              + ", ".join(f"{k} {v:.2f}" for k, v in grid.items()) + ")")
    for row in report["decode"]:
        kinds = "  ".join(f"{k} {v['kernels']:.0f}x {v['ms']:.3f} ms" for k, v in sorted(row["by_kind"].items()))
        print(f"  {row['mode']:62s} step {row['step_p50_ms']:.3f} ms ({1000 / row['step_p50_ms']:.1f} tok/s)  "
              f"{row['kernels_per_step']:.0f} kernels  idle {row['idle_share']:.0%}  {kinds}  "
              f"digests {row['digests_hash'][:12]} tokens {row['tokens_hash'][:12]}")
        prefill = row["prefill"]
        print(f"      TTFT {row['ttft_ms']:.1f} ms, then " + ", ".join(f"{t:.1f}" for t in row["ttft_ms_next"])
              + f"; one prefill: {prefill['wall_ms_profiled']:.1f} ms on the host (profiled), "
              f"{prefill['kernels']} kernels {prefill['kernel_ms']:.2f} ms, {prefill['graph_launches']} graph launches")
    for name, grid in report.get("glu_grid", {}).items():
        print(f"  gate/up GEMV grid {name} best {max(grid, key=grid.get)} ("
              + ", ".join(f"{k} {v:.2f}" for k, v in grid.items()) + " TB/s)")
    none = {"top_kernels": [], "prefill": {"kernels_top": []}}  # the gemv row skipped
    gemv_row = next((row for row in report["decode"] if row["mode"].endswith("+triton-gemv")), none)
    for entry in gemv_row["top_kernels"]:  # the -O2 step with the GEMV as the engine runs it
        print(f"    {entry['per_step']:6.1f}x/step {entry['ms']:.4f} ms  {entry['kernel']}")
    print("  its prefill's longest kernels:")
    for entry in gemv_row["prefill"]["kernels_top"]:
        print(f"    {entry['count']:6d}x {entry['ms']:.4f} ms  {entry['kernel']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
