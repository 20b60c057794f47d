import dataclasses
import json

import pytest
import torch

from evalrun.config import (NUMERICS_FACTORS, WORKLOAD_FACTORS, CompilationMode, CUDAGraphMode, EffectiveConfig,
                            RunConfig, resolve)
from evalrun.fingerprint import apply_numerics_flags, backend_flags, environment, environment_hash
from evalrun.hashing import canonical_json
from evalrun.models import load_model, model_identity
from evalrun.prompts import PromptRecord, PromptSet, load_prompt_set

from conftest import copy_model_dir


def test_canonical_json_ignores_key_order():
    assert canonical_json({"b": 1, "a": [1, 2]}) == canonical_json({"a": [1, 2], "b": 1}) == '{"a":[1,2],"b":1}'


def _effective():
    return resolve(RunConfig(model="random:tiny"), cuda_available=False)


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, tuple):
        return value + (4096,)
    if isinstance(value, CompilationMode):
        return CompilationMode.STOCK
    if isinstance(value, CUDAGraphMode):
        return CUDAGraphMode.FULL
    return f"{value}-x"


@pytest.mark.parametrize("key", NUMERICS_FACTORS + WORKLOAD_FACTORS)
def test_changing_any_declared_factor_changes_the_config_hash(key):
    base = _effective()
    changed = base.replace(**{key: _other(getattr(base, key))})
    assert changed.compute_hash() != base.compute_hash()


@pytest.mark.parametrize("key", ["opt_level", "warmup", "strict_config", "keep_logits", "adjustments"])
def test_fields_that_change_no_numbers_are_not_hashed(key):
    """Recording or procedure, not numerics: they must never show up as a verdict's cause."""
    base = _effective()
    value = {"keep_logits": "all", "adjustments": ("x",)}.get(key, _other(getattr(base, key)))
    assert base.replace(**{key: value}).compute_hash() == base.compute_hash()


def test_every_field_is_a_factor_or_declared_unhashed():
    unhashed = {"opt_level", "warmup", "strict_config", "keep_logits", "adjustments", "server_timeout"}
    fields = {f.name for f in dataclasses.fields(EffectiveConfig)}
    assert fields == set(NUMERICS_FACTORS) | set(WORKLOAD_FACTORS) | unhashed


def test_environment_covers_the_design_list():
    env = environment("cpu")
    for key in ("python", "torch", "cuda", "cudnn", "triton", "transformers", "numpy", "cpu", "os", "env", "backend_flags"):
        assert key in env
    assert "float32_matmul_precision" in env["backend_flags"]


@pytest.mark.parametrize("key", ["torch", "transformers", "cpu", "python"])
def test_changing_any_environment_key_changes_only_the_environment_hash(key):
    env = environment("cpu")
    config_hash = _effective().compute_hash()
    changed = dict(env, **{key: "something-else"})
    assert environment_hash(changed) != environment_hash(env)
    assert _effective().compute_hash() == config_hash


def test_numerics_env_vars_are_recorded(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert environment("cpu")["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_deterministic_flags_are_applied_and_recorded():
    try:
        applied = apply_numerics_flags(_effective().replace(deterministic=True))
        assert applied["use_deterministic_algorithms"] is True
        assert backend_flags()["deterministic_algorithms"] is True
        assert applied["CUBLAS_WORKSPACE_CONFIG"]
    finally:
        apply_numerics_flags(_effective())
    assert backend_flags()["deterministic_algorithms"] is False


def _identity(directory) -> dict:
    return model_identity(load_model(str(directory), "cpu", "float32"))


def test_model_identity_parts_change_alone(tiny_hf_dir, tmp_path):
    base = _identity(tiny_hf_dir)
    assert base["hash"] == _identity(copy_model_dir(tiny_hf_dir, tmp_path / "same"))["hash"]

    def one_ulp(state):
        weight = state["model.layers.0.mlp.up_proj.weight"]
        weight.view(torch.int32)[0, 0] += 1

    weights = _identity(copy_model_dir(tiny_hf_dir, tmp_path / "ulp", one_ulp))
    assert weights["weights"] != base["weights"]
    assert (weights["config"], weights["tokenizer"]) == (base["config"], base["tokenizer"])

    config_dir = copy_model_dir(tiny_hf_dir, tmp_path / "cfg")
    config = json.loads((config_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (config_dir / "config.json").write_text(json.dumps(config))
    changed = _identity(config_dir)
    assert changed["config"] != base["config"] and changed["weights"] == base["weights"]

    tok_dir = copy_model_dir(tiny_hf_dir, tmp_path / "tok")
    tok_config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{{ messages[0]['content'] }}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (tok_dir / "chat_template.jinja").unlink(missing_ok=True)
    changed = _identity(tok_dir)
    assert changed["tokenizer"] != base["tokenizer"]
    assert (changed["weights"], changed["config"]) == (base["weights"], base["config"])


def test_identity_does_not_depend_on_the_run_dtype(tiny_hf_dir):
    assert model_identity(load_model(str(tiny_hf_dir), "cpu", "bfloat16"))["hash"] == _identity(tiny_hf_dir)["hash"]


def test_random_models_are_seeded_without_torch_rng():
    torch.manual_seed(123)
    first = load_model("random:tiny", "cpu", "float32").model.state_dict()
    torch.manual_seed(456)
    second = load_model("random:tiny", "cpu", "float32").model.state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_prompt_set_hash_covers_records_and_token_ids():
    tokenizer = load_model("random:tiny", "cpu", "float32").tokenizer
    base = load_prompt_set("smoke", tokenizer)
    records = [dataclasses.replace(r) for r in base.records]
    assert PromptSet("x", "x", records, base.token_ids).hash == base.hash
    records[0] = PromptRecord(records[0].id, records[0].prompt + "!", None, None)
    assert PromptSet("x", "x", records, base.token_ids).hash != base.hash
    ids = [list(t) for t in base.token_ids]
    ids[1][0] += 1
    assert PromptSet("x", "x", base.records, ids).hash != base.hash


def test_environment_names_the_engine_code(monkeypatch, tmp_path):
    """An engine change must show as an environment difference, not pass for nondeterminism."""
    from evalrun import fingerprint

    digest = fingerprint.engine_code_digest()
    assert environment("cpu")["engine_code"] == digest and len(digest) == 32
    package = tmp_path / "evalrun"
    (package / "engine").mkdir(parents=True)
    for name in ("fingerprint.py", "engine/capture.py", "engine/transformer.py", "engine/faults.py"):
        (package / name).write_text(f"# {name}\n")
    monkeypatch.setattr(fingerprint, "__file__", str(package / "fingerprint.py"))
    copy = fingerprint.engine_code_digest()
    (package / "engine" / "faults.py").write_text("# fault injection never runs in a real run\n")
    assert fingerprint.engine_code_digest() == copy
    (package / "engine" / "capture.py").write_text("# capture.py, one line changed\n")
    assert fingerprint.engine_code_digest() != copy != digest
    changed = fingerprint.engine_code_digest()
    (package / "engine" / "gguf_gemv.cpp").write_text("// the engine's C++ (linear_kernel=gguf-gemv's kernel)\n")
    assert fingerprint.engine_code_digest() != changed  # its order of sums is its bits


def test_environment_names_the_cpp_compiler_inductor_builds_cpu_kernels_with(monkeypatch, tmp_path):
    """The compiled modes on CPU and linear_kernel=gguf-gemv run C++ that the host compiler built: another
    compiler (or version) shows as an environment difference; no compiler at all is recorded as None."""
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-c++ (evalrun test) 99.1'\necho 'second line'\n")
    fake.chmod(0o755)
    before = environment("cpu")
    monkeypatch.setenv("CXX", str(fake))
    env = environment("cpu")
    assert env["cpp_compiler"] == "fake-c++ (evalrun test) 99.1" and env["env"]["CXX"] == str(fake)
    assert environment_hash(env) != environment_hash(before)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert environment("cpu")["cpp_compiler"] is None


def test_an_empty_evalrun_cache_is_the_default_folder_not_the_working_directory(monkeypatch, tmp_path):
    """EVALRUN_CACHE= (a CI variable left blank) wrote the model conversions and compiled graphs into the folder
    the command ran from."""
    from pathlib import Path

    from evalrun.compile_cache import cache_folder
    from evalrun.models import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EVALRUN_CACHE", "")
    assert cache_root() == Path(tmp_path) / ".cache" / "evalrun"
    assert cache_folder().is_relative_to(Path(tmp_path) / ".cache" / "evalrun" / "compile")
    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
