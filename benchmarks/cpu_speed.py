"""The CPU speed target: the engine against transformers' own generate, side by side in one run.

    python benchmarks/cpu_speed.py                       # SmolLM2-135M float32, default prompts, 32 tokens
    python benchmarks/cpu_speed.py --prompts smoke --target 1.4

Each side is a fresh process (`evalrun bench --matrix O0` and transformers' eager `generate` through
evalrun.hf_baseline, batch 1, the same prompts and token count), so neither inherits the other's warm
state. Prints both rows and the ratio of tokens/s; exits 1 when the engine is below the target ratio
(default 1.4x, issue #16), 2 when a side failed. `make bench` runs it.
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
    parser.add_argument("--target", type=float, default=1.4, help="The least ratio engine / transformers that passes.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    request = BenchRequest(model=args.model, prompts=args.prompts, dtype="float32", device="cpu",
                           max_new_tokens=args.max_new_tokens, matrix_names="O0", baselines=("eager",))
    rows = run_bench(request, lambda name: print(f"cpu_speed: {name}", file=sys.stderr, flush=True))
    ours, theirs = rows[0], rows[1]
    if ours.get("error") or theirs.get("error"):
        print(f"cpu_speed: a side failed: {ours.get('error') or theirs.get('error')}", file=sys.stderr)
        return 2
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    result = {"model": args.model, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "engine_tokens_per_s": ours["tokens_per_s"], "transformers_tokens_per_s": theirs["tokens_per_s"],
              "ratio": ratio, "target": args.target, "passes": ratio >= args.target}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.model} float32 on CPU, prompts {args.prompts}, {args.max_new_tokens} tokens: engine -O0 "
              f"{ours['tokens_per_s']:.1f} tok/s, transformers generate {theirs['tokens_per_s']:.1f} tok/s: "
              f"{ratio:.2f}x (target >= {args.target:g}x: {'pass' if result['passes'] else 'BELOW'})")
    return 0 if result["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
