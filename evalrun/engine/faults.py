"""Fault injection: planted numeric changes in the engine, for tests and calibration only.

Each fault makes the engine compute a different function from the same files, after the model's
identity was hashed, so the identity gate cannot see it: what the verdict's checks must catch.
Nothing in evalrun imports this module; no config key, preset, flag or golden can reach it. Tests
and `benchmarks/calibrate.py` plant a fault through the `hook` argument of `create_golden` /
`verify_golden`, which is called on every model those prepare:

    verify_golden(golden, config, hook=fault_hook(Fault("scale", 1e-4)))        # the model changed
    verify_golden(golden, config, hook=fault_hook(Fault("mask_position"), only=lambda p: ...))  # one execution

Faults live in the engine's own copy of the affected tensors (the Hugging Face module is never
touched), so a fault planted in one prepared run never leaks into another that shares the weights.
Under --engine transformers the engine is built over a private deep copy of the module instead, with the
fault in the copy's weights (`apply_to_module`: scale, sign_flip, int8 of one MLP output projection).
Kinds (`layer` defaults to the middle layer):
  scale          one MLP tensor (down projection) x (1 + magnitude), rounded to the run dtype
  int8           every projection of one layer fake-quantized to int8 (symmetric, per output row)
  rope_theta     rotary base x (1 + magnitude)
  norm_eps       RMSNorm epsilon x magnitude
  mask_position  one prompt position (slot 1) hidden from every later query
  sign_flip      the sign of one output channel of one MLP down projection
  swap_layers    layers `layer` and `layer + 1` swapped
  router         MoE models: expert 0's router row of one MoE layer x (1 + magnitude): moves that
                 expert's router logit, so routing flips where it was near the top-k boundary
In an MoE layer, scale, sign_flip and int8 act on the experts' tensors (every expert's down
projection; int8: the router and every expert too).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .modes import build_execution_mode
from .model_support import OFFSET_NORM_FAMILIES
from .transformer import LayerWeights, Transformer

KINDS = ("scale", "int8", "rope_theta", "norm_eps", "mask_position", "sign_flip", "swap_layers", "router")


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
                "router": f" x(1{self.magnitude:+g})",
                "norm_eps": f" x{self.magnitude:g}"}.get(self.kind, "")
        return f"{self.kind}{size}{where}"


def _like(original: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` as the same kind of tensor as `original` (a parameter stays a parameter), so compiled
    pieces see the same types in every layer and the fault adds no guard, hence no recompile."""
    if isinstance(original, torch.nn.Parameter):
        return torch.nn.Parameter(values, requires_grad=False)
    return values


def _scaled(weight: torch.Tensor, factor: float) -> torch.Tensor:
    """A copy of `weight` x factor, computed in float64 and rounded once to the weight's dtype."""
    return _like(weight, (weight.detach().double() * factor).to(weight.dtype))


def _fake_int8(weight: torch.Tensor) -> torch.Tensor:
    """A copy quantized symmetrically per output row to int8 and back."""
    wide = weight.detach().double()
    scale = wide.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / 127
    return _like(weight, ((wide / scale).round().clamp(-127, 127) * scale).to(weight.dtype))


def _sign_flipped(weight: torch.Tensor) -> torch.Tensor:
    copy = weight.detach().clone()
    copy[(0,) * (copy.ndim - 1)].neg_()  # output channel 0 (of expert 0 in an MoE layer's [E, hidden, I])
    return _like(weight, copy)


def _moe_fault(weights: LayerWeights, fault: Fault) -> LayerWeights:
    experts = weights.moe
    if fault.kind == "router":
        router = weights.moe.router.detach().clone()
        router[0] = router[0].double().mul(1 + fault.magnitude).to(router.dtype)
        return dataclasses.replace(weights, moe=dataclasses.replace(experts, router=_like(experts.router, router)))
    if fault.kind == "scale":
        return dataclasses.replace(weights, moe=dataclasses.replace(experts, down=_scaled(experts.down,
                                                                                           1 + fault.magnitude)))
    if fault.kind == "sign_flip":
        return dataclasses.replace(weights, moe=dataclasses.replace(experts, down=_sign_flipped(experts.down)))
    quantized = dataclasses.replace(experts, router=_fake_int8(experts.router), gate_up=_fake_int8(experts.gate_up),
                                    down=_fake_int8(experts.down))
    return dataclasses.replace(weights, qkv=_fake_int8(weights.qkv), o=_fake_int8(weights.o), moe=quantized)


def _scaled_norm(weight: torch.Tensor, factor: float, offset: bool) -> torch.Tensor:
    """A norm weight whose output is `factor` x the original's: w x factor, or for Gemma's (1 + w) scaling
    (1 + w) x factor - 1; in float64, rounded once."""
    wide = weight.detach().double()
    return _like(weight, ((1 + wide) * factor - 1 if offset else wide * factor).to(weight.dtype))


def _layer_fault(weights: LayerWeights, fault: Fault, norm_offset: bool = False) -> LayerWeights:
    if weights.moe is not None:
        return _moe_fault(weights, fault)
    if fault.kind == "router":
        raise ValueError("fault kind 'router' needs an MoE layer; pass Fault(layer=...) naming one")
    if fault.kind == "scale" and weights.mlp_out_norm is not None:
        # Gemma normalises the MLP's output: a scaled down projection would be cancelled (a red-team pass found the
        # fault a no-op there); scaling that norm's output scales the MLP's contribution to the residual instead
        return dataclasses.replace(weights, mlp_out_norm=_scaled_norm(weights.mlp_out_norm, 1 + fault.magnitude,
                                                                      norm_offset))
    if fault.kind == "scale":
        return dataclasses.replace(weights, down=_scaled(weights.down, 1 + fault.magnitude))
    if fault.kind == "sign_flip":
        return dataclasses.replace(weights, down=_sign_flipped(weights.down))
    return dataclasses.replace(weights, qkv=_fake_int8(weights.qkv), o=_fake_int8(weights.o),
                               gate_up=_fake_int8(weights.gate_up), down=_fake_int8(weights.down))


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


def apply(transformer: Transformer, fault: Fault) -> None:
    """Plant `fault` in an engine Transformer (its own copies of the tensors it changes)."""
    index = fault.layer if fault.layer is not None else len(transformer.layers) // 2
    if fault.kind in ("scale", "sign_flip", "int8", "router"):
        transformer.layers[index] = _layer_fault(transformer.layers[index], fault, transformer.variant.norm_offset)
    elif fault.kind == "rope_theta":  # inv_freq = theta^(-2i/D): a new base scales it by (1+m)^(-2i/D)
        exponents = torch.arange(transformer.inv_freq.numel(), dtype=torch.float64) / transformer.inv_freq.numel()
        factor = ((1 + fault.magnitude) ** -exponents).to(transformer.inv_freq.device)
        transformer.inv_freq = (transformer.inv_freq.double() * factor).to(transformer.inv_freq.dtype)
    elif fault.kind == "norm_eps":
        transformer.eps *= fault.magnitude
    elif fault.kind == "mask_position":
        _mask_position(transformer)
    elif fault.kind == "swap_layers":
        transformer.layers[index], transformer.layers[index + 1] = transformer.layers[index + 1], transformer.layers[index]


# The MLP output projection of one decoder layer, by family naming (Llama/Qwen, GPT-2, OPT, GPT-NeoX).
HF_DOWN_PROJECTIONS = ("mlp.down_proj.weight", "mlp.c_proj.weight", "fc2.weight", "mlp.dense_4h_to_h.weight")
HF_KINDS = ("scale", "sign_flip", "int8")


def apply_to_module(module: torch.nn.Module, fault: Fault) -> None:
    """Plant `fault` in a private copy of a transformers module (--engine transformers): the MLP output
    projection of one decoder layer scaled, sign-flipped or fake-quantized (int8: that projection only)."""
    if fault.kind not in HF_KINDS:
        raise ValueError(f"fault {fault.kind} is planted in evalrun's engine only; for --engine transformers use "
                         f"one of {HF_KINDS}")
    names = sorted({name.rsplit(".", 1)[0] for name, _ in module.named_parameters()
                    if any(name.endswith(suffix) for suffix in HF_DOWN_PROJECTIONS)},
                   key=lambda name: [int(part) if part.isdigit() else part for part in name.split(".")])
    if not names:
        raise ValueError(f"no MLP output projection ({', '.join(HF_DOWN_PROJECTIONS)}) in {type(module).__name__}")
    index = fault.layer if fault.layer is not None else len(names) // 2
    layer = module.get_submodule(names[index].rsplit(".", 2)[0])
    after = getattr(layer, "post_feedforward_layernorm", None)  # Gemma: a norm would cancel a scaled projection
    if fault.kind == "scale" and after is not None:
        offset = getattr(getattr(module, "config", None), "model_type", None) in OFFSET_NORM_FAMILIES
        after.weight = torch.nn.Parameter(_scaled_norm(after.weight, 1 + fault.magnitude, offset).detach().clone(),
                                          requires_grad=False)
        return
    projection = module.get_submodule(names[index])
    change = {"scale": lambda w: _scaled(w, 1 + fault.magnitude), "sign_flip": _sign_flipped,
              "int8": _fake_int8}[fault.kind]
    weight = projection.weight
    # GPT-2's Conv1D stores [in, out]: flip an output channel either way (its first row or first column)
    changed = change(weight.T).T if type(projection).__name__ == "Conv1D" else change(weight)
    projection.weight = torch.nn.Parameter(changed.detach().clone(), requires_grad=False)


def plant(prepared: Any, fault: Fault) -> None:
    """Plant `fault` in a runner.Prepared: its execution mode is built here, on a faulted Transformer,
    so compiled pieces and CUDA graphs see the fault too. Under --engine transformers the engine is
    built over a faulted private copy of the module."""
    if prepared.config.engine == "transformers":
        from .hf_engine import TransformersEngine

        module = copy.deepcopy(prepared.loaded.model)
        apply_to_module(module, fault)
        prepared.mode = TransformersEngine(module, prepared.config)
        return
    if prepared.config.engine != "evalrun":
        raise ValueError(f"faults are not planted in engine {prepared.config.engine}")
    if prepared.config.linear_kernel == "gguf-gemv":  # the blocks it reads would not carry the planted change
        raise ValueError("faults are not planted under linear_kernel=gguf-gemv")
    transformer = Transformer(prepared.loaded.model, prepared.config.attn_implementation).with_kernels(prepared.config)
    apply(transformer, fault)
    prepared.mode = build_execution_mode(transformer, prepared.config)


def fault_hook(fault: Fault, only: Callable[[Any], bool] | None = None) -> Callable[[Any], None]:
    """A hook for `create_golden` / `verify_golden` that plants `fault` in every prepared run (a model
    change), or only in those `only(prepared)` accepts (a fault in one execution)."""

    def hook(prepared: Any) -> None:
        if only is None or only(prepared):
            plant(prepared, fault)

    return hook
