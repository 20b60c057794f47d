"""Mixture-of-experts feed-forward (Qwen3-MoE): a softmax router picks the top-k experts of each token.

Pure functions with static shapes, so the block compiles with `fullgraph=True`, is captured in CUDA
graphs and never syncs with the host: no `.item()`, no `nonzero`, no per-expert token lists. Two
equivalent computations, chosen from the (static) token count when the graph is built:

  gathered  N*k < E: each token's k experts' weights are gathered ([N, k, 2I, hidden]) and applied
            to it alone (decode: reads k experts per token, not all E);
  dense     otherwise: every expert runs on every token ([E, N, 2I]) and each token keeps its k
            outputs (prefill: reads each expert once, whatever the token count).

Both weight the k chosen outputs and sum them over k, as transformers' Qwen3MoeExperts does.

Routing is itself a discrete decision, so the block also returns, for the last token of each row (the
token whose logits a step captures), the chosen experts and the router margin: the gap between the
k-th and (k+1)-th router probability. A flip of the chosen set at a margin near 0 is a near-tie.

Forced routing (verify's forced runs, like forced tokens): the last token of each row may be given its k
experts (another run's choice at that step), and in a prefill every token of the prompt too (the golden's prompt
routing); the block then applies those experts, weighted by its own router probabilities at them, and still
returns its own choice and margin. A token given -1 routes freely.

Shapes: B batch, T tokens, N = B*T, E experts, k experts per token, I expert inner size, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]  # the feed-forward activation, elementwise


@dataclass
class MoEWeights:
    """One MoE layer's feed-forward; `slot` is its index among the model's MoE layers (routing capture)."""

    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2I, hidden]: each expert's gate and up projections stacked
    down: torch.Tensor  # [E, hidden, I]
    top_k: int
    normalize: bool  # norm_topk_prob: the k chosen probabilities rescaled to sum to 1
    slot: int


def layer_weights(mlp: torch.nn.Module, slot: int) -> MoEWeights | None:
    """The MoE weights of a transformers Qwen3MoeSparseMoeBlock (views, no copies); None for a dense MLP."""
    if not hasattr(mlp, "experts"):
        return None
    router = mlp.gate
    return MoEWeights(router.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj, router.top_k,
                      bool(router.norm_topk_prob), slot)


def model_routing_layout(hf_model: torch.nn.Module) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of a transformers model: the shape [L, k] of each step's routing that the
    engine captures and that forced routing applies; None for a dense model (or one laid out unlike the
    decoder families the engine runs: it has no routing either)."""
    layers = getattr(getattr(hf_model, "model", None), "layers", None) or []
    moe = [mlp for mlp in (getattr(layer, "mlp", None) for layer in layers) if hasattr(mlp, "experts")]
    top_k = getattr(getattr(moe[0], "gate", None), "top_k", None) if moe else None
    return (len(moe), top_k) if isinstance(top_k, int) else None  # layer_weights reads the same fields


class RoutingState:
    """The last forward's routing of each row's last token, in every MoE layer; lives with the KV cache
    (one per workspace), written by the forward, read by the step's capture. With `record_prompt`, a prefill records
    the experts of every token of the prompt (`prompt` [B, S, L, k] int16, the first T slots of a T-token prefill).

    A workspace that forces routing also holds `forced`: the experts the next forward applies to each row's last
    token (written by the decode loop), and `prompt_forced` [B, S, L, k] int16: the experts a prefill applies to the
    tokens before the last (its first P slots written with each batch padded to P; -1: free). Free workspaces have
    neither, so a free run computes what it always did (its pieces take no forced experts: the bits of before forced
    routing existed); a forced run's graph differs, so under torch.compile a run forced along its own routing may
    differ from its free run in the last bits (eagerly it is the same)."""

    def __init__(self, batch: int, layers: int, top_k: int, device: torch.device, forcing: bool = False,
                 slots: int = 0, record_prompt: bool = False):
        self.experts = torch.zeros((batch, layers, top_k), dtype=torch.int64, device=device)  # [B, L, k]
        self.margins = torch.zeros((batch, layers), dtype=torch.float32, device=device)  # [B, L]
        self.forced = torch.full((batch, layers, top_k), -1, dtype=torch.int64, device=device) if forcing else None
        prompt_shape = (batch, slots, layers, top_k)
        self.prompt = torch.zeros(prompt_shape, dtype=torch.int16, device=device) if record_prompt else None
        self.prompt_forced = torch.full(prompt_shape, -1, dtype=torch.int16, device=device) if forcing else None

    def forced_for(self, slot: int, tokens: int = 1) -> torch.Tensor | None:
        """The experts MoE layer `slot` applies in a forward of `tokens` tokens a row, or None (free routing):
        [B, k] to each row's last token in a decode step, [B, T, k] to every token in a prefill."""
        if self.forced is None:
            return None
        last = self.forced.select(1, slot)  # [B, k]
        if tokens == 1:
            return last
        before = self.prompt_forced[:, :tokens - 1, slot].long()  # [B, T-1, k]
        return torch.cat([before, last[:, None]], dim=1)

    def record(self, slot: int, experts: torch.Tensor, margin: torch.Tensor) -> None:
        """experts [B, T, k], margin [B, T] of MoE layer `slot`: the last token's kept (a prefill's every token's
        experts too, when the state records a prompt's)."""
        self.experts.select(1, slot).copy_(experts[:, -1])
        self.margins.select(1, slot).copy_(margin[:, -1])
        tokens = experts.shape[1]
        if self.prompt is not None and tokens > 1:
            self.prompt[:, :tokens, slot].copy_(experts)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, forced: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, hidden] -> weights [N, k] (x's dtype), applied experts [N, k] int64, own experts [N, k], margin [N]
    float32. `forced` [N, k] (a row of -1: free) replaces the own choice of the applied experts; their weights
    are this router's probabilities at them. Without it, applied and own experts are one tensor.

    Softmax in fp32 (fp64 for an fp64 model), as transformers' Qwen3MoeTopKRouter (which uses fp32)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=wide)  # [N, E]
    values, experts = torch.topk(probs, min(top_k + 1, probs.shape[-1]), dim=-1)  # [N, k+1] (k when k = E)
    runner_up = values[:, top_k] if values.shape[-1] > top_k else torch.zeros_like(values[:, 0])
    margin = (values[:, top_k - 1] - runner_up).float()
    own = experts[:, :top_k]
    applied, chosen = own, values[:, :top_k]
    if forced is not None:
        applied = torch.where(forced[:, :1] >= 0, forced, own)  # [N, k]
        chosen = probs.gather(-1, applied)  # the same values where the row routes freely
    if normalize:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen.to(x.dtype), applied, own, margin


def experts_gathered(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     act: Activation) -> torch.Tensor:
    """x [N, hidden], experts [N, k] -> each token's chosen experts' outputs [N, k, hidden]."""
    gate, up = torch.einsum("nh,nkih->nki", x, gate_up[experts]).chunk(2, dim=-1)  # [N, k, I] each
    return torch.einsum("nki,nkhi->nkh", act(gate) * up, down[experts])


def experts_dense(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  act: Activation) -> torch.Tensor:
    """x [N, hidden], experts [N, k] -> the same [N, k, hidden], computed by every expert on every token."""
    gate, up = torch.matmul(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
    every = torch.matmul(act(gate) * up, down.transpose(1, 2)).transpose(0, 1)  # [N, E, hidden]
    return every.gather(1, experts[..., None].expand(-1, -1, x.shape[-1]))  # [N, k, hidden]


def sparse_mlp(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Activation,
               top_k: int, normalize: bool, forced: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, hidden] (normed), forced [N, k] or None (see route) -> out [N, hidden], own experts [N, k], margin [N]."""
    weights, applied, own, margin = route(x, router, top_k, normalize, forced)
    compute = experts_gathered if x.shape[0] * top_k < gate_up.shape[0] else experts_dense  # static shapes
    outputs = compute(x, applied, gate_up, down, act)  # [N, k, hidden]
    return (outputs * weights[..., None]).sum(dim=1), own, margin


def mlp_block(x: torch.Tensor, normed: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, act: Activation, top_k: int, normalize: bool, forced: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE sub-block's residual update: x, normed (x after the layer's post-attention norm) [B, T, hidden]
    -> x + experts(normed) [B, T, hidden], and the routing of every token: experts [B, T, k], margin [B, T]
    (its own choice). `forced` or None: [B, k], the experts applied to each row's last token, or [B, T, k], those
    applied to every token (-1: free).

    (engine.transformer.moe_post_attention applies the norm and the attention output first: this module
    builds on no other, so the transformer can import it.)"""
    batch, tokens, hidden = x.shape
    if forced is not None and forced.dim() == 2:  # [B, k] -> [B, T, k]: only each row's last token is given its experts
        free = torch.full((batch, tokens - 1, top_k), -1, dtype=forced.dtype, device=forced.device)
        forced = torch.cat([free, forced[:, None]], dim=1)
    out, experts, margin = sparse_mlp(normed.reshape(-1, hidden), router, gate_up, down, act, top_k, normalize,
                                      forced.reshape(-1, top_k) if forced is not None else None)
    return x + out.view(batch, tokens, hidden), experts.view(batch, tokens, top_k), margin.view(batch, tokens)
