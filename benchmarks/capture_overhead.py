"""Benchmark: decode time with and without the on-device capture, side by side in one process.

Runs the same decode loop alternately with capture on and off (after a warm-up of each) and prints
the median decode time of each and their ratio. Decode time excludes prefill (step 0).

  python benchmarks/capture_overhead.py --model random:smollm2 --device cpu
  python benchmarks/capture_overhead.py --model random:llama3-8b --device cuda --dtype bfloat16
  python benchmarks/capture_overhead.py --model random:llama3-8b --device cuda --opt-level 2 --compare-kernels

`--opt-level 2` runs the A/B in -O2's execution mode (piecewise compile, full-and-piecewise graphs).
`--compare-kernels` (CUDA) also times the capture alone, replayed in a CUDA graph, with the torch ops
and with the fused Triton kernel at several chunk sizes, and runs the A/B once per kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch

from evalrun.engine import capture_triton, generate
from evalrun.engine.driver import generate_batch
from evalrun.engine.generate import BatchSpec, CaptureBuffers, capture_step
from evalrun.config import CompilationMode, CUDAGraphMode
from evalrun.engine.modes import ExecutionMode
from evalrun.engine.timing import StepClock
from evalrun.engine.transformer import Transformer
from evalrun.models import load_model

PROMPT = "Benchmarks measure what a change costs, side by side, in one process, on one machine."


def decode_ms(model: Transformer, prompts: list[list[int]], steps: int, capture: bool, mode=None) -> float:
    output = generate_batch(model, BatchSpec(prompts, steps, pad_id=0, capture=capture), mode)
    return float(output.step_ms[1:].sum())


@contextlib.contextmanager
def capture_kernel_forced(kernel: str | None):
    """Within: capture_step uses the torch ops ("torch") or the fused Triton kernel ("triton-fused");
    None leaves the choice to the engine."""
    original = generate.fused_capture_supported
    if kernel is not None:
        generate.fused_capture_supported = lambda logits, top_k: kernel == "triton-fused"
    try:
        yield
    finally:
        generate.fused_capture_supported = original


def isolated_capture_ms(model: Transformer, batch: int, steps: int, top_k: int = 8, in_graph: bool = False) -> float:
    """Mean time of the capture alone on one step's logits [B, V], timed on the device (events on CUDA).

    In eager mode on a GPU the host's kernel-launch time dominates a decode step and drifts by more
    than the capture costs, so the A/B above is noisy there; this isolates the capture's own cost.
    `in_graph`: the steps are replayed as one CUDA graph, as -O2 runs them (no launch cost).
    """
    logits = torch.randn(batch, model.vocab_size, device=model.device).to(model.dtype)
    spec = BatchSpec([[0]] * batch, steps, pad_id=0, top_k=top_k)
    buffers = CaptureBuffers.allocate(batch, steps, model.vocab_size, spec, model.dtype, model.device)
    seeds = torch.zeros(batch, dtype=torch.int64, device=model.device)
    index = torch.arange(steps, device=model.device)

    def all_steps():
        for step in range(steps):
            capture_step(logits, index[step:step + 1], buffers, top_k, 0.0, seeds)

    all_steps()  # warm-up
    run = all_steps
    if in_graph:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_steps()
        graph.replay()
        run = graph.replay
    clock = StepClock(model.device)
    clock.start()
    for _ in range(5 if in_graph else 1):
        run()
    clock.mark()
    return float(clock.elapsed_ms()[0]) / steps / (5 if in_graph else 1)


def build_mode(opt_level: int | None, cudagraph: bool, model: Transformer):
    if opt_level == 2:
        graphs = CUDAGraphMode.FULL_AND_PIECEWISE if model.device.type == "cuda" else CUDAGraphMode.NONE
        return ExecutionMode(model, CompilationMode.PIECEWISE, graphs)
    return ExecutionMode(model, CompilationMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY) if cudagraph else None


def ab(model: Transformer, prompts: list[list[int]], args, kernel: str | None) -> dict:
    """Decode with capture on and off, alternated; a fresh execution mode, so graphs hold this kernel."""
    with capture_kernel_forced(kernel):
        torch._dynamo.reset()
        mode = build_mode(args.opt_level, args.cudagraph, model)
        for capture in (True, False):  # warm-up: allocator, kernels selection, caches, compiles
            decode_ms(model, prompts, args.max_new_tokens, capture, mode)
        on, off = [], []
        for _ in range(args.repeats):  # alternate so drift in clocks or load hits both alike
            on.append(decode_ms(model, prompts, args.max_new_tokens, True, mode))
            off.append(decode_ms(model, prompts, args.max_new_tokens, False, mode))
    ratio = statistics.median(on) / statistics.median(off)
    step_ms = statistics.median(off) / (args.max_new_tokens - 1)
    return {"kernel": kernel or capture_triton.capture_kernel(model.device, model.dtype, 8),
            "decode_ms_with_capture": statistics.median(on), "decode_ms_without_capture": statistics.median(off),
            "ratio": ratio, "capture_overhead_percent": (ratio - 1) * 100, "decode_step_ms_without_capture": step_ms}


def compare_kernels(model: Transformer, args, step_ms: float) -> dict:
    """The capture alone in a CUDA graph: torch ops vs the fused kernel at several chunk sizes."""
    rows = {}
    with capture_kernel_forced("torch"):
        rows["torch"] = isolated_capture_ms(model, args.batch_size, args.max_new_tokens, in_graph=True)
    default_chunk = capture_triton.CHUNK
    try:
        for chunk in (512, 1024, 2048, 4096):
            capture_triton.CHUNK = chunk
            with capture_kernel_forced("triton-fused"):
                rows[f"triton-fused chunk {chunk}"] = isolated_capture_ms(model, args.batch_size,
                                                                         args.max_new_tokens, in_graph=True)
    finally:
        capture_triton.CHUNK = default_chunk
    return {name: {"ms_per_step": ms, "percent_of_step": ms / step_ms * 100} for name, ms in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--opt-level", type=int, choices=[2], default=None,
                        help="Run the A/B in -O2's execution mode (piecewise compile, full-and-piecewise graphs).")
    parser.add_argument("--compare-kernels", action="store_true",
                        help="CUDA: A/B once per capture kernel (torch ops, fused Triton), and each alone in a graph.")
    parser.add_argument("--cudagraph", action="store_true",
                        help="Replay each decode step as one CUDA graph (eager kernels inside): on a GPU this takes the "
                             "host's launch jitter out of the A/B, which otherwise exceeds the capture's cost.")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    loaded = load_model(args.model, args.device, dtype)
    model = Transformer(loaded.model)
    prompts = [loaded.tokenizer(PROMPT)["input_ids"]] * args.batch_size
    kernels = ["torch", "triton-fused"] if args.compare_kernels else [None]
    runs = [ab(model, prompts, args, kernel) for kernel in kernels]
    step_ms = runs[0]["decode_step_ms_without_capture"]
    capture_ms = isolated_capture_ms(model, args.batch_size, args.max_new_tokens)
    result = {"model": args.model, "device": args.device, "dtype": dtype, "batch_size": args.batch_size,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cudagraph": args.cudagraph,
              "opt_level": args.opt_level, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              **runs[-1], "runs": runs,
              "isolated_capture_ms_per_step": capture_ms, "isolated_capture_percent_of_step": capture_ms / step_ms * 100}
    if args.compare_kernels:
        result["in_graph_capture_by_kernel"] = compare_kernels(model, args, step_ms)
    print(json.dumps(result, indent=2))
    for run in runs:
        print(f"capture overhead ({run['kernel']}): {run['capture_overhead_percent']:+.2f}% of decode time A/B "
              f"({args.model}, {args.device}, {dtype}, step {run['decode_step_ms_without_capture']:.3f} ms)")
    for name, row in result.get("in_graph_capture_by_kernel", {}).items():
        print(f"capture alone in a CUDA graph, {name}: {row['ms_per_step'] * 1000:.1f} us = "
              f"{row['percent_of_step']:.2f}% of the step")


if __name__ == "__main__":
    main()
