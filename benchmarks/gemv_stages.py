"""Does pipelining the GEMV's K loop (Triton's `tl.range(..., num_stages=S)`: S - 1 weight tiles in flight per
program, copied into shared memory with cp.async) hide the latency each tile waits for? (issue #16)

  python benchmarks/gemv_stages.py [--layers 32] [--json PATH]

Compiled for the H200 with S = 1 (the engine's GEMV as it was), each program of Llama-3-8B's q/k/v GEMV reads its 8
weight rows as 8 tiles in turn, each waited for before the next is asked for: a line through the three small
products (stop 22) costs 3.9 us a kernel before the weights stream. With S > 1 the next tiles are already on their
way while one is multiplied. Each projection of Llama-3-8B's shape (q/k/v, o, down by `linear_kernel=triton-gemv`,
gate/up by `triton-gemv-glu`), over every layer's weights in turn in one CUDA graph (the L2 never holds them), at
the engine's blocks and at others, for S = 1..4: time per layer, TB/s of weights read, and whether the outputs are
the engine's bits (the same blocks and S = 1). A chain (each GEMV reading the one before's output) too at the
engine's blocks. Same products in the same order at any S, so the same bits at the same BLOCK_K.

Measured and dropped (stop 37, `benchmarks/results/h200-gemv-pipelined.json`): at the engine's blocks only o (11.32 ->
10.64 us at S = 3) and gate/up (57.34 -> 56.37 at S = 2) gained, q/k/v and down lost; smaller tiles caught up with
the engine's blocks when pipelined, to within 0.6%. The engine runs S = 1; the kernels keep the parameter for this
benchmark. (The down chain pads each output to K with one more kernel, so its chain rows time that kernel too.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_breakdown import graphed_ms, per_layer_arguments  # noqa: E402
from evalrun.engine import linear  # noqa: E402
from evalrun.engine.linear_triton_kernel import launch, launch_glu  # noqa: E402

SHAPES = {"qkv": (6144, 4096, launch), "o": (4096, 4096, launch), "down": (4096, 14336, launch),
          "gate_up": (2 * 14336, 4096, launch_glu)}
GEMV_GRID = [(8, 256, 4), (16, 256, 4), (8, 512, 4), (16, 512, 4), (8, 1024, 4)]
GLU_GRID = [(4, 1024, 4), (4, 512, 4), (8, 512, 4), (8, 256, 4)]
STAGES = (1, 2, 3, 4)


def main() -> None:
    args = per_layer_arguments(__doc__)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers, "rows": {}}
    for name, (n, k, kernel) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(args.layers)]
        engine = linear.GLU_BLOCKS[1] if kernel is launch_glu else linear.blocks(1, weights[0])
        grid = [engine] + [b for b in (GLU_GRID if kernel is launch_glu else GEMV_GRID) if b != engine]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k * 2
        reference = [kernel(x, w, None, *engine, stages=1) for w in weights]
        rows = report["rows"][name] = {"engine_blocks": "x".join(map(str, engine)), "variants": {}}
        for blocks in grid:
            for stages in STAGES:
                label = f"{'x'.join(map(str, blocks))} S={stages}"
                try:
                    us = graphed_ms(lambda w, b=blocks, s=stages: kernel(x, w, None, *b, stages=s),
                                    [(w,) for w in weights]) * 1000
                    same = all(torch.equal(kernel(x, w, None, *blocks, stages=stages), r)
                               for w, r in zip(weights, reference))
                except Exception as error:  # a variant over the shared memory: recorded, the others measured
                    rows["variants"][label] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
                    continue
                rows["variants"][label] = {"us": us, "tb_per_s": nbytes / us / 1e6, "same_bits": same}
                print(f"{name:8s} {label:14s} {us:8.2f} us  {nbytes / us / 1e6:.2f} TB/s  same bits {same}",
                      flush=True)
        if kernel is launch:  # a chain: each reads the one before's output (its first k columns, or padded)
            for stages in STAGES:
                def chain(w, s=stages):
                    y = launch(chain.x, w, None, *engine, stages=s)
                    chain.x = y[:, :k] if n >= k else torch.nn.functional.pad(y, (0, k - n))
                    return y
                chain.x = x
                us = graphed_ms(chain, [(w,) for w in weights]) * 1000
                rows["variants"][f"chain {'x'.join(map(str, engine))} S={stages}"] = {"us": us,
                                                                                     "tb_per_s": nbytes / us / 1e6}
                print(f"{name:8s} chain S={stages}      {us:8.2f} us  {nbytes / us / 1e6:.2f} TB/s", flush=True)
        del weights, reference
        torch.cuda.empty_cache()
    for name, rows in report["rows"].items():
        timed = {label: row for label, row in rows["variants"].items() if "us" in row and not label.startswith("chain")}
        best = min(timed, key=lambda label: timed[label]["us"])
        print(f"{name}: engine {rows['engine_blocks']} S=1 {timed[rows['engine_blocks'] + ' S=1']['us']:.2f} us, "
              f"best {best} {timed[best]['us']:.2f} us ({timed[best]['tb_per_s']:.2f} TB/s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
