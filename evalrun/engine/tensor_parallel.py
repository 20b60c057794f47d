"""Tensor parallelism over torch.distributed, as gpt-fast's tp.py does it: the engine's projections split
across the ranks of a process group, one all-reduce after each row-parallel projection.

Per layer, on rank r of W ranks (H query heads, G key/value heads, D head dim, I intermediate size):
  qkv      column-wise: rank r keeps query heads [r*H/W, (r+1)*H/W) and key/value heads
           [r*G/W, (r+1)*G/W) (query head h still reads key/value head h // (H/G)), stacked again
  o        row-wise: the input columns of its query heads; partial products summed by an all-reduce,
           the bias added once, after the sum
  gate_up  column-wise: its slice of the gate rows and the same slice of the up rows, stacked again
  down     row-wise: its slice of the intermediate columns; all-reduce, bias once
The KV cache holds only the rank's key/value heads. Embedding, norms and lm_head stay replicated: every
rank computes the same full logits from the same reduced hidden state, so capture happens on any rank
(rank 0 records) with no gather. The model's whole projections are released once split (a rank holds
its shards, not the model twice); the sharded forward is built once per loaded model and shared by
every config of the same tensor-parallel size that shares the model (runner.shares_model).

The reduce is `torch.distributed._functional_collectives.all_reduce` where Dynamo traces (trace-once,
stock and piecewise compile it with the pieces around it), c10d's in-place all-reduce in eager code.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable

import torch

from ..errors import ConfigError
from .transformer import LayerWeights, Transformer


def check_divisible(heads: int, kv_heads: int, intermediate: int, ranks: int) -> None:
    """ConfigError (one line) unless `ranks` divides the query heads, key/value heads and intermediate size."""
    for name, size in (("attention heads", heads), ("key/value heads", kv_heads), ("intermediate size", intermediate)):
        if size % ranks:
            raise ConfigError(f"tensor_parallel={ranks} does not divide the model's {size} {name}; use a "
                              f"tensor-parallel size that divides {heads} heads, {kv_heads} key/value heads and "
                              f"{intermediate} intermediate size")


def _rows(matrix: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return matrix[start:start + count]


def shard_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, rank: int, ranks: int) -> torch.Tensor:
    """qkv [(H+2G)*D, ...] (weight or bias) -> this rank's [(H+2G)/W*D, ...]: its q, k and v heads, stacked."""
    q_rows, kv_rows = heads // ranks * head_dim, kv_heads // ranks * head_dim
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    return torch.cat([_rows(q, rank * q_rows, q_rows), _rows(k, rank * kv_rows, kv_rows),
                      _rows(v, rank * kv_rows, kv_rows)]).contiguous()


def shard_gate_up(gate_up: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """gate_up [2*I, ...] -> [2*I/W, ...]: this rank's gate rows, then the same rows of up."""
    gate, up = gate_up.chunk(2)
    rows = gate.shape[0] // ranks
    return torch.cat([_rows(gate, rank * rows, rows), _rows(up, rank * rows, rows)]).contiguous()


def shard_columns(matrix: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """A row-parallel projection [out, in] -> [out, in/W]: this rank's input columns."""
    columns = matrix.shape[1] // ranks
    return matrix[:, rank * columns:(rank + 1) * columns].contiguous()


def shard_layer(w: LayerWeights, heads: int, kv_heads: int, head_dim: int, rank: int, ranks: int) -> LayerWeights:
    """One layer's weights as rank `rank` of `ranks` holds them (new tensors)."""
    qkv = lambda t: None if t is None else shard_qkv(t, heads, kv_heads, head_dim, rank, ranks)  # noqa: E731
    gate_up = lambda t: None if t is None else shard_gate_up(t, rank, ranks)  # noqa: E731
    # replace(): every field not split here (norms, row-parallel biases, Gemma's output norms) stays as it is
    return dataclasses.replace(w, qkv=qkv(w.qkv), o=shard_columns(w.o, rank, ranks), gate_up=gate_up(w.gate_up),
                               down=shard_columns(w.down, rank, ranks), qkv_bias=qkv(w.qkv_bias),
                               gate_up_bias=gate_up(w.gate_up_bias))


def all_reduce_sum(group: "torch.distributed.ProcessGroup") -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the sum of x over the group's ranks: functional where Dynamo traces (compiled pieces), c10d's
    in-place all-reduce in eager code, where the functional wrapper's host cost made eager TP=2 on two
    H200s 2.6x slower per step than TP=1 (both are one NCCL all-reduce of the same buffer)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return funcol.all_reduce(x, "sum", group)
        dist.all_reduce(x, group=group)
        return x

    return reduce


def release(model: torch.nn.Module, layers: list[LayerWeights]) -> None:
    """Free the whole projections of `layers`: each parameter of `model` sharing their storage becomes a
    zero-stride view of one zero (same shape and element count, so the model identity's parameter
    count stays; its weight hash was taken at load). Family-agnostic: found by address, not by name.
    The memory returns once nothing else holds it (the pre-split layers are dropped by `shard`)."""
    spans = [_span(t) for w in layers for t in (w.qkv, w.o, w.gate_up, w.down)]
    for parameter in model.parameters():
        start, end = _span(parameter)
        if any(low <= start and end <= high for low, high in spans):  # inside a whole projection, nothing else
            parameter.data = torch.zeros((), dtype=parameter.dtype, device=parameter.device).expand(parameter.shape)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes a contiguous tensor covers: [first, last)."""
    return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()


_SHARDED: "weakref.WeakKeyDictionary[torch.nn.Module, Transformer]" = weakref.WeakKeyDictionary()


def sharded_transformer(model: torch.nn.Module, attn_implementation: str, rank: int, ranks: int,
                        group: "torch.distributed.ProcessGroup") -> Transformer:
    """Rank `rank`'s forward of a `ranks`-way split of `model`, built once per loaded model (its whole
    projections are released after the split, so a second build could not read them)."""
    if model not in _SHARDED:
        transformer = Transformer(model, attn_implementation)
        whole = transformer.layers
        _SHARDED[model] = shard(transformer, rank, ranks, group)
        release(model, whole)
    transformer = _SHARDED[model]
    assert (transformer.attn_implementation, transformer.tensor_parallel["ranks"]) == (attn_implementation, ranks), \
        "a sharded model shared with another attention implementation or tensor-parallel size"
    return transformer


def shard(transformer: Transformer, rank: int, ranks: int, group: "torch.distributed.ProcessGroup") -> Transformer:
    """Make `transformer` rank `rank`'s part of a `ranks`-way tensor-parallel forward (in place; returned)."""
    if any(w.moe is not None for w in transformer.layers):
        raise ConfigError("tensor parallelism of mixture-of-experts layers is not implemented yet; "
                          "run this model with --tensor-parallel 1")
    intermediate = transformer.layers[0].down.shape[1]
    check_divisible(transformer.heads, transformer.kv_heads, intermediate, ranks)
    heads, kv_heads, head_dim = transformer.heads, transformer.kv_heads, transformer.head_dim
    transformer.layers = [shard_layer(w, heads, kv_heads, head_dim, rank, ranks) for w in transformer.layers]
    transformer.heads, transformer.kv_heads = heads // ranks, kv_heads // ranks
    transformer.reduce = all_reduce_sum(group)
    transformer.tensor_parallel = {"rank": rank, "ranks": ranks, "heads": heads // ranks, "kv_heads": kv_heads // ranks,
                                   "intermediate": intermediate // ranks}
    return transformer
