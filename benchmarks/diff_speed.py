"""Benchmark: `evalrun diff` of two stored runs of 1,000 prompts x 256 steps (synthetic arrays).

Both runs are written through the store's own API; the timed part is what `evalrun diff` does:
load both runs from SQLite and compare every prompt step by step (no tokenizer decoding).

  python benchmarks/diff_speed.py [--prompts 1000] [--steps 256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from evalrun.diff import diff_runs, load_run
from evalrun.store import PromptResult, Store


def synthetic_results(prompts: int, steps: int, top_k: int, seed: int, noise: float) -> list[PromptResult]:
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(0)
    results = []
    for index in range(prompts):
        values = np.sort(base.normal(size=(steps, top_k)).astype(np.float32), axis=-1)[:, ::-1]
        values = values + rng.normal(scale=noise, size=values.shape).astype(np.float32)
        ids = np.argsort(base.random(size=(steps, 49152)), axis=-1)[:, :top_k] if index == 0 else \
            base.integers(0, 49152, size=(steps, top_k))
        tokens = ids[:, 0].astype(np.int64)
        digests = base.integers(-2**62, 2**62, size=(steps, 2))
        if noise:
            digests = digests + rng.integers(0, 2, size=digests.shape)
        arrays = {"input_ids": np.arange(20, dtype=np.int64), "tokens": tokens, "digests": digests,
                  "topk_ids": ids.astype(np.int64), "topk_values": values, "margins": values[:, 0] - values[:, 1]}
        results.append(PromptResult(index, f"p{index}", {"id": f"p{index}", "prompt": "x"}, index, 0, 20, steps, -1,
                                    "", "t", "l", arrays))
    return results


def header(prompts: int) -> dict:
    return {"config": {"dtype": "bfloat16", "device": "cuda"}, "config_hash": "c", "environment": {"torch": "2.11"},
            "environment_hash": "e", "model": {"hash": "m", "ref": "synthetic"},
            "prompt_set": {"hash": "p", "name": "synthetic", "count": prompts}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        store = Store(Path(directory) / "bench.db")
        ids = []
        for seed, noise in ((1, 0.0), (2, 0.01)):
            run_id = store.begin_run(header(args.prompts))
            store.finish_run(run_id, synthetic_results(args.prompts, args.steps, args.top_k, seed, noise), {}, "t", "l")
            ids.append(run_id)
        started = time.perf_counter()
        a, b = load_run(ids[0], store), load_run(ids[1], store)
        loaded = time.perf_counter()
        result = diff_runs(a, b)
        finished = time.perf_counter()
    rows = args.prompts * args.steps
    seconds = finished - started
    print(json.dumps({"prompts": args.prompts, "steps": args.steps, "load_s": loaded - started,
                      "compare_s": finished - loaded, "total_s": seconds, "prompt_steps_per_s": rows / seconds,
                      "compared_prompts": len(result.prompts)}, indent=2))
    print(f"diff of {args.prompts} prompts x {args.steps} steps: {seconds:.2f} s ({rows / seconds:,.0f} rows/s)")


if __name__ == "__main__":
    main()
