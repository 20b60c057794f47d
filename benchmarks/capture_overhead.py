"""Benchmark: decode time with and without the on-device capture, side by side in one process.

Runs the same decode loop alternately with capture on and off (after a warm-up of each) and prints
the median decode time of each and their ratio. Decode time excludes prefill (step 0).

  python benchmarks/capture_overhead.py --model random:smollm2 --device cpu
  python benchmarks/capture_overhead.py --model random:llama3-8b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

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


def isolated_capture_ms(model: Transformer, batch: int, steps: int, top_k: int = 8) -> float:
    """Mean time of the capture alone on one step's logits [B, V], timed on the device (events on CUDA).

    In eager mode on a GPU the host's kernel-launch time dominates a decode step and drifts by more
    than the capture costs, so the A/B above is noisy there; this isolates the capture's own cost.
    """
    logits = torch.randn(batch, model.vocab_size, device=model.device).to(model.dtype)
    spec = BatchSpec([[0]] * batch, steps, pad_id=0, top_k=top_k)
    buffers = CaptureBuffers.allocate(batch, steps, model.vocab_size, spec, model.dtype, model.device)
    seeds = torch.zeros(batch, dtype=torch.int64, device=model.device)
    index = torch.arange(steps, device=model.device)
    for step in range(steps):  # warm-up
        capture_step(logits, index[step:step + 1], buffers, top_k, 0.0, seeds)
    clock = StepClock(model.device)
    clock.start()
    for step in range(steps):
        capture_step(logits, index[step:step + 1], buffers, top_k, 0.0, seeds)
    clock.mark()
    return float(clock.elapsed_ms()[0]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cudagraph", action="store_true",
                        help="Replay each decode step as one CUDA graph (eager kernels inside): on a GPU this takes the "
                             "host's launch jitter out of the A/B, which otherwise exceeds the capture's cost.")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    loaded = load_model(args.model, args.device, dtype)
    model = Transformer(loaded.model)
    prompts = [loaded.tokenizer(PROMPT)["input_ids"]] * args.batch_size
    mode = ExecutionMode(model, CompilationMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY) if args.cudagraph else None
    for capture in (True, False):  # warm-up: allocator, kernels selection, caches
        decode_ms(model, prompts, args.max_new_tokens, capture, mode)
    on, off = [], []
    for _ in range(args.repeats):  # alternate so drift in clocks or load hits both alike
        on.append(decode_ms(model, prompts, args.max_new_tokens, True, mode))
        off.append(decode_ms(model, prompts, args.max_new_tokens, False, mode))
    ratio = statistics.median(on) / statistics.median(off)
    capture_ms = isolated_capture_ms(model, args.batch_size, args.max_new_tokens)
    step_ms = statistics.median(off) / (args.max_new_tokens - 1)
    result = {"model": args.model, "device": args.device, "dtype": dtype, "batch_size": args.batch_size,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cudagraph": args.cudagraph,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "decode_ms_with_capture": statistics.median(on), "decode_ms_without_capture": statistics.median(off),
              "ratio": ratio, "capture_overhead_percent": (ratio - 1) * 100,
              "isolated_capture_ms_per_step": capture_ms, "decode_step_ms_without_capture": step_ms,
              "isolated_capture_percent_of_step": capture_ms / step_ms * 100}
    print(json.dumps(result, indent=2))
    print(f"capture overhead: {(ratio - 1) * 100:+.2f}% of decode time A/B; capture alone "
          f"{capture_ms:.3f} ms = {capture_ms / step_ms * 100:.2f}% of a {step_ms:.2f} ms step "
          f"({args.model}, {args.device}, {dtype})")


if __name__ == "__main__":
    main()
