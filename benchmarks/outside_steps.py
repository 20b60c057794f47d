"""What a run's tokens/s pays outside its clocked steps (the timings' `outside_steps_s`), with and without batches
overlapped, side by side in one process.

`evalrun run` clocks each batch's prefill and decode steps with device events; tokens/s also counts the time between
them: a batch's padding and loading, its copy to the host and step-clock readout, and its results (tokens decoded to
text, hashes). Since stop 23 the runner enqueues the next batch before it makes a batch's results
(`runner.OVERLAP_BATCHES`), so on a GPU most of that host work runs while the device computes. This runs one configuration
twice in one process (the same compiled model): each batch made before the next is enqueued, then overlapped; for
each its tokens/s, `outside_steps_s` and the host time of each part of the measured batches (waiting for the device
included: one batch at a time, the copy to the host waits for its batch; overlapped, `PendingBatch.wait` does).

  python benchmarks/outside_steps.py --model random:llama3-8b --device cuda --dtype bfloat16 --prompts smoke \\
      --max-new-tokens 128 --set linear_kernel=triton-gemv --set cudagraph_mode=full
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any, Callable

from evalrun import runner
from evalrun.config import RunConfig, parse_set_option
from evalrun.engine import generate, modes, timing


def timed(totals: dict[str, list[float]], name: str, function: Callable) -> Callable:
    """`function` with each call's host wall time added to totals[name]."""

    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name].append((time.perf_counter() - started) * 1000)

    return call


def instrument(totals: dict[str, list[float]]) -> None:
    parts = [(runner, "batch_spec", "batch spec"), (generate.PaddedBatch, "build", "padding"),
             (modes, "load_batch", "load into the workspace"),
             (generate.CaptureBuffers, "copy_to_host", "copy to the host, enqueued"),
             (generate.PendingBatch, "wait", "wait for the device"),
             (timing.StepClock, "elapsed_ms", "step clock readout"),
             (runner, "to_results", "results (decode, hashes)")]
    for owner, attribute, name in parts:
        original = owner.__dict__[attribute]
        if isinstance(original, classmethod):
            setattr(owner, attribute, classmethod(timed(totals, name, original.__func__)))
        else:
            setattr(owner, attribute, timed(totals, name, original))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", default="smoke")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--opt-level", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config knob, as evalrun's")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    knobs = dict(parse_set_option(item) for item in args.set)
    base = dict(model=args.model, device=args.device, dtype=args.dtype, prompts=args.prompts,
                max_new_tokens=args.max_new_tokens, opt_level=args.opt_level)
    config = RunConfig(**{**base, **knobs})  # a knob --set names wins over the option of the same field
    totals: dict[str, list[float]] = defaultdict(list)
    instrument(totals)
    prepared = runner.prepare(config)
    mode = prepared.execution_mode()
    start_measuring = mode.start_measuring
    mode.start_measuring = lambda: totals.clear() or start_measuring()  # the parts of measured batches, not warm-up
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "rows": []}
    for overlap in (False, True):
        runner.OVERLAP_BATCHES = overlap
        run = runner.execute_run(config, None, prepared=prepared)
        batches = len(run.plan)
        report["rows"].append({
            "overlap_batches": overlap, "batches": batches, "generate_ms": run.timings["generate_s"] * 1000,
            "outside_steps_ms": run.timings["outside_steps_s"] * 1000, "tokens_per_s": run.timings["tokens_per_s"],
            "tokens_digest": run.tokens_digest, "logits_digest": run.logits_digest,
            "parts_ms": {name: sum(values) for name, values in totals.items()}})
    runner.OVERLAP_BATCHES = True
    first = report["rows"][0]
    print(f"{args.model} {args.device} {args.dtype}, {first['batches']} batches, same digests: "
          f"{all(r['logits_digest'] == first['logits_digest'] for r in report['rows'])}")
    for row in report["rows"]:
        print(f"  {'batches overlapped' if row['overlap_batches'] else 'one batch at a time'}: "
              f"generate {row['generate_ms']:.1f} ms, outside the clocked steps {row['outside_steps_ms']:.2f} ms, "
              f"{row['tokens_per_s']:.1f} tok/s")
        for name, ms in row["parts_ms"].items():
            print(f"    {name:36s} {ms:8.2f} ms")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
