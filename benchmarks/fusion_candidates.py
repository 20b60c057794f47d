"""Measure candidate decode fusions on the GPU before building them into the engine (issue #16).

  python benchmarks/fusion_candidates.py [--layers 32] [--json PATH]

Each candidate is timed against what the -O2 engine runs today for the same work, both replayed from one
CUDA graph over `--layers` layers of distinct Llama-3-8B-shaped bf16 weights (so the L2 cache never holds
them), at batch 1. Per layer, side by side:

  norm + q/k/v   Inductor's RMSNorm kernel, then the Triton GEMV (linear_kernel=triton-gemv)
                 vs one GEMV whose prologue normalises x (each program recomputes x's norm from L2)
  SiLU.up + down Inductor's SiLU.up kernel, then cuBLAS's down (split-K: two kernels)
                 vs the Triton GEMV for down after the same SiLU.up kernel
                 vs one GEMV whose prologue computes SiLU(gate).up from gate/up's output

The fused kernels round where the engine rounds (the norm and SiLU.up to bf16 before the product), so their
outputs are compared with the engine's (max abs difference printed: other reduction orders, not other maths).
Prototypes only: nothing here is reachable from a config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_breakdown import graphed_ms, per_layer_arguments  # noqa: E402
from evalrun.engine import linear  # noqa: E402
from evalrun.engine.linear_triton_kernel import launch  # noqa: E402
from evalrun.engine.transformer import rms_norm  # noqa: E402

HIDDEN, INTER, QKV = 4096, 14336, 6144
EPS = 1e-5


@triton.jit
def normed_gemv_kernel(x_ptr, norm_ptr, w_ptr, y_ptr, eps, k: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """y [N] = (norm_w * rmsnorm(x)) @ w [N, K]^T for one row, the normed x rounded to bf16 as the engine does."""
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    lanes = tl.arange(0, BLOCK_K)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        x = tl.load(x_ptr + start + lanes).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / k + eps)
    w_rows = w_ptr + outs.to(tl.int64)[:, None] * k  # [BN, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + lanes
        normed = (tl.load(x_ptr + ks).to(tl.float32) * rstd).to(tl.bfloat16)
        scaled = (tl.load(norm_ptr + ks).to(tl.float32) * normed.to(tl.float32)).to(tl.bfloat16)
        acc += scaled.to(tl.float32)[None, :] * tl.load(w_rows + ks[None, :]).to(tl.float32)
    tl.store(y_ptr + outs, tl.sum(acc, axis=1).to(tl.bfloat16))


@triton.jit
def silu_gemv_kernel(gate_up_ptr, w_ptr, y_ptr, k: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y [N] = (silu(gate) * up) @ w [N, K]^T for one row, gate_up [2K] = (gate, up); SiLU.up rounded to bf16."""
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + outs.to(tl.int64)[:, None] * k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + lanes
        gate = tl.load(gate_up_ptr + ks).to(tl.float32)
        up = tl.load(gate_up_ptr + k + ks).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16)
        acc += act.to(tl.float32)[None, :] * tl.load(w_rows + ks[None, :]).to(tl.float32)
    tl.store(y_ptr + outs, tl.sum(acc, axis=1).to(tl.bfloat16))


def normed_gemv(x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, blocks=(8, 512, 4)) -> torch.Tensor:
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    block_n, block_k, warps = blocks
    normed_gemv_kernel[(weight.shape[0] // block_n,)](x, norm, weight, y, EPS, x.shape[-1], BLOCK_N=block_n,
                                                      BLOCK_K=block_k, num_warps=warps)
    return y


def silu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, blocks=(8, 1024, 4)) -> torch.Tensor:
    y = torch.empty(1, weight.shape[0], dtype=gate_up.dtype, device=gate_up.device)
    block_n, block_k, warps = blocks
    silu_gemv_kernel[(weight.shape[0] // block_n,)](gate_up, weight, y, weight.shape[1], BLOCK_N=block_n,
                                                    BLOCK_K=block_k, num_warps=warps)
    return y


def graph_us(step, inputs: list[tuple]) -> float:
    """Device time per layer of step(*inputs[i]) for every layer, replayed from one CUDA graph."""
    return graphed_ms(step, inputs, warmups=2) * 1000


def main() -> None:
    args = per_layer_arguments(__doc__)
    bf16, cuda = torch.bfloat16, "cuda"
    linear.prepare("triton-gemv", cuda)
    qkv = [torch.randn(QKV, HIDDEN, dtype=bf16, device=cuda) * 0.02 for _ in range(args.layers)]
    down = [torch.randn(HIDDEN, INTER, dtype=bf16, device=cuda) * 0.02 for _ in range(args.layers)]
    norm_w = torch.rand(HIDDEN, dtype=bf16, device=cuda) + 0.5
    x = torch.randn(1, HIDDEN, dtype=bf16, device=cuda)
    gate_up = torch.randn(1, 2 * INTER, dtype=bf16, device=cuda)
    qkv_bytes, down_bytes = qkv[0].numel() * 2, down[0].numel() * 2

    def engine_norm_qkv(x, n, w):
        return linear.linear(rms_norm(x, n, EPS), w, None, "triton-gemv")

    def engine_mlp_down(gu, w, kernel):
        gate, up = gu.chunk(2, dim=-1)
        return linear.linear(F.silu(gate) * up, w, None, kernel)

    options = {"triton.cudagraphs": False}
    norm_qkv = torch.compile(engine_norm_qkv, fullgraph=True, dynamic=False, options=options)
    mlp_down = torch.compile(engine_mlp_down, fullgraph=True, dynamic=False, options=options)
    silu_up = torch.compile(lambda gu: F.silu(gu[:, :INTER]) * gu[:, INTER:], fullgraph=True, dynamic=False,
                            options=options)
    rows = {
        "norm+qkv: Inductor norm, GEMV": graph_us(norm_qkv, [(x, norm_w, w) for w in qkv]),
        "norm+qkv: GEMV with norm prologue": graph_us(normed_gemv, [(x, norm_w, w) for w in qkv]),
        "silu.up+down: Inductor silu.up, cuBLAS": graph_us(lambda gu, w: mlp_down(gu, w, "aten"),
                                                           [(gate_up, w) for w in down]),
        "silu.up+down: Inductor silu.up, GEMV 8x1024x4": graph_us(
            lambda gu, w: launch(silu_up(gu), w, None, 8, 1024, 4),
            [(gate_up, w) for w in down]),
        "silu.up+down: GEMV with silu.up prologue": graph_us(silu_gemv, [(gate_up, w) for w in down]),
    }
    for blocks in ((8, 512, 4), (4, 1024, 4), (8, 2048, 8), (16, 1024, 8)):
        rows[f"silu.up+down: prologue GEMV {'x'.join(map(str, blocks))}"] = graph_us(
            lambda gu, w, b=blocks: silu_gemv(gu, w, b), [(gate_up, w) for w in down])
    for blocks in ((8, 1024, 4), (4, 512, 2)):
        rows[f"norm+qkv: prologue GEMV {'x'.join(map(str, blocks))}"] = graph_us(
            lambda x, n, w, b=blocks: normed_gemv(x, n, w, b), [(x, norm_w, w) for w in qkv])
    differences = {
        "norm+qkv": float((normed_gemv(x, norm_w, qkv[0]).float() - norm_qkv(x, norm_w, qkv[0]).float()).abs().max()),
        "silu.up+down": float((silu_gemv(gate_up, down[0]).float() - mlp_down(gate_up, down[0], "aten").float())
                              .abs().max()),
        "scale": float(mlp_down(gate_up, down[0], "aten").float().abs().max()),
    }
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "us_per_layer": rows, "max_abs_difference": differences,
              "tb_per_s": {name: (qkv_bytes if name.startswith("norm") else down_bytes) / us / 1e6
                           for name, us in rows.items()}}
    print(f"{report['device']}  torch {report['torch']}  per layer, one CUDA graph over {args.layers} layers")
    for name, us in rows.items():
        print(f"  {name:52s} {us:7.2f} us  ({report['tb_per_s'][name]:.2f} TB/s of weights)")
    print("  max abs difference from the engine's kernels:", differences)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
