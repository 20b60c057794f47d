"""Whether transformers' conversion of a GGUF file is the model llama.cpp computes from it.

transformers' GGUF converter skips, without a word, every tensor it has no name for (a Llama file's attention
biases, Llama 3's rope_freqs frequency factors) and every family metadata key it has no mapping for (rope scaling,
a sliding window, experts), and leaves settings it never reads at its defaults (Gemma's attention scale). The model
it builds is then another than the file's, and a run of it verified `identical` against the golden of the file
without them. `check_read_whole` refuses such a file: the converted weights must hold every value the file
stores, and a family key the converter did not read must be off, inert, or equal to what the converted config
says (in the file's terms).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .errors import ModelError

CHECKED = "whole-file-v2"  # in the conversion cache key: which checks a cached conversion passed

# Family keys the converter does not read, and the config field each must equal: where they agree with the
# converted config the model is the same. "head_dim", "sliding_rope_theta" and "layer_types" are read from the
# config in the file's terms (`expected_value`).
EQUAL_TO_CONFIG = {"rope.dimension_count": "head_dim", "attention.key_length": "head_dim",
                   "attention.value_length": "head_dim", "attn_logit_softcapping": "attn_logit_softcapping",
                   "final_logit_softcapping": "final_logit_softcapping", "expert_count": "num_experts",
                   "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size",
                   "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
                   "attention.sliding_window": "sliding_window",  # 0 and None: no window
                   "attention.sliding_window_pattern": "layer_types", "rope.freq_base_swa": "sliding_rope_theta"}
# Family keys llama.cpp never reads: the legacy converters' tensor layout note ("Meta AI original pth").
INERT_KEYS = ("tensor_data_layout",)
# Gemma: llama.cpp scales attention scores by 1/sqrt(hidden / heads) for the 27B model (known by its layer count),
# by 1/sqrt(head_dim) otherwise; transformers' converter reads no query_pre_attn_scalar (its default is 256).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# transformers' model_type -> llama.cpp's architecture name, where they differ
LLAMA_CPP_NAMES = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "gemma3_text": "gemma3"}

FIX = "use the checkpoint's Hugging Face folder, or --engine openai: with llama.cpp's server"


def check_read_whole(gguf: Path, model: torch.nn.Module) -> None:
    """Refuse (ModelError) a GGUF file whose conversion `model` is not the model the file describes."""
    from .engine.gguf_blocks import open_gguf  # gguf's reader, its header read 4x faster (SmolLM2: 4 s -> 1 s)

    reader = open_gguf(gguf)
    _check_tensors(gguf, reader, model)
    _check_metadata(gguf, reader, model.config)
    _check_gemma_attention_scale(gguf, model.config)


def _check_tensors(gguf: Path, reader: Any, model: torch.nn.Module) -> None:
    """The converted weights hold every value the file stores (tied weights once, as the file stores them once)."""
    stored = sum(int(t.n_elements) for t in reader.tensors)
    loaded = sum(p.numel() for p in model.parameters())
    if stored != loaded:
        names = _gguf_names(model)
        unread = sorted(t.name for t in reader.tensors if t.name not in names)
        shown = ", ".join(unread[:3]) + (f" (+{len(unread) - 3} more)" if len(unread) > 3 else "")
        raise ModelError(f"{gguf.name} holds {stored:,} weight values but transformers' converter read "
                         f"{loaded:,}{': it skips ' + shown if unread else ''}; evalrun would compute another model "
                         f"than llama.cpp does: {FIX}")


def _check_metadata(gguf: Path, reader: Any, config: Any) -> None:
    """Every family key (`ARCH.*`) is read into the config, off, inert, or equal to the config's value."""
    architecture = str(_value(reader.fields["general.architecture"]))
    mapped = _config_mapping(architecture, config)
    head_dim = _head_dim(config)
    scaling = reader.fields.get(f"{architecture}.rope.scaling.type")
    unscaled = scaling is None or _value(scaling) in ("", "none")
    for key, field in reader.fields.items():
        prefix, _, name = key.partition(".")
        if prefix != architecture or mapped.get(name):  # general.*, tokenizer.*, GGUF.*; or read into config
            continue
        if name in INERT_KEYS or (name == "rope.scaling.original_context_length" and unscaled):
            continue  # the original context length only matters to a scaled rotary (YaRN, LongRoPE)
        value = _value(field)
        if _agrees(value, name, config, head_dim):
            continue
        raise ModelError(f"{gguf.name}: metadata {key} = {str(value)[:60]} is not read by transformers' GGUF "
                         f"converter (its model would be another than llama.cpp computes); {FIX}")


def _agrees(value: Any, name: str, config: Any, head_dim: int) -> bool:
    """Whether an unread key's value leaves the converted model the file's: equal to the config, or off."""
    if name not in EQUAL_TO_CONFIG:
        return value in (None, 0, 0.0, False, "", "none", [])
    expected = expected_value(EQUAL_TO_CONFIG[name], config, head_dim)
    if isinstance(value, bool) or isinstance(expected, bool):
        return False
    if isinstance(value, (int, float)) and isinstance(expected, (int, float)):
        return value == expected
    return isinstance(value, list) and value == expected


def _check_gemma_attention_scale(gguf: Path, config: Any) -> None:
    if config.model_type not in GEMMA_27B_LAYERS:
        return
    is_27b = config.num_hidden_layers == GEMMA_27B_LAYERS[config.model_type]
    scalar = config.hidden_size // config.num_attention_heads if is_27b else _head_dim(config)
    if getattr(config, "query_pre_attn_scalar", None) != scalar:
        raise ModelError(f"{gguf.name}: llama.cpp scales this model's attention scores by 1/sqrt({scalar}), "
                         f"transformers' GGUF converter by 1/sqrt({config.query_pre_attn_scalar}) (it reads no "
                         f"query_pre_attn_scalar); {FIX}")


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - a field gguf cannot decode is shown as such
        return "?"


def _config_mapping(architecture: str, config: Any) -> dict[str, Any]:
    """transformers' key map for the file's family. transformers looks it up under its own name for the
    architecture (llama.cpp's "qwen3moe" is "qwen3_moe", "gemma3" is "gemma3_text", a "llama" file named
    "mistral" is "mistral"): the converted config's model_type says which it used."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    model_type = str(config.model_type)
    for name in (model_type, model_type.removesuffix("_text"), architecture):
        if name in GGUF_CONFIG_MAPPING:
            return GGUF_CONFIG_MAPPING[name]
    return {}


def expected_value(field: str, config: Any, head_dim: int) -> Any:
    """The converted config's value for an EQUAL_TO_CONFIG field, in the file's terms."""
    if field == "head_dim":
        return head_dim
    if field == "sliding_rope_theta":  # Gemma 3: the sliding layers' own rotary base
        rope = getattr(config, "rope_parameters", None) or {}
        return (rope.get("sliding_attention") or {}).get("rope_theta") if isinstance(rope, dict) else None
    if field == "layer_types":  # llama.cpp: one flag a layer, true where it attends through the window
        kinds = getattr(config, "layer_types", None)
        return [kind == "sliding_attention" for kind in kinds] if kinds else None
    value = getattr(config, field, None)
    return 0 if field == "sliding_window" and value is None else value


def _gguf_names(model: torch.nn.Module) -> set[str]:
    """The GGUF tensor names of the converted model's weights (gguf's own name map), for naming the rest."""
    import gguf as gguf_py

    model_type = LLAMA_CPP_NAMES.get(model.config.model_type, model.config.model_type)
    arch = next((key for key, value in gguf_py.MODEL_ARCH_NAMES.items() if value == model_type), None)
    if arch is None:
        return set()
    name_map = gguf_py.get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = set()
    for hf_name, _ in model.named_parameters(remove_duplicate=False):
        base, _, suffix = hf_name.rpartition(".")
        for candidate in (base, hf_name):
            found = name_map.get_name(candidate)
            if found:
                names.add(found + ("." + suffix if candidate == base else ""))
        if ".mlp.experts." in hf_name:  # merged experts: ffn_{gate,up,down}_exps
            block = hf_name.split(".")[2]
            names |= {f"blk.{block}.ffn_{part}_exps.weight" for part in ("gate", "up", "down")}
    return names
