import dataclasses

import pytest

from evalrun.config import (OPT_LEVEL_DEFAULTS, CompilationMode, CUDAGraphMode, EffectiveConfig, RunConfig, build_config,
                            parse_opt_level, parse_set_option, preset_names, resolve)
from evalrun.errors import ConfigError


def test_all_design_presets_exist_and_resolve_on_a_gpu():
    assert set(preset_names()) >= {"debug", "online-latency", "online-throughput", "offline-batch", "strict-eval"}
    for name in preset_names():
        resolve(build_config(name), cuda_available=True)


def test_debug_preset_is_deterministic_eager():
    effective = resolve(build_config("debug"), cuda_available=False)
    assert (effective.compilation_mode, effective.cudagraph_mode, effective.deterministic) == ("none", "none", True)


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
    assert (effective.compilation_mode, effective.cudagraph_mode, effective.max_autotune) == (compilation, graphs, autotune)
    assert effective.coordinate_descent_tuning == autotune


def test_explicit_settings_win_over_opt_level():
    effective = resolve(build_config(flags={"opt_level": 3, "compilation_mode": "piecewise", "max_autotune": False}), True)
    assert effective.compilation_mode == "piecewise" and effective.max_autotune is False
    assert effective.cudagraph_mode == "full-and-piecewise" and effective.coordinate_descent_tuning is True


def test_an_opt_level_given_later_takes_its_knobs_back_from_earlier_layers():
    """`golden verify G -O2` on a golden requested as eager (the debug preset) once ran eager labelled -O2."""
    debug = {"compilation_mode": "none", "cudagraph_mode": "none", "deterministic": True, "max_autotune": False}
    on_top = resolve(build_config(flags={"opt_level": 2}, base=debug), cuda_available=True)
    assert (on_top.compilation_mode, on_top.cudagraph_mode, on_top.deterministic) == (
        "piecewise", "full-and-piecewise", True)  # not governed by the level: kept
    same_layer = resolve(build_config(flags={"opt_level": 2, "compilation_mode": "stock"}, base=debug), True)
    assert same_layer.compilation_mode == "stock"
    later_set = resolve(build_config(flags={"opt_level": 3}, sets=["max_autotune=false"], base=debug), True)
    assert later_set.max_autotune is False and later_set.coordinate_descent_tuning is True
    flag_then_set_level = resolve(build_config(flags={"compilation_mode": "stock"}, sets=["opt_level=2"]), True)
    assert flag_then_set_level.compilation_mode == "stock"  # one command line is one layer
    preset_then_level = resolve(build_config("debug", flags={"opt_level": 1}), True)
    assert preset_then_level.compilation_mode == "piecewise"


def test_default_opt_level_and_dtype_follow_the_device():
    cpu, gpu = resolve(RunConfig(), False), resolve(RunConfig(), True)
    assert (cpu.device, cpu.opt_level, cpu.dtype) == ("cpu", 0, "float32")
    assert (gpu.device, gpu.opt_level, gpu.dtype) == ("cuda", 2, "bfloat16")


def test_opt_level_on_cpu_never_fills_cuda_graphs():
    assert resolve(build_config(flags={"opt_level": 2}), cuda_available=False).cudagraph_mode == "none"


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
                                           ({"batch_size": 0}, "from 1 to"), ({"max_new_tokens": 10**9}, "from 1 to"),
                                           ({"prefill_buckets": []}, "give 1 to 64 sizes"),
                                           ({"top_k": 10**6}, "from 2 to")])
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


def test_a_key_a_toml_file_gives_twice_in_two_spellings_is_refused(tmp_path):
    """max-new-tokens and max_new_tokens are one key: the later one won, silently."""
    path = tmp_path / "twice.toml"
    path.write_text("max-new-tokens = 4\nmax_new_tokens = 8\n")
    with pytest.raises(ConfigError, match="twice.toml: max_new_tokens is given twice .'max-new-tokens' and "
                                          "'max_new_tokens'.; keep one"):
        build_config(str(path))


def test_resolve_returns_a_frozen_typed_config():
    effective = resolve(build_config(flags={"opt_level": 1}), cuda_available=True)
    assert effective.compilation_mode is CompilationMode.PIECEWISE
    assert effective.cudagraph_mode.has_piecewise_cudagraphs() and not effective.cudagraph_mode.has_full_cudagraphs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        effective.dtype = "float16"


@pytest.mark.parametrize("mode,full,piecewise,needs_piecewise", [
    ("none", False, False, False), ("piecewise", False, True, True), ("full", True, False, False),
    ("full-decode-only", True, False, False), ("full-and-piecewise", True, True, True)])
def test_cudagraph_modes_carry_their_behaviour(mode, full, piecewise, needs_piecewise):
    graphs = CUDAGraphMode(mode)
    assert (graphs.has_full_cudagraphs(), graphs.has_piecewise_cudagraphs(),
            graphs.requires_piecewise_compilation()) == (full, piecewise, needs_piecewise)
    assert not graphs.without_piecewise().requires_piecewise_compilation()


@pytest.mark.parametrize("level,compilation,expected_graphs", [(2, "stock", "full"), (2, "trace-once", "full"),
                                                              (1, "stock", "none"), (2, "none", "full"),
                                                              (3, "piecewise", "full-and-piecewise")])
def test_a_level_fills_graphs_compatible_with_the_users_compilation(level, compilation, expected_graphs):
    """-O2 with only --compilation-mode stock once exited 2: the level filled full-and-piecewise."""
    effective = resolve(build_config(flags={"opt_level": level, "compilation_mode": compilation}), cuda_available=True)
    assert effective.cudagraph_mode == expected_graphs
    assert bool(effective.adjustments) == (expected_graphs != OPT_LEVEL_DEFAULTS[level]["cudagraph_mode"])


def test_a_level_fills_compilation_the_users_graphs_need():
    effective = resolve(build_config(flags={"opt_level": 0, "cudagraph_mode": "piecewise"}), cuda_available=True)
    assert effective.compilation_mode == "piecewise" and "needs piecewise" in effective.adjustments[0]


@pytest.mark.parametrize("flags,cuda,message", [
    ({"compilation_mode": "stock", "cudagraph_mode": "piecewise"}, True, "needs --compilation-mode piecewise"),
    ({"cudagraph_mode": "full"}, False, "needs a GPU"),
    ({"device": "cuda"}, False, "no CUDA GPU"),
    ({"dtype": "float16"}, False, "not supported on CPU")])
def test_one_validation_names_the_fix(flags, cuda, message):
    with pytest.raises(ConfigError, match=message):
        resolve(build_config(flags=flags), cuda_available=cuda)


def test_effective_config_round_trips_through_its_dict():
    effective = resolve(build_config("online-latency"), cuda_available=True)
    assert EffectiveConfig.from_dict(effective.as_dict()) == effective
    assert EffectiveConfig.from_dict(effective.as_dict()).compute_hash() == effective.compute_hash()


@pytest.mark.parametrize("key,value", [("batch_size", "x"), ("max_new_tokens", 10**12), ("compilation_mode", "turbo"),
                                       ("prefill_buckets", "oops"), ("device", "auto"), ("top_k", True)])
def test_a_stored_config_is_validated_when_read(key, value):
    """Goldens are untrusted input: a forged config value is a ConfigError, never a crash later."""
    data = resolve(RunConfig(), cuda_available=False).as_dict()
    data[key] = value
    with pytest.raises(ConfigError):
        EffectiveConfig.from_dict(data)
