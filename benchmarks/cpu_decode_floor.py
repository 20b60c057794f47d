"""Where the CPU time goes, prompt by prompt, against the machine's weight-read floor (issue #16).

    python benchmarks/cpu_decode_floor.py                  # SmolLM2-135M float32, default prompts
    python benchmarks/cpu_decode_floor.py --prompts smoke --json
    python benchmarks/cpu_decode_floor.py --linear-kernel gguf-gemv   # the engine's projections from the GGUF blocks

In one process, side by side: for every prompt, evalrun's engine (-O0, eager) and transformers'
`generate` (eager, batch 1), each timed once after a warm-up call: prefill (time to first token) and
the median decode step. Then the floor: the time of one matrix-vector product over a float32 matrix
with as many elements as the model has parameters, the least a decode step can cost when it must read
every weight once from memory. Decode steps of a small model on a CPU are bound by that read, so
the ratio of the two engines' steps cannot exceed transformers' step / floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evalrun.config import RunConfig  # noqa: E402
from evalrun.hf_baseline import timed_generate  # noqa: E402
from evalrun.runner import batch_spec, prepare  # noqa: E402


def weight_read_ms(parameters: int, repeats: int = 10) -> float:
    """Milliseconds of one float32 gemv over `parameters` elements ([parameters / 576, 576] @ [576])."""
    matrix, vector = torch.randn(parameters // 576, 576), torch.randn(576)
    for _ in range(3):
        matrix @ vector
    started = time.perf_counter()
    for _ in range(repeats):
        matrix @ vector
    return (time.perf_counter() - started) / repeats * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", default="default")
    parser.add_argument("--linear-kernel", default="aten", choices=("aten", "gguf-gemv"),
                        help="The engine's projections (transformers' stay its own).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prepared = prepare(RunConfig(model=args.model, prompts=args.prompts, device="cpu", dtype="float32",
                                 linear_kernel=args.linear_kernel))
    engine, hf = prepared.execution_mode(), prepared.loaded.model
    hf.generation_config.pad_token_id = prepared.loaded.tokenizer.eos_token_id
    rows = []
    for index, ids in enumerate(prepared.prompt_set.token_ids):
        spec = batch_spec(prepared, [index])
        engine.generate(spec)  # warm-up
        ours = engine.generate(spec).step_ms
        timed_generate(hf, ids, spec.steps, "eager", torch.device("cpu"))  # warm-up
        ready = timed_generate(hf, ids, spec.steps, "eager", torch.device("cpu"))[1] * 1000  # [steps] ms
        theirs = np.concatenate([ready[:1], np.diff(ready)])
        rows.append({"prompt": prepared.prompt_set.records[index].id, "prompt_tokens": len(ids), "steps": spec.steps,
                     "engine_prefill_ms": float(ours[0]), "engine_step_ms": float(np.median(ours[1:])),
                     "engine_total_ms": float(ours.sum()), "transformers_prefill_ms": float(theirs[0]),
                     "transformers_step_ms": float(np.median(theirs[1:])), "transformers_total_ms": float(theirs.sum())})
    parameters = sum(p.numel() for p in hf.parameters())
    floor = weight_read_ms(parameters)
    step = lambda key: float(np.median([row[key] for row in rows]))  # noqa: E731
    total = lambda key: sum(row[key] for row in rows)  # noqa: E731
    summary = {"model": args.model, "prompts": args.prompts, "linear_kernel": args.linear_kernel,
               "threads": torch.get_num_threads(),
               "parameters": parameters, "weight_read_floor_ms": floor,
               "engine_step_ms": step("engine_step_ms"), "transformers_step_ms": step("transformers_step_ms"),
               "step_ratio": step("transformers_step_ms") / step("engine_step_ms"),
               "step_ratio_limit": step("transformers_step_ms") / floor,
               "engine_floor_fraction": floor / step("engine_step_ms"),
               "prefill_ratio": total("transformers_prefill_ms") / total("engine_prefill_ms"),
               "total_ratio": total("transformers_total_ms") / total("engine_total_ms"), "prompts_detail": rows}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    for row in rows:
        print(f"{row['prompt']:14s} {row['prompt_tokens']:5d} tokens  engine prefill {row['engine_prefill_ms']:7.1f} ms "
              f"step {row['engine_step_ms']:5.1f} ms  transformers prefill {row['transformers_prefill_ms']:7.1f} ms "
              f"step {row['transformers_step_ms']:5.1f} ms")
    print(f"weight-read floor {floor:.1f} ms/step ({parameters / 1e6:.0f}M float32 parameters, "
          f"{summary['threads']} threads); decode step: engine ({args.linear_kernel}) "
          f"{summary['engine_step_ms']:.1f} ms ({summary['engine_floor_fraction']:.0%} of the floor's speed), "
          f"transformers {summary['transformers_step_ms']:.1f} ms; step ratio {summary['step_ratio']:.2f}x (at most "
          f"{summary['step_ratio_limit']:.2f}x at the floor, for float32 weights); "
          f"prefill ratio {summary['prefill_ratio']:.2f}x; whole run {summary['total_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
