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

from evalrun.engine.generate import generate_batch
from evalrun.engine.transformer import Transformer
from evalrun.models import load_model

PROMPT = "Benchmarks measure what a change costs, side by side, in one process, on one machine."


def decode_ms(model: Transformer, prompts: list[list[int]], steps: int, capture: bool) -> float:
    output = generate_batch(model, prompts, steps, pad_id=0, capture=capture)
    return float(output.step_ms[1:].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    loaded = load_model(args.model, args.device, dtype)
    model = Transformer(loaded.model)
    prompts = [loaded.tokenizer(PROMPT)["input_ids"]] * args.batch_size
    for capture in (True, False):  # warm-up: allocator, kernels selection, caches
        decode_ms(model, prompts, args.max_new_tokens, capture)
    on, off = [], []
    for _ in range(args.repeats):  # alternate so drift in clocks or load hits both alike
        on.append(decode_ms(model, prompts, args.max_new_tokens, True))
        off.append(decode_ms(model, prompts, args.max_new_tokens, False))
    ratio = statistics.median(on) / statistics.median(off)
    result = {"model": args.model, "device": args.device, "dtype": dtype, "batch_size": args.batch_size,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "decode_ms_with_capture": statistics.median(on), "decode_ms_without_capture": statistics.median(off),
              "ratio": ratio, "capture_overhead_percent": (ratio - 1) * 100}
    print(json.dumps(result, indent=2))
    print(f"capture overhead: {(ratio - 1) * 100:+.2f}% of decode time ({args.model}, {args.device}, {dtype})")


if __name__ == "__main__":
    main()
