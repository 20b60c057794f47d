"""Benchmark: what `batch_invariant=true` costs, side by side with the default engine in one process.

For each batch size, runs the same prompt set with the default engine and with batch_invariant on,
alternating, `--rounds` times each after a warm-up, and prints the median tokens/s of each and their
ratio (batch-invariant / default). Tokens/s counts every generated token of the run (prefill included
in the time, as `evalrun run` reports it). The model is loaded once and shared.

  PYTHONPATH=. python benchmarks/batch_invariant_cost.py --model random:tiny --batch-sizes 1,16
  PYTHONPATH=. python benchmarks/batch_invariant_cost.py --model smollm2-135m --batch-sizes 1,16
  python benchmarks/batch_invariant_cost.py --device cuda --dtype bfloat16 -O0      # the H200 row (later)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from evalrun.config import RunConfig
from evalrun.runner import Prepared, effective_config, execute, prepare


def synthetic_prompts(count: int = 16) -> str:
    """`count` prompts of 8 to 68 words (varied lengths, so a batch pads), as a JSONL file; its path."""
    words = "the river runs past old towns where people trade grain salt and stories each season".split()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as file:
        for index in range(count):
            text = " ".join(words[(index + k) % len(words)] for k in range(8 + 4 * index))
            file.write(json.dumps({"id": f"p{index}", "prompt": text}) + "\n")
    return file.name


def measure(base: Prepared, batch_size: int, rounds: int) -> dict:
    runs = {flag: prepare(base.config.replace(batch_size=batch_size, batch_invariant=flag), reuse=base)
            for flag in (False, True)}
    speeds: dict[bool, list[float]] = {False: [], True: []}
    for prepared in runs.values():  # warm-up: allocator, compile where a mode compiles
        execute(prepared, timed=False)
    for _ in range(rounds):
        for flag, prepared in runs.items():
            speeds[flag].append(execute(prepared, timed=False).timings["tokens_per_s"])
    default, invariant = statistics.median(speeds[False]), statistics.median(speeds[True])
    return {"batch_size": batch_size, "default_tokens_per_s": round(default, 1),
            "batch_invariant_tokens_per_s": round(invariant, 1), "ratio": round(invariant / default, 3),
            "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--prompts", default="synthetic", help="synthetic (16 prompts of 8-68 words) or a set")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("-O", "--opt-level", dest="opt_level", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prompts = synthetic_prompts() if args.prompts == "synthetic" else args.prompts
    config = RunConfig(model=args.model, prompts=prompts, device=args.device, dtype=args.dtype,
                       opt_level=args.opt_level, max_new_tokens=args.max_new_tokens)
    base = prepare(effective_config(config))
    rows = [measure(base, int(size), args.rounds) for size in args.batch_sizes.split(",")]
    header = {"model": args.model, "prompts": args.prompts, "device": base.config.device, "dtype": base.config.dtype,
              "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        print(json.dumps(header, indent=2))
        return
    print(f"{args.model} {args.prompts} {base.config.device} {base.config.dtype}, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds")
    print(f"{'batch':>5}  {'default tok/s':>13}  {'batch-invariant tok/s':>21}  {'ratio':>6}")
    for row in rows:
        print(f"{row['batch_size']:>5}  {row['default_tokens_per_s']:>13.1f}  {row['batch_invariant_tokens_per_s']:>21.1f}"
              f"  {row['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
