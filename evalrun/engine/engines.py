"""The engine seam: what computes a run's logits, chosen by `config.engine` and built here, in one place.

An `Engine` turns one `BatchSpec` into one `BatchOutput` (the same capture arrays whatever computes them:
tokens, digests, top-k sketch, margins, kept logits, probe values) and proves what it ran (`evidence`). One that
can also `submit` a batch (enqueue it, return it as a `PendingBatch`) lets the runner make a finished batch's
results while the device computes the next (`submit` below; evalrun's engine does).
The runner (`runner.execute`) sees nothing else: warm-up, batching, results and the store are shared.

  evalrun       evalrun's own forward (engine.transformer) under an `ExecutionMode`: every compilation
                and CUDA-graph mode; runs the families `model_support` lists, refuses the rest
  transformers  transformers' own forward of any causal LM it loads (engine.hf_engine): eager,
                torch.compile of the forward, static cache + compile with CUDA graphs; refuses
                piecewise modes
  openai:URL    a running OpenAI-compatible server: not an engine over a loaded model; its runs go through
                evalrun.server_run (engine.openai_server is its client)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..config import EffectiveConfig
from ..errors import ConfigError, UnsupportedModelError
from .generate import BatchOutput, BatchSpec, PendingBatch


class Engine(Protocol):
    """What the runner needs of an engine. `static`: prompts padded to prefill buckets and batches to
    batch buckets, so shapes repeat (warm-up then covers each shape); `calls_to_warm`: calls per shape
    before one runs as measured."""

    static: bool
    batch_invariant: bool
    calls_to_warm: int

    def plan(self, max_prompt_length: int, max_steps: int) -> None: ...

    def padded_length(self, prompts: list[list[int]]) -> int: ...

    def padded_batch(self, rows: int) -> int: ...

    def generate(self, spec: BatchSpec) -> BatchOutput: ...

    def start_measuring(self) -> None: ...

    def evidence(self) -> dict[str, Any]: ...


def submit(engine: Engine, spec: BatchSpec) -> PendingBatch:
    """Enqueue one batch and return it pending: the engine's own `submit` where it has one (evalrun's engine: the
    host makes the previous batch's results while the device computes this one), else `generate` at once."""
    if hasattr(engine, "submit"):
        return engine.submit(spec)
    output = engine.generate(spec)
    return PendingBatch(None, lambda: output)


def uses_engine_families(engine: str) -> bool:
    """Whether the engine computes the model itself (evalrun's own forward), so the checkpoint's family and
    every config field must be one it implements (`model_support`); other engines run what they load."""
    return engine == "evalrun"


def check_model(engine: str, model: Any) -> None:
    """Refuse, with one line, a model (a loaded Hugging Face module) the engine would not compute as its
    config asks."""
    if uses_engine_families(engine):
        from .model_support import check_config

        check_config(model.config.to_dict())
    elif engine == "transformers" and _keeps_recurrent_state(model):
        # A recurrent state (Mamba, RWKV, hybrids) is not an attention KV cache: the transformers engine's
        # left-padded decode with a 2D padding mask computes another model for it (Mamba: logits off by ~30)
        raise UnsupportedModelError(f"{type(model).__name__} keeps a recurrent state (transformers marks it "
                                    "stateful); --engine transformers decodes attention models with a KV cache and "
                                    "padding mask only and would compute another model; use an attention model")
    if engine == "transformers" and not _is_causal(model):
        raise UnsupportedModelError(f"{type(model).__name__} as loaded attends to later tokens (a bidirectional "
                                    "encoder, e.g. a BERT without is_decoder); --engine transformers decodes token by "
                                    "token and would compute another model; use a causal language model")


def _keeps_recurrent_state(model: Any) -> bool:
    """Whether the model keeps a recurrent state (Mamba, RWKV, linear-attention hybrids). transformers before 5.25
    marks such a model `_is_stateful`; 5.25 dropped the mark and gives their cache linear-attention layers
    instead (a Mamba then ran, computing another model, found by CI on a fresh install): both are asked."""
    if getattr(model, "_is_stateful", False):
        return True
    from transformers import cache_utils

    recurrent = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if recurrent is None:
        return False
    try:
        layers = cache_utils.DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - a config its cache cannot be built for has no such layers to ask about
        return False
    return any(isinstance(layer, recurrent) for layer in layers)


def _is_causal(model: Any) -> bool:
    """Whether the model's logits at a position ignore later tokens: two forwards of 8 tokens that share the
    first 2 and differ in all 6 after them must agree on the first 2 positions (a bidirectional model's move
    there). Changing one last token only moved a small random BERT's logits within the tolerance in 13 of
    200 seeds; changing six, in none of 300."""
    import torch

    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config().vocab_size)
    tokens = (torch.arange(3, 11, device=device) % vocab)[None]  # [1, 8]
    changed = tokens.clone()
    changed[0, 2:] = (tokens[0, 2:] + 1 + torch.arange(6, device=device)) % vocab
    with torch.no_grad():
        first, second = (model(input_ids=ids).logits[0, :2].float() for ids in (tokens, changed))  # [2, V]
    return bool(torch.allclose(first, second, rtol=1e-3, atol=1e-3 * float(first.abs().max()) + 1e-6))


def build_engine(model: Any, config: EffectiveConfig, shard: tuple[int, int, Any] | None = None,
                 gguf: Path | None = None) -> Engine:
    """The engine `config.engine` names over a loaded Hugging Face module, in `config`'s execution mode.
    ConfigError (exit 2) when that engine cannot honour the mode; never another engine or mode instead.
    `shard` (rank, ranks, process group): this rank's place in a tensor-parallel world (runner gives it);
    `gguf`: the file the model was converted from, whose blocks linear_kernel=gguf-gemv reads."""
    if config.engine == "evalrun":
        from .modes import build_execution_mode
        from .transformer import Transformer

        if config.tensor_parallel > 1:  # this rank's share of the projections (config.validate checked the world)
            from .tensor_parallel import sharded_transformer

            assert shard is not None, "a tensor-parallel engine needs its rank, rank count and process group"
            transformer = sharded_transformer(model, config.attn_implementation, *shard)
            return build_execution_mode(transformer.with_kernels(config), config)
        transformer = Transformer(model, config.attn_implementation).with_kernels(config)
        if config.linear_kernel == "gguf-gemv":
            from .gguf_blocks import attach

            if gguf is None:
                raise ConfigError("linear_kernel=gguf-gemv reads the weights of a GGUF file; this model was not loaded "
                                  "from one: use linear_kernel=aten")
            transformer = attach(transformer, gguf)
        return build_execution_mode(transformer, config)
    if config.engine == "transformers":
        from .hf_engine import TransformersEngine

        return TransformersEngine(model, config)
    raise ConfigError(f"engine={config.engine[:80]!r} computes no loaded model (a server's runs go through "
                      "evalrun.server_run); use --engine evalrun or --engine transformers")
