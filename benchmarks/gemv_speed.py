"""Benchmark (CUDA): a decode step's projections by cuBLAS, cuBLASLt and the Triton GEMV, side by side.

For each projection shape of a model at 1 (and 2, 4) rows: the time of one product replayed in a CUDA
graph (`triton.testing.do_bench_cudagraph`), as -O2 runs it, and the weight-read bandwidth it reaches;
the Triton GEMV at the engine's block sizes (engine/linear.GEMV_BLOCKS) and at a grid of alternatives,
which is how those block sizes were chosen. Prints JSON.

  python benchmarks/gemv_speed.py --model random:llama3-8b
  python benchmarks/gemv_speed.py --shapes qkv=6144x4096,o=4096x4096 --rows 1,2,4
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from evalrun.engine import linear

CANDIDATES = [(8, 256, 4), (16, 128, 4), (16, 256, 4), (16, 512, 4), (32, 128, 4), (32, 256, 4), (32, 256, 8),
              (64, 128, 4), (8, 512, 4), (16, 256, 8), (4, 512, 4), (16, 64, 4), (16, 128, 8)]


def model_shapes(ref: str) -> dict[str, tuple[int, int]]:
    """Each projection of `ref`'s config as (out N, in K), without building the model."""
    from evalrun.models import RANDOM_SHAPES

    c = RANDOM_SHAPES[ref.removeprefix("random:")]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    dim = c.get("head_dim") or c["hidden_size"] // heads
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    return {"qkv": ((heads + 2 * kv) * dim, hidden), "o": (hidden, heads * dim), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "head": (c["vocab_size"], hidden)}


def timed_us(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=100)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--shapes", help="NAME=NxK,... instead of the model's")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    linear.prepare("triton-gemv", device)
    from evalrun.engine.linear_triton_kernel import launch

    shapes = ({name: tuple(int(v) for v in size.split("x")) for name, _, size in
               (item.partition("=") for item in args.shapes.split(","))} if args.shapes else model_shapes(args.model))
    results = []
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device=device, dtype=dtype)
            row = {"projection": name, "n": n, "k": k, "rows": rows, "weight_mb": n * k * weight.element_size() / 1e6}
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                row[f"{library}_us"] = timed_us(lambda: F.linear(x, weight))
            torch.backends.cuda.preferred_blas_library("cublas")
            grid = {}
            for block_n, block_k, warps in CANDIDATES:
                if block_k > k:
                    continue
                grid[f"{block_n}x{block_k}w{warps}"] = timed_us(lambda: launch(x, weight, None, block_n, block_k, warps))
            engine = linear.blocks(rows)
            row["triton_engine_blocks"] = f"{engine[0]}x{engine[1]}w{engine[2]}"
            row["triton_engine_us"] = timed_us(lambda: linear.linear(x, weight, None, "triton-gemv"))
            row["triton_grid_us"] = grid
            best = min(grid, key=grid.get)
            row["triton_best"], row["triton_best_us"] = best, grid[best]
            for key in ("cublas_us", "cublaslt_us", "triton_engine_us", "triton_best_us"):
                row[key.replace("_us", "_tb_s")] = n * k * weight.element_size() / (row[key] * 1e-6) / 1e12
            results.append(row)
    print(json.dumps({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "results": results}, indent=1))


if __name__ == "__main__":
    main()
