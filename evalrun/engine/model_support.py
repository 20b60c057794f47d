"""What evalrun's engine computes, field by field, for each model family it runs.

The rule: **the engine never runs silently as another model.** Every field of a supported family's
config is one of

  implemented  the engine computes it (tests/test_model_support.py checks each against transformers'
               own forward on a tiny random checkpoint);
  inert        it cannot change the logits of an eval-mode forward (names, token ids, generation and
               training settings, transformers' own bookkeeping);
  refused      outside the values listed, the engine stops before computing a token with one line
               naming the field, its value, the values it accepts and what to do.

A field no table names is refused unless its value is off (None, False, 0, empty): evalrun never
guesses that an unknown setting is harmless, because a setting transformers ignores for this family
(`sliding_window` on a Llama, say) is often one the checkpoint's own family needs.

The tables are data: one `Rule` per field, `FAMILIES[model_type]` for each family. The check runs on
the config as transformers loaded it (`model.config.to_dict()`), so legacy spellings transformers
converts (`rope_scaling` and `rope_theta` into `rope_parameters`) are checked as converted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import UnsupportedModelError

IMPLEMENTED, INERT, REFUSED = "implemented", "inert", "refused"

# Feed-forward activations the engine computes (engine.transformer.activate), by transformers' ACT2FN name.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")
# Rotary types whose frequencies are fixed at load (the engine takes transformers' inv_freq and
# attention scaling as they are). `dynamic` and `longrope` change them with the sequence length and
# `proportional` is another family's; those are refused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# What each family's transformers class is: the checkpoint's `architectures` must name it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
# Families whose config names the activation under another field than hidden_act.
ACTIVATION_FIELD = {"gemma2": "hidden_activation", "gemma3_text": "hidden_activation"}
OFFSET_NORM_FAMILIES = ("gemma2", "gemma3_text")  # RMSNorm scales by (1 + w)
WINDOWED_FAMILIES = ("mistral", "phi3", "gemma2", "gemma3_text")  # the engine computes their sliding_window
ATTENTION_KINDS = ("full_attention", "sliding_attention")  # transformers' layer_types values
# Families transformers implements without SDPA (Gemma 2: SDPA cannot soft-cap scores); their modules load
# with eager attention, which only transformers' own forward uses (the engine has its own attention).
HF_EAGER_ONLY = ("gemma2",)
NO_ENGINE_FIX = ("evalrun's engine does not compute that yet; run it with --engine transformers, or use a "
                 "checkpoint that does not need it")


@dataclass(frozen=True)
class Rule:
    """How one config field is handled: `accepts(value)` says whether the engine computes the model
    that value asks for; `accepted` says which values those are, in words."""

    handling: str
    accepts: Callable[[Any], bool]
    accepted: str
    fix: str = NO_ENGINE_FIX


def _any(_: Any) -> bool:
    return True


def is_off(value: Any) -> bool:
    """None, False, 0 or an empty container: a setting that is not switched on."""
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0) or value in ("", [], {})


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == accepted and type(value) is type(accepted) for accepted in values)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _rope(value: Any) -> bool:
    if not isinstance(value, Mapping):
        return False
    partial = value.get("partial_rotary_factor", 1.0)
    return value.get("rope_type", "default") in ROPE_TYPES and partial in (None, 1, 1.0)


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def _window(value: Any) -> bool:
    return value is None or _positive_int(value)


def _cap(value: Any) -> bool:
    return value is None or _positive_number(value)


def _attention_kinds(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(kind in ATTENTION_KINDS for kind in value)


def _rope_per_kind(value: Any) -> bool:
    """Gemma 3: one rotary per attention kind, {"full_attention": {...}, "sliding_attention": {...}}."""
    return (isinstance(value, Mapping) and set(value) <= set(ATTENTION_KINDS) and len(value) > 0
            and all(_rope(rope) for rope in value.values()))


def _full_attention_only(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(kind == "full_attention" for kind in value))


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _layer_indices(value: Any) -> bool:
    return isinstance(value, list) and all(_non_negative_int(index) for index in value)


def implemented(accepts: Callable[[Any], bool] = _any, accepted: str = "any value") -> Rule:
    return Rule(IMPLEMENTED, accepts, accepted)


def inert(why: str) -> Rule:
    return Rule(INERT, _any, f"any value ({why})")


def refused(accepts: Callable[[Any], bool], accepted: str, fix: str = NO_ENGINE_FIX) -> Rule:
    return Rule(REFUSED, accepts, accepted, fix)


SHAPE = implemented(_positive_int, "a positive integer")
OFF = (is_off, "off (absent, null or false)")

# Fields every family shares: the decoder's shape, norms, rotary, activation, and bookkeeping.
COMMON: dict[str, Rule] = {
    "vocab_size": SHAPE, "hidden_size": SHAPE, "intermediate_size": SHAPE, "num_hidden_layers": SHAPE,
    "num_attention_heads": SHAPE, "num_key_value_heads": SHAPE,
    "head_dim": implemented(lambda v: v is None or _positive_int(v), "a positive integer (or absent: hidden/heads)"),
    "hidden_act": implemented(_one_of(*ACTIVATIONS), ", ".join(ACTIVATIONS)),
    "rms_norm_eps": implemented(lambda v: isinstance(v, (int, float)) and v > 0, "a positive number"),
    "rope_parameters": implemented(_rope, f"rope_type {', '.join(ROPE_TYPES)} over the whole head "
                                          "(partial_rotary_factor 1)"),
    "tie_word_embeddings": implemented(_one_of(True, False), "true or false"),
    "max_position_embeddings": implemented(lambda v: v is None or _positive_int(v),
                                           "a positive integer (caps prompt + new tokens)"),
    "model_type": implemented(_any, "the family"),
    "architectures": implemented(_any, "the family's CausalLM class"),  # checked by check_architecture
    # Off at eval time or outside the forward.
    "attention_dropout": inert("dropout is off in eval mode"),
    "initializer_range": inert("initialisation only"),
    "use_cache": inert("the engine keeps its own KV cache"),
    "bos_token_id": inert("token ids: the tokenizer's are used"),
    "eos_token_id": inert("token ids: the tokenizer's are used"),
    "pad_token_id": inert("token ids: the tokenizer's are used"),
    "unk_token_id": inert("token ids"), "sep_token_id": inert("token ids"),
    "decoder_start_token_id": inert("token ids"),
    "tokenizer_class": inert("the tokenizer is loaded from its own files"),
    # transformers' PreTrainedConfig bookkeeping.
    "_name_or_path": inert("where it was loaded from"), "_model_name_or_path": inert("where it was loaded from"),
    "transformers_version": inert("recorded in the environment fingerprint"),
    "dtype": inert("the run's --dtype decides"), "torch_dtype": inert("the run's --dtype decides"),
    "output_attentions": inert("outputs, not values"), "output_hidden_states": inert("outputs, not values"),
    "return_dict": inert("outputs, not values"), "chunk_size_feed_forward": inert("memory, not values"),
    "id2label": inert("classification heads only"), "label2id": inert("classification heads only"),
    "problem_type": inert("classification heads only"),
    "task_specific_params": inert("generation settings"), "prefix": inert("generation settings"),
    "is_llama_config": inert("a nanotron export marker"), "transformers.js_config": inert("transformers.js settings"),
    "is_encoder_decoder": refused(*OFF, "evalrun runs decoder-only causal language models"),
    "pruned_heads": refused(*OFF, "prune the weights themselves and save the checkpoint"),
    "auto_map": refused(*OFF, "custom modeling code is not run; evalrun's engine runs transformers' built-in "
                              "families only"),
    "quantization_config": refused(*OFF, "dequantize the checkpoint (or pass the .gguf file)"),
}

# Off-values accepted for settings of other families: a Llama config that switches one on is a
# checkpoint of another family (Mistral, Gemma, Qwen3 ...), which transformers' Llama would ignore.
FOREIGN_SWITCHES = ("sliding_window", "use_sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                    "query_pre_attn_scalar", "qk_layernorm", "use_qk_norm", "rope_interleaved", "partial_rotary_factor",
                    "layer_types", "num_experts", "num_local_experts", "moe_intermediate_size")

LLAMA: dict[str, Rule] = {
    **COMMON,
    "attention_bias": implemented(_one_of(True, False), "true or false"),
    "mlp_bias": implemented(_one_of(True, False), "true or false"),
    "pretraining_tp": inert("transformers 5 no longer slices the projections; the same products"),
}

QWEN2: dict[str, Rule] = {  # q/k/v biases are part of the architecture (no config switch)
    **COMMON,
    "use_sliding_window": refused(_one_of(False), "false", "sliding-window attention is not implemented yet "
                                                           "(--engine transformers runs it)"),
    "sliding_window": inert("unused while use_sliding_window is false (transformers sets it to null)"),
    "max_window_layers": inert("unused while use_sliding_window is false"),
    "layer_types": refused(_full_attention_only, "full_attention in every layer",
                           "sliding-window attention is not implemented yet (--engine transformers runs it)"),
}

QWEN3: dict[str, Rule] = {  # q/k RMSNorm per head is part of the architecture (no config switch)
    **QWEN2,
    "attention_bias": implemented(_one_of(True, False), "true or false"),
}

SLIDING_WINDOW = implemented(_window, "a positive integer, or null for full attention")

MISTRAL: dict[str, Rule] = {**COMMON, "sliding_window": SLIDING_WINDOW}

PHI3: dict[str, Rule] = {  # q/k/v and gate/up stored fused (qkv_proj, gate_up_proj): the same products
    **COMMON,
    "rope_parameters": Rule(IMPLEMENTED, _rope, COMMON["rope_parameters"].accepted,
                            "Phi-3's longrope (the 128k checkpoints) and partial rotary are not implemented yet; "
                            "use a 4k-context Phi-3 checkpoint, or --engine transformers"),
    "sliding_window": SLIDING_WINDOW,
    "resid_pdrop": inert("dropout is off in eval mode"), "embd_pdrop": inert("dropout is off in eval mode"),
    "original_max_position_embeddings": inert("read only by longrope, which is refused"),
}

GEMMA2: dict[str, Rule] = {  # offset norms, sqrt(hidden) embedding scale, four norms per layer: the architecture
    **COMMON,
    "hidden_act": inert("transformers' Gemma 2 and 3 read hidden_activation; hidden_act is unused"),
    "hidden_activation": implemented(_one_of(*ACTIVATIONS), ", ".join(ACTIVATIONS)),
    "attention_bias": implemented(_one_of(True, False), "true or false"),
    "query_pre_attn_scalar": implemented(_positive_number, "a positive number (scores scale by its -1/2 power)"),
    "sliding_window": implemented(_positive_int, "a positive integer"),
    "layer_types": implemented(_attention_kinds, "a list of full_attention and sliding_attention, one per layer"),
    "attn_logit_softcapping": implemented(_cap, "a positive number, or null for no capping"),
    "final_logit_softcapping": implemented(_cap, "a positive number, or null for no capping"),
    "use_bidirectional_attention": refused(lambda v: v is None or v is False, "null or false",
                                           "bidirectional attention is an encoder's (EmbeddingGemma); evalrun "
                                           "decodes causally"),
    "cache_implementation": inert("the engine keeps its own KV cache"),
}

GEMMA3_TEXT: dict[str, Rule] = {  # Gemma 2 plus q/k RMSNorm per head and a rotary per attention kind
    **GEMMA2,
    "rope_parameters": implemented(_rope_per_kind, "for full_attention and sliding_attention each: rope_type "
                                                   f"{', '.join(ROPE_TYPES)} over the whole head"),
    # transformers' Gemma 3 keeps the field but never caps scores with it: a value would mean two models
    "attn_logit_softcapping": refused(lambda v: v is None, "null", "Gemma 3 does not soft-cap attention scores "
                                      "(transformers ignores the field); remove it from config.json"),
    "_sliding_window_pattern": inert("transformers expands it into layer_types"),
    "sliding_window_pattern": inert("transformers expands it into layer_types"),
}

# Qwen3 with mixture-of-experts feed-forwards (engine/moe.py). Which layers are MoE
# (decoder_sparse_step, mlp_only_layers, num_experts) is read from the modules transformers built,
# so every value that transformers computes is computed; the router is a softmax over the experts.
QWEN3_MOE: dict[str, Rule] = {
    **QWEN3,
    "num_local_experts": implemented(_non_negative_int, "a non-negative integer (0: every layer dense)"),
    "num_experts": implemented(_non_negative_int, "a non-negative integer (0: every layer dense)"),
    "num_experts_per_tok": implemented(_positive_int, "a positive integer (at most num_experts)"),
    "moe_intermediate_size": SHAPE,
    "norm_topk_prob": implemented(_one_of(True, False), "true or false"),
    "decoder_sparse_step": implemented(_positive_int, "a positive integer"),
    "mlp_only_layers": implemented(lambda v: v is None or _layer_indices(v), "a list of layer indices"),
    "output_router_logits": inert("outputs, not values"),
    "router_aux_loss_coef": inert("a training loss only"),
}

FAMILIES: dict[str, dict[str, Rule]] = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE,
                                        "mistral": MISTRAL, "phi3": PHI3, "gemma2": GEMMA2, "gemma3_text": GEMMA3_TEXT}
FAMILY_NAMES = {"llama": "Llama", "qwen2": "Qwen2/2.5", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "mistral": "Mistral",
                "phi3": "Phi-3", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3 text"}


def supported_families() -> str:
    """One phrase naming every family the engine runs, e.g. for an error message."""
    return ", ".join(f"{FAMILY_NAMES[t]} ({t})" for t in FAMILIES)


def _shown(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def check_architecture(config: Mapping[str, Any]) -> str:
    """The family of a config dict (config.json as read, or a loaded config's to_dict()); raises
    UnsupportedModelError naming the supported families when the engine runs none of its kind."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(f"model_type {_shown(model_type)} is not a family evalrun's engine runs; run it "
                                    "through transformers' own forward with --engine transformers, or use one of: "
                                    f"{supported_families()}")
    architectures = config.get("architectures")
    if architectures not in (None, [], [ARCHITECTURES[model_type]]):
        raise UnsupportedModelError(f"architectures {_shown(architectures)} is not {ARCHITECTURES[model_type]}, "
                                    f"the class of model_type {model_type!r}; evalrun's engine runs only that class "
                                    "for it; fix config.json's architectures or model_type")
    return model_type


def check_config(config: Mapping[str, Any]) -> str:
    """Raise UnsupportedModelError for the first field (in name order) the engine would not compute
    as the config asks; return the family. `config` is the loaded config's to_dict()."""
    family = check_architecture(config)
    rules = FAMILIES[family]
    for name in sorted(config):
        value = config[name]
        rule = rules.get(name)
        if rule is None:
            if is_off(value):
                continue
            known = "a setting of another family" if name in FOREIGN_SWITCHES else "not a field evalrun knows"
            raise UnsupportedModelError(
                f"model config field {name!r} = {_shown(value)} is {known} for {FAMILY_NAMES[family]}; evalrun's "
                "engine would ignore it and compute another model; remove it from config.json if it does not "
                "apply, else run this checkpoint with --engine transformers")
        if not rule.accepts(value):
            raise UnsupportedModelError(f"model config field {name!r} = {_shown(value)} is not supported for "
                                        f"{FAMILY_NAMES[family]} (evalrun's engine accepts {rule.accepted}); {rule.fix}")
    return family
