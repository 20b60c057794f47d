"""A Llama-family decoder forward over a Hugging Face model's weights, gpt-fast style.

The weights stay in the Hugging Face module: q/k/v and gate/up are stacked into one matrix each,
and the module's parameters become views of it (no copies). This module only changes how the forward
runs: a static KV cache allocated once at a fixed size, positions and cache slots given as
tensors, and an additive mask built from them, so that every decode step has the same shapes and can
be compiled with `fullgraph=True` and captured in a CUDA graph.

Shapes: B batch, T tokens in this call, S cache slots, H query heads, G key/value heads, D head dim,
R = H/G query heads per key/value head.

Grouped-query attention runs without copying keys and values: the R query heads that share a
key/value head are stacked as R*T query rows of that head ([B, G, R*T, D]), so attention sees G heads
on every side and the additive mask [B, 1, R*T, S], built once per forward, serves every layer. That
keeps CUDA's SDPA on its fused memory-efficient kernel (one launch per layer) where `enable_gqa` with
a mask falls back to the unfused math path.

Families: Llama (optional attention and MLP biases), Qwen2/2.5 (q/k/v biases), Qwen3 (RMSNorm of
each query and key head before rotary), Mistral (sliding-window attention), Phi-3 (q/k/v and gate/up
stored fused; sliding window) and Gemma 2 / Gemma 3 text (RMSNorm scaling by 1 + w, embeddings scaled
by sqrt(hidden), norms after attention and after the MLP, tanh soft-capping of attention scores and
of the final logits, query_pre_attn_scalar, sliding and full layers alternating, Gemma 3's q/k norms
and separate rotary base for sliding layers), Qwen3-MoE (its MoE layers' feed-forward runs in
engine/moe.py; `moe_post_attention` is their piece). Every config field is checked first (`model_support`),
so a config asking for what this forward does not compute is refused, never run as another model.

A family's switches are one frozen `Variant` passed to the pieces (compiled code specialises on its
values); what differs per layer (sliding or full mask, local or global rotary) is chosen in `forward`
and passed as tensors of the same shapes, so one compiled piece still serves every layer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import attention_triton, moe, norm_triton
from . import linear as projections
from .model_support import ACTIVATION_FIELD, FAMILIES, OFFSET_NORM_FAMILIES, WINDOWED_FAMILIES, check_config

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types names


@dataclass(frozen=True)
class Variant:
    """A family's switches, static for the whole model (the defaults are Llama's), and the run's choice of
    projection kernel (engine/linear.py; not the family's: set from the config)."""

    norm_offset: bool = False  # Gemma: RMSNorm scales by (1 + w), computed in fp32 and rounded once
    embed_scale: float | None = None  # Gemma: embeddings x sqrt(hidden), rounded to the model dtype
    attn_scale: float | None = None  # Gemma: query_pre_attn_scalar**-0.5; None: D**-0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> c * tanh(scores / c) before the mask
    final_softcap: float | None = None  # Gemma 2: logits -> c * tanh(logits / c)
    sliding_window: int | None = None  # a query sees the keys of its last `sliding_window` slots
    linear_kernel: str = "aten"  # aten | triton-gemv[-glu] | gguf-gemv: who computes 1-4 rows' projections (linear.py)
    norm_kernel: str = "aten"  # aten | triton: who computes the RMSNorms norm() computes (norm_triton.py)


LLAMA_VARIANT = Variant()


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H+2G)*D, hidden]: q, k and v projections stacked
    o: torch.Tensor  # [hidden, H*D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # [2*inter, hidden]: gate and up projections stacked (None in an MoE layer)
    down: torch.Tensor | None  # [hidden, inter]
    qkv_bias: torch.Tensor | None = None  # [(H+2G)*D]
    o_bias: torch.Tensor | None = None  # [hidden]
    gate_up_bias: torch.Tensor | None = None  # [2*inter]
    down_bias: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [D], Qwen3's and Gemma 3's per-head query RMSNorm
    k_norm: torch.Tensor | None = None  # [D], Qwen3's and Gemma 3's per-head key RMSNorm
    attn_out_norm: torch.Tensor | None = None  # [hidden], Gemma: norm of the attention output before the residual
    mlp_out_norm: torch.Tensor | None = None  # [hidden], Gemma: norm of the MLP output before the residual
    moe: "moe.MoEWeights | None" = None  # the experts and router of an MoE layer (engine/moe.py)


def stack_rows(module_weights: list[torch.nn.Parameter]) -> torch.Tensor:
    """Stack weight matrices [n_i, hidden] (or biases [n_i]) row-wise into one [sum n_i, hidden] tensor, and make each
    parameter a view of its rows, so the stacked tensor costs no memory beyond the model's own.

    One matrix product over the stack replaces several (vLLM's merged QKV and gate/up projections).
    Parameters that already are consecutive rows of one storage (stacked before) are reused as they are.
    """
    first, rows = module_weights[0], sum(w.shape[0] for w in module_weights)
    offsets = [first.storage_offset()]
    for weight in module_weights[:-1]:
        offsets.append(offsets[-1] + weight.numel())
    adjacent = all(w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and w.is_contiguous()
                   and w.storage_offset() == offset for w, offset in zip(module_weights, offsets))
    if adjacent:
        return first.detach().as_strided((rows, *first.shape[1:]), first.stride())
    stacked = torch.cat([w.detach() for w in module_weights])
    start = 0
    for weight in module_weights:
        weight.data = stacked[start:start + weight.shape[0]]
        start += weight.shape[0]
    return stacked


class KVCache:
    """Keys and values of every layer in one tensor, allocated once: [layers, 2, B, G, S, D]
    (index 0 keys, 1 values), so one copy per layer writes a step's keys and values."""

    def __init__(self, layers: int, batch: int, heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.kv = torch.zeros((layers, 2, batch, heads, slots, head_dim), dtype=dtype, device=device)
        self.routing: "moe.RoutingState | None" = None  # MoE models: each MoE layer's last routing

    @property
    def slots(self) -> int:
        return self.kv.shape[4]


class Transformer:
    """Callable forward of a supported model: (tokens, positions, slots, key_valid, cache) -> logits."""

    def __init__(self, hf_model: torch.nn.Module, attn_implementation: str = "sdpa", linear_kernel: str = "aten"):
        config = hf_model.config
        family = check_config(config.to_dict())  # refuses, with one line, any field this forward does not compute
        inner = hf_model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.activation = getattr(config, ACTIVATION_FIELD.get(family, "hidden_act"))
        self.attn_implementation = attn_implementation
        self.embed = inner.embed_tokens.weight  # [V, hidden]
        self.final_norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight  # [V, hidden]
        self.layers = self._layers(inner.layers)
        rotary_embedding = inner.rotary_emb
        # The pieces the forward calls; an execution mode may replace them with compiled versions.
        self.prologue, self.pre_attention, self.post_attention, self.head = prologue, pre_attention, post_attention, head
        # Set by an execution mode whose compiled pieces run without piecewise graphs (engine/modes.py): the
        # pre-attention piece writes the step's keys and values into the cache itself (pre_attention_writing), so
        # Inductor fuses the write into the rotary kernel instead of a separate index_copy per layer. Same bits.
        self.pre_attention_writing: Callable | None = None
        self.moe_post_attention = moe_post_attention  # an MoE layer's piece (engine/moe.py)
        moe_layers = [w.moe for w in self.layers if w.moe is not None]
        # (L, k): the routing each step captures, for MoE models only
        self.routing_shape = (len(moe_layers), moe_layers[0].top_k) if moe_layers else None
        self.dtype = self.embed.dtype
        self.variant = replace(_variant(config, family, inner, self.dtype), linear_kernel=linear_kernel)
        # Each layer's attention kind: the config's layer_types (Gemma; Qwen's are all full, model_support
        # checks), else every layer sliding where the family has a window (Mistral, Phi-3).
        default_kind = SLIDING if self.variant.sliding_window else FULL
        kinds = getattr(config, "layer_types", None) or [default_kind] * len(self.layers)
        self.layer_kinds = tuple(kinds)
        self.kinds_used = tuple(sorted(set(kinds)))  # the masks and rotaries the prologue builds
        wide = torch.promote_types(self.dtype, torch.float32)  # rotary angles in fp32 (fp64 for an fp64 model)
        # [D/2]: the rotary of full layers (and of every layer, except where Gemma 3 gives sliding layers their own)
        global_rotary = f"{FULL}_inv_freq" if hasattr(rotary_embedding, f"{FULL}_inv_freq") else "inv_freq"
        self.inv_freq = getattr(rotary_embedding, global_rotary).to(wide)
        self.rope_scale = float(getattr(rotary_embedding, global_rotary.replace("inv_freq", "attention_scaling"), 1.0))
        self.local_rotary = None  # (inv_freq [D/2], scale) of sliding layers, where they have their own
        if hasattr(rotary_embedding, f"{SLIDING}_inv_freq"):
            self.local_rotary = (getattr(rotary_embedding, f"{SLIDING}_inv_freq").to(wide),
                                 float(getattr(rotary_embedding, f"{SLIDING}_attention_scaling", 1.0)))
        self.device = self.embed.device
        self._refuse_glu_without_a_gated_mlp(linear_kernel)
        projections.prepare(linear_kernel, self.device)  # registers the GEMV before anything is compiled
        self.vocab_size = self.lm_head.shape[0]
        self.reduce: Callable | None = None  # tensor parallelism (tensor_parallel.py): sums row-parallel outputs
        self.attention_kernel = "sdpa"  # triton-split-kv: decode steps' attention (attention_triton.py)

    def with_linear_kernel(self, kernel: str) -> "Transformer":
        """This forward over the same weights with projections computed by `kernel` (linear.py): a shallow
        copy, so a forward already handed to another execution mode keeps its own choice."""
        if kernel == self.variant.linear_kernel:
            return self
        self._refuse_glu_without_a_gated_mlp(kernel)
        projections.prepare(kernel, self.device)
        chosen = copy.copy(self)
        chosen.variant = replace(self.variant, linear_kernel=kernel)
        return chosen

    def _refuse_glu_without_a_gated_mlp(self, kernel: str) -> None:
        """linear_kernel=triton-gemv-glu on a model it would never apply to (another activation than SiLU, or no
        dense MLP layer) is refused, not run as triton-gemv under another name in the config hash."""
        if kernel != "triton-gemv-glu":
            return
        if self.activation not in projections.GLU_ACTIVATIONS:
            raise ConfigError(f"linear_kernel=triton-gemv-glu computes SiLU gates only (this model's activation is "
                              f"{self.activation}); use linear_kernel=triton-gemv")
        if all(w.gate_up is None for w in self.layers):
            raise ConfigError("linear_kernel=triton-gemv-glu computes dense MLP layers only (this model's are all "
                              "mixture-of-experts); use linear_kernel=triton-gemv")

    def with_kernels(self, config) -> "Transformer":
        """This forward with the kernels a run's config chooses (its linear_kernel, attention_kernel and norm_kernel):
        the one place an engine built from a config takes them."""
        return (self.with_linear_kernel(config.linear_kernel).with_attention_kernel(config.attention_kernel)
                .with_norm_kernel(config.norm_kernel))

    def with_norm_kernel(self, kernel: str) -> "Transformer":
        """This forward over the same weights with its RMSNorms computed by `kernel` (norm_triton.py): a shallow
        copy, like with_linear_kernel."""
        if kernel == self.variant.norm_kernel:
            return self
        norm_triton.prepare(kernel, self.device)
        chosen = copy.copy(self)
        chosen.variant = replace(self.variant, norm_kernel=kernel)
        return chosen

    def with_attention_kernel(self, kernel: str) -> "Transformer":
        """This forward over the same weights with a decode step's attention computed by `kernel`
        (attention_triton.py): a shallow copy, like with_linear_kernel."""
        if kernel == self.attention_kernel:
            return self
        if self.variant.attn_softcap is not None:
            raise ConfigError(f"attention_kernel={kernel} computes no soft-capped scores (this model caps them); use "
                              "attention_kernel=sdpa")
        attention_triton.prepare(kernel, self.device)
        chosen = copy.copy(self)
        chosen.attention_kernel = kernel
        return chosen

    @classmethod
    def _layers(cls, layers: torch.nn.ModuleList) -> list[LayerWeights]:
        weights, slots = [], 0
        for layer in layers:
            experts = moe.layer_weights(layer.mlp, slots)
            slots += experts is not None
            weights.append(cls._layer(layer, experts))
        return weights

    @staticmethod
    def _layer(layer: torch.nn.Module, experts: "moe.MoEWeights | None" = None) -> LayerWeights:
        attention, mlp = layer.self_attn, layer.mlp
        # Phi-3 stores q/k/v and gate/up fused already (stack_rows takes one matrix as it is).
        qkv_projections = ([attention.qkv_proj] if hasattr(attention, "qkv_proj")
                           else [attention.q_proj, attention.k_proj, attention.v_proj])
        dense = experts is None  # an MoE layer's experts and router are in `experts` (engine/moe.py)
        gate_up_projections = ([] if not dense else [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj")
                               else [mlp.gate_proj, mlp.up_proj])
        qkv = stack_rows([p.weight for p in qkv_projections])
        gate_up = stack_rows([p.weight for p in gate_up_projections]) if dense else None
        norms = [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
        # Gemma's four norms per layer: its post_attention_layernorm normalises the attention output, and
        # pre_feedforward_layernorm is the MLP's input norm (Llama's post_attention_layernorm).
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        return LayerWeights(layer.input_layernorm.weight, qkv, attention.o_proj.weight, mlp_norm.weight, gate_up,
                            mlp.down_proj.weight if dense else None, qkv_bias=_stacked_biases(qkv_projections),
                            o_bias=attention.o_proj.bias,
                            gate_up_bias=_stacked_biases(gate_up_projections) if dense else None,
                            down_bias=mlp.down_proj.bias if dense else None,
                            q_norm=None if norms[0] is None else norms[0].weight,
                            k_norm=None if norms[1] is None else norms[1].weight,
                            attn_out_norm=layer.post_attention_layernorm.weight if sandwich else None,
                            mlp_out_norm=layer.post_feedforward_layernorm.weight if sandwich else None, moe=experts)

    def weights(self) -> list[torch.Tensor]:
        """Every tensor of the model the pieces take as an argument: each layer's weights (stacked ones and an
        MoE layer's experts included), the embedding, the final norm, the head and the rotary frequencies."""
        found = [self.embed, self.final_norm, self.lm_head, self.inv_freq]
        if self.local_rotary is not None:
            found.append(self.local_rotary[0])
        for layer in self.layers:
            parts = [getattr(layer, f.name) for f in fields(layer)]
            if layer.moe is not None:
                parts += [getattr(layer.moe, f.name) for f in fields(layer.moe)]
            found += [part for part in parts if isinstance(part, torch.Tensor)]
        return found

    def new_cache(self, batch: int, slots: int, forced_routing: bool = False, prompt_routing: bool = False) -> KVCache:
        """MoE models: `forced_routing`, the cache's routing state takes the experts each forward must apply;
        `prompt_routing`, it records a prefill's experts at every prompt token."""
        cache = KVCache(len(self.layers), batch, self.kv_heads, slots, self.head_dim, self.dtype, self.device)
        if self.routing_shape is not None:
            cache.routing = moe.RoutingState(batch, *self.routing_shape, self.device, forced_routing, slots,
                                             prompt_routing)
        return cache

    # ------------------------------------------------------------ forward

    def attend(self, index: int, q: torch.Tensor, kv: torch.Tensor | None, slots: torch.Tensor, mask: torch.Tensor,
               cache: KVCache) -> torch.Tensor:
        """Write kv [2, B, G, T, D] into layer `index`'s cache at `slots` [T] (None: already written);
        attend over all S slots."""
        layer = cache.kv[index]  # [2, B, G, S, D]
        if kv is not None:
            layer.index_copy_(3, slots, kv)
        return attention(q, layer[0], layer[1], mask, self.attn_implementation, self.variant.attn_scale,
                         self.variant.attn_softcap, self.attention_kernel)

    def _query_and_write(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights,
                         slots: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer `index`'s queries [B, H, T, D], and its keys and values [2, B, G, T, D] still to write, or None
        where the piece wrote them into the cache itself."""
        shape = (self.heads, self.kv_heads, self.head_dim, self.eps)
        if self.pre_attention_writing is None:
            return self.pre_attention(x, cos, sin, w.input_norm, w.qkv, *shape, w.qkv_bias, w.q_norm, w.k_norm,
                                      self.variant)
        return self.pre_attention_writing(x, cos, sin, w.input_norm, w.qkv, *shape, cache.kv[index], slots,
                                          w.qkv_bias, w.q_norm, w.k_norm, self.variant), None

    def _positional(self, prologue: Callable, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    key_valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, ...]]]:
        """`prologue` (eager or compiled) over this model: x and {attention kind: (cos, sin, mask)}."""
        return prologue(tokens, positions, slots, key_valid, self.embed, self.inv_freq, self.rope_scale,
                        self.heads // self.kv_heads, self.variant, self.local_rotary, self.kinds_used)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                key_valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens/positions [B, T], slots [T], key_valid [B, S] -> logits of the last token [B, V]."""
        x, kinds = self._positional(self.prologue, tokens, positions, slots, key_valid)
        variant = self.variant
        for index, w in enumerate(self.layers):
            cos, sin, mask = kinds[self.layer_kinds[index]]
            q, kv = self._query_and_write(index, x, cos, sin, w, slots, cache)
            attended = self.attend(index, q, kv, slots, mask, cache)
            if w.moe is not None:
                m = w.moe
                x, experts, margin = self.moe_post_attention(x, attended, w.o, w.post_norm, m.router, m.gate_up, m.down,
                                                             self.eps, self.activation, m.top_k, m.normalize, w.o_bias,
                                                             variant, cache.routing.forced_for(m.slot, x.shape[1]))
                cache.routing.record(m.slot, experts, margin)
                continue
            x = self.post_attention(x, attended, w.o, w.post_norm, w.gate_up, w.down, self.eps, self.activation,
                                    w.o_bias, w.gate_up_bias, w.down_bias, w.attn_out_norm, w.mlp_out_norm, variant,
                                    self.reduce)
        return self.head(x[:, -1], self.final_norm, self.lm_head, self.eps, variant)

    def forward_states(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       key_valid: torch.Tensor, cache: KVCache, pieces: "StatePieces | None" = None,
                       ) -> list[torch.Tensor]:
        """The forward with the residual stream kept at every sub-block boundary (the layer stage of
        `evalrun bisect`): [layer 0 after attention, layer 0 after MLP, layer 1 ..., logits of every
        token [B, T, V]], each [B, T, hidden]. The same pieces as `forward`, post_attention run as its
        two halves; `pieces` may hold compiled versions (modes.state_pieces)."""
        p = pieces or StatePieces()
        x, kinds = self._positional(p.prologue, tokens, positions, slots, key_valid)
        shape, variant, states = (self.heads, self.kv_heads, self.head_dim, self.eps), self.variant, []
        for index, w in enumerate(self.layers):
            cos, sin, mask = kinds[self.layer_kinds[index]]
            q, kv = p.pre_attention(x, cos, sin, w.input_norm, w.qkv, *shape, w.qkv_bias, w.q_norm, w.k_norm,
                                    variant)
            x = p.output_projection(x, self.attend(index, q, kv, slots, mask, cache), w.o, w.o_bias, w.attn_out_norm,
                                    self.eps, variant, self.reduce)
            states.append(x)
            if w.moe is not None:  # eager: the MoE block is not among the compiled state pieces yet
                m = w.moe
                x = moe.mlp_block(x, rms_norm(x, w.post_norm, self.eps), m.router, m.gate_up, m.down,
                                  lambda t: activate(t, self.activation), m.top_k, m.normalize)[0]
            else:
                x = p.mlp_block(x, w.post_norm, w.gate_up, w.down, self.eps, self.activation, w.gate_up_bias,
                                w.down_bias, w.mlp_out_norm, variant, self.reduce)
            states.append(x)
        return states + [p.head(x, self.final_norm, self.lm_head, self.eps, variant)]


def _variant(config, family: str, inner: torch.nn.Module, dtype: torch.dtype) -> Variant:
    """The family switches of a checked config (model_support has vouched for every value)."""
    scale = getattr(inner.embed_tokens, "embed_scale", None)  # Gemma's sqrt(hidden), a buffer transformers rounds
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return Variant(norm_offset=family in OFFSET_NORM_FAMILIES,
                   embed_scale=None if scale is None else float(scale.to(dtype)),
                   attn_scale=None if scalar is None else float(scalar) ** -0.5,
                   attn_softcap=getattr(config, "attn_logit_softcapping", None),
                   final_softcap=getattr(config, "final_logit_softcapping", None),
                   # Qwen2's sliding_window is inert (use_sliding_window is refused): only these families use it
                   sliding_window=getattr(config, "sliding_window", None) if family in WINDOWED_FAMILIES else None)


def _stacked_biases(projections: list[torch.nn.Module]) -> torch.Tensor | None:
    """The biases of projections whose weights are stacked, stacked the same way [sum n_i]; None
    without biases. model_support has vouched that they come all or none (one config switch)."""
    biases = [p.bias for p in projections]
    if all(b is None for b in biases):
        return None
    assert all(b is not None for b in biases), "a stacked projection without its bias"
    return stack_rows(biases)


# The pieces of the forward, pure functions but for pre_attention_writing, which writes the layer's KV cache.
# Piecewise compilation compiles these (one compiled artefact per piece serves every layer: same code, same
# shapes); attention stays between them, and so does the KV-cache write where a piece cannot hold it.

def prologue(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, key_valid: torch.Tensor,
             embed: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float, rows_per_key_head: int,
             variant: Variant = LLAMA_VARIANT, local_rotary: tuple[torch.Tensor, float] | None = None,
             kinds: tuple[str, ...] = (FULL,)) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, ...]]]:
    """What the layers share: embeddings x [B, T, hidden] and, for each attention kind in `kinds` (full,
    sliding), its rotary cos/sin [B, 1, T, D] and mask [B, 1, R*T, S], built once per forward.

    Sliding layers see only the last `variant.sliding_window` slots and rotate with `local_rotary`
    (inv_freq [D/2], scale), where the family gives them their own (Gemma 3)."""
    x = F.embedding(tokens, embed)
    if variant.embed_scale is not None:
        x = x * variant.embed_scale
    rotations = {FULL: (inv_freq, rope_scale), SLIDING: local_rotary or (inv_freq, rope_scale)}
    out = {}
    for kind in kinds:
        cos, sin = rotary(positions, *rotations[kind], embed.dtype)
        window = variant.sliding_window if kind == SLIDING else None
        out[kind] = (cos, sin, build_mask(slots, key_valid, rows_per_key_head, embed.dtype, window))
    return x, out


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T], inv_freq [D/2] (fp32, fp64 for an fp64 model) -> cos, sin [B, 1, T, D] in `dtype`."""
    angles = positions.to(inv_freq.dtype)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [B, T, D]
    return (angles.cos() * scale).to(dtype)[:, None], (angles.sin() * scale).to(dtype)[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm as transformers computes it: normalise in fp32 (PyTorch's fused kernel accumulates
    in fp32 and rounds once to x's dtype), then scale in the model dtype."""
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by (1 + weight) both in fp32 (fp64 for an fp64 model), round once."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return F.rms_norm(x.to(wide), x.shape[-1:], 1.0 + weight.to(wide), eps).to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: Variant) -> torch.Tensor:
    """The family's RMSNorm of x [..., n] with weight [n]: by norm_triton's kernel where the run's norm_kernel asks
    for it and it applies, else by torch (Inductor's kernel when compiled), with the same roundings."""
    if variant.norm_kernel == "triton" and norm_triton.applies(x, weight):
        return norm_triton.rms_norm(x, weight, eps, variant.norm_offset)
    return torch_norm(x, weight, eps, variant)


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: Variant) -> torch.Tensor:
    """The family's RMSNorm by torch, whatever the run's norm_kernel: the per-head q/k norms, which Inductor fuses
    with the rotary after them."""
    return offset_rms_norm(x, weight, eps) if variant.norm_offset else rms_norm(x, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def pre_attention(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_norm: torch.Tensor,
                  wqkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float,
                  bqkv: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, variant: Variant = LLAMA_VARIANT,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, hidden] -> q [B, H, T, D] and kv [2, B, G, T, D] (keys, values), rotary applied to q and k.

    bqkv [(H+2G)*D]: the q/k/v biases (Qwen2, Llama's attention_bias); q_norm, k_norm [D]: Qwen3's and
    Gemma 3's RMSNorm of each query and key head, applied before rotary."""
    batch, tokens, _ = x.shape
    qkv = projections.linear(norm(x, input_norm, eps, variant), wqkv, bqkv, variant.linear_kernel).view(batch, tokens, heads + 2 * kv_heads, head_dim)
    q, k, v = qkv.transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    if q_norm is not None:
        q, k = torch_norm(q, q_norm, eps, variant), torch_norm(k, k_norm, eps, variant)
    return apply_rotary(q, cos, sin), torch.stack((apply_rotary(k, cos, sin), v))


def pre_attention_writing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_norm: torch.Tensor,
                          wqkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float,
                          layer_cache: torch.Tensor, slots: torch.Tensor, bqkv: torch.Tensor | None = None,
                          q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                          variant: Variant = LLAMA_VARIANT) -> torch.Tensor:
    """pre_attention that also writes the keys and values into layer_cache [2, B, G, S, D] at slots [T]
    (the same values as Transformer.attend's index_copy); returns q [B, H, T, D]. Compiled as one piece,
    the write is a store of the rotary kernel (gpt-fast's cache update), not a kernel of its own."""
    q, kv = pre_attention(x, cos, sin, input_norm, wqkv, heads, kv_heads, head_dim, eps, bqkv, q_norm, k_norm,
                          variant)
    layer_cache[:, :, :, slots] = kv
    return q


def post_attention(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, post_norm: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, eps: float, activation: str = "silu",
                   bo: torch.Tensor | None = None, b_gate_up: torch.Tensor | None = None,
                   b_down: torch.Tensor | None = None, attn_out_norm: torch.Tensor | None = None,
                   mlp_out_norm: torch.Tensor | None = None, variant: Variant = LLAMA_VARIANT,
                   reduce: Callable | None = None) -> torch.Tensor:
    """x [B, T, hidden], attended [B, H, T, D] -> x after the output projection and the MLP."""
    projected = output_projection(x, attended, wo, bo, attn_out_norm, eps, variant, reduce)
    return mlp_block(projected, post_norm, gate_up, down, eps, activation, b_gate_up, b_down, mlp_out_norm, variant,
                     reduce)


def output_projection(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None = None,
                      out_norm: torch.Tensor | None = None, eps: float | None = None,
                      variant: Variant = LLAMA_VARIANT, reduce: Callable | None = None) -> torch.Tensor:
    """The attention sub-block's end: x [B, T, hidden] + the output projection of attended [B, H, T, D]
    (bo [hidden]: its bias, where the config has one; out_norm [hidden]: Gemma's norm of it before the add)."""
    batch, tokens, _ = x.shape
    flat = attended.transpose(1, 2).reshape(batch, tokens, -1)  # [B, T, H*D]
    if variant.norm_kernel == "triton" and out_norm is None and reduce is None and RESIDUAL_IN_PROJECTION:
        # The norm after this add is then a kernel of its own that reads x stored in the model dtype, so the add
        # goes into the GEMV's epilogue where the GEMV computes this projection (else it is a kernel of its own):
        # the same bits, both round the sum once to the model dtype. (An MoE layer's norm stays with torch; its x
        # is then stored rounded too, as eager stores it.)
        return projections.linear(flat, wo, bo, variant.linear_kernel, residual=x)
    out = row_parallel_linear(flat, wo, bo, reduce, variant.linear_kernel)
    return x + (out if out_norm is None else norm(out, out_norm, eps, variant))


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        reduce: Callable | None, kernel: str = "aten") -> torch.Tensor:
    """The projection (by `kernel`, linear.py), or under tensor parallelism (`reduce` set,
    tensor_parallel.py) this rank's partial product [.., out] summed over the ranks, the bias added once
    after the sum."""
    if reduce is None:
        return projections.linear(x, weight, bias, kernel)
    summed = reduce(projections.linear(x, weight, None, kernel))
    return summed if bias is None else summed + bias


def activate(x: torch.Tensor, name: str) -> torch.Tensor:
    """The feed-forward activation `name` (transformers' ACT2FN name; model_support.ACTIVATIONS), elementwise."""
    if name in ("silu", "swish"):
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise AssertionError(f"activation {name!r} passed model_support but is not computed here")


# mlp_block's residual added by the down projection (and under norm_kernel=triton output_projection's by o); off only
# to measure it
RESIDUAL_IN_PROJECTION = True


def mlp_block(x: torch.Tensor, post_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              eps: float, activation: str = "silu", b_gate_up: torch.Tensor | None = None,
              b_down: torch.Tensor | None = None, out_norm: torch.Tensor | None = None,
              variant: Variant = LLAMA_VARIANT, reduce: Callable | None = None) -> torch.Tensor:
    """The MLP sub-block with its residual: x [B, T, hidden] -> x + down(act(gate) * up) of norm(x);
    b_gate_up [2*inter] and b_down [hidden] are its biases where the config has them; out_norm [hidden]:
    Gemma's norm of the MLP output before the add; reduce: the tensor-parallel sum (row_parallel_linear)."""
    hidden = gated(norm(x, post_norm, eps, variant), gate_up, b_gate_up, activation, variant.linear_kernel)
    # x + down(...): the Triton GEMV adds x in its epilogue, one kernel fewer. Eagerly the same bits as the add. In
    # a compiled post_attention x (= the residual + the output projection) is then stored rounded to the model
    # dtype, as eager rounds it, where Inductor had kept that sum in float32 for the norm and this add: other bits
    # for compiled bfloat16/float16 runs with linear_kernel=triton-gemv than before stop 15 (engine_code says so).
    if out_norm is None and reduce is None and RESIDUAL_IN_PROJECTION:
        return projections.linear(hidden, down, b_down, variant.linear_kernel, residual=x)
    out = row_parallel_linear(hidden, down, b_down, reduce, variant.linear_kernel)
    return x + (out if out_norm is None else norm(out, out_norm, eps, variant))


def gated(x: torch.Tensor, gate_up: torch.Tensor, b_gate_up: torch.Tensor | None, activation: str,
          kernel: str) -> torch.Tensor:
    """act(gate) * up [..., inter] of x [..., hidden] and gate_up [2*inter, hidden] (a tensor-parallel rank's: its
    gate rows, then its up rows): one GEMV with the activation in its epilogue where linear_kernel=triton-gemv-glu
    computes it (linear.glu_applies), else the product, then the activation."""
    if projections.glu_applies(x, gate_up, b_gate_up, activation, kernel):
        return projections.gated_linear(x, gate_up, b_gate_up)
    gate, up = projections.linear(x, gate_up, b_gate_up, kernel).chunk(2, dim=-1)
    return activate(gate, activation) * up


def moe_post_attention(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, post_norm: torch.Tensor,
                       router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, eps: float, activation: str,
                       top_k: int, normalize: bool, bo: torch.Tensor | None = None,
                       variant: Variant = LLAMA_VARIANT, forced: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """post_attention of an MoE layer (engine/moe.py): x [B, T, hidden], attended [B, H, T, D] -> x, and
    the routing of every token: experts [B, T, k], margin [B, T]; `forced` [B, k] (each row's last token) or
    [B, T, k] (every token) or None: the experts applied instead (forced routing). One piece (piecewise mode
    compiles it)."""
    x = output_projection(x, attended, wo, bo, variant=variant)
    return moe.mlp_block(x, rms_norm(x, post_norm, eps), router, gate_up, down, lambda t: activate(t, activation),
                         top_k, normalize, forced)




def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma's soft-capping, as transformers computes it: cap * tanh(x / cap)."""
    return torch.tanh(x / cap) * cap


def head(last: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float,
         variant: Variant = LLAMA_VARIANT) -> torch.Tensor:
    """last [B, hidden] -> logits [B, V] (soft-capped where the family caps them)."""
    logits = projections.linear(norm(last, final_norm, eps, variant), lm_head, None, variant.linear_kernel)
    return logits if variant.final_softcap is None else softcap(logits, variant.final_softcap)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, implementation: str,
              scale: float | None = None, cap: float | None = None, kernel: str = "sdpa") -> torch.Tensor:
    """q [B, H, T, D], k/v [B, G, S, D], mask [B, 1, R*T, S] additive -> [B, H, T, D].

    Query head h attends with key/value head h // R (transformers' `repeat_kv` order). scale: the
    scores' factor (None: D**-0.5); cap: Gemma's soft-capping of the scores before the mask, which
    SDPA cannot compute, so a capped model takes the explicit path whatever `implementation` says.
    kernel=triton-split-kv: a decode step (T = 1) by the split-KV kernel (attention_triton.py)."""
    batch, heads, tokens, dim = q.shape
    grouped = q.reshape(batch, k.shape[1], -1, dim)  # [B, G, R*T, D]
    if kernel == "triton-split-kv" and tokens == 1 and cap is None and attention_triton.applies(grouped, k, v, mask):
        out = attention_triton.decode_attention(grouped, k, v, mask, dim**-0.5 if scale is None else scale)
    elif implementation == "sdpa" and cap is None:
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    else:  # explicit math, as transformers' eager attention: softmax in fp32 (fp64 for an fp64 model)
        scores = (grouped @ k.transpose(-1, -2)) * (dim**-0.5 if scale is None else scale)  # [B, G, R*T, S]
        scores = (scores if cap is None else softcap(scores, cap)) + mask
        wide = torch.promote_types(q.dtype, torch.float32)
        out = torch.softmax(scores, dim=-1, dtype=wide).to(q.dtype) @ v
    return out.reshape(batch, heads, tokens, dim)  # a copy only where the kernel's output layout needs one


MASK_ALIGNMENT = 16  # fused attention kernels want the mask's row stride a multiple of 16 elements


def build_mask(slots: torch.Tensor, key_valid: torch.Tensor, rows_per_key_head: int, dtype: torch.dtype,
               window: int | None = None) -> torch.Tensor:
    """slots [T], key_valid [B, S] -> additive mask [B, 1, R*T, S] (0 or -inf): causal, padding hidden,
    each query sees itself; row r*T + t belongs to query token t (R = rows_per_key_head). With a
    `window`, a query in slot s sees only slots > s - window (transformers' sliding window; a row's real
    tokens fill consecutive slots, so slot distance is position distance).

    A padding query would otherwise see no key at all (a NaN row that poisons the cache). The mask is
    a view of rows padded to MASK_ALIGNMENT, so the fused kernels take it without a copy.
    """
    cache_slots = key_valid.shape[1]
    aligned = -(-cache_slots // MASK_ALIGNMENT) * MASK_ALIGNMENT
    key_index = torch.arange(aligned, device=slots.device)  # [S']
    valid = F.pad(key_valid, (0, aligned - cache_slots))  # [B, S'], the padding columns never valid
    causal = key_index[None, :] <= slots[:, None]  # [T, S']
    if window is not None:
        causal = causal & (key_index[None, :] > slots[:, None] - window)
    itself = key_index[None, :] == slots[:, None]  # [T, S']
    visible = (causal[None] & valid[:, None, :]) | itself[None]  # [B, T, S']
    rows = visible[:, None].expand(-1, rows_per_key_head, -1, -1).reshape(key_valid.shape[0], 1, -1, aligned)
    zero = torch.zeros((), dtype=dtype, device=slots.device)
    blocked = torch.full((), float("-inf"), dtype=dtype, device=slots.device)
    return torch.where(rows, zero, blocked)[..., :cache_slots]  # [B, 1, R*T, S]


@dataclass
class StatePieces:
    """The pure pieces `Transformer.forward_states` runs: these functions, or compiled versions of them."""

    prologue: Callable = prologue
    pre_attention: Callable = pre_attention
    output_projection: Callable = output_projection
    mlp_block: Callable = mlp_block
    head: Callable = head
