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

Families: Llama (optional attention and MLP biases), Qwen2/2.5 (q/k/v biases) and Qwen3 (RMSNorm of
each query and key head before rotary); every config field is checked first (`model_support`), so a
config asking for what this forward does not compute is refused, never run as another model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .model_support import FAMILIES, check_config

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H+2G)*D, hidden]: q, k and v projections stacked
    o: torch.Tensor  # [hidden, H*D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2*inter, hidden]: gate and up projections stacked
    down: torch.Tensor  # [hidden, inter]
    qkv_bias: torch.Tensor | None = None  # [(H+2G)*D]
    o_bias: torch.Tensor | None = None  # [hidden]
    gate_up_bias: torch.Tensor | None = None  # [2*inter]
    down_bias: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [D], Qwen3's per-head query RMSNorm
    k_norm: torch.Tensor | None = None  # [D], Qwen3's per-head key RMSNorm


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

    @property
    def slots(self) -> int:
        return self.kv.shape[4]


class Transformer:
    """Callable forward of a supported model: (tokens, positions, slots, key_valid, cache) -> logits."""

    def __init__(self, hf_model: torch.nn.Module, attn_implementation: str = "sdpa"):
        config = hf_model.config
        check_config(config.to_dict())  # refuses, with one line, any field this forward does not compute
        inner = hf_model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.activation = config.hidden_act
        self.attn_implementation = attn_implementation
        self.embed = inner.embed_tokens.weight  # [V, hidden]
        self.final_norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight  # [V, hidden]
        self.layers = [self._layer(layer) for layer in inner.layers]
        rotary_embedding = inner.rotary_emb
        # The pieces the forward calls; an execution mode may replace them with compiled versions.
        self.prologue, self.pre_attention, self.post_attention, self.head = prologue, pre_attention, post_attention, head
        self.dtype = self.embed.dtype
        # [D/2]; rotary angles in fp32 (fp64 for an fp64 model)
        self.inv_freq = rotary_embedding.inv_freq.to(torch.promote_types(self.dtype, torch.float32))
        self.rope_scale = float(getattr(rotary_embedding, "attention_scaling", 1.0))
        self.device = self.embed.device
        self.vocab_size = self.lm_head.shape[0]
        self.reduce: Callable | None = None  # tensor parallelism (tensor_parallel.py): sums row-parallel outputs

    @staticmethod
    def _layer(layer: torch.nn.Module) -> LayerWeights:
        attention, mlp = layer.self_attn, layer.mlp
        qkv_projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        qkv = stack_rows([p.weight for p in qkv_projections])
        gate_up = stack_rows([mlp.gate_proj.weight, mlp.up_proj.weight])
        norms = [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
        return LayerWeights(layer.input_layernorm.weight, qkv, attention.o_proj.weight,
                            layer.post_attention_layernorm.weight, gate_up, mlp.down_proj.weight,
                            qkv_bias=_stacked_biases(qkv_projections), o_bias=attention.o_proj.bias,
                            gate_up_bias=_stacked_biases([mlp.gate_proj, mlp.up_proj]), down_bias=mlp.down_proj.bias,
                            q_norm=None if norms[0] is None else norms[0].weight,
                            k_norm=None if norms[1] is None else norms[1].weight)

    def new_cache(self, batch: int, slots: int) -> KVCache:
        return KVCache(len(self.layers), batch, self.kv_heads, slots, self.head_dim, self.dtype, self.device)

    # ------------------------------------------------------------ forward

    def attend(self, index: int, q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
               cache: KVCache) -> torch.Tensor:
        """Write kv [2, B, G, T, D] into layer `index`'s cache at `slots` [T]; attend over all S slots."""
        layer = cache.kv[index]  # [2, B, G, S, D]
        layer.index_copy_(3, slots, kv)
        return attention(q, layer[0], layer[1], mask, self.attn_implementation)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                key_valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens/positions [B, T], slots [T], key_valid [B, S] -> logits of the last token [B, V]."""
        x, cos, sin, mask = self.prologue(tokens, positions, slots, key_valid, self.embed, self.inv_freq,
                                          self.rope_scale, self.heads // self.kv_heads)
        shape = (self.heads, self.kv_heads, self.head_dim, self.eps)
        for index, w in enumerate(self.layers):
            q, kv = self.pre_attention(x, cos, sin, w.input_norm, w.qkv, *shape, w.qkv_bias, w.q_norm, w.k_norm)
            attended = self.attend(index, q, kv, slots, mask, cache)
            x = self.post_attention(x, attended, w.o, w.post_norm, w.gate_up, w.down, self.eps, self.activation,
                                    w.o_bias, w.gate_up_bias, w.down_bias, self.reduce)
        return self.head(x[:, -1], self.final_norm, self.lm_head, self.eps)

    def forward_states(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       key_valid: torch.Tensor, cache: KVCache, pieces: "StatePieces | None" = None,
                       ) -> list[torch.Tensor]:
        """The forward with the residual stream kept at every sub-block boundary (the layer stage of
        `evalrun bisect`): [layer 0 after attention, layer 0 after MLP, layer 1 ..., logits of every
        token [B, T, V]], each [B, T, hidden]. The same pieces as `forward`, post_attention run as its
        two halves; `pieces` may hold compiled versions (modes.state_pieces)."""
        p = pieces or StatePieces()
        x, cos, sin, mask = p.prologue(tokens, positions, slots, key_valid, self.embed, self.inv_freq,
                                       self.rope_scale, self.heads // self.kv_heads)
        shape, states = (self.heads, self.kv_heads, self.head_dim, self.eps), []
        for index, w in enumerate(self.layers):
            q, kv = p.pre_attention(x, cos, sin, w.input_norm, w.qkv, *shape, w.qkv_bias, w.q_norm, w.k_norm)
            x = p.output_projection(x, self.attend(index, q, kv, slots, mask, cache), w.o, w.o_bias, self.reduce)
            states.append(x)
            x = p.mlp_block(x, w.post_norm, w.gate_up, w.down, self.eps, self.activation, w.gate_up_bias,
                            w.down_bias, self.reduce)
            states.append(x)
        return states + [p.head(x, self.final_norm, self.lm_head, self.eps)]


def _stacked_biases(projections: list[torch.nn.Module]) -> torch.Tensor | None:
    """The biases of projections whose weights are stacked, stacked the same way [sum n_i]; None
    without biases. model_support has vouched that they come all or none (one config switch)."""
    biases = [p.bias for p in projections]
    if all(b is None for b in biases):
        return None
    assert all(b is not None for b in biases), "a stacked projection without its bias"
    return stack_rows(biases)


# The pure pieces of the forward. Piecewise compilation compiles these (one compiled artefact per
# piece serves every layer: same code, same shapes); attention and its KV-cache write stay between.

def prologue(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, key_valid: torch.Tensor,
             embed: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float, rows_per_key_head: int,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every layer shares: embeddings x [B, T, hidden], rotary cos/sin [B, 1, T, D], attention mask."""
    x = F.embedding(tokens, embed)
    cos, sin = rotary(positions, inv_freq, rope_scale, embed.dtype)
    return x, cos, sin, build_mask(slots, key_valid, rows_per_key_head, embed.dtype)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def pre_attention(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_norm: torch.Tensor,
                  wqkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float,
                  bqkv: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, hidden] -> q [B, H, T, D] and kv [2, B, G, T, D] (keys, values), rotary applied to q and k.

    bqkv [(H+2G)*D]: the q/k/v biases (Qwen2, Llama's attention_bias); q_norm, k_norm [D]: Qwen3's
    RMSNorm of each query and key head, applied before rotary."""
    batch, tokens, _ = x.shape
    qkv = F.linear(rms_norm(x, input_norm, eps), wqkv, bqkv).view(batch, tokens, heads + 2 * kv_heads, head_dim)
    q, k, v = qkv.transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return apply_rotary(q, cos, sin), torch.stack((apply_rotary(k, cos, sin), v))


def post_attention(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, post_norm: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, eps: float, activation: str = "silu",
                   bo: torch.Tensor | None = None, b_gate_up: torch.Tensor | None = None,
                   b_down: torch.Tensor | None = None, reduce: Callable | None = None) -> torch.Tensor:
    """x [B, T, hidden], attended [B, H, T, D] -> x after the output projection and the MLP."""
    return mlp_block(output_projection(x, attended, wo, bo, reduce), post_norm, gate_up, down, eps, activation,
                     b_gate_up, b_down, reduce)


def output_projection(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor,
                      bo: torch.Tensor | None = None, reduce: Callable | None = None) -> torch.Tensor:
    """The attention sub-block's end: x [B, T, hidden] + the output projection of attended [B, H, T, D]
    (bo [hidden]: its bias, where the config has one)."""
    batch, tokens, _ = x.shape
    return x + row_parallel_linear(attended.transpose(1, 2).reshape(batch, tokens, -1), wo, bo, reduce)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        reduce: Callable | None) -> torch.Tensor:
    """F.linear, or under tensor parallelism (`reduce` set, tensor_parallel.py) this rank's partial
    product [.., out] summed over the ranks, the bias added once after the sum."""
    if reduce is None:
        return F.linear(x, weight, bias)
    summed = reduce(F.linear(x, weight))
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


def mlp_block(x: torch.Tensor, post_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              eps: float, activation: str = "silu", b_gate_up: torch.Tensor | None = None,
              b_down: torch.Tensor | None = None, reduce: Callable | None = None) -> torch.Tensor:
    """The MLP sub-block with its residual: x [B, T, hidden] -> x + down(act(gate) * up) of norm(x);
    b_gate_up [2*inter] and b_down [hidden] are its biases where the config has them."""
    gate, up = F.linear(rms_norm(x, post_norm, eps), gate_up, b_gate_up).chunk(2, dim=-1)
    return x + row_parallel_linear(activate(gate, activation) * up, down, b_down, reduce)


def head(last: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """last [B, hidden] -> logits [B, V]."""
    return F.linear(rms_norm(last, final_norm, eps), lm_head)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, implementation: str) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, G, S, D], mask [B, 1, R*T, S] additive -> [B, H, T, D].

    Query head h attends with key/value head h // R (transformers' `repeat_kv` order)."""
    batch, heads, tokens, dim = q.shape
    grouped = q.reshape(batch, k.shape[1], -1, dim)  # [B, G, R*T, D]
    if implementation == "sdpa":
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
    else:  # explicit math, as transformers' eager attention: softmax in fp32 (fp64 for an fp64 model)
        scores = (grouped @ k.transpose(-1, -2)) * dim**-0.5 + mask  # [B, G, R*T, S]
        wide = torch.promote_types(q.dtype, torch.float32)
        out = torch.softmax(scores, dim=-1, dtype=wide).to(q.dtype) @ v
    return out.reshape(batch, heads, tokens, dim)  # a copy only where the kernel's output layout needs one


MASK_ALIGNMENT = 16  # fused attention kernels want the mask's row stride a multiple of 16 elements


def build_mask(slots: torch.Tensor, key_valid: torch.Tensor, rows_per_key_head: int, dtype: torch.dtype) -> torch.Tensor:
    """slots [T], key_valid [B, S] -> additive mask [B, 1, R*T, S] (0 or -inf): causal, padding hidden,
    each query sees itself; row r*T + t belongs to query token t (R = rows_per_key_head).

    A padding query would otherwise see no key at all (a NaN row that poisons the cache). The mask is
    a view of rows padded to MASK_ALIGNMENT, so the fused kernels take it without a copy.
    """
    cache_slots = key_valid.shape[1]
    aligned = -(-cache_slots // MASK_ALIGNMENT) * MASK_ALIGNMENT
    key_index = torch.arange(aligned, device=slots.device)  # [S']
    valid = F.pad(key_valid, (0, aligned - cache_slots))  # [B, S'], the padding columns never valid
    causal = key_index[None, :] <= slots[:, None]  # [T, S']
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
