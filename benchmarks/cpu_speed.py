"""The CPU speed target: the engine against transformers' own generate, side by side in one run.

    python benchmarks/cpu_speed.py                       # SmolLM2-135M float32, default prompts, 32 tokens
    python benchmarks/cpu_speed.py --prompts smoke --target 1.4
    python benchmarks/cpu_speed.py --repeats 3             # three rounds: medians, and each row's spread

Each row is a fresh process (`evalrun bench --matrix O0,O0+linear_kernel=gguf-gemv` and transformers' eager
`generate` through evalrun.hf_baseline, batch 1, the same prompts and token count), so none inherits
another's warm state. The engine runs twice: with its default projections (`F.linear` over the float32
weights) and with `linear_kernel=gguf-gemv`, whose decode projections read the GGUF file's blocks
(engine/gguf_blocks.py: the same float32 weights, 5.6x fewer bytes). Prints every row and each engine row's
ratio of tokens/s to transformers'; exits 1 when the fastest engine row is below the target ratio (default
1.4x, issue #16), 2 when a row failed. `make bench` runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evalrun.bench import BenchRequest, run_bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", default="default")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--matrix", default="O0,O0+linear_kernel=gguf-gemv",
                        help="The engine's rows (evalrun bench --matrix); the fastest is held to the target.")
    parser.add_argument("--target", type=float, default=1.4, help="The least ratio engine / transformers that passes.")
    parser.add_argument("--repeats", type=int, default=1, help="Rounds of every row (evalrun bench --repeats).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    request = BenchRequest(model=args.model, prompts=args.prompts, dtype="float32", device="cpu",
                           max_new_tokens=args.max_new_tokens, matrix_names=args.matrix, baselines=("eager",),
                           repeats=args.repeats)
    rows = run_bench(request, lambda name: print(f"cpu_speed: {name}", file=sys.stderr, flush=True))
    failed = [row for row in rows if row.get("error")]
    if failed:
        print(f"cpu_speed: {failed[0]['config']} failed: {failed[0]['error']}", file=sys.stderr)
        return 2
    *ours, theirs = rows
    engine = {row["config"]: row["tokens_per_s"] for row in ours}
    ratios = {name: speed / theirs["tokens_per_s"] for name, speed in engine.items()}
    best = max(ratios, key=ratios.get)
    result = {"model": args.model, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "engine_tokens_per_s": engine, "transformers_tokens_per_s": theirs["tokens_per_s"], "ratios": ratios,
              "best": best, "target": args.target, "passes": ratios[best] >= args.target,
              "spread_percent": {row["config"]: row.get("tokens_per_s_spread_percent") for row in rows}}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.model} float32 on CPU, prompts {args.prompts}, {args.max_new_tokens} tokens: transformers "
              f"generate {theirs['tokens_per_s']:.1f} tok/s; "
              + "; ".join(f"engine {name} {engine[name]:.1f} tok/s = {ratios[name]:.2f}x" for name in engine)
              + f" (target >= {args.target:g}x: {'pass' if result['passes'] else 'BELOW'}, by {best})"
              + ("" if args.repeats == 1 else f"; medians of {args.repeats} rounds, tokens/s spread "
                 + ", ".join(f"{name} {spread:.1f}%" for name, spread in result["spread_percent"].items())))
    return 0 if result["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
