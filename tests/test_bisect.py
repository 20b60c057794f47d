"""evalrun bisect: SPECs, the knob ladder and its search (pure, with fake predicates), and whole bisects on
random:tiny (CPU, real runs, real torch.compile) with faults planted by the engine's fault-injection hook."""

import json
import math

import pytest

from evalrun.bisect import BisectRequest, parse_spec, run_bisect, split_spec
from evalrun.bisect_search import (Predicate, apply_knobs, first_bad_prefix, knob_ladder, parse_predicate, run_bound,
                                   search_knobs)
from evalrun.config import build_config, resolve
from evalrun.engine.faults import Fault, fault_hook
from evalrun.errors import BisectError, ConfigError

from conftest import one_line_exit_2

TINY = {"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 4}
# The smoke set's first prompt and one of its prefill bucket: a compiled probe compiles one prefill shape for them,
# not three, and the stages still pick one prompt of several.
CAPITALS = [{"id": "capital", "prompt": "The capital of France is"},
            {"id": "spain", "prompt": "The capital of Spain is"}]
# Bit-neutral on CPU for random:tiny in float32 (measured): the fault hook decides which one matters.
NEUTRAL = ("coordinate_descent_tuning=true,epilogue_fusion=false,emulate_precision_casts=true,tf32=true,"
           "deterministic=true")


def _bisect(store_path, good, bad, hook=None, stages=("compiler", "layer"), **flags):
    request = BisectRequest(good, bad, flags={**TINY, **flags}, store_path=store_path, in_process=True, hook=hook,
                            stages=stages)
    return run_bisect(request)


# ---------------------------------------------------------------- SPECs, predicates, the ladder

def test_spec_items_of_every_kind(cli, tiny_args, store_path, golden_factory, tmp_path):
    assert split_spec("O2, prefill_buckets=16,32,64 ,max_autotune=true") == [
        "O2", "prefill_buckets=16,32,64", "max_autotune=true"]
    assert parse_spec("O3") == {"opt_level": 3}
    assert parse_spec("debug,O3")["opt_level"] == 3 and "compilation_mode" not in parse_spec("debug,O3")
    assert parse_spec("compilation_mode=stock,max_autotune=true") == {"compilation_mode": "stock", "max_autotune": True}
    assert parse_spec("debug")["deterministic"] is True  # a preset
    toml = tmp_path / "knobs.toml"
    toml.write_text('compilation_mode = "piecewise"\ntf32 = true\n')
    assert parse_spec(f"O0,{toml}") == {"opt_level": 0, "compilation_mode": "piecewise", "tf32": True}
    run_id = json.loads(cli("run", *tiny_args, "--json", "--quiet", "--batch-size", "2")[1])["run_id"]
    stored = parse_spec(f"run:{run_id[:10]},O1", store_path=store_path)
    assert stored["batch_size"] == 2 and stored["model"] == "random:tiny" and stored["opt_level"] == 1
    golden = parse_spec("golden:g,tf32=true", golden_dir=golden_factory())
    assert golden["model"] == "random:tiny" and golden["tf32"] is True and "opt_level" not in golden
    for bad in ("O7", "turbo", "nosuchkey=1", "compilation_mode=warp", ""):
        with pytest.raises((BisectError, ConfigError)):
            parse_spec(bad)


def test_predicates():
    assert parse_predicate("bits", None, "golden", []).kind == "bits"
    assert parse_predicate("cmd:\"exit 0\"", None, "golden", []) == Predicate("cmd", "exit 0", golden_dir="golden")
    assert parse_predicate("verdict", None, "golden", ["g"]).golden == "g"
    for bad in ("verdict", "cmd:", "sometimes"):
        with pytest.raises(BisectError):
            parse_predicate(bad, None, "golden", [])


def test_the_knob_ladder_is_ordered_and_skips_invalid_configs():
    good = resolve(build_config(flags=TINY), cuda_available=False)
    bad = resolve(build_config(flags=TINY, sets=("tf32=true", "epilogue_fusion=false", "compilation_mode=stock",
                                                 "batch_size=2", "deterministic=true")), cuda_available=False)
    assert [k.name for k in knob_ladder(good, bad)] == ["compilation_mode", "epilogue_fusion", "tf32", "deterministic",
                                                         "batch_size"]
    with pytest.raises(BisectError, match="same model"):
        knob_ladder(good, bad.replace(max_new_tokens=9))
    gpu_good = resolve(build_config(flags={**TINY, "device": "cuda", "opt_level": 0}), cuda_available=True)
    gpu_bad = resolve(build_config(flags={**TINY, "device": "cuda", "opt_level": 2}), cuda_available=True)
    ladder = knob_ladder(gpu_good, gpu_bad)
    assert [k.name for k in ladder] == ["compilation_mode", "cudagraph_mode"]
    with pytest.raises(ConfigError, match="piecewise"):  # CUDA graphs around pieces need piecewise compilation
        apply_knobs(gpu_good, ladder[1:], cuda_available=True)


def test_a_probe_config_written_as_toml_reads_back_to_the_same_config(tmp_path):
    from evalrun.bisect_probe import write_toml

    good = resolve(build_config(flags=TINY), cuda_available=False)
    probe = good.replace(compilation_mode="piecewise", prefill_buckets=(8, 64), tf32=True)
    path = write_toml(probe, tmp_path / "probe.toml")
    assert resolve(build_config(str(path)), cuda_available=False).compute_hash() == probe.compute_hash()


# ---------------------------------------------------------------- the search, with fake predicates

def _counting(bad_when):
    asked = []

    def test(indices):
        asked.append(indices)
        return "bad" if bad_when(indices) else "good"

    return test, asked


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13])
def test_one_culprit_among_k_knobs_within_the_bound(count):
    for culprit in range(count):
        test, asked = _counting(lambda s, c=culprit: c in s)
        found = search_knobs(count, test)
        assert (found.kind, found.indices) == ("knob", [culprit])
        assert len(set(asked)) + 1 <= run_bound(count) == (math.ceil(math.log2(count)) + 3 if count > 1 else 2)


def test_an_interaction_is_minimised_to_its_knobs():
    test, _ = _counting(lambda s: {1, 4} <= s)
    found = search_knobs(6, test)
    assert (found.kind, found.indices) == ("interaction", [1, 4])
    test, _ = _counting(lambda s: {0, 2, 5} <= s)
    assert search_knobs(7, test).indices == [0, 2, 5]


def test_no_difference_and_skipped_prefixes():
    assert search_knobs(4, lambda s: "good").kind == "none"
    assert search_knobs(4, lambda s: "skip" if len(s) == 4 else "bad").kind == "none"  # BAD not judged: nothing
    outcomes = {2: "skip", 3: "skip"}  # prefixes 2 and 3 are not valid configs: knobs 1..3 change together
    lo, hi = first_bad_prefix(5, lambda n: outcomes.get(n, "good" if n < 4 else "bad"))
    assert (lo, hi) == (1, 4)
    found = search_knobs(5, lambda s: "skip" if len(s) in (2, 3) and s == frozenset(range(len(s)))
                         else "bad" if 3 in s else "good")
    assert found.kind == "knob" and 3 in found.indices
    assert "the configs between them were skipped (not valid here, or their runs failed" in found.note  # either


def test_a_knob_bad_alone_is_no_culprit_when_bad_with_every_knob_is_good():
    """A predicate need not be monotone: knob 1 alone turns GOOD bad, knob 0 undoes it, BAD (both) is good. BAD is
    judged first, and the answer is no culprit, not knob 1."""
    test, asked = _counting(lambda s: s == {1})
    found = search_knobs(2, test)
    assert found.kind == "none" and "do not differ" in found.note
    assert asked == [frozenset({0, 1})]  # nothing else run once BAD passes


# ---------------------------------------------------------------- whole bisects with planted faults

def test_a_fault_in_one_layers_mlp_switched_on_by_one_inductor_knob_is_found(store_path, write_prompts):
    """Piecewise-compiled GOOD and BAD differ in five knobs; a 5% change of layer 1's MLP down projection
    exists only when epilogue_fusion is off: knob, layer and sub-block, within ceil(log2 5) + 2 runs."""
    hook = fault_hook(Fault("scale", 0.05, layer=1), only=lambda p: p.config.epilogue_fusion is False)
    result = _bisect(store_path, "compilation_mode=piecewise", f"compilation_mode=piecewise,{NEUTRAL}", hook,
                     prompts=str(write_prompts(CAPITALS)))
    assert len(result.knobs) == 5 and result.culprit.kind == "knob"
    assert [k.name for k in result.culprit_knobs] == ["epilogue_fusion"]
    assert result.runs == 5 and result.bound == 6  # GOOD, BAD, prefixes 2 and 1, the knob alone
    assert (result.layer.first_out.layer, result.layer.first_out.block) == (1, "MLP")
    assert result.layer.first_bits.name == "layer 1 MLP"
    assert all(p.bits_equal for p in result.layer.points[:3])
    assert (result.compiler.status, result.compiler.backend) == ("before the compiler", "eager")  # not a pass
    assert result.step.prompt_id == "capital" and result.step.step == 0
    assert result.culprit_config["epilogue_fusion"] is False


def test_a_fault_needing_two_knobs_is_reported_as_an_interaction(store_path):
    hook = fault_hook(Fault("scale", 0.05, layer=0),
                      only=lambda p: p.config.coordinate_descent_tuning and p.config.deterministic)
    result = _bisect(store_path, "O0", NEUTRAL, hook, stages=("compiler", "layer"))
    assert result.culprit.kind == "interaction" and result.runs == 8  # 5 to find the last knob and BAD, 2 of ddmin
    assert sorted(k.name for k in result.culprit_knobs) == ["coordinate_descent_tuning", "deterministic"]
    assert result.compiler.status == "not run" and "set of knobs" in result.compiler.summary
    assert (result.layer.first_out.layer, result.layer.first_out.block) == (0, "MLP")


def test_resume_reuses_the_stored_probes_and_diff_works_between_them(store_path, cli):
    hook = fault_hook(Fault("scale", 0.05, layer=1), only=lambda p: p.config.tf32)
    first = _bisect(store_path, "O0", NEUTRAL, hook, stages=())
    assert [k.name for k in first.culprit_knobs] == ["tf32"] and first.reused == 0 and first.runs == first.bound == 6
    second = _bisect(store_path, "O0", NEUTRAL, hook, stages=())
    assert second.session == first.session and second.reused == second.runs == first.runs
    assert [p.run_id for p in second.probes] == [p.run_id for p in first.probes]
    code, out, err = cli("diff", first.probes[0].run_id[:12], first.culprit_run[:12], "--store", str(store_path),
                         "--json")
    assert code == 0, err
    diff = json.loads(out)
    assert {"key": "tf32", "a": False, "b": True} in diff["config"]


def test_good_equal_to_bad_under_bits_says_so(cli, store_path):
    code, out, err = cli("bisect", "--good", "O0", "--bad", "tf32=true,deterministic=true", "--in-process", "--json",
                         "--quiet", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "3",
                         "--store", str(store_path))
    assert code == 0, err
    data = json.loads(out)
    assert data["culprit"]["kind"] == "none" and "do not differ" in data["culprit"]["note"]
    assert data["runs"] == len(data["probes"]) and all(p["outcome"] == "good" for p in data["probes"])


def test_a_bad_that_agrees_with_good_names_no_culprit_though_one_of_its_knobs_alone_differs(cli, store_path):
    """batch_invariant=true keeps batch 4's bits equal to batch 1's; batch_size=4 alone does not. BAD
    (batch_invariant=true, batch_size=4) has GOOD's bits: no culprit (it named batch_size 1 -> 4)."""
    code, out, err = cli("bisect", "--good", "batch_size=1", "--bad", "batch_invariant=true,batch_size=4",
                         "--in-process", "--json", "--quiet", "--model", "random:tiny", "--prompts", "smoke",
                         "--max-new-tokens", "4", "--store", str(store_path), "--skip", "compiler", "--skip", "layer")
    assert code == 0, err
    data = json.loads(out)
    assert data["culprit"]["kind"] == "none" and "do not differ" in data["culprit"]["note"], data["culprit"]
    assert [p["outcome"] for p in data["probes"]] == ["good", "good"] and data["runs"] == 2  # GOOD, BAD


def test_verdict_predicate_finds_the_knob_that_makes_it_wrong(golden_factory, store_path):
    directory = golden_factory()
    hook = fault_hook(Fault("scale", 0.25), only=lambda p: p.config.tf32)  # never the function check's config
    request = BisectRequest("golden:g", "golden:g,deterministic=true,tf32=true", "verdict", golden_dir=directory,
                            store_path=store_path, in_process=True, hook=hook, stages=("compiler",))
    result = run_bisect(request)
    assert [k.name for k in result.culprit_knobs] == ["tf32"] and (result.runs, result.bound) == (3, 4)  # GOOD, BAD, tf32
    assert [p.note.split(":")[0] for p in result.probes[:2]] == ["verdict identical", "verdict changed"]
    assert result.step.verdict_reason.startswith("execution check")
    assert result.compiler.status == "not run" and "not a compilation knob" in result.compiler.summary


# ---------------------------------------------------------------- the command line

_one_line_exit_2 = one_line_exit_2


@pytest.mark.parametrize("args,needle", [
    (["--good", "O0", "--bad", "warp9"], "SPEC item 'warp9'"),
    (["--good", "O0", "--bad", "O1", "--until", "verdict"], "needs a golden"),
    (["--good", "O0", "--bad", "O1", "--until", "often"], "--until 'often'"),
    # an invalid --until is named before the options it would decide on (it read "--until often reads none")
    (["--good", "O0", "--bad", "O1", "--until", "often", "--golden", "g"], "--until 'often' is not valid"),
    (["--good", "O0", "--bad", "O1", "--until", "often", "--probe-timeout", "60"], "--until 'often' is not valid"),
    (["--good", "O0", "--bad", "O1", "--until", "cmd:", "--golden", "g"], "needs a command"),
    (["--good", "O0", "--bad", "seed=5"], "same model, prompts and tokens"),
    (["--good", "O0", "--bad", "tf32=true", "--until", "cmd:exit 3"], "GOOD itself does not pass"),
    # BAD that cannot run, or that the predicate skips, was "no culprit" and exit 0: nothing was bisected
    (["--good", "O0", "--bad", "engine=openai:http://127.0.0.1:9/v1"], "BAD could not be judged (bits: skip"),
    (["--good", "O0", "--bad", "tf32=true", "--until",
      'cmd:grep -q "^tf32 = true" "$EVALRUN_BISECT_CONFIG" && exit 125 || exit 0'], "BAD could not be judged"),
    # NaN passed FloatRange(min=1) and ran; out of process, NaN, inf and 1e10 crashed the wait for a probe (exit 3)
    (["--good", "O0", "--bad", "tf32=true", "--probe-timeout", "nan"], "--probe-timeout"),
    (["--good", "O0", "--bad", "tf32=true", "--probe-timeout", "inf"], "--probe-timeout"),
    (["--good", "O0", "--bad", "tf32=true", "--probe-timeout", "1e10"], "--probe-timeout"),
    # options that were silently not read: a golden beside --until bits, a timeout of probes run in this process
    (["--good", "O0", "--bad", "tf32=true", "--golden", "g"], "--until bits reads none"),
    (["--good", "O0", "--bad", "tf32=true", "--probe-timeout", "60"], "drop one of them"),
    (["--good", "O0", "--bad", "tf32=true", "--probe-timeout", "1", "--until",  # cmd: keeps its timeout in-process
      'cmd:grep -q "^tf32 = true" "$EVALRUN_BISECT_CONFIG" && sleep 3; exit 0'], "timed out after 1 s); raise --probe"),
])
def test_bad_input_is_one_line_and_exit_2(cli, store_path, args, needle):
    _one_line_exit_2(cli("bisect", *args, "--in-process", "--quiet", "--model", "random:tiny", "--prompts", "smoke",
                         "--max-new-tokens", "2", "--store", str(store_path)), needle)


def test_cli_with_a_command_predicate_in_fresh_processes(cli, store_path, tmp_path):
    """The default: every probe in its own process; the command sees the probe's config and run."""
    command = 'cmd:test -n "$EVALRUN_BISECT_RUN" && ! grep -q "^deterministic = true" "$EVALRUN_BISECT_CONFIG"'
    args = ["bisect", "--good", "O0", "--bad", "tf32=true,deterministic=true", "--until", command, "--model",
            "random:tiny", "--prompts", "smoke", "--max-new-tokens", "2", "--store", str(store_path), "--quiet"]
    code, out, err = cli(*args, "--format", "markdown")
    assert code == 0, err
    assert out.startswith("### evalrun bisect: culprit: deterministic False")
    assert "| probe | knobs of BAD on GOOD |" in out and "<!--" not in out
    code, out, err = cli(*args, "--json")
    data = json.loads(out)
    assert code == 0 and data["runs"] == data["bound"] == 4 and all(p["reused"] for p in data["probes"])
    assert data["compiler"]["status"] == "not run" and data["layer"]["first_out"] is None


def test_text_report_and_plot(cli, store_path, tmp_path):
    plot = tmp_path / "layers.png"
    code, out, err = cli("bisect", "--good", "O0", "--bad", "attn_implementation=eager", "--in-process", "--quiet",
                         "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "3", "--store",
                         str(store_path), "--plot", str(plot), "--skip", "compiler")
    assert code == 0, err
    assert "culprit: attn_implementation sdpa -> eager" in out and "stage 3, layer:" in out
    assert "stage 2, inside the compiler: skipped" in out and "evalrun diff" in out
    assert "bound for one culprit: 2\n" in out  # one knob: GOOD and BAD (no ceil(log2 K) + 3 = 2)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_culprit_the_layer_stage_cannot_look_into_is_reported_with_a_warning_not_exit_2(cli, store_path, tmp_path):
    """The engine knob (the README's own example): stage 3 has no per-layer errors for transformers' forward. The
    culprit's report exits 0 and says why no plot was written (it printed the report, then exit 2)."""
    plot = tmp_path / "layers.png"
    code, out, err = cli("bisect", "--good", "engine=evalrun", "--bad", "engine=transformers", "--in-process",
                         "--quiet", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "3", "--store",
                         str(store_path), "--plot", str(plot), "--skip", "compiler")
    assert code == 0, err
    assert "culprit: engine evalrun -> transformers" in out
    assert err.startswith(f"bisect: no plot written to {plot}: the layer stage has no per-layer errors")
    assert len(err.strip().splitlines()) == 1 and not plot.exists()


def test_forward_states_follow_the_forward_bit_for_bit():
    """The layer stage's states are the forward's own: the last MLP state, through the head, gives forward's logits."""
    import torch

    from evalrun.runner import prepare

    transformer = prepare(build_config(flags=TINY)).execution_mode().transformer
    ids = [3, 14, 15, 92, 65, 35]
    tokens, positions, valid = torch.tensor([ids]), torch.arange(len(ids))[None], torch.ones(1, len(ids), dtype=torch.bool)
    logits = transformer.forward(tokens, positions, positions[0], valid, transformer.new_cache(1, len(ids)))
    states = transformer.forward_states(tokens, positions, positions[0], valid, transformer.new_cache(1, len(ids)))
    assert len(states) == 2 * len(transformer.layers) + 1
    last = transformer.head(states[-2][:, -1], transformer.final_norm, transformer.lm_head, transformer.eps)
    assert torch.equal(last, logits)
    assert torch.allclose(states[-1][:, -1], logits, atol=1e-5)


@pytest.mark.gpu
def test_o0_to_o3_on_cuda_in_fresh_processes(store_path, golden_factory):
    """On a GPU (not run on the CPU machine): the issue's H200 cases on random:tiny, bf16, probes in fresh processes."""
    flags = {**TINY, "device": "cuda", "dtype": "bfloat16"}
    result = run_bisect(BisectRequest("O0", "O3", flags=flags, store_path=store_path))
    assert [k.name for k in result.knobs][:2] == ["compilation_mode", "cudagraph_mode"]
    if result.culprit.kind == "knob":
        assert result.runs <= result.bound
        assert result.layer is not None and result.step is not None
        assert result.compiler.status != "failed", result.compiler.summary
    directory = golden_factory("--device", "cuda", "--dtype", "bfloat16")
    verdict = run_bisect(BisectRequest("golden:g", "golden:g,O3", "verdict", golden_dir=directory, store_path=store_path))
    assert verdict.probes[0].outcome == "good"  # an O0 golden's own config verifies


def test_compiler_bisector_alone_is_run_beside_for_comparison(store_path, write_prompts):
    """--compare-compiler-bisector: torch's bisector on BAD as a whole, its calls and answer beside ours."""
    from evalrun import bisect_report

    flags = {**TINY, "max_new_tokens": 2, "prompts": str(write_prompts(CAPITALS))}
    request = BisectRequest("O0", "compilation_mode=piecewise", flags=flags, store_path=store_path, in_process=True,
                            stages=("compiler",), compare_compiler_bisector=True)
    result = run_bisect(request)
    ours, alone = result.compiler, result.compiler_alone
    assert ours.status in ("found", "before the compiler") and ours.calls > 0
    assert alone.status not in ("not run", "failed") and alone.calls > 0
    assert alone.reference.startswith("the culprit config under Dynamo's eager backend")
    text = bisect_report.render(result, "text")
    assert f"for comparison, CompilerBisector alone on BAD: {alone.calls} call(s): {alone.status}" in text
    assert f"evalrun: {result.runs + ours.calls} ({result.runs} stored run(s)" in text
    assert json.loads(bisect_report.render(result, "json"))["compiler_alone"]["calls"] == alone.calls
