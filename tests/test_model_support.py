"""Every family the engine runs matches transformers, field by field; every config it does not compute is
refused with one line (engine/model_support.py holds the table)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import one_line_exit_2
from evalrun.engine.driver import generate_batch
from evalrun.engine.generate import BatchSpec
from evalrun.engine.model_support import ARCHITECTURES, FAMILIES, check_config
from evalrun.engine.transformer import Transformer
from evalrun.errors import ModelError, UnsupportedModelError
from evalrun.models import byte_tokenizer, load_model

STEPS = 32
MAX_ABS_LOGITS = 1e-4  # float32 on CPU; measured differences are ~1e-6 (the test prints them)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
# The prompt below is 48 tokens and the decode 32 more: a window of 8 hides most of the context.
WINDOW = 8
# Gemma with every special switched on: head_dim != hidden/heads, a query scalar that is not head_dim,
# caps small enough that tanh bends the scores and logits (|logits| < 10 here: not saturated, no ties),
# sliding and full layers alternating. Untied: a random tied head over sqrt(hidden)-scaled embeddings
# only repeats the input token (logits ~100, margins ~60).
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW, "attn_logit_softcapping": 2.0,
         "final_logit_softcapping": 5.0, "num_hidden_layers": 3, "tie_word_embeddings": False,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}

# (family, config overrides): each switches on one feature the engine implements (or one inert field).
CASES = {
    "llama": ("llama", {}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama-head-dim-32": ("llama", {"head_dim": 32}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-gelu": ("llama", {"hidden_act": "gelu"}),
    "llama-gelu-tanh-biases": ("llama", {"hidden_act": "gelu_pytorch_tanh", "mlp_bias": True, "attention_bias": True}),
    "llama-relu": ("llama", {"hidden_act": "relu"}),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-rope-yarn": ("llama", {"rope_parameters": YARN_ROPE}),
    "llama-rope-linear": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "llama-inert-fields": ("llama", {"attention_dropout": 0.25, "pretraining_tp": 2, "rms_norm_eps": 1e-3}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied-yarn": ("qwen2", {"tie_word_embeddings": True, "rope_parameters": YARN_ROPE}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3-attention-bias-gelu": ("qwen3", {"attention_bias": True, "hidden_act": "gelu_pytorch_tanh"}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-sliding-window": ("mistral", {"sliding_window": WINDOW}),
    "phi3": ("phi3", {}),
    "phi3-sliding-window-gelu": ("phi3", {"sliding_window": WINDOW, "hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": ("gemma2", GEMMA),
    "gemma2-tied-attention-bias": ("gemma2", {"head_dim": 16, "attention_bias": True,
                                                  "sliding_window": WINDOW}),
    "gemma3": ("gemma3_text", {**GEMMA, "attn_logit_softcapping": None, "rope_parameters": GEMMA3_ROPE}),
    "gemma3-defaults": ("gemma3_text", {"head_dim": 16, "sliding_window": WINDOW, "num_hidden_layers": 3,
                                        "sliding_window_pattern": 2}),
}
# transformers' SDPA path ignores soft-capping: Gemma's reference forward is its eager attention.
HF_ATTENTION = {"gemma2": "eager", "gemma3_text": "eager"}


def _config(family: str, **overrides):
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig,
               "mistral": MistralConfig, "phi3": Phi3Config, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig}
    return classes[family](**{**TINY, "architectures": [ARCHITECTURES[family]], **overrides})


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, biases and norm weights included (transformers initialises biases to 0
    and norms to 1, which would hide a dropped bias or norm)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator)
        if param.ndim == 1:
            param.copy_((1.0 if "norm" in name else 0.0) + 0.3 * noise)
        else:
            param.copy_(noise * (1.0 if "embed" in name else param.shape[1] ** -0.5))


def _checkpoint(directory: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint of `family` saved by transformers: config.json, safetensors, tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family, **overrides))
    _randomize(model, seed)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def _hf_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' own forward, the whole sequence each step: tokens and last-position logits [steps, V]."""
    tokens, logits = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            last = model(torch.tensor([tokens])).logits[0, -1]
            logits.append(last.numpy())
            tokens.append(int(last.argmax()))
    return tokens[len(ids):], np.stack(logits)


def _hf_reference(directory: Path, family: str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """transformers' own model of the checkpoint, with the attention that computes every feature of it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=HF_ATTENTION.get(
        family, "sdpa")).to(device).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_transformers_over_a_32_token_greedy_decode(tmp_path, case):
    family, overrides = CASES[case]
    directory = _checkpoint(tmp_path / case, family, **overrides)
    loaded = load_model(str(directory), "cpu", "float32")
    assert loaded.model.config.model_type == family
    ids = loaded.tokenizer("The engine must compute this model and no other")["input_ids"]
    out = generate_batch(Transformer(loaded.model, "sdpa"), BatchSpec([ids], STEPS, pad_id=0, keep_logits=True))
    expected_tokens, expected_logits = _hf_greedy(_hf_reference(directory, family, torch.float32), ids, STEPS)
    ours = out.logits[0].view(np.float32)  # [steps, V]
    difference = float(np.abs(ours - expected_logits).max())
    print(f"{case}: max abs logits difference {difference:.2e}")
    assert out.tokens[0].tolist() == expected_tokens
    assert difference < MAX_ABS_LOGITS, difference
    assert np.abs(expected_logits).max() > 0.1  # the logits are not degenerate


@pytest.mark.parametrize("case,switch", [
    ("llama-mlp-bias", lambda s: s.update({k: v + 1 for k, v in s.items() if "mlp" in k and k.endswith("bias")})),
    ("llama-attention-bias", lambda s: s.update({k: v + 1 for k, v in s.items() if "v_proj.bias" in k})),
    ("qwen2", lambda s: s.update({k: v + 1 for k, v in s.items() if "q_proj.bias" in k})),
    ("qwen3", lambda s: s.update({k: v * 2 for k, v in s.items() if "k_norm" in k})),
    ("gemma2", lambda s: s.update({k: v * 2 for k, v in s.items() if "post_feedforward_layernorm" in k})),
    ("gemma2", lambda s: s.update({k: v * 2 for k, v in s.items() if "post_attention_layernorm" in k})),
    ("gemma3", lambda s: s.update({k: v * 2 for k, v in s.items() if "q_norm" in k})),
])
def test_each_implemented_feature_changes_the_engines_logits(tmp_path, case, switch):
    """The features are really computed: editing only their weights changes the engine's logits."""
    from safetensors.torch import load_file, save_file

    family, overrides = CASES[case]
    directory = _checkpoint(tmp_path / case, family, **overrides)
    ids = [5, 6, 7, 8]

    def logits() -> np.ndarray:
        loaded = load_model(str(directory), "cpu", "float32")
        return generate_batch(Transformer(loaded.model), BatchSpec([ids], 1, pad_id=0, keep_logits=True)).logits

    before = logits()
    state = load_file(directory / "model.safetensors")
    switch(state)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    assert not np.array_equal(before, logits())


LONG_PROMPT = "The engine must compute this model and no other"  # 48 byte tokens: longer than WINDOW


@pytest.mark.parametrize("case,fields", [
    ("mistral-sliding-window", {"sliding_window": None}),
    ("phi3-sliding-window-gelu", {"sliding_window": None}),
    ("gemma2", {"sliding_window": 4096}),
    ("gemma2", {"layer_types": ["full_attention"] * 3}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3", {"rope_parameters": {**GEMMA3_ROPE, "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}}),
])
def test_each_config_feature_changes_the_engines_logits(tmp_path, case, fields):
    """The window, the caps, the query scalar and Gemma 3's local rotary take effect on the tested prompt:
    switching one off in config.json changes the engine's logits (so matching transformers with it on
    says something)."""
    family, overrides = CASES[case]
    directory = _checkpoint(tmp_path / case, family, **overrides)

    def logits() -> np.ndarray:
        loaded = load_model(str(directory), "cpu", "float32")
        ids = loaded.tokenizer(LONG_PROMPT)["input_ids"]
        return generate_batch(Transformer(loaded.model), BatchSpec([ids], 2, pad_id=0, keep_logits=True)).logits

    before = logits()
    _edit_config(directory, **fields)
    assert not np.array_equal(before, logits())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemmas_offset_rms_norm_matches_transformers_bit_for_bit(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from evalrun.engine.transformer import offset_rms_norm

    generator = torch.Generator().manual_seed(1)
    reference = Gemma2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(0.3 * torch.randn(96, generator=generator))
        reference = reference.to(dtype)
        x = (torch.randn(2, 5, 96, generator=generator) * 4).to(dtype)
        assert torch.equal(offset_rms_norm(x, reference.weight, 1e-6), reference(x))


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_forward_states_follow_the_forward_for_a_gemma(tmp_path, case):
    """bisect's layer stage runs the same Gemma: its last state through the head gives forward's logits."""
    family, overrides = CASES[case]
    transformer = Transformer(load_model(str(_checkpoint(tmp_path / case, family, **overrides)), "cpu",
                                         "float32").model)
    ids = list(range(3, 3 + 2 * WINDOW))
    tokens, positions, valid = torch.tensor([ids]), torch.arange(len(ids))[None], torch.ones(1, len(ids), dtype=torch.bool)
    logits = transformer.forward(tokens, positions, positions[0], valid, transformer.new_cache(1, len(ids)))
    states = transformer.forward_states(tokens, positions, positions[0], valid, transformer.new_cache(1, len(ids)))
    assert len(states) == 2 * len(transformer.layers) + 1
    last = transformer.head(states[-2][:, -1], transformer.final_norm, transformer.lm_head, transformer.eps,
                            transformer.variant)
    assert torch.equal(last, logits)
    assert torch.allclose(states[-1][:, -1], logits, atol=1e-5)


@pytest.mark.parametrize("case", ["mistral-sliding-window", "gemma3"])
def test_a_left_padded_row_decodes_as_it_does_alone_under_a_sliding_window(tmp_path, case):
    """The window counts a row's own tokens, not the padding before them: the short prompt, padded to the
    long one's length in a batch, gives the tokens and logits it gives alone (checked against transformers
    above)."""
    family, overrides = CASES[case]
    loaded = load_model(str(_checkpoint(tmp_path / case, family, **overrides)), "cpu", "float32")
    long, short = (loaded.tokenizer(text)["input_ids"] for text in (LONG_PROMPT, "A shorter prompt, 24 tokens"))
    transformer = Transformer(loaded.model)
    batch = generate_batch(transformer, BatchSpec([long, short], STEPS, pad_id=0, keep_logits=True))
    alone = generate_batch(transformer, BatchSpec([short], STEPS, pad_id=0, keep_logits=True))
    assert batch.tokens[1].tolist() == alone.tokens[0].tolist()
    assert np.abs(batch.logits[1].view(np.float32) - alone.logits[0].view(np.float32)).max() < MAX_ABS_LOGITS


@pytest.mark.parametrize("case,mode", [("gemma2", "trace-once"), ("gemma3", "piecewise"),
                                       ("mistral-sliding-window", "piecewise")])
def test_compiled_modes_give_the_eager_tokens_for_a_new_family(tmp_path, case, mode):
    """The compiled modes run the new pieces (two masks and rotaries, caps, sandwich norms) without a graph
    break or fallback, and decode the same tokens as eager on a left-padded batch whose window bites."""
    from evalrun.config import CompilationMode
    from evalrun.engine.modes import ExecutionMode, allow_recompiles_for

    family, overrides = CASES[case]
    loaded = load_model(str(_checkpoint(tmp_path / case, family, **overrides)), "cpu", "float32")
    prompts = [loaded.tokenizer(LONG_PROMPT)["input_ids"], loaded.tokenizer("A shorter one")["input_ids"]]
    spec = BatchSpec(prompts, 12, pad_id=0, keep_logits=True)
    transformer = Transformer(loaded.model)
    eager = generate_batch(transformer, spec)
    torch._dynamo.reset()
    compiled_mode = ExecutionMode(transformer, CompilationMode(mode), prefill_buckets=(64,), batch_buckets=(2,))
    allow_recompiles_for(compiled_mode.prefill_buckets, compiled_mode.batch_buckets)
    generate_batch(transformer, spec, compiled_mode)  # warm-up: compiles every shape
    compiled_mode.start_measuring()
    compiled = generate_batch(transformer, spec, compiled_mode)
    evidence = compiled_mode.evidence()
    assert evidence["dynamo_graphs"] > 0 and evidence["fallbacks"] == [], evidence
    assert compiled.tokens.tolist() == eager.tokens.tolist()
    assert np.abs(compiled.logits.view(np.float32) - eager.logits.view(np.float32)).max() < MAX_ABS_LOGITS


def test_every_field_of_every_supported_familys_config_has_a_rule():
    """A field a new transformers adds to a family's config must be audited before the engine runs it."""
    for family in FAMILIES:
        config = _config(family).to_dict()
        missing = sorted(set(config) - set(FAMILIES[family]))
        assert missing == [], f"{family}: no rule for {missing}"
        assert check_config(config) == family


REFUSED = [
    ("llama", {"hidden_act": "gelu_new"}, "'hidden_act' = 'gelu_new'"),
    ("llama", {"hidden_act": "tanh"}, "'hidden_act' = 'tanh'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "'rope_parameters'"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                                   "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ("llama", {"sliding_window": 16}, "'sliding_window' = 16 is a setting of another family"),
    ("llama", {"final_logit_softcapping": 30.0}, "'final_logit_softcapping'"),
    ("llama", {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping'"),
    ("llama", {"rope_interleaved": True}, "'rope_interleaved'"),
    ("llama", {"some_new_switch": 3}, "'some_new_switch' = 3 is not a field evalrun knows"),
    ("llama", {"pruned_heads": {"0": [1]}}, "'pruned_heads'"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     "'use_sliding_window' = True"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "'layer_types'"),
    ("qwen2", {"mlp_bias": True}, "'mlp_bias' = True is not a field evalrun knows for Qwen2/2.5"),
    ("mistral", {"sliding_window": 0}, "'sliding_window' = 0 is not supported for Mistral"),
    ("mistral", {"sliding_window": 4.5}, "'sliding_window' = 4.5"),
    ("mistral", {"attention_bias": True}, "'attention_bias' = True is not a field evalrun knows for Mistral"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                  "long_factor": [2.0] * 8, "partial_rotary_factor": 1.0}}, "Phi-3's longrope"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("phi3", {"sliding_window": -1}, "'sliding_window' = -1"),
    ("gemma2", {"hidden_activation": "gelu_new"}, "'hidden_activation' = 'gelu_new'"),
    ("gemma2", {"attn_logit_softcapping": -50.0}, "'attn_logit_softcapping' = -50.0"),
    ("gemma2", {"final_logit_softcapping": "30"}, "'final_logit_softcapping' = '30'"),
    ("gemma2", {"query_pre_attn_scalar": 0}, "'query_pre_attn_scalar' = 0"),
    ("gemma2", {"sliding_window": None}, "'sliding_window' = None"),
    ("gemma2", {"layer_types": ["full_attention", "chunked_attention"]}, "'layer_types'"),
    ("gemma2", {"use_bidirectional_attention": True}, "'use_bidirectional_attention' = True"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' = 50.0 is not supported for Gemma 3"),
    ("gemma3_text", {"rope_parameters": {**GEMMA3_ROPE, "full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                                           "rope_theta": 1e6}}}, "'rope_parameters'"),
    ("gemma3_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "'rope_parameters'"),
]


@pytest.mark.parametrize("family,overrides,needle", REFUSED)
def test_configs_the_engine_does_not_compute_are_refused_naming_the_field(family, overrides, needle):
    config = _config(family).to_dict()
    config.update(overrides)
    with pytest.raises(UnsupportedModelError, match="evalrun") as error:
        check_config(config)
    message = str(error.value)
    assert needle in message and "\n" not in message, message


def test_off_values_of_unknown_fields_pass():
    config = _config("llama").to_dict()
    config.update(sliding_window=None, use_sliding_window=False, rope_interleaved=False, unknown_empty={})
    assert check_config(config) == "llama"


def test_the_engine_itself_refuses_a_config_it_does_not_compute():
    """Not only the runner: any Transformer built over such a module refuses (bench, bisect, tests)."""
    loaded = load_model("random:tiny", "cpu", "float32")
    loaded.model.config.hidden_act = "gelu_new"
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        Transformer(loaded.model)


def _edit_config(directory: Path, **fields) -> Path:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("fields,needles", [
    ({"hidden_act": "gelu_new"}, ["'hidden_act' = 'gelu_new'", "silu"]),
    ({"sliding_window": 16}, ["'sliding_window' = 16", "remove it from config.json"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["'rope_parameters'", "dynamic"]),
])
def test_run_refuses_an_unsupported_config_with_one_line(tmp_path, cli, store_path, fields, needles):
    directory = _edit_config(_checkpoint(tmp_path / "model", "llama"), **fields)
    result = cli("run", "--model", str(directory), "--prompts", "smoke", "--max-new-tokens", "2",
                 "--store", str(store_path))
    one_line_exit_2(result, *needles)
    assert not store_path.exists() or "run" not in result[1]


@pytest.mark.parametrize("model_type", ["mixtral", "gemma3", "gpt2", "made_up_family"])
def test_run_on_an_unsupported_architecture_names_the_supported_families(tmp_path, cli, store_path, model_type):
    directory = _edit_config(_checkpoint(tmp_path / "model", "llama"), model_type=model_type,
                             architectures=["SomethingForCausalLM"])
    result = cli("run", "--model", str(directory), "--prompts", "smoke", "--store", str(store_path))
    one_line_exit_2(result, f"model_type '{model_type}' is not a family evalrun's engine runs",
                    "--engine transformers", "Llama (llama)", "Qwen2/2.5 (qwen2)", "Qwen3 (qwen3)",
                    "Qwen3-MoE (qwen3_moe)", "Mistral (mistral)", "Phi-3 (phi3)", "Gemma 2 (gemma2)",
                    "Gemma 3 text (gemma3_text)")


def test_run_refuses_architectures_that_do_not_match_the_model_type(tmp_path, cli, store_path):
    directory = _edit_config(_checkpoint(tmp_path / "model", "llama"), architectures=["MistralForCausalLM"])
    result = cli("run", "--model", str(directory), "--prompts", "smoke", "--store", str(store_path))
    one_line_exit_2(result, "architectures ['MistralForCausalLM'] is not LlamaForCausalLM")


@pytest.mark.parametrize("case,fields,needles", [
    ("gemma3", {"attn_logit_softcapping": 50.0}, ["'attn_logit_softcapping' = 50.0", "remove it from config.json"]),
    ("phi3", {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     ["'rope_parameters'", "partial_rotary_factor 1"]),
    ("mistral", {"sliding_window": 0}, ["'sliding_window' = 0", "a positive integer, or null"]),
])
def test_run_refuses_an_unsupported_value_of_a_new_familys_field_with_one_line(tmp_path, cli, store_path, case,
                                                                               fields, needles):
    family, overrides = CASES[case]
    directory = _edit_config(_checkpoint(tmp_path / "model", family, **overrides), **fields)
    result = cli("run", "--model", str(directory), "--prompts", "smoke", "--max-new-tokens", "2",
                 "--store", str(store_path))
    one_line_exit_2(result, *needles)


@pytest.mark.parametrize("case", ["qwen3", "gemma2"])
def test_run_on_a_model_folder_records_its_tokens(tmp_path, cli, store_path, case):
    """Through the CLI (Gemma 2: transformers loads it with eager attention, having no SDPA path)."""
    family, overrides = CASES[case]
    directory = _checkpoint(tmp_path / case, family, **overrides)
    code, out, err = cli("run", "--model", str(directory), "--prompts", "smoke", "--max-new-tokens", "4",
                         "--store", str(store_path), "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["results"]) == 3 and all(len(r["tokens"]) == 4 for r in data["results"])


@pytest.mark.parametrize("case", ["llama", "gemma2", "gemma3"])
def test_the_scale_fault_scales_the_mlps_contribution_in_every_family(tmp_path, case):
    """Gemma normalises the MLP's output before the residual, so the `scale` fault (the down projection x(1+m))
    was cancelled by that norm: a planted change that changed nothing (found by a red-team pass). It scales the
    norm's output there: the MLP's contribution x(1+m) in every family, the logits moving as for Llama."""
    from evalrun.engine.faults import Fault, apply, apply_to_module

    family, overrides = CASES[case]
    loaded = load_model(str(_checkpoint(tmp_path / case, family, **overrides)), "cpu", "float64")
    spec = BatchSpec([[5, 6, 7, 8, 9]], 2, pad_id=0, keep_logits=True)
    clean = generate_batch(Transformer(loaded.model), spec).logits
    faulty = Transformer(loaded.model)
    apply(faulty, Fault("scale", 0.01, layer=0))
    moved = np.abs(generate_batch(faulty, spec).logits - clean).max() / np.abs(clean).max()
    assert moved > 1e-4, moved  # Gemma before: about 1e-9 (the norm's epsilon)
    module = loaded.model  # --engine transformers: the fault planted in the module
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = module(ids).logits
        apply_to_module(module, Fault("scale", 0.01, layer=0))
        after = module(ids).logits
    assert float((after - before).abs().max() / before.abs().max()) > 1e-4


# ---------------------------------------------------------------- the files hold the model the config says

def _edit_weights(directory: Path, edit, metadata: dict | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    state = load_file(directory / "model.safetensors")
    edit(state)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt", **(metadata or {})})
    return directory


@pytest.mark.parametrize("case,edit,needles", [
    ("llama", lambda s: s.pop("model.layers.1.mlp.down_proj.weight"),
     ["lacks weights its config needs: model.layers.1.mlp.down_proj.weight"]),
    ("llama", lambda s: s.pop("lm_head.weight"), ["lacks weights", "lm_head.weight"]),
    ("llama", lambda s: s.update({"model.layers.0.self_attn.v_proj.bias": torch.ones(64)}),
     ["holds tensors its config does not use: model.layers.0.self_attn.v_proj.bias", "attention_bias"]),
    ("llama-tied", lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"] + 1}),
     ["tie_word_embeddings is true but the files hold an lm_head.weight that differs"]),
])
def test_weights_missing_unused_or_contradicting_the_config_are_refused(tmp_path, cli, store_path, case, edit,
                                                                        needles):
    """Before: a missing weight ran randomly initialised (each run another model), unused tensors and a
    stored head under tied embeddings were dropped without a word."""
    family, overrides = CASES[case]
    directory = _edit_weights(_checkpoint(tmp_path / "model", family, **overrides), edit)
    result = cli("run", "--model", str(directory), "--prompts", "smoke", "--max-new-tokens", "2",
                 "--store", str(store_path))
    one_line_exit_2(result, *needles)


def test_a_sharded_folder_with_a_second_copy_of_its_weights_is_refused(tmp_path, cli, store_path):
    """A model.safetensors left beside the index and its shards (transformers loaded the one file, vLLM the shards)
    and a tensor stored in two shards (transformers kept the later file's) ran without a word: two readers of one
    folder, two models. The shards alone still load (the control)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    whole = _checkpoint(tmp_path / "whole", "llama")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(whole).save_pretrained(sharded, max_shard_size="20KB")
    for path in whole.iterdir():  # the tokenizer's files
        if not (sharded / path.name).exists() and path.suffix != ".safetensors":
            shutil.copy(path, sharded / path.name)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").exists()
    assert _digest(cli, sharded, store_path) == _digest(cli, whole, store_path)

    leftover = tmp_path / "leftover"
    shutil.copytree(sharded, leftover)
    shutil.copy(whole / "model.safetensors", leftover / "model.safetensors")
    one_line_exit_2(cli("run", "--model", str(leftover), "--prompts", "smoke", "--max-new-tokens", "2", "--store",
                        str(store_path)), "holds model.safetensors beside model.safetensors.index.json")

    twice = tmp_path / "twice"
    shutil.copytree(sharded, twice)
    first, last = (load_file(shards[0]), twice / shards[-1].name)
    key = next(iter(first))
    save_file({**load_file(last), key: first[key] + 1}, last, metadata={"format": "pt"})
    one_line_exit_2(cli("run", "--model", str(twice), "--prompts", "smoke", "--max-new-tokens", "2", "--store",
                        str(store_path)), f"stores {key} in both {shards[0].name} and {last.name}")


def test_an_index_of_the_one_model_safetensors_is_one_copy_not_refused(tmp_path, cli, store_path):
    """Some checkpoints ship model.safetensors with an index mapping every tensor to it (one copy, which every
    loader reads alike): it was refused as 'model.safetensors beside its shards'."""
    from safetensors import safe_open

    whole = _checkpoint(tmp_path / "whole", "llama")
    before = _digest(cli, whole, store_path)
    with safe_open(str(whole / "model.safetensors"), "pt") as handle:
        weight_map = {key: "model.safetensors" for key in handle.keys()}
    (whole / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert _digest(cli, whole, store_path) == before


def _digest(cli, directory: Path, store_path: Path) -> tuple[str, str]:
    code, out, err = cli("run", "--model", str(directory), "--prompts", "smoke", "--max-new-tokens", "4",
                         "--store", str(store_path), "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    return data["logits_digest"], data["model"]["hash"]


def test_the_same_weights_in_another_file_layout_compute_the_same_bits(tmp_path, cli, store_path):
    """Tensors used to stay backed by the mmapped file, at offsets its header decides, and the CPU matmul's
    bits depend on that alignment: header padding of 1 to 63 bytes changed the logits (a false changed)."""
    base = _checkpoint(tmp_path / "base", "llama")
    expected = _digest(cli, base, store_path)
    for pad in (1, 4, 13, 60):
        moved = tmp_path / f"pad{pad}"
        shutil.copytree(base, moved)
        _edit_weights(moved, lambda s: None, metadata={"padding": "x" * pad})
        assert _digest(cli, moved, store_path) == expected, pad


def test_config_dtype_does_not_round_float32_weights(tmp_path, cli, store_path):
    """config.json's dtype used to decide the load dtype: 'bfloat16' rounded float32 weights before a
    float32 run (and the float64 oracle). The stored tensors' dtype decides now."""
    base = _checkpoint(tmp_path / "base", "llama")
    expected = _digest(cli, base, store_path)
    for declared in ("bfloat16", "float16"):
        edited = tmp_path / declared
        shutil.copytree(base, edited)
        _edit_config(edited, dtype=declared)
        assert _digest(cli, edited, store_path) == expected, declared


# ---------------------------------------------------------------- bfloat16 on a GPU, within the drift envelope

ENVELOPE_MULTIPLIER = 3  # the verdict's rule: within 3x the error of a known-good implementation of the same dtype


def _relative_rms(values: np.ndarray, reference: np.ndarray) -> float:
    """[steps, V] against [steps, V] float64: RMS error over RMS of the reference."""
    return float(np.sqrt(np.mean((values - reference) ** 2)) / np.sqrt(np.mean(reference ** 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_engine_in_bfloat16_on_cuda_stays_within_transformers_bfloat16_envelope(tmp_path, case):
    """Along one path (float64 greedy tokens), the engine's bfloat16 logits are within 3x the error that
    transformers' own bfloat16 forward makes against its float64 forward: drift, not another model."""
    from evalrun.compare import bits_to_float

    family, overrides = CASES[case]
    directory = _checkpoint(tmp_path / case, family, **overrides)
    reference_model = _hf_reference(directory, family, torch.float64, "cuda")
    hf_bf16 = _hf_reference(directory, family, torch.bfloat16, "cuda")
    loaded = load_model(str(directory), "cuda", "bfloat16")
    ids = loaded.tokenizer("The engine must compute this model and no other")["input_ids"]
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(STEPS):  # the float64 greedy path, then every model scored along it
            tokens.append(int(reference_model(torch.tensor([tokens], device="cuda")).logits[0, -1].argmax()))
        sequence = torch.tensor([tokens], device="cuda")
        span = slice(len(ids) - 1, len(tokens) - 1)  # the positions that predict each generated token
        reference = reference_model(sequence).logits[0, span].cpu().numpy()
        theirs = hf_bf16(sequence).logits[0, span].double().cpu().numpy()
    forced = [np.array(tokens[len(ids):], dtype=np.int64)]
    out = generate_batch(Transformer(loaded.model, "sdpa"),
                         BatchSpec([ids], STEPS, pad_id=0, keep_logits=True, forced_tokens=forced))
    ours = bits_to_float(out.logits[0], "bfloat16")
    ours_error, their_error = _relative_rms(ours, reference), _relative_rms(theirs, reference)
    print(f"{case}: engine bf16 {ours_error:.3g}, transformers bf16 {their_error:.3g} "
          f"(ratio {ours_error / their_error:.2f})")
    assert 0 < their_error and ours_error <= ENVELOPE_MULTIPLIER * their_error, (ours_error, their_error)


# ---------------------------------------------------------------- a GGUF file is read whole

def _tiny_gguf(path: Path, extra_tensors: dict | None = None, extra_metadata: dict | None = None,
               drop: str | None = None) -> Path:
    """A tiny Llama GGUF (float32 tensors in llama.cpp's layout) without a tokenizer: evalrun reads the model first."""
    from gguf import GGUFWriter
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("llama"))
    _randomize(model, 0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(256), writer.add_embedding_length(64), writer.add_block_count(2)
    writer.add_feed_forward_length(128), writer.add_head_count(4), writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16), writer.add_layer_norm_rms_eps(1e-6), writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(320)
    for key, value in (extra_metadata or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for i in range(2) for hf, g in parts.items()})
    for hf, name in names.items():
        if name == drop:
            continue
        weight = model.state_dict()[hf].numpy()
        if ".attn_q." in name or ".attn_k." in name:  # llama.cpp's rotary row order
            heads = 4 if ".attn_q." in name else 2
            weight = weight.reshape(heads, 2, -1, 64).swapaxes(1, 2).reshape(weight.shape)
        writer.add_tensor(name, np.ascontiguousarray(weight))
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


@pytest.mark.parametrize("edit,needles", [
    (dict(extra_tensors={"blk.0.attn_q.bias": np.ones(64, np.float32)}), ["skips blk.0.attn_q.bias"]),
    (dict(extra_tensors={"rope_freqs.weight": np.full(8, 4.0, np.float32)}), ["skips rope_freqs.weight"]),
    (dict(extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0}),
     ["llama.rope.scaling"]),
    (dict(drop="blk.1.ffn_down.weight"), ["lacks weights", "model.layers.1.mlp.down_proj.weight"]),
    # transformers picks its converter by general.name too: a llama file named "mistral" crashed (exit 3)
    (dict(extra_metadata={"general.name": "mistral"}), ["transformers cannot convert edited.gguf", "Hugging Face"]),
])
def test_a_gguf_file_transformers_converts_only_in_part_is_refused(tmp_path, monkeypatch, cli, store_path, edit,
                                                                    needles):
    """Before: transformers' converter skipped tensors and metadata it has no name for (a Llama file's attention
    biases, Llama 3's rope_freqs, rope scaling), and a missing tensor ran randomly initialised (cached, so each
    machine another model), without a word: the same bits and identity as the file without them, `identical`."""
    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path / "cache"))
    result = cli("run", "--model", str(_tiny_gguf(tmp_path / "edited.gguf", **edit)), "--prompts", "smoke",
                 "--max-new-tokens", "2", "--store", str(store_path))
    one_line_exit_2(result, *needles)


def test_smollm2s_gguf_file_is_read_whole():
    """The control of the test above: every tensor and family key of SmolLM2's file is what its conversion read."""
    from evalrun.gguf_check import check_read_whole

    loaded = load_model("smollm2-135m", "cpu", "float32")
    assert loaded.source["kind"] == "gguf"
    check_read_whole(loaded.gguf_path, loaded.model)


def _family_gguf(path: Path, model_type: str, arch: str, overrides: dict, metadata: dict,
                 name: str = "Tiny") -> tuple[Path, torch.nn.Module]:
    """A tiny GGUF of any family transformers converts: the family keys llama.cpp's converter writes for it
    (`metadata`, "{arch}" standing for the architecture), a token list (the other families' vocab_size), and
    the tensors under gguf's names (their values and row order do not matter to the check). With the model
    written: the config transformers' converter makes of the file where `overrides` are keys it reads."""
    from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **overrides}))
    names = get_tensor_name_map(next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch),
                                model.config.num_hidden_layers)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name), writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(TINY["vocab_size"])])
    writer.add_bos_token_id(1), writer.add_eos_token_id(2), writer.add_pad_token_id(0)
    for key, value in metadata.items():
        key = key.replace("{arch}", arch)
        add = {bool: writer.add_bool, str: writer.add_string, float: writer.add_float32, int: writer.add_uint32,
               list: writer.add_array}[type(value)]
        add(key, value)
    for hf_name, weight in model.state_dict().items():
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:  # llama.cpp stores it once
            continue
        base, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "weight")
        weight = weight.numpy()
        if base.endswith("experts.gate_up_proj"):  # merged experts: llama.cpp stores gate and up apart
            half = weight.shape[1] // 2
            block = base.split(".")[2]
            writer.add_tensor(f"blk.{block}.ffn_gate_exps.weight", np.ascontiguousarray(weight[:, :half]))
            writer.add_tensor(f"blk.{block}.ffn_up_exps.weight", np.ascontiguousarray(weight[:, half:]))
            continue
        gguf_name = names.get_name(base)
        if "ffn_gate_inp_shexp" in gguf_name:
            weight = weight.reshape(-1)
        writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(weight))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path, model


def _llama_cpp_keys(**keys) -> dict:
    """The keys every family's file carries (llama.cpp's TextModel), TINY's values, plus `keys`."""
    return {"{arch}.context_length": 256, "{arch}.embedding_length": 64, "{arch}.block_count": 2,
            "{arch}.feed_forward_length": 128, "{arch}.attention.head_count": 4, "{arch}.attention.head_count_kv": 2,
            "{arch}.rope.freq_base": 10000.0, "{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            **{key.replace("__", "."): value for key, value in keys.items()}}


_HD256 = {"{arch}.attention.key_length": 256, "{arch}.attention.value_length": 256}
_GEMMA2_KEYS = {**_llama_cpp_keys(), **_HD256, "{arch}.attn_logit_softcapping": 50.0,
                "{arch}.final_logit_softcapping": 30.0, "{arch}.attention.sliding_window": 128}
_GEMMA3_KEYS = {**_llama_cpp_keys(), **_HD256, "{arch}.rope.freq_base": 1e6, "{arch}.block_count": 6,
                "{arch}.attention.sliding_window": 128}
_MOE = dict(num_experts=4, num_experts_per_tok=2)
_MOE_KEYS = {"{arch}.expert_count": 4, "{arch}.expert_used_count": 2}
# (model_type, llama.cpp architecture, config, keys): files llama.cpp writes for real checkpoints of each family
GGUF_FAMILIES = {
    # transformers reads qwen3moe.* under its own name qwen3_moe: every key was refused as unread
    "qwen3moe": ("qwen3_moe", "qwen3moe", dict(head_dim=16, moe_intermediate_size=768, **_MOE),
                 {**_llama_cpp_keys(), **_MOE_KEYS, "{arch}.attention.key_length": 16,
                  "{arch}.attention.value_length": 16, "{arch}.expert_feed_forward_length": 768}),
    "qwen2moe": ("qwen2_moe", "qwen2moe", dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                               **_MOE),
                 {**_llama_cpp_keys(), **_MOE_KEYS, "{arch}.expert_feed_forward_length": 1408,
                  "{arch}.expert_shared_feed_forward_length": 5632}),
    # Phi-4: the original context length (read only by a scaled rotary) and sliding_window 0
    "phi3": ("phi3", "phi3", dict(num_key_value_heads=4),
             {**_llama_cpp_keys(), "{arch}.attention.head_count_kv": 4, "{arch}.rope.dimension_count": 16,
              "{arch}.rope.scaling.original_context_length": 256, "{arch}.attention.sliding_window": 0}),
    "gemma2": ("gemma2", "gemma2", dict(head_dim=256, sliding_window=128, tie_word_embeddings=True), _GEMMA2_KEYS),
    "gemma3": ("gemma3_text", "gemma3", dict(head_dim=256, sliding_window=128, num_hidden_layers=6,
                                             tie_word_embeddings=True),
               {**_GEMMA3_KEYS, "{arch}.rope.freq_base_swa": 10000.0,
                "{arch}.attention.sliding_window_pattern": [True] * 5 + [False]}),
    # converted from an old GGML file: a layout note llama.cpp never reads
    "llama-legacy": ("llama", "llama", {}, {**_llama_cpp_keys(), "{arch}.vocab_size": 320,
                                            "{arch}.rope.dimension_count": 16,
                                            "{arch}.tensor_data_layout": "Meta AI original pth"}),
}


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_a_gguf_file_of_each_family_as_llama_cpp_writes_it_is_read_whole(tmp_path, family):
    """Before: a Qwen3-MoE or Qwen2-MoE file was refused on its first key (qwen3moe.context_length: the check
    looked transformers' key map up under llama.cpp's name), a Phi-4 file on its original context length, a
    Gemma 3 file carrying its sliding layers' rotary base or pattern, an old Llama file on its layout note."""
    from transformers import AutoModelForCausalLM

    from evalrun.gguf_check import check_read_whole

    model_type, arch, overrides, keys = GGUF_FAMILIES[family]
    path, _ = _family_gguf(tmp_path / f"{family}.gguf", model_type, arch, overrides, keys)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    check_read_whole(path, model)


@pytest.mark.parametrize("model_type,arch,overrides,keys,needles", [
    # any other Gemma: by 1/sqrt(head_dim)
    ("gemma2", "gemma2", dict(head_dim=16, tie_word_embeddings=True),
     {**_GEMMA2_KEYS, "{arch}.attention.key_length": 16, "{arch}.attention.value_length": 16},
     ["1/sqrt(16)", "1/sqrt(256)"]),
    ("gemma3_text", "gemma3", dict(head_dim=256, num_hidden_layers=6, tie_word_embeddings=True),
     {**_GEMMA3_KEYS, "{arch}.rope.freq_base_swa": 20000.0}, ["gemma3.rope.freq_base_swa = 20000.0"]),
    ("gemma3_text", "gemma3", dict(head_dim=256, num_hidden_layers=6, tie_word_embeddings=True),
     {**_GEMMA3_KEYS, "{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 8.0},
     ["gemma3.rope.scaling.type = linear"]),
    # Phi-3-mini-4k's window: the converted model has none
    ("phi3", "phi3", dict(num_key_value_heads=4),
     GGUF_FAMILIES["phi3"][3] | {"{arch}.attention.sliding_window": 2047},
     ["phi3.attention.sliding_window = 2047"]),
    # a scaled rotary still is refused once the key map is found under transformers' name
    ("qwen3_moe", "qwen3moe", GGUF_FAMILIES["qwen3moe"][2],
     GGUF_FAMILIES["qwen3moe"][3] | {"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
                                     "{arch}.rope.scaling.original_context_length": 64},
     ["qwen3moe.rope.scaling.type = yarn"]),
])
def test_a_gguf_file_whose_model_the_converter_changes_is_refused(tmp_path, monkeypatch, model_type, arch, overrides,
                                                                  keys, needles):
    """Before: Gemma files were accepted whose attention scale the converter changes (it reads no
    query_pre_attn_scalar: Gemma 2 / 3 27B ran with 1/sqrt(256) where llama.cpp computes 1/sqrt(144) and
    1/sqrt(168))."""
    from evalrun.models import converted_gguf_dir

    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path / "cache"))
    path, _ = _family_gguf(tmp_path / "family.gguf", model_type, arch, overrides, keys)
    with pytest.raises(ModelError) as refused:
        converted_gguf_dir(path)  # refused before the tokenizer converts
    assert all(needle in str(refused.value) for needle in needles), str(refused.value)


@pytest.mark.parametrize("model_type,arch,layers,scalar", [("gemma2", "gemma2", 46, 144),
                                                         ("gemma3_text", "gemma3", 62, 168)])
def test_a_27b_gemma_gguf_file_is_refused_for_its_attention_scale(tmp_path, model_type, arch, layers, scalar):
    """llama.cpp knows Gemma 2 / 3 27B by its layer count and scales its scores by 1/sqrt(hidden/heads)
    (144 and 168 for the real ones), where the converted model keeps transformers' default 1/sqrt(256). Checked
    on the model the converter makes (its default query_pre_attn_scalar; transformers' own 46-layer conversion
    takes half a minute), hidden/heads = `scalar` as in the real checkpoints."""
    from evalrun.gguf_check import check_read_whole

    heads = 2
    keys = {**_llama_cpp_keys(), **_HD256, "{arch}.block_count": layers, "{arch}.embedding_length": heads * scalar,
            "{arch}.attention.head_count": heads, "{arch}.attention.head_count_kv": 1,
            "{arch}.attention.sliding_window": 128, "{arch}.feed_forward_length": 8}
    if arch == "gemma2":
        keys |= {"{arch}.attn_logit_softcapping": 50.0, "{arch}.final_logit_softcapping": 30.0}
    path, model = _family_gguf(tmp_path / "27b.gguf", model_type, arch,
                               dict(head_dim=256, num_hidden_layers=layers, hidden_size=heads * scalar,
                                    num_attention_heads=heads, num_key_value_heads=1, intermediate_size=8,
                                    sliding_window=128, tie_word_embeddings=True), keys)
    assert model.config.query_pre_attn_scalar == 256  # what the converter leaves
    with pytest.raises(ModelError, match=rf"1/sqrt\({scalar}\), transformers' GGUF converter by 1/sqrt\(256\)"):
        check_read_whole(path, model)
