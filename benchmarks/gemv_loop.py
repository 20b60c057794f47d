"""Two ways to read the GEMV's weights faster at the same bits, measured and dropped (stop 19, issue #16).

  python benchmarks/gemv_loop.py OUT_UNROLL.json OUT_STAGES.json     (CUDA)

Llama-3-8B's q/k/v [6144, 4096], o [4096, 4096] and down [4096, 14336] at batch 1, bfloat16, every layer's weight in
turn (32, so the L2 cache never holds them), one CUDA graph (decode_breakdown.graphed_ms): time per layer.
1. The K loop unrolled (`UNROLL`: the same steps in the same order, so the loads of later steps may be issued
   early) against the loop, at the engine's blocks, with the bits of both compared.
2. The loop's software-pipelining depth (`num_stages` 1-6, the same arithmetic), and four other block shapes.
Results: `benchmarks/results/h200-gemv-unroll.json`, `h200-gemv-stages.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_breakdown import graphed_ms  # noqa: E402
from evalrun.engine.linear import blocks  # noqa: E402
from evalrun.engine.linear_triton_kernel import gemv_kernel, launch  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
OTHER_BLOCKS = ((4, 1024, 4), (16, 256, 4), (8, 512, 8), (2, 2048, 4))


def staged(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, warps: int, stages: int) -> torch.Tensor:
    """One row x [1, K] @ w [N, K]^T by the GEMV at these blocks and pipelining depth."""
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    gemv_kernel[(triton.cdiv(n, block_n),)](x, w, x, x, y, 1, n, x.stride(0), w.stride(0), y.stride(0), k,
                                            HAS_BIAS=False, HAS_RESIDUAL=False, EVEN=True, ROWS_POW2=1,
                                            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def timed(product, x: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, float]:
    ms = graphed_ms(product, [(x, w) for w in weights], warmups=2)
    return {"us": ms * 1000, "tb_per_s": weights[0].numel() * weights[0].element_size() / ms / 1e9}


def main() -> None:
    torch.manual_seed(0)
    unrolled, stages = {}, {}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(32)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        config = blocks(1, weights[0])
        row = {"blocks": config}
        for label, unroll in (("loop", False), ("unrolled", True), ("loop again", False), ("unrolled again", True)):
            row[label] = timed(lambda xx, w, u=unroll: launch(xx, w, None, *config, unroll=u), x, weights)
        row["same_bits"] = all(torch.equal(launch(x, w, None, *config), launch(x, w, None, *config, unroll=True))
                               for w in weights[:4])
        unrolled[name] = row
        reference = launch(x, weights[0], None, *config)
        row = {"blocks": config}
        for depth in range(1, 7):
            row[f"stages {depth}"] = {**timed(lambda xx, w, d=depth: staged(xx, w, *config, d), x, weights),
                                      "same_bits": bool(torch.equal(staged(x, weights[0], *config, depth), reference))}
        for other in OTHER_BLOCKS:
            for depth in (3, 5):
                row[f"{other} stages {depth}"] = timed(lambda xx, w, c=other, d=depth: staged(xx, w, *c, d), x, weights)
        stages[name] = row
        print(name, json.dumps(unrolled[name]), json.dumps(row), flush=True)
        del weights
    Path(sys.argv[1]).write_text(json.dumps(unrolled, indent=1))
    Path(sys.argv[2]).write_text(json.dumps(stages, indent=1))


if __name__ == "__main__":
    main()
