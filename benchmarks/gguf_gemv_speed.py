"""The GGUF block GEMV two ways, side by side in one process: engine/gguf_gemv.cpp against Inductor's loop over
gguf_blocks' torch formulas (what linear_kernel=gguf-gemv ran eagerly before it), over the projections of one
SmolLM2-135M decode step (30 layers of Q4_1 q/k/v, o, gate/up and down, and the Q8_0 head, random blocks: the
weights stream from memory as in a run), and the bits of both.

    python benchmarks/gguf_gemv_speed.py            # prints ms a step each way and the ratio
    python benchmarks/gguf_gemv_speed.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evalrun.engine import gguf_blocks  # noqa: E402
from evalrun.engine.gguf_blocks import Blocks  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 30, 576, 1536, 49152
SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))  # qkv, o, gate_up, down


def random_blocks(fmt: str, rows: int, cols: int, generator: torch.Generator) -> Blocks:
    blocks = cols // gguf_blocks.BLOCK
    d = (torch.rand(rows, blocks, generator=generator) * 0.02).half()
    if fmt == "Q8_0":
        return Blocks(fmt, torch.randint(-128, 128, (rows, blocks, 32), generator=generator, dtype=torch.int8), d)
    qs = torch.randint(0, 256, (rows, blocks, 16), generator=generator, dtype=torch.uint8)
    return Blocks(fmt, qs, d, (-torch.rand(rows, blocks, generator=generator) * 0.1).half())


def inductor_kernels(step: list[tuple[torch.Tensor, Blocks]]) -> dict:
    """Inductor's compiled loop for each (format, shapes) of the step, as gguf_blocks built them eagerly before."""
    from torch.fx.experimental.proxy_tensor import make_fx

    compiled = {}
    for x, blocks in step:
        args = (x, blocks.qs, blocks.d) + (() if blocks.m is None else (blocks.m,))
        key = (blocks.format, *(tuple(a.shape) for a in args))
        if key not in compiled:
            compiled[key] = torch._inductor.compile(make_fx(gguf_blocks._KERNELS[blocks.format])(*args), list(args))
    return compiled


def milliseconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    inputs = {cols: torch.randn(1, cols, generator=generator) for cols in (HIDDEN, INTERMEDIATE)}
    step = [(inputs[cols], random_blocks("Q4_1", rows, cols, generator))
            for _ in range(LAYERS) for rows, cols in SHAPES]
    step.append((inputs[HIDDEN], random_blocks("Q8_0", VOCAB, HIDDEN, generator)))
    compiled = inductor_kernels(step)

    def by_inductor(x, blocks):
        args = (x, blocks.qs, blocks.d) + (() if blocks.m is None else (blocks.m,))
        out = compiled[(blocks.format, *(tuple(a.shape) for a in args))](*args)
        return out[0] if isinstance(out, (list, tuple)) else out

    same = all(torch.equal(gguf_blocks.native_gemv(x, b), by_inductor(x, b)) for x, b in step)
    native = milliseconds(lambda: [gguf_blocks.native_gemv(x, b) for x, b in step], args.repeats)
    inductor = milliseconds(lambda: [by_inductor(x, b) for x, b in step], args.repeats)
    result = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "native_ms": native, "inductor_ms": inductor, "speedup": inductor / native, "bit_identical": same}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"one SmolLM2-135M decode step's block GEMVs ({result['cpu_capability']}, {result['threads']} threads): "
              f"native {native:.2f} ms, Inductor {inductor:.2f} ms = {result['speedup']:.2f}x; "
              f"bit-identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
