import pytest

from evalrun.config import RunConfig, build_config, parse_opt_level, parse_set_option, preset_names, resolve
from evalrun.errors import ConfigError


def test_all_design_presets_exist_and_load():
    assert set(preset_names()) >= {"debug", "online-latency", "online-throughput", "offline-batch", "strict-eval"}
    for name in preset_names():
        build_config(name)


def test_debug_preset_is_deterministic_eager():
    effective = resolve(build_config("debug"), cuda_available=False)
    assert (effective["compilation_mode"], effective["cudagraph_mode"], effective["deterministic"]) == ("none", "none", True)


@pytest.mark.parametrize("alias,canonical", [("eager", "none"), ("NONE", "none"), ("STOCK_TORCH_COMPILE", "stock"),
                                             ("DYNAMO_TRACE_ONCE", "trace-once"), ("VLLM_COMPILE", "piecewise"),
                                             ("0", "none"), ("1", "stock"), ("2", "trace-once"), ("3", "piecewise")])
def test_compilation_mode_aliases(alias, canonical):
    assert build_config(flags={"compilation_mode": alias}).compilation_mode == canonical


@pytest.mark.parametrize("alias,canonical", [("FULL_AND_PIECEWISE", "full-and-piecewise"), ("NONE", "none"),
                                             ("FULL_DECODE_ONLY", "full-decode-only"), ("piecewise", "piecewise")])
def test_cudagraph_mode_aliases(alias, canonical):
    assert build_config(flags={"cudagraph_mode": alias}).cudagraph_mode == canonical


@pytest.mark.parametrize("level,compilation,graphs,autotune", [(0, "none", "none", False), (1, "piecewise", "piecewise", False),
                                                               (2, "piecewise", "full-and-piecewise", False),
                                                               (3, "piecewise", "full-and-piecewise", True)])
def test_opt_levels_fill_unset_fields_on_gpu(level, compilation, graphs, autotune):
    effective = resolve(build_config(flags={"opt_level": level}), cuda_available=True)
    assert (effective["compilation_mode"], effective["cudagraph_mode"], effective["max_autotune"]) == (compilation, graphs, autotune)
    assert effective["coordinate_descent_tuning"] == autotune


def test_explicit_settings_win_over_opt_level():
    effective = resolve(build_config(flags={"opt_level": 3, "compilation_mode": "stock", "max_autotune": False}), True)
    assert effective["compilation_mode"] == "stock" and effective["max_autotune"] is False
    assert effective["cudagraph_mode"] == "full-and-piecewise"


def test_default_opt_level_and_dtype_follow_the_device():
    cpu, gpu = resolve(RunConfig(), False), resolve(RunConfig(), True)
    assert (cpu["device"], cpu["opt_level"], cpu["dtype"]) == ("cpu", 0, "float32")
    assert (gpu["device"], gpu["opt_level"], gpu["dtype"]) == ("cuda", 2, "bfloat16")


def test_opt_level_on_cpu_never_fills_cuda_graphs():
    assert resolve(build_config(flags={"opt_level": 2}), cuda_available=False)["cudagraph_mode"] == "none"


def test_precedence_preset_then_file_flags_then_set(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('batch_size = 4\nmax_new_tokens = 9\n')
    config = build_config(str(path), flags={"max_new_tokens": 5}, sets=["max_new_tokens=7", "top_k=3"])
    assert (config.batch_size, config.max_new_tokens, config.top_k) == (4, 7, 3)


@pytest.mark.parametrize("text,expected", [("batch_size=4", ("batch_size", 4)), ("deterministic=true", ("deterministic", True)),
                                           ("temperature=0.5", ("temperature", 0.5)), ("dtype=bf16", ("dtype", "bf16")),
                                           ("prefill-buckets=8,16", ("prefill_buckets", [8, 16]))])
def test_set_option_is_typed(text, expected):
    assert parse_set_option(text) == expected


@pytest.mark.parametrize("flags,message", [({"compilation_mode": "turbo"}, "none, stock, trace-once, piecewise"),
                                           ({"dtype": "int8"}, "float32, bfloat16, float16"),
                                           ({"device": "tpu"}, "auto, cpu, cuda"),
                                           ({"batch_size": 0}, ">= 1")])
def test_bad_values_list_the_valid_ones(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config(flags=flags)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match="valid keys: model, prompts"):
        build_config(sets=["batchsize=3"])


@pytest.mark.parametrize("value", ["7", "-O7", "x", "-1"])
def test_bad_opt_level(value):
    with pytest.raises(ConfigError, match="-O0, -O1, -O2 or -O3"):
        parse_opt_level(value)


def test_bad_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("batch_size = = 3")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        build_config(str(path))
