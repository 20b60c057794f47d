"""Fault injection: planted numeric changes in a loaded model, for tests and calibration only.

Each fault makes the engine compute a different function from the same files, after the model's
identity was hashed, so the identity gate cannot see it: what the verdict's checks must catch.
Nothing in evalrun imports this module; no config key, preset, flag or golden can reach it. Tests
and `benchmarks/calibrate.py` plant a fault through the `hook` argument of `create_golden` /
`verify_golden`, which is called on every model those load:

    verify_golden(golden, config, hook=fault_hook(Fault("scale", 1e-4)))

Kinds (`layer` defaults to the middle layer):
  scale          one MLP tensor (down projection) x (1 + magnitude)
  int8           every projection of one layer fake-quantized to int8 (symmetric, per output row)
  rope_theta     rotary base x (1 + magnitude)
  norm_eps       RMSNorm epsilon x magnitude
  mask_position  one prompt position (slot 1) hidden from every later query
  sign_flip      the sign of one output channel of one MLP down projection
  swap_layers    layers `layer` and `layer + 1` swapped
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .modes import build_execution_mode
from .transformer import Transformer

KINDS = ("scale", "int8", "rope_theta", "norm_eps", "mask_position", "sign_flip", "swap_layers")
_PLANTED = "_evalrun_planted_faults"  # on the HF module: faults already applied to its weights


@dataclass(frozen=True)
class Fault:
    kind: str
    magnitude: float = 0.0
    layer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}; use one of {KINDS}")

    def describe(self) -> str:
        where = "" if self.layer is None else f" layer {self.layer}"
        size = {"scale": f" x(1{self.magnitude:+g})", "rope_theta": f" x(1{self.magnitude:+g})",
                "norm_eps": f" x{self.magnitude:g}"}.get(self.kind, "")
        return f"{self.kind}{size}{where}"


def _layer(model: torch.nn.Module, fault: Fault) -> int:
    count = len(model.model.layers)
    return fault.layer if fault.layer is not None else count // 2


@torch.no_grad()
def _fake_int8(weight: torch.Tensor) -> None:
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(weight.dtype).tiny) / 127
    weight.copy_((weight / scale).round().clamp(-127, 127) * scale)


@torch.no_grad()
def plant_in_weights(model: torch.nn.Module, fault: Fault) -> None:
    """Faults that live in the HF module (weights, rotary table, config): once per loaded model."""
    planted = getattr(model, _PLANTED, set())
    if fault in planted:
        return
    layer = model.model.layers[_layer(model, fault)]
    if fault.kind == "scale":
        layer.mlp.down_proj.weight.mul_(1 + fault.magnitude)
    elif fault.kind == "int8":
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            _fake_int8(module.weight)
    elif fault.kind == "sign_flip":
        layer.mlp.down_proj.weight[0].neg_()
    elif fault.kind == "rope_theta":
        inv_freq = model.model.rotary_emb.inv_freq  # theta^(-2i/D): a new base scales it by (1+m)^(-2i/D)
        exponents = torch.arange(inv_freq.numel(), dtype=torch.float64, device=inv_freq.device) / inv_freq.numel()
        inv_freq.mul_(((1 + fault.magnitude) ** -exponents).to(inv_freq.dtype))
    elif fault.kind == "norm_eps":
        model.config.rms_norm_eps *= fault.magnitude
    setattr(model, _PLANTED, planted | {fault})


def _mask_position(transformer: Transformer, position: int = 1) -> None:
    """Wrap `attend` so that key slot `position` is hidden from every query after it."""
    original = transformer.attend

    def attend(index, q, kv, slots, mask, cache):
        rows_per_query = mask.shape[2] // slots.shape[0]
        later = (slots > position).repeat(rows_per_query)[None, None, :, None]  # [1, 1, R*T, 1]
        column = mask[..., position:position + 1]
        blocked = torch.where(later, torch.full_like(column, float("-inf")), column)
        return original(index, q, kv, slots, torch.cat([mask[..., :position], blocked, mask[..., position + 1:]], -1),
                        cache)

    transformer.attend = attend


def plant(prepared: Any, fault: Fault) -> None:
    """Plant `fault` in a runner.Prepared: its weights, then its engine (the execution mode is built
    here, on a faulted Transformer, so compiled pieces and graphs see the fault too)."""
    model = prepared.loaded.model
    plant_in_weights(model, fault)
    transformer = Transformer(model, prepared.config.attn_implementation)
    if fault.kind == "swap_layers":
        index = _layer(model, fault)
        transformer.layers[index], transformer.layers[index + 1] = transformer.layers[index + 1], transformer.layers[index]
    elif fault.kind == "mask_position":
        _mask_position(transformer)
    prepared.mode = build_execution_mode(transformer, prepared.config)


def fault_hook(fault: Fault) -> Callable[[Any], None]:
    """A hook for `create_golden` / `verify_golden` that plants `fault` in every model they load."""
    return lambda prepared: plant(prepared, fault)
