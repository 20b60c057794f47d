"""A Llama-family decoder forward over a Hugging Face model's weights, gpt-fast style.

The weights stay in the Hugging Face module (no copies); this module only changes how the
forward runs: a static KV cache allocated once at a fixed size, positions and cache slots given as
tensors, and a boolean mask built from them, so that every decode step has the same shapes and can
be compiled with `fullgraph=True` and captured in a CUDA graph.

Shapes: B batch, T tokens in this call, S cache slots, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ModelError

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    q: torch.Tensor  # [H*D, hidden]
    k: torch.Tensor  # [G*D, hidden]
    v: torch.Tensor  # [G*D, hidden]
    o: torch.Tensor  # [hidden, H*D]
    post_norm: torch.Tensor  # [hidden]
    gate: torch.Tensor  # [inter, hidden]
    up: torch.Tensor  # [inter, hidden]
    down: torch.Tensor  # [hidden, inter]


class KVCache:
    """Keys and values for every layer, allocated once: [layers, B, G, S, D] each."""

    def __init__(self, layers: int, batch: int, heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (layers, batch, heads, slots, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def slots(self) -> int:
        return self.keys.shape[3]


class Transformer:
    """Callable forward of a Llama-family model: (tokens, positions, slots, key_valid, cache) -> logits."""

    def __init__(self, hf_model: torch.nn.Module, attn_implementation: str = "sdpa"):
        config = hf_model.config
        if getattr(config, "model_type", None) not in SUPPORTED_ARCHITECTURES:
            raise ModelError(f"architecture {config.model_type!r} is not supported by evalrun's engine; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        inner = hf_model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.attn_implementation = attn_implementation
        self.embed = inner.embed_tokens.weight  # [V, hidden]
        self.final_norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight  # [V, hidden]
        self.layers = [self._layer(layer) for layer in inner.layers]
        rotary = inner.rotary_emb
        # The pieces the forward calls; an execution mode may replace them with compiled versions.
        self.pre_attention, self.post_attention, self.head = pre_attention, post_attention, head
        self.dtype = self.embed.dtype
        self.compute_dtype = torch.promote_types(self.dtype, torch.float32)  # norms and rotary angles
        self.inv_freq = rotary.inv_freq.to(self.compute_dtype)  # [D/2]
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.device = self.embed.device
        self.vocab_size = self.lm_head.shape[0]

    @staticmethod
    def _layer(layer: torch.nn.Module) -> LayerWeights:
        attention, mlp = layer.self_attn, layer.mlp
        if getattr(attention.q_proj, "bias", None) is not None:
            raise ModelError("attention biases are not supported by evalrun's engine")
        return LayerWeights(layer.input_layernorm.weight, attention.q_proj.weight, attention.k_proj.weight,
                            attention.v_proj.weight, attention.o_proj.weight, layer.post_attention_layernorm.weight,
                            mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)

    def new_cache(self, batch: int, slots: int) -> KVCache:
        return KVCache(len(self.layers), batch, self.kv_heads, slots, self.head_dim, self.dtype, self.device)

    # ------------------------------------------------------------ forward

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, D] in the model dtype."""
        angles = positions.to(self.compute_dtype)[..., None] * self.inv_freq  # [B, T, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [B, T, D]
        cos = (angles.cos() * self.rope_scale).to(self.dtype)
        sin = (angles.sin() * self.rope_scale).to(self.dtype)
        return cos[:, None], sin[:, None]

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Write k, v [B, G, T, D] into layer `index`'s cache at `slots` [T]; attend over all S slots."""
        keys, values = cache.keys[index], cache.values[index]  # [B, G, S, D]
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v)
        return attention(q, keys, values, mask, self.attn_implementation, self.heads // self.kv_heads)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                key_valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens/positions [B, T], slots [T], key_valid [B, S] -> logits of the last token [B, V]."""
        x = F.embedding(tokens, self.embed)  # [B, T, hidden]
        cos, sin = self.rotary(positions)
        mask = build_mask(slots, key_valid, cache.slots)
        shape = (self.heads, self.kv_heads, self.head_dim, self.eps)
        for index, w in enumerate(self.layers):
            q, k, v = self.pre_attention(x, cos, sin, w.input_norm, w.q, w.k, w.v, *shape)
            attended = self.attend(index, q, k, v, slots, mask, cache)
            x = self.post_attention(x, attended, w.o, w.post_norm, w.gate, w.up, w.down, self.eps)
        return self.head(x[:, -1], self.final_norm, self.lm_head, self.eps)


# The pure pieces of a decoder layer. Piecewise compilation compiles these (one compiled artefact
# serves every layer: same code, same shapes); attention and its KV-cache write stay between them.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in fp32 (fp64 for an fp64 model), scale in the model dtype, as HF does."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def pre_attention(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_norm: torch.Tensor,
                  wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, hidden] -> q [B, H, T, D], k and v [B, G, T, D], rotary applied to q and k."""
    batch, tokens, _ = x.shape
    h = rms_norm(x, input_norm, eps)
    q = F.linear(h, wq).view(batch, tokens, heads, head_dim).transpose(1, 2)
    k = F.linear(h, wk).view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
    v = F.linear(h, wv).view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def post_attention(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, post_norm: torch.Tensor,
                   gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, T, hidden], attended [B, H, T, D] -> x after the output projection and the MLP."""
    batch, tokens, _ = x.shape
    x = x + F.linear(attended.transpose(1, 2).reshape(batch, tokens, -1), wo)
    h = rms_norm(x, post_norm, eps)
    return x + F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


def head(last: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """last [B, hidden] -> logits [B, V]."""
    return F.linear(rms_norm(last, final_norm, eps), lm_head)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, implementation: str,
              groups: int) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, G, S, D], mask [B, 1, T, S] bool -> [B, H, T, D]."""
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def build_mask(slots: torch.Tensor, key_valid: torch.Tensor, cache_slots: int) -> torch.Tensor:
    """slots [T], key_valid [B, S] -> [B, 1, T, S]: causal, padding hidden, each query sees itself.

    A padding query would otherwise see no key at all (a NaN row that poisons the cache).
    """
    key_index = torch.arange(cache_slots, device=slots.device)  # [S]
    causal = key_index[None, :] <= slots[:, None]  # [T, S]
    itself = key_index[None, :] == slots[:, None]  # [T, S]
    return ((causal[None] & key_valid[:, None, :]) | itself[None])[:, None]  # [B, 1, T, S]
