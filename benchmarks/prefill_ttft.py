"""Time to first token by CUDA graph mode, side by side in one process, and where the host spends a prefill.

  python benchmarks/prefill_ttft.py [--shape llama3-8b] [--modes full-and-piecewise,piecewise,full] [--json PATH]
                                    [--profile DIR]

random:llama3-8b's shape (seeded weights, built without a tokenizer: no GGUF needed), bf16 on the GPU, with the
decode levers of issue #16 (Triton GEMV, split-KV attention, combo kernels), a 6-token prompt (the 16-token
prefill bucket). Each mode is compiled afresh and warmed up as the runner does, then ten batches of two steps:
the time to first token of each (device time from the prefill's start to its token), their host wall time, the
decode step p50 of the warm-up's 64 steps, and the first digests (equal rows: equal bits). `--profile DIR` also
writes a cProfile of five prefills per mode (where the host time goes). Stop 18 (README, Measured): -O2's
prefill under Inductor's graph trees took 15.5 ms for 5.2 ms of kernels; under the engine's piecewise graphs
(engine/piece_graphs.py) 5.9-6.0 ms.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evalrun.config import CompilationMode, CUDAGraphMode  # noqa: E402
from evalrun.engine.driver import generate_batch  # noqa: E402
from evalrun.engine.generate import BatchSpec  # noqa: E402
from evalrun.engine.modes import ExecutionMode, allow_recompiles_for  # noqa: E402
from evalrun.engine.transformer import Transformer  # noqa: E402
from evalrun.models import _random_module, fill_seeded  # noqa: E402

PROMPT = [1, 415, 6333, 302, 4843, 349]


def measure(forward: Transformer, graphs: str, profile_dir: Path | None) -> dict:
    torch._dynamo.reset()
    mode = ExecutionMode(forward, CompilationMode.PIECEWISE, CUDAGraphMode(graphs), inductor_options={"combo_kernels": True})
    mode.plan(len(PROMPT), 64)
    for _ in range(1 + mode.calls_to_warm):
        warm = generate_batch(forward, BatchSpec([PROMPT], 64, pad_id=0), mode)
    ttfts, walls = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        started = time.perf_counter()
        output = generate_batch(forward, BatchSpec([PROMPT], 2, pad_id=0), mode)
        walls.append((time.perf_counter() - started) * 1000)
        ttfts.append(float(output.step_ms[0]))
    if profile_dir is not None:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            generate_batch(forward, BatchSpec([PROMPT], 1, pad_id=0), mode)
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
        (profile_dir / f"cprofile-{graphs}.txt").write_text(text.getvalue())
    return {"ttft_ms": ttfts, "wall_ms": walls, "step_p50_ms": float(np.median(warm.step_ms[1:])),
            "digests": warm.digests[0, :8].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--modes", default="full-and-piecewise,piecewise,full")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--profile", metavar="DIR")
    args = parser.parse_args()
    model = _random_module(args.shape, torch.device("cuda"))
    fill_seeded(model, 0)
    forward = Transformer(model.to(torch.bfloat16)).with_linear_kernel("triton-gemv")
    forward = forward.with_attention_kernel("triton-split-kv")
    allow_recompiles_for((16, 32, 64, 128, 256, 512, 1024, 2048), (1, 2, 4, 8, 16, 32))
    profile_dir = Path(args.profile) if args.profile else None
    report = {}
    for graphs in args.modes.split(","):
        report[graphs] = row = measure(forward, graphs, profile_dir)
        print(f"{graphs:20s} TTFT " + " ".join(f"{t:.1f}" for t in row["ttft_ms"])
              + f" ms  step p50 {row['step_p50_ms']:.3f} ms  digests {row['digests'][0]}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
