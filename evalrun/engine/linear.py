"""Who computes a projection: torch's `F.linear` (cuBLAS on CUDA), or for the 1-4 rows of a decode step a
Triton GEMV (linear_triton_kernel.py), chosen by the run's `linear_kernel` knob (issue #16).

At batch 1 a decode step's projections are matrix-vector products bound by reading the weights; cuBLAS
reads the small ones (Llama-3-8B's q/k/v and o) at 2.9-3.1 and 2.4 of the H200's 4.3 TB/s, the GEMV at 3.4
and 2.9. Of the large ones, gate/up (under triton-gemv; triton-gemv-glu below) and the head stay with cuBLAS,
as fast or faster there (benchmarks/decode_breakdown.py --gemv-grid); a single row of a long-row product
(Llama-3-8B's down, K = 14336), which cuBLAS splits over two kernels, takes the GEMV with longer blocks:
4.00 TB/s against cuBLAS's 3.69 in two H200 runs (benchmarks/decode_breakdown.py). The GEMV is another reduction order,
so other bits: a knob in the config hash, never on by default. Which calls it takes is decided by shape alone
(rows <= GEMV_MAX_ROWS and a weight of at most GEMV_MAX_WEIGHT elements, or one row of a larger weight shaped
like a down projection, is_long_row; contiguous rows): a prefill of more than 4 tokens stays on `F.linear`, and
one compiled piece always makes the same choice. Which projections that is depends on the model: Llama-3-8B's
q/k/v and o, and down at batch 1; every projection and the head of SmolLM2-135M; more of them on a
tensor-parallel rank's shards. The golden's reference and oracle run without it (golden.py).

`triton-gemv-glu` is `triton-gemv`, and the 1-4 rows of a SiLU model's gate/up product by a GEMV whose epilogue
applies the activation (silu(gate) * up, linear_triton_kernel.gemv_glu_kernel): one kernel a layer fewer, and
gate/up read by the GEMV instead of cuBLAS, whatever its size.

`gguf-gemv` (CPU) computes those rows from a GGUF model's stored blocks instead (gguf_blocks.py): its weights
are BlockWeights, and a prefill multiplies their dense tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..config import GEMV_MAX_ROWS, TRITON_DTYPE_NAMES  # decode at batch <= 4; more rows: F.linear
from ..errors import ConfigError
from .gguf_blocks import BlockWeight, gemv
from .triton_ops import INTERPRETED, refuse_unregistrable

GEMV_MAX_WEIGHT = 1 << 25  # elements (64 MB in bf16): larger ones stay with cuBLAS, except long-row ones
GEMV_DTYPES = tuple(getattr(torch, name) for name in TRITON_DTYPE_NAMES)
# (BLOCK_N, BLOCK_K, num_warps) by rows padded to a power of two: fixed, so the bits depend on shapes only
# (never autotuned at run time by timing). One row: the best of a grid on the H200 for q/k/v and o
# (benchmarks/decode_breakdown.py --gemv-grid); 2 and 4 rows: the same with the accumulator kept in registers.
GEMV_BLOCKS = {1: (8, 512, 4), 2: (8, 512, 4), 4: (8, 256, 4)}
# One row of a weight over GEMV_MAX_WEIGHT shaped like a down projection (rows at least this long, and longer
# than there are rows: K >= GEMV_LONG_ROW and K > N) takes the GEMV with these blocks: the best of the grid for
# Llama-3-8B's down on the H200 (8x1024x4: 4.00 TB/s, cuBLAS 3.69). Gate/up (but for triton-gemv-glu's, GLU_BLOCKS),
# q/k/v, o and the head of larger models (K <= N) stay with cuBLAS: not measured.
GEMV_LONG_ROW = 8192
GEMV_LONG_BLOCKS = (8, 1024, 4)
# The gate/up GEMV's (BLOCK_N, BLOCK_K, num_warps) by rows padded to a power of two: BLOCK_N outputs read
# 2 * BLOCK_N weight rows. One row: the best of a grid for Llama-3-8B's gate/up on the H200 (4x1024x4: 4.14 TB/s,
# 4x512x4 3.99; benchmarks/decode_breakdown.py --glu-grid); 2 and 4 rows: the accumulators' size of one row's.
GLU_BLOCKS = {1: (4, 1024, 4), 2: (4, 512, 4), 4: (4, 256, 4)}
GLU_ACTIVATIONS = ("silu", "swish")  # what gemv_glu_kernel's epilogue computes
GEMV_KERNELS = ("triton-gemv", "triton-gemv-glu")  # linear_kernel values that run the Triton GEMV
_OP: dict = {}  # "op", "glu": the registered torch ops, once prepare() ran on a CUDA device with Triton


def prepare(kernel: str, device: torch.device | str) -> None:
    """Register the GEMV as a torch op for a CUDA device, once, before anything is compiled (triton_ops)."""
    if kernel not in GEMV_KERNELS or "op" in _OP or INTERPRETED:
        return
    refuse_unregistrable("linear_kernel", kernel, "aten", device)
    from torch.library import triton_op, wrap_triton

    from . import linear_triton_kernel

    @triton_op("evalrun::gemv", mutates_args={})
    def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045 (schema)
             residual: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045 (schema)
        return linear_triton_kernel.launch(x, weight, bias, *blocks(x.shape[0], weight), wrap_triton, residual)

    @triton_op("evalrun::gemv_glu", mutates_args={})
    def gemv_glu(x: torch.Tensor, gate_up: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
        return linear_triton_kernel.launch_glu(x, gate_up, bias, *GLU_BLOCKS[_rows_pow2(x.shape[0])], wrap_triton)

    _OP["op"], _OP["glu"] = gemv, gemv_glu


def blocks(rows: int, weight: torch.Tensor | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for `rows` rows of `weight` [N, K]: fixed by the shapes alone."""
    if weight is not None and weight.numel() > GEMV_MAX_WEIGHT:  # only a long-row product gets here
        return GEMV_LONG_BLOCKS
    return GEMV_BLOCKS[_rows_pow2(rows)]


def _rows_pow2(rows: int) -> int:
    return max(1, 1 << (rows - 1).bit_length())


def is_long_row(weight: torch.Tensor) -> bool:
    """A weight [N, K] shaped like a down projection: rows of at least GEMV_LONG_ROW, longer than N."""
    return weight.shape[1] >= GEMV_LONG_ROW and weight.shape[1] > weight.shape[0]


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the GEMV computes x [..., K] @ weight [N, K]^T (+ bias [N]): few rows of a small weight, or one
    row of a weight with long rows; contiguous rows, one float dtype, a contiguous bias, on a CUDA device (or
    interpreted)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (_gemv_operands(x, weight, bias)
            and (weight.numel() <= GEMV_MAX_WEIGHT or (rows == 1 and is_long_row(weight))))


def glu_applies(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None, activation: str,
                kernel: str) -> bool:
    """Whether linear_kernel=`kernel` computes act(gate) * up of x [..., K] and gate_up [2I, K] (gate rows, then up
    rows) in one GEMV (gated_linear): triton-gemv-glu, a SiLU activation, the GEMV's operands; any size."""
    return (kernel == "triton-gemv-glu" and activation in GLU_ACTIVATIONS and gate_up.dim() == 2
            and gate_up.shape[0] % 2 == 0 and _gemv_operands(x, gate_up, bias))


def _gemv_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """1-4 contiguous rows x [..., K] of weight [N, K] (contiguous rows), one float dtype, a contiguous bias [N], on a
    CUDA device (or interpreted)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (1 <= rows <= GEMV_MAX_ROWS and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and weight.stride(-1) == 1 and x.dtype == weight.dtype and x.dtype in GEMV_DTYPES
            and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.is_contiguous()))
            and (x.is_cuda or INTERPRETED))


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up [..., I] of x [..., K] by the gate/up GEMV, where glu_applies said it does."""
    _require_prepared("triton-gemv-glu")
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    if INTERPRETED:
        from .linear_triton_kernel import launch_glu

        out = launch_glu(rows, gate_up, bias, *GLU_BLOCKS[_rows_pow2(rows.shape[0])])
    else:
        out = _OP["glu"](rows, gate_up, bias)  # [M, I]
    return out.view(*x.shape[:-1], gate_up.shape[0] // 2)


def _require_prepared(kernel: str) -> None:
    if "op" not in _OP and not INTERPRETED:  # asked for and never prepared: refused, not run as cuBLAS
        raise ConfigError(f"linear_kernel={kernel} needs a CUDA device with Triton; use linear_kernel=aten")


def linear(x: torch.Tensor, weight: "torch.Tensor | BlockWeight", bias: torch.Tensor | None,
           kernel: str = "aten", residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias [N] -> [..., N], by `kernel` (aten | triton-gemv[-glu] | gguf-gemv) where
    it applies; with `residual` [..., N], residual + that. The GEMV adds it in its epilogue (one kernel fewer), with
    the bits of adding it with torch afterwards; compiled, the residual is then a stored tensor of the model dtype,
    where Inductor might otherwise have kept the sum that made it unrounded (transformer.mlp_block)."""
    if kernel == "gguf-gemv":
        return _plus(residual, _block_linear(x, weight, bias))
    if kernel not in GEMV_KERNELS:
        return _plus(residual, F.linear(x, weight, bias))
    _require_prepared(kernel)
    if not gemv_applies(x, weight, bias):
        return _plus(residual, F.linear(x, weight, bias))
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    fused = (residual is not None and residual.is_contiguous() and residual.dtype == x.dtype
             and residual.shape == (*x.shape[:-1], weight.shape[0]))
    into = residual.view(rows.shape[0], weight.shape[0]) if fused else None  # [M, N]
    if INTERPRETED:
        from .linear_triton_kernel import launch

        out = launch(rows, weight, bias, *blocks(rows.shape[0], weight), residual=into)
    else:
        out = _OP["op"](rows, weight, bias, into)  # [M, N]
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if fused else _plus(residual, out)


def _plus(residual: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    return out if residual is None else residual + out


def _block_linear(x: torch.Tensor, weight: "torch.Tensor | BlockWeight", bias: torch.Tensor | None) -> torch.Tensor:
    """linear_kernel=gguf-gemv: 1-4 float32 CPU rows read the weight's GGUF blocks (gguf_blocks.py); more rows
    (a prefill) multiply its dense tensor. A weight without blocks is refused, never computed another way."""
    if not isinstance(weight, BlockWeight):
        raise ConfigError("linear_kernel=gguf-gemv needs the projections of a GGUF model read by gguf_blocks.attach; "
                          "use linear_kernel=aten")
    rows = x.numel() // max(1, x.shape[-1])
    if not (1 <= rows <= GEMV_MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"):
        return F.linear(x, weight.dense, bias)
    out = gemv(x.reshape(rows, x.shape[-1]).contiguous(), weight.blocks)  # [M, N]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])
