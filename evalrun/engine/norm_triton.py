"""RMSNorms by one Triton kernel (norm_triton_kernel.py), chosen by the run's `norm_kernel` knob (issue #16).

Why: compiled, a norm is an Inductor reduction whose launch configuration Inductor may choose by timing. Under
-O3 (coordinate descent) that choice, made on each kernel alone, made the two norms a layer of Llama-3-8B's
decode step up to twice as slow in the step as untuned (0.313 and 0.256 against 0.158 and 0.145 ms a step in two
runs on the H200, stop 42; stop 37 saw the same), so -O3's step was slower than -O2's. `norm_kernel=triton` computes every norm the engine's `norm()`
computes (the input and post-attention norms, the final norm, Gemma's sandwich norms) with a kernel of fixed
blocks instead, registered as a torch op that Inductor launches as it is. It is another reduction order, so other
bits: a knob in the config hash, never on by default, refused where it cannot run (config.validate), and the
golden's reference and oracle run without it (golden.py). It takes rows of at most MAX_LENGTH elements of a
Triton dtype on a CUDA device (or interpreted), contiguous or evenly spaced (a batch's last tokens before the head);
other inputs stay with torch, as do the per-head q/k norms of Qwen3 and Gemma 3 (transformer.torch_norm, fused by
Inductor with the rotary after them) and an MoE layer's norm.
"""

from __future__ import annotations

import torch

from ..config import TRITON_DTYPE_NAMES
from ..errors import ConfigError
from .triton_ops import INTERPRETED, refuse_unregistrable

MAX_LENGTH = 1 << 15  # elements a row: one program holds the whole row
DTYPES = tuple(getattr(torch, name) for name in TRITON_DTYPE_NAMES)
_OP: dict = {}  # "op": the registered torch op, once prepare() ran on a CUDA device with Triton


def prepare(kernel: str, device: torch.device | str) -> None:
    """Register the kernel as a torch op for a CUDA device, once, before anything is compiled (triton_ops)."""
    if kernel != "triton" or "op" in _OP or INTERPRETED:
        return
    refuse_unregistrable("norm_kernel", kernel, "aten", device)
    from torch.library import triton_op, wrap_triton

    from . import norm_triton_kernel

    @triton_op("evalrun::rms_norm", mutates_args={})
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        return norm_triton_kernel.launch(x, weight, eps, offset, wrap_triton)

    _OP["op"] = rms_norm


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes the norm of x [..., n] with weight [n]: contiguous, or rows [M, n] evenly spaced;
    one Triton dtype, rows of at most MAX_LENGTH, on a CUDA device (or interpreted)."""
    n = x.shape[-1]
    rows_apart = x.dim() == 2 and x.stride(-1) == 1 and x.stride(0) >= n
    return ((x.is_contiguous() or rows_apart) and x.numel() > 0 and 1 <= n <= MAX_LENGTH and x.dtype in DTYPES
            and weight.dim() == 1 and weight.shape[0] == n and weight.is_contiguous() and weight.dtype == x.dtype
            and (x.is_cuda or INTERPRETED))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm of x [..., n] scaled by weight [n] (Gemma's 1 + weight where `offset`), where applies() said so."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, n], a view: x is contiguous or rows [M, n]
    if INTERPRETED:
        from .norm_triton_kernel import launch

        return launch(rows, weight, eps, offset).view(x.shape)
    if "op" not in _OP:  # asked for and never prepared: refused, not run as torch's norm
        raise ConfigError("norm_kernel=triton needs a CUDA device with Triton; use norm_kernel=aten")
    return _OP["op"](rows, weight, eps, offset).view(x.shape)
