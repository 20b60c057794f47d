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

    # ------------------------------------------------------------ pieces

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama RMSNorm: normalise in fp32 (fp64 for an fp64 model), scale in the model dtype, as HF does."""
        x32 = x.to(self.compute_dtype)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, D] in the model dtype."""
        angles = positions.to(self.compute_dtype)[..., None] * self.inv_freq  # [B, T, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [B, T, D]
        cos = (angles.cos() * self.rope_scale).to(self.dtype)
        sin = (angles.sin() * self.rope_scale).to(self.dtype)
        return cos[:, None], sin[:, None]

    @staticmethod
    def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, G, S, D], mask [B, 1, T, S] bool -> [B, H, T, D]."""
        if self.attn_implementation == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5  # [B, H, T, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return weights @ v

    def layer_forward(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      slots: torch.Tensor, mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decoder layer; writes this call's keys/values into cache slots `slots` [T]."""
        w = self.layers[index]
        batch, tokens, _ = x.shape
        h = self.rms_norm(x, w.input_norm)
        q = F.linear(h, w.q).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = F.linear(h, w.k).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, G, T, D]
        v = F.linear(h, w.v).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.apply_rotary(q, cos, sin), self.apply_rotary(k, cos, sin)
        keys, values = cache.keys[index], cache.values[index]  # [B, G, S, D]
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v)
        attended = self.attention(q, keys, values, mask)  # [B, H, T, D]
        x = x + F.linear(attended.transpose(1, 2).reshape(batch, tokens, -1), w.o)
        h = self.rms_norm(x, w.post_norm)
        return x + F.linear(F.silu(F.linear(h, w.gate)) * F.linear(h, w.up), w.down)

    # ------------------------------------------------------------ forward

    @staticmethod
    def build_mask(slots: torch.Tensor, key_valid: torch.Tensor, cache_slots: int) -> torch.Tensor:
        """slots [T], key_valid [B, S] -> [B, 1, T, S]: causal, padding hidden, each query sees itself.

        A padding query would otherwise see no key at all (a NaN row that poisons the cache).
        """
        key_index = torch.arange(cache_slots, device=slots.device)  # [S]
        causal = key_index[None, :] <= slots[:, None]  # [T, S]
        itself = key_index[None, :] == slots[:, None]  # [T, S]
        return ((causal[None] & key_valid[:, None, :]) | itself[None])[:, None]  # [B, 1, T, S]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                key_valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens/positions [B, T], slots [T], key_valid [B, S] -> logits of the last token [B, V]."""
        x = F.embedding(tokens, self.embed)  # [B, T, hidden]
        cos, sin = self.rotary(positions)
        mask = self.build_mask(slots, key_valid, cache.slots)
        for index in range(len(self.layers)):
            x = self.layer_forward(index, x, cos, sin, slots, mask, cache)
        last = self.rms_norm(x[:, -1], self.final_norm)  # [B, hidden]
        return F.linear(last, self.lm_head)  # [B, V]
