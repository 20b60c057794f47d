"""--engine transformers: transformers' own forward with evalrun's capture, through the engine seam."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import one_line_exit_2
from evalrun.config import CompilationMode, CUDAGraphMode, RunConfig, build_config, resolve, validate
from evalrun.errors import ConfigError
from evalrun.runner import Run, execute, prepare
from test_model_support import _checkpoint, _edit_config, _hf_greedy, _randomize

MAX_ABS_LOGITS = 1e-4  # float32 on CPU, as tests/test_model_support.py holds evalrun's engine to transformers
BATCH_ROUNDING = 1e-5  # float32: a row's logits in a padded batch against the row alone


def _run(model: str, engine: str, timed: bool = False, **flags) -> Run:
    """`timed`: warm up first, as `evalrun run` does (on a GPU the launches per decode step are counted then)."""
    config = build_config(flags={"model": model, "prompts": "smoke", "engine": engine, "keep_logits": "all",
                                 "max_new_tokens": 32, **flags})
    return execute(prepare(config), timed=timed)


def _tokens(run: Run) -> list[list[int]]:
    return [r.arrays["tokens"].tolist() for r in run.results]


def _logits(run: Run) -> list[np.ndarray]:
    return [r.arrays["logits"].view(np.float32) for r in run.results]


def _assert_same_tokens_close_logits(ours: Run, theirs: Run, tolerance: float) -> float:
    worst = 0.0
    for a, b, la, lb in zip(ours.results, theirs.results, _logits(ours), _logits(theirs)):
        assert a.arrays["tokens"].tolist() == b.arrays["tokens"].tolist(), a.prompt_id
        worst = max(worst, float(np.abs(la - lb).max()))
    assert worst < tolerance, worst
    return worst


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32})])
def test_families_give_the_same_tokens_and_float32_logits_under_both_engines(tmp_path, family, overrides):
    directory = str(_checkpoint(tmp_path / family, family, **overrides))
    ours, theirs = _run(directory, "evalrun"), _run(directory, "transformers")
    worst = _assert_same_tokens_close_logits(ours, theirs, MAX_ABS_LOGITS)
    print(f"{family}: max abs logits difference between the engines {worst:.2e}")
    assert theirs.evidence["engine"] == "transformers" and ours.evidence["engine"] == "evalrun"
    assert theirs.header["config_hash"] != ours.header["config_hash"]


def test_random_tiny_runs_from_the_cli_and_the_engine_is_in_the_fingerprint(cli, tiny_args):
    code, out, err = cli("run", *tiny_args, "--engine", "transformers", "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["config"]["engine"] == "transformers" and data["evidence"]["engine"] == "transformers"
    assert data["evidence"]["kv_cache"] == "DynamicCache" and data["evidence"]["fallbacks"] == []
    assert all(len(r["tokens"]) == 6 for r in data["results"])
    code, out, err = cli("run", *tiny_args, "--engine", "transformers", "--quiet")
    assert code == 0 and "engine=transformers" in out.splitlines()[0], (out, err)
    code, out, err = cli("fingerprint", "--model", "random:tiny", "--prompts", "smoke", "--json")
    assert code == 0, err
    default_hash = json.loads(out)["config_hash"]
    assert data["config_hash"] != default_hash


def test_a_padded_batch_gives_each_rows_tokens_alone_to_float32_rounding():
    """Left padding, attention mask and positions: prompts of different lengths batched as they run alone."""
    alone, batched = _run("random:tiny", "transformers"), _run("random:tiny", "transformers", batch_size=3)
    assert len({len(ids) for ids in prepare(build_config(flags={"model": "random:tiny", "prompts": "smoke"}))
                .prompt_set.token_ids}) > 1  # the prompts really differ in length: the batch is padded
    assert batched.plan[0]["prompt_ids"] == [r.prompt_id for r in alone.results]
    _assert_same_tokens_close_logits(alone, batched, BATCH_ROUNDING)


def _cache_taken_as_past_key_values(model: torch.nn.Module, dropped: bool = False) -> None:
    """Give `model` transformers 5.17's forward signature (the KV cache as `past_key_values`); `dropped`: a
    forward that ignores the cache it is given (what 5.17 did with the newer `cache=` keyword)."""
    base = type(model)

    class OlderSignature(base):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, logits_to_keep=0, **kwargs):
            return base.forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                cache=None if dropped else past_key_values, use_cache=use_cache,
                                logits_to_keep=logits_to_keep, **kwargs)

    model.__class__ = OlderSignature


def test_the_cache_goes_by_the_keyword_the_forward_takes():
    """transformers 5.17 takes `past_key_values`, later versions `cache`: the same bits either way."""
    from evalrun.engine.hf_engine import cache_keyword

    config = build_config(flags={"model": "random:tiny", "prompts": "smoke", "engine": "transformers",
                                 "keep_logits": "all", "max_new_tokens": 8})
    plain, older = prepare(config), prepare(config)
    _cache_taken_as_past_key_values(older.loaded.model)
    assert cache_keyword(older.loaded.model) == "past_key_values" and cache_keyword(plain.loaded.model) == "cache"
    a, b = execute(plain, timed=False), execute(older, timed=False)
    assert [r.logits_digest for r in a.results] == [r.logits_digest for r in b.results]


def test_a_forward_that_ignores_the_cache_is_refused_not_run_without_history():
    from evalrun.errors import ModelError

    prepared = prepare(build_config(flags={"model": "random:tiny", "prompts": "smoke", "engine": "transformers",
                                           "max_new_tokens": 4}))
    _cache_taken_as_past_key_values(prepared.loaded.model, dropped=True)
    with pytest.raises(ModelError, match="left the KV cache at 0 tokens"):
        execute(prepared, timed=False)


def test_forced_decoding_feeds_the_given_tokens_and_records_the_models_choice():
    config = build_config(flags={"model": "random:tiny", "prompts": "smoke", "engine": "transformers",
                                 "max_new_tokens": 6, "keep_logits": "all"})
    prepared = prepare(config)
    free = execute(prepared, timed=False)
    path = {r.prompt_index: np.roll(r.arrays["tokens"], 1) for r in free.results}  # another path
    forced = execute(prepared, forced=path, timed=False)
    followed = execute(prepared, forced={i: r.arrays["tokens"] for i, r in enumerate(free.results)}, timed=False)
    for f, g, h in zip(free.results, forced.results, followed.results):
        assert f.arrays["tokens"][0] == g.arrays["tokens"][0]  # step 0 sees only the prompt
        assert not np.array_equal(f.arrays["logits"][1:], g.arrays["logits"][1:])  # later steps saw the fed tokens
        assert np.array_equal(f.arrays["digests"], h.arrays["digests"])  # fed its own path: the free run's bits


def _foreign_model(kind: str) -> torch.nn.Module:
    """A tiny random model of a family evalrun's engine does not run: GPT-2 (Conv1D, learned positions)
    or GPT-NeoX (partial rotary, parallel residual)."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=320, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                                           bos_token_id=1, eos_token_id=2))
    else:
        model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=320, max_position_embeddings=256, hidden_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                                 bos_token_id=1, eos_token_id=2))
    _randomize(model, 0)
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox"])
def test_a_family_evalruns_engine_does_not_run_runs_under_transformers(tmp_path, cli, store_path, kind):
    from evalrun.models import byte_tokenizer

    directory = tmp_path / kind
    model = _foreign_model(kind)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    refused = cli("run", "--model", str(directory), "--prompts", "smoke", "--store", str(store_path))
    one_line_exit_2(refused, f"model_type '{kind}' is not a family evalrun's engine runs", "--engine transformers")
    run = _run(str(directory), "transformers", max_new_tokens=16, batch_size=3)  # a padded batch, too
    for result, ids in zip(run.results, prepare(build_config(flags={"model": str(directory), "prompts": "smoke",
                                                                    "engine": "transformers"})).prompt_set.token_ids):
        tokens, logits = _hf_greedy(model, list(ids), 16)  # transformers' forward over the whole sequence
        assert result.arrays["tokens"].tolist() == tokens
        assert float(np.abs(result.arrays["logits"].view(np.float32) - logits).max()) < MAX_ABS_LOGITS


def test_a_bidirectional_model_is_refused_under_transformers_with_one_line(tmp_path, cli, store_path):
    """A BERT masked-LM checkpoint loads as BertLMHeadModel without is_decoder: it attends to later tokens, so
    the engine's token-by-token decode computed logits its forward over the sequence does not (off by ~0.05)."""
    from transformers import BertConfig, BertForMaskedLM

    from evalrun.models import byte_tokenizer

    directory = tmp_path / "bert"
    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                               vocab_size=320)).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    args = ("run", "--model", str(directory), "--prompts", "smoke", "--engine", "transformers", "--max-new-tokens",
            "2", "--store", str(store_path), "-q")
    one_line_exit_2(cli(*args), "attends to later tokens", "use a causal language model")
    _edit_config(directory, is_decoder=True)  # the same weights as a causal decoder run
    assert cli(*args)[0] == 0


def test_a_multimodal_causal_lm_runs_its_text_under_transformers(tmp_path, cli, store_path):
    """Gemma 3 4B+ loads as Gemma3ForConditionalGeneration, whose config keeps vocab_size in text_config: the
    run crashed (internal error) reading config.vocab_size; it runs, and its tokens are transformers' greedy ones."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from evalrun.models import byte_tokenizer

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, vocab_size=320, sliding_window=8)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    _randomize(model, 0)
    directory = tmp_path / "gemma3"
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    code, out, err = cli("run", "--model", str(directory), "--prompts", "smoke", "--engine", "transformers",
                         "--max-new-tokens", "4", "--store", str(store_path), "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    ids = byte_tokenizer()("The capital of France is")["input_ids"]
    expected, _ = _hf_greedy(model.eval(), ids, 4)
    assert [r["tokens"] for r in results if r["prompt_id"] == "capital"] == [expected]


def test_a_model_without_sdpa_in_transformers_names_the_eager_option(tmp_path, cli, store_path):
    """Gemma 2 has no SDPA path in transformers: the line names the option that runs it (it said 'check the
    files'), and with that option it runs."""
    directory = _checkpoint(tmp_path / "gemma2", "gemma2", head_dim=16)
    args = ("run", "--model", str(directory), "--prompts", "smoke", "--engine", "transformers", "--max-new-tokens", "2",
            "--store", str(store_path), "-q")
    one_line_exit_2(cli(*args), "no SDPA attention", "--set attn_implementation=eager")
    assert cli(*args, "--set", "attn_implementation=eager")[0] == 0


def test_a_stateful_model_is_refused_under_transformers_with_one_line(tmp_path, cli, store_path):
    """Mamba keeps a recurrent state, not a KV cache: the engine's padded decode computed another model
    (greedy tokens off from transformers' own after two steps), so it is refused before any token."""
    from transformers import MambaConfig, MambaForCausalLM

    from evalrun.models import byte_tokenizer

    directory = tmp_path / "mamba"
    MambaForCausalLM(MambaConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, state_size=4)).save_pretrained(
        directory)
    byte_tokenizer().save_pretrained(directory)
    refused = cli("run", "--model", str(directory), "--prompts", "smoke", "--engine", "transformers", "--set",
                  "attn_implementation=eager", "--max-new-tokens", "2", "--store", str(store_path))
    one_line_exit_2(refused, "MambaForCausalLM keeps a recurrent state", "--engine transformers")


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox"])
def test_faults_plant_in_a_private_copy_of_a_transformers_module(kind):
    import copy

    from evalrun.engine.faults import Fault, apply_to_module

    model = _foreign_model(kind)
    faulted = copy.deepcopy(model)
    apply_to_module(faulted, Fault("sign_flip"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, faulted(ids).logits)
        assert torch.equal(model(ids).logits, _foreign_model(kind)(ids).logits)  # the original is untouched
    with pytest.raises(ValueError, match="evalrun's engine only"):
        apply_to_module(faulted, Fault("swap_layers"))


def test_unsupported_architecture_message_names_the_transformers_engine(tmp_path, cli, store_path):
    directory = _edit_config(_checkpoint(tmp_path / "model", "llama"), model_type="made_up_family",
                             architectures=["SomethingForCausalLM"])
    one_line_exit_2(cli("run", "--model", str(directory), "--prompts", "smoke", "--store", str(store_path)),
                    "Llama (llama)", "Qwen3 (qwen3)", "--engine transformers")


# ---------------------------------------------------------------- execution modes

def test_piecewise_modes_are_refused_with_one_line(cli, tiny_args):
    one_line_exit_2(cli("run", *tiny_args, "--engine", "transformers", "--compilation-mode", "piecewise"),
                    "compilation_mode=piecewise", "--engine transformers", "stock or trace-once")


def test_cuda_graphs_need_compilation_under_transformers():
    effective = resolve(RunConfig(model="random:tiny", engine="transformers", opt_level=0), False)
    graphs = effective.replace(device="cuda", cudagraph_mode=CUDAGraphMode.FULL)
    with pytest.raises(ConfigError, match="add --compilation-mode stock or trace-once"):
        validate(graphs, True)
    validate(graphs.replace(compilation_mode=CompilationMode.TRACE_ONCE), True)  # static cache + compile: fine


def test_opt_levels_fill_whole_forward_modes_for_transformers_and_say_so():
    effective = resolve(RunConfig(model="random:tiny", engine="transformers", device="cuda"), True)
    assert (effective.compilation_mode, effective.cudagraph_mode) == (CompilationMode.TRACE_ONCE, CUDAGraphMode.FULL)
    assert len(effective.adjustments) == 2 and all("--engine transformers" in a for a in effective.adjustments)
    evalrun = resolve(RunConfig(model="random:tiny", device="cuda"), True)
    assert evalrun.compilation_mode is CompilationMode.PIECEWISE and not evalrun.adjustments


def test_trace_once_compiles_transformers_forward_with_a_static_cache_and_the_same_tokens(write_prompts):
    # two prompts, two batches, one prefill bucket: one static cache reset between batches, one shape to compile
    two = str(write_prompts([{"id": "france", "prompt": "The capital of France is"},
                             {"id": "italy", "prompt": "The capital of Italy is"}]))
    eager = _run("random:tiny", "transformers", max_new_tokens=3, prompts=two)
    compiled = _run("random:tiny", "transformers", max_new_tokens=3, compilation_mode="trace-once", prompts=two)
    evidence = compiled.evidence
    assert evidence["kv_cache"] == "StaticCache" and evidence["fallbacks"] == []
    assert evidence["dynamo_graphs"] >= 2 and evidence["recompiles_after_warmup"] == 0  # prefill and decode shapes
    assert _tokens(eager) == _tokens(compiled) and len(compiled.results) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["full", "full-decode-only"])
def test_static_cache_compile_with_cuda_graphs_on_the_gpu(graphs):
    """float32 on the GPU: transformers' static cache + compile with CUDA graphs gives eager's tokens."""
    flags = {"device": "cuda", "dtype": "float32", "max_new_tokens": 16, "batch_size": 2}
    eager = _run("random:tiny", "transformers", timed=True, opt_level=0, **flags)
    compiled = _run("random:tiny", "transformers", timed=True, compilation_mode="trace-once", cudagraph_mode=graphs,
                    **flags)
    evidence = compiled.evidence
    assert evidence["fallbacks"] == [] and evidence["cudagraphs"], evidence
    assert evidence["cudagraph_launches_per_decode_step"] >= 1, evidence
    assert eager.evidence["cudagraph_launches_per_decode_step"] == 0
    assert evidence["kernel_launches_per_decode_step"] < eager.evidence["kernel_launches_per_decode_step"]
    assert _tokens(eager) == _tokens(compiled)


# ---------------------------------------------------------------- across engines: golden verify, diff, bisect

@pytest.fixture(scope="module")
def evalrun_golden(tmp_path_factory) -> Path:
    from evalrun.golden import create_golden

    directory = tmp_path_factory.mktemp("golden")
    create_golden("tiny", build_config(flags={"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 8}),
                  directory)
    return directory


def test_verify_with_transformers_a_golden_made_by_evalrun_passes_naming_the_engine(evalrun_golden, cli):
    code, out, err = cli("golden", "verify", "tiny", "--dir", str(evalrun_golden), "--engine", "transformers",
                         "--format", "json")
    verdict = json.loads(out)
    assert code == 0, err
    assert verdict["verdict"] in ("identical", "drift")
    assert "config: engine evalrun -> transformers" in verdict["causes"]
    assert verdict["candidate_config"]["engine"] == "transformers"


def test_verify_with_transformers_catches_a_change_planted_in_it(evalrun_golden):
    """The function check runs the golden's own engine; a change in transformers' forward alone must fail
    the execution check."""
    from evalrun.engine.faults import Fault, fault_hook
    from evalrun.golden import open_golden
    from evalrun.verify import candidate_config, verify_golden

    golden = open_golden("tiny", evalrun_golden)
    config = candidate_config(golden, None, {"engine": "transformers"}, ())
    hook = fault_hook(Fault("scale", 0.05), only=lambda prepared: prepared.config.engine == "transformers")
    verdict = verify_golden(golden, config, hook=hook)
    assert verdict.verdict == "changed" and verdict.exit_code == 1, verdict.causes
    assert any("execution check failed" in cause for cause in verdict.causes), verdict.causes
    assert "forced_s" in verdict.timings  # tokens left the golden's path: transformers re-ran along it, forced


def test_diff_names_the_engine(cli, tiny_args):
    ids = []
    for engine in ("evalrun", "transformers"):
        code, out, err = cli("run", *tiny_args, "--engine", engine, "--json", "--quiet")
        assert code == 0, err
        ids.append(json.loads(out)["run_id"])
    code, out, err = cli("diff", *ids, "--store", tiny_args[-1], "--format", "json")
    assert code in (0, 1), err
    keys = [row["key"] if isinstance(row, dict) else row[0] for row in json.loads(out)["config"]]
    assert "engine" in keys


def test_bisect_names_the_engine_as_the_culprit(store_path):
    from evalrun.bisect import BisectRequest, run_bisect
    from evalrun.bisect_report import render

    flags = {"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 4}
    result = run_bisect(BisectRequest("engine=evalrun", "engine=transformers,batch_size=3", flags=flags,
                                      store_path=store_path, in_process=True))
    assert [knob.name for knob in result.knobs] == ["engine", "batch_size"]
    assert result.culprit.kind == "knob" and [k.name for k in result.culprit_knobs] == ["engine"]
    assert result.layer.summary.startswith("not run: per-layer states are observed in evalrun's own forward only")
    assert result.compiler.status == "not run"
    text = render(result, "text")
    assert "stage 3, layer: not run: per-layer states" in text and "the culprit runs --engine transformers" in text


@pytest.mark.gpu
def test_a_bfloat16_golden_of_evalruns_engine_verifies_through_transformers_at_O2(tmp_path):
    """On the GPU in bfloat16: -O2 under transformers (trace-once over a static cache, CUDA graphs) against
    a golden evalrun's engine made eagerly is numerics only: identical or drift, never changed."""
    from evalrun.golden import create_golden, open_golden
    from evalrun.verify import candidate_config, verify_golden

    flags = {"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 16, "device": "cuda", "dtype": "bfloat16",
             "opt_level": 0}
    create_golden("g", build_config(flags=flags), tmp_path)
    golden = open_golden("g", tmp_path)
    verdict = verify_golden(golden, candidate_config(golden, None, {"engine": "transformers", "opt_level": 2}, ()))
    assert verdict.candidate_config["compilation_mode"] == "trace-once"
    assert verdict.candidate_config["cudagraph_mode"] == "full"
    assert verdict.verdict in ("identical", "drift"), verdict.causes


def test_bench_puts_both_engines_side_by_side(cli):
    code, out, err = cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4",
                         "--matrix", "O0,O0@transformers", "--no-baselines", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [row["config"] for row in rows] == ["O0", "O0@transformers"]
    assert all(row["error"] is None and row["fallbacks"] == [] and row["tokens_per_s"] > 0 for row in rows)
    one_line_exit_2(cli("bench", "--model", "random:tiny", "--matrix", "O0@nope"), "engine='nope' is not valid")


def test_an_moe_golden_of_the_transformers_engine_computes_its_float64_oracle(tmp_path):
    """transformers' grouped_mm experts have no float64 kernel: the oracle of a Qwen3-MoE golden made with
    --engine transformers crashed (RuntimeError: Expected mat_a to be Float32, BFloat16 or Float16, got Double)."""
    from evalrun.golden import create_golden, open_golden
    from evalrun.verify import candidate_config, verify_golden
    from test_moe import moe_checkpoint

    directory = str(moe_checkpoint(tmp_path / "moe"))
    create_golden("moe", build_config(flags={"model": directory, "prompts": "smoke", "max_new_tokens": 4,
                                             "engine": "transformers"}), tmp_path)
    golden = open_golden("moe", tmp_path)
    assert golden.config("oracle").dtype == "float64"
    verdict = verify_golden(golden, candidate_config(golden, None, {"batch_size": 2}, ()))
    assert verdict.verdict in ("identical", "drift"), verdict.causes
