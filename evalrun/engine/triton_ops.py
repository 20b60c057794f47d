"""Registering evalrun's Triton kernels as torch ops, so `torch.compile(fullgraph=True)` traces through
them and a CUDA graph captures their launches (capture_triton.py, linear.py).

A registration happens once, eagerly, before any step Dynamo could trace (Dynamo cannot trace one), and
only for a CUDA device with Triton installed: importing Triton costs a CPU-only command a second it never
needs. Under `TRITON_INTERPRET=1` (tests on the CPU) the kernels are called directly, unregistered.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..errors import ConfigError

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton runs kernels on the CPU (tests)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def can_register(device: torch.device | str) -> bool:
    """Whether a kernel is registered for `device`: a CUDA device, Triton installed, not interpreted."""
    return torch.device(device).type == "cuda" and not INTERPRETED and triton_installed()


def refuse_unregistrable(knob: str, value: str, default: str, device: torch.device | str) -> None:
    """One line naming the fix where a knob's Triton kernel cannot be registered: not a CUDA device (config.validate
    refuses this first; here for forwards built without it), or no Triton."""
    if torch.device(device).type != "cuda":
        raise ConfigError(f"{knob}={value} is a CUDA kernel; on CPU use {knob}={default}")
    if not can_register(device):
        raise ConfigError(f"{knob}={value} needs Triton, which this torch lacks; install triton, or use {knob}={default}")
