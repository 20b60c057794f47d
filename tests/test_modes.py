"""Execution modes on CPU: every compilation mode with real torch.compile, evidence, fallbacks."""

import json
import os
import shutil

import pytest
from conftest import one_line_exit_2

from evalrun.engine.shapes import bucket_size

MODES = ["stock", "trace-once", "piecewise"]


# A prompt set of one prompt: a cold compile of random:tiny in a fresh process compiles 8 graphs for it where the
# smoke set's three prompt lengths take 12 (48 s against 59 on a 2-core machine). With one new token (the prefill
# alone, no decode step) -O1 compiles 4: the cache tests, which compile cold by design, take that (30 s against 44).
ONE_PROMPT = [{"id": "one", "prompt": "The cache"}]


def child_environment(tmp_path, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for evalrun in a child process with a cache folder and a store of its own:
    without Inductor's and Triton's settings (Inductor writes its cache folder into this environment), except the
    compile threads conftest shares out (how many processes compile, not what they compile)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TORCHINDUCTOR", "TRITON", *drop))
           or key in ("TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_VEC_ISA_OK")}
    env.update(EVALRUN_CACHE=str(tmp_path / "cache"), EVALRUN_STORE=str(tmp_path / "store.db"))
    return env


@pytest.mark.parametrize("mode", MODES)
def test_each_compilation_mode_repeats_bit_for_bit_with_evidence(cli, tiny_args, mode):
    runs = []
    for _ in range(2):
        code, out, err = cli("run", *tiny_args, "--compilation-mode", mode, "--json", "--quiet")
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[0]["logits_digest"] == runs[1]["logits_digest"]
    evidence = runs[0]["evidence"]
    assert evidence["compilation_mode"] == mode and evidence["dynamo_graphs"] > 0
    assert evidence["fallbacks"] == [] and evidence["recompiles_after_warmup"] == 0
    assert evidence["prefill_buckets"] and runs[0]["timings"]["compile_s"] > 0


@pytest.fixture(scope="module")
def o0_golden(tmp_path_factory):
    from evalrun.cli import main

    directory = tmp_path_factory.mktemp("modes-golden")
    with pytest.raises(SystemExit) as exit:
        main(["golden", "create", "o0", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "6",
              "-O0", "--dir", str(directory), "--quiet"])
    assert exit.value.code == 0
    return directory


@pytest.mark.parametrize("mode", MODES)
def test_o0_golden_under_each_compilation_mode_is_never_changed(cli, o0_golden, mode):
    code, out, err = cli("golden", "verify", "o0", "--dir", str(o0_golden), "--compilation-mode", mode,
                         "--quiet", "--format", "json")
    verdict = json.loads(out)
    assert code == 0, err
    assert verdict["verdict"] in ("identical", "drift")
    assert verdict["candidate_config"]["compilation_mode"] == mode


def test_a_graph_break_is_a_reported_fallback_and_fails_strict(cli, store_path, write_prompts, monkeypatch, tmp_path):
    import torch

    from evalrun.engine import transformer

    original = transformer.head

    def head_with_break(*args):
        torch._dynamo.graph_break()
        return original(*args)

    monkeypatch.setattr(transformer, "head", head_with_break)
    monkeypatch.setattr(transformer.Transformer, "__init__", _patched_init(transformer.Transformer.__init__, head_with_break))
    # one prompt: the stock mode compiles the forward around the break for one prefill shape, not three
    stock = ["--model", "random:tiny", "--prompts", str(write_prompts(ONE_PROMPT)), "--max-new-tokens", "3",
             "--compilation-mode", "stock"]
    code, out, err = cli("run", *stock, "--store", str(store_path), "--json", "--quiet")
    evidence = json.loads(out)["evidence"]
    assert code == 0 and evidence["graph_breaks"]
    assert any(f.startswith("graph break") for f in evidence["fallbacks"])
    code, out, err = cli("run", *stock, "--store", str(store_path), "--strict-config", "--quiet")
    assert code == 2 and "fell back" in err and "graph break" in err and len(err.strip().splitlines()) == 1
    code, out, _ = cli("store", "ls", "--store", str(store_path), "--json")
    assert json.loads(out)[0]["status"] == "failed"
    # --strict-config is the library's rule: golden create refuses a fallback too
    code, _, err = cli("golden", "create", "g", *stock, "--strict-config", "--dir", str(tmp_path), "--quiet")
    assert code == 2 and "fell back" in err and not (tmp_path / "g.db").exists()


def _patched_init(init, head_function):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.head = head_function
    return patched


def test_cuda_graph_modes_need_a_gpu_and_piecewise_graphs_need_piecewise(cli, tiny_args):
    code, _, err = cli("run", *tiny_args, "--cudagraph-mode", "piecewise")
    assert code == 2 and "needs a GPU" in err


@pytest.mark.parametrize("value,buckets,expected", [(5, [4, 8, 16], 8), (16, [4, 8, 16], 16), (17, [4, 8, 16], 32),
                                                    (1, [1, 2], 1)])
def test_buckets(value, buckets, expected):
    assert bucket_size(value, buckets) == expected


def test_o2_fingerprint_lists_every_numerics_knob(cli):
    code, out, _ = cli("fingerprint", "--model", "random:tiny", "--prompts", "smoke", "-O2", "--json")
    config = json.loads(out)["config"]
    for key in ("max_autotune", "coordinate_descent_tuning", "epilogue_fusion", "emulate_precision_casts", "tf32",
                "deterministic", "attn_implementation", "prefill_buckets", "batch_buckets"):
        assert key in config
    assert config["compilation_mode"] == "piecewise"


def test_static_workspaces_keep_each_batch_result(cli, tiny_args):
    """Workspaces are reused batch after batch: results must be copies, not views of the buffers."""
    eager = json.loads(cli("run", *tiny_args, "--json", "--quiet")[1])
    code, out, err = cli("run", *tiny_args, "--compilation-mode", "trace-once", "--json", "--quiet")
    compiled = json.loads(out)
    assert code == 0, err
    assert [r["tokens"] for r in compiled["results"]] == [r["tokens"] for r in eager["results"]]


def test_first_request_without_warmup_carries_the_compile(cli, tiny_args):
    """Without warm-up the measured batches compile (first_request is the first measured batch); with
    warm-up nothing compiles while measured. Asserted on Dynamo's counters, not on timings: timed tests
    flake on a loaded machine (a 3x margin failed on a 2-core CI runner), the benchmarks report times."""
    code, out, err = cli("run", *tiny_args, "--compilation-mode", "trace-once", "--set", "warmup=0", "--json", "--quiet")
    assert code == 0, err
    cold = json.loads(out)
    assert cold["timings"]["warmup_s"] < 0.01 and cold["evidence"]["compile_s"] > 0
    assert cold["evidence"]["recompiles_after_warmup"] > 0  # the compile landed in the measured requests
    code, out, err = cli("run", *tiny_args, "--compilation-mode", "trace-once", "--json", "--quiet")
    assert code == 0, err
    warm = json.loads(out)
    assert warm["timings"]["warmup_s"] > 0 and warm["evidence"]["recompiles_after_warmup"] == 0
    assert warm["evidence"]["dynamo_graphs"] > 0


def test_bench_measures_side_by_side_with_baselines(cli, write_prompts):
    import torch

    # one prompt: each compiled row (stock, transformers' static cache) compiles one prefill shape, not three
    code, out, err = cli("bench", "--model", "random:tiny", "--prompts", str(write_prompts(ONE_PROMPT)),
                         "--max-new-tokens", "4", "--matrix", "O0,stock", "--json")
    rows = json.loads(out)
    assert code == 0, err
    assert [row["config"] for row in rows] == ["O0", "stock", "transformers eager", "transformers static-compile"]
    assert all(row["error"] is None for row in rows), rows
    assert rows[0]["identical_to_first"] is True and "identical_to_first" in rows[1]
    assert all(row["tokens_per_s"] > 0 and row["p50_ms"] > 0 for row in rows)
    assert rows[1]["compile_s"] > 0
    assert [row["batch_size"] for row in rows] == [1, 1, 1, 1]  # the table's batch column (baselines: batch 1)
    assert rows[0]["workload"]["dtype"] == "float32" and "workload" not in rows[2]  # what --compare checks
    # transformers compiles a static cache on GPUs only: on CPU the row says it ran eagerly (its label did not)
    assert rows[3].get("fallbacks") == (None if torch.cuda.is_available() else [
        "transformers compiled nothing (it compiles a static cache on GPUs only): a static cache, eagerly"])


def test_bench_config_timeout_stops_one_configuration_and_says_so(cli):
    """With --quiet (no "bench: NAME" progress lines), stderr is the one line, naming why the row failed."""
    code, out, err = cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--matrix", "stock",
                         "--no-baselines", "--config-timeout", "1", "--json", "--quiet")
    rows = json.loads(out)
    assert code == 2 and "1 of 1 bench configurations failed (stock)" in err
    assert len(err.splitlines()) == 1 and "the first: timed out after 1 s" in err, err
    assert rows[0]["config"] == "stock" and rows[0]["error"].startswith("timed out after 1 s")


def test_bench_unknown_config(cli):
    code, _, err = cli("bench", "--model", "random:tiny", "--matrix", "O9")
    assert code == 2 and "unknown bench config" in err


@pytest.mark.parametrize("seconds", ["nan", "inf", "1e10"])
def test_bench_config_timeout_past_a_week_or_nan_is_refused(cli, seconds):
    """FloatRange(min=1) let them through; the wait for a configuration's process then crashed (exit 3)."""
    one_line_exit_2(cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--matrix", "O0", "--no-baselines",
                        "--config-timeout", seconds), "--config-timeout", "from 1 to 604800")


@pytest.mark.parametrize("matrix,needle", [("O0,O0", "names 'O0' twice"), ("O0, O2,O0", "names 'O0' twice"),
                                           ("O2+seed=1,O2+seed=1", "names 'O2+seed=1' twice"),
                                           ("", "names no configuration"), (" , ", "names no configuration")])
def test_bench_matrix_naming_a_config_twice_or_none_is_refused(cli, matrix, needle):
    """O0,O0 ran two rows of one name (a baseline of them is refused: "appears twice"); an empty --matrix ran the
    default matrix, silently. Both are one line, exit 2, before anything runs."""
    one_line_exit_2(cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--no-baselines", "--matrix", matrix),
                    "--matrix", needle)


def test_piecewise_graph_modes_warm_each_shape_twice(monkeypatch):
    """Piecewise graphs capture a shape's pieces on its second call: warm-up must make that call, or the first
    measured prefills capture (as Inductor's graph trees, used before, recorded: a 400 ms TTFT on the H200)."""
    from evalrun import runner
    from evalrun.config import build_config
    from evalrun.engine.piece_graphs import PieceGraphs, RerunGraphs

    flags = {"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 2, "compilation_mode": "piecewise"}
    prepared = runner.prepare(build_config(flags=flags))
    mode = prepared.execution_mode()
    batches = runner.plan_batches(prepared.prompt_set, prepared.config)
    shapes = len(runner.warmup_batches(batches, prepared, mode))
    calls, real = [], mode.submit  # warm-up's generate calls submit; measured batches call it directly
    monkeypatch.setattr(mode, "submit", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    runner.execute(prepared)
    assert len(calls) == shapes + len(batches)
    calls.clear()
    mode.piece_graphs = PieceGraphs(RerunGraphs())  # what --cudagraph-mode piecewise / full-and-piecewise set (GPU)
    runner.execute(prepared)
    assert len(calls) == 2 * shapes + len(batches)


def test_the_runner_enqueues_the_next_batch_before_it_makes_a_batchs_results(monkeypatch):
    """runner.execute waits until the device has finished batch i, submits batch i + 1, then makes batch i's results
    (on a GPU the device computes meanwhile); with OVERLAP_BATCHES off, one batch at a time. Either way: the same
    results, in order."""
    from evalrun import runner
    from evalrun.config import build_config

    flags = {"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 3, "compilation_mode": "none"}
    prepared = runner.prepare(build_config(flags=flags))
    mode = prepared.execution_mode()
    events, real = [], mode.submit

    class Recorded:
        def __init__(self, number, pending):
            self.number, self.pending = number, pending

        def wait(self):
            events.append(("wait", self.number))
            self.pending.wait()

        def result(self):
            events.append(("result", self.number))
            return self.pending.result()

    def submit(spec):
        number = sum(1 for event in events if event[0] == "submit")
        events.append(("submit", number))
        return Recorded(number, real(spec))

    monkeypatch.setattr(mode, "submit", submit)
    runs = []
    for overlap in (True, False):
        monkeypatch.setattr(runner, "OVERLAP_BATCHES", overlap)
        events.clear()
        runs.append(runner.execute(prepared, timed=False))
        assert len(runs[-1].plan) == 3
        if overlap:
            assert events == [("submit", 0), ("wait", 0), ("submit", 1), ("result", 0), ("wait", 1), ("submit", 2),
                              ("result", 1), ("result", 2)]
        else:
            assert events == [("submit", 0), ("result", 0), ("submit", 1), ("result", 1), ("submit", 2), ("result", 2)]
    assert [(r.prompt_id, r.logits_digest, r.tokens_digest) for r in runs[0].results] == \
        [(r.prompt_id, r.logits_digest, r.tokens_digest) for r in runs[1].results]
    assert [r.prompt_id for r in runs[0].results] == [record.id for record in prepared.prompt_set.records]


@pytest.mark.parametrize("mode", ["piecewise", "trace-once"])
def test_more_shapes_than_dynamos_recompile_limit(cli, tiny_args, write_prompts, mode):
    """More shapes than Dynamo's recompile limit per function, which with fullgraph=True was a hard failure
    mid-run (seen on the H200 with SmolLM2's default prompts: 5 prefill buckets past the default limit of 8
    compiles). The limit is set to 1 here, so the two prefill buckets are past it (with trace-once, whose one
    function also takes the decode shape, three shapes), as nine buckets are past the default (each bucket is a
    cold compile: two cost a third of six). Both limits are set: an earlier run in this process raised them
    for its own buckets."""
    import torch

    path = write_prompts([{"id": f"p{n}", "prompt": "x" * (8 * n + 1)} for n in range(2)])
    args = [a if a != "smoke" else str(path) for a in tiny_args]
    with torch._dynamo.config.patch(recompile_limit=1, accumulated_recompile_limit=256):
        code, out, err = cli("run", *args, "--compilation-mode", mode, "--json", "--quiet",
                             "--set", "prefill_buckets=8,16", "--max-new-tokens", "2")
    assert code == 0, err
    evidence = json.loads(out)["evidence"]
    assert evidence["fallbacks"] == [] and evidence["prefill_buckets"] == [8, 16], evidence


def test_a_second_process_takes_the_compiled_graphs_from_evalruns_cache_per_cpu_instruction_set(tmp_path,
                                                                                                 write_prompts):
    """Inductor's caches live under EVALRUN_CACHE; the first process compiles (misses), the second hits, each
    run's evidence says which, and the logits are the same bits. Each process compiles something before evalrun's
    first run, as a library user's torch.compile or a test does: Inductor then writes its own default folder into
    TORCHINDUCTOR_CACHE_DIR, which evalrun took for the user's choice, and its runs shared /tmp/torchinductor_<user>
    across CPU instruction sets. That default does not count as a choice; a folder the user names does (a third
    process, with evalrun's graphs moved there).

    Inductor's cache keys miss ATEN_CPU_CAPABILITY: a bfloat16 -O1 run compiled with the machine's instruction set,
    then the same command with ATEN_CPU_CAPABILITY=default sharing one Inductor folder, failed to compile (exit 3; a
    bfloat16 MoE crashed with a segmentation fault under avx2). evalrun keeps a folder per instruction set, so a
    process under ATEN_CPU_CAPABILITY=default, run while the first one's graphs are in evalrun's folder, compiles
    into its own. Two cold compiles serve the four processes (one test: each cold compile is most of a minute on a
    2-core machine)."""
    import subprocess
    import sys

    import torch

    script = """
import json, os, sys, torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
# unset, Inductor writes its default folder into the environment. The user's graph differs per instruction set:
# in Inductor's own folder it has the bug evalrun's folders avoid (x * 2 compiled under avx2, then the same graph
# under ATEN_CPU_CAPABILITY=default, failed to compile: `at::vec` has not been declared).
factor = 3.0 if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else 2.0
torch.compile(lambda x: x * factor)(torch.ones(3))
assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == (chosen or os.path.abspath(default_cache_dir()))
from evalrun.cli import main
main(sys.argv[1:])
"""
    env = child_environment(tmp_path, drop=("ATEN_CPU_CAPABILITY",))
    prompts = str(write_prompts(ONE_PROMPT))
    command = [sys.executable, "-c", script, "run", "--model", "random:tiny", "--prompts", prompts,
               "--dtype", "bfloat16", "--max-new-tokens", "1", "-O1", "--json", "--quiet"]

    def run(environment: dict[str, str]) -> dict:
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    runs = [run(env), run(env)]
    cold, warm = (done["evidence"]["compile_cache"] for done in runs)
    assert cold["folder"].startswith(str(tmp_path / "cache" / "compile" / "torch-")), cold
    assert cold["folder"].endswith("/inductor") and warm["folder"] == cold["folder"], (cold, warm)
    assert cold["misses"] > 0 and cold["hits"] == 0
    assert warm["hits"] == cold["misses"] and warm["misses"] == 0
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":  # else no vector instruction set here to differ from it
        # while the machine's graphs are in evalrun's folder: a shared folder would hit them (and crash, as it did)
        default = run({**env, "ATEN_CPU_CAPABILITY": "default"})["evidence"]["compile_cache"]
        assert default["folder"].startswith(str(tmp_path / "cache" / "compile" / "torch-")), default
        assert default["folder"] != cold["folder"] and "-cpu-DEFAULT-cxx-" in default["folder"], (cold, default)
        assert default["folder"].endswith("/inductor") and default["misses"] > 0 and default["hits"] == 0, default
    chosen = tmp_path / "mine"
    shutil.move(cold["folder"], chosen)  # evalrun's graphs, now only there: hits can come from that folder alone
    runs.append(run({**env, "TORCHINDUCTOR_CACHE_DIR": str(chosen)}))
    named = runs[2]["evidence"]["compile_cache"]
    assert named["folder"] == str(chosen)
    assert named["hits"] == cold["misses"] and named["misses"] == 0, (cold, named)
    assert len({done["logits_digest"] for done in runs}) == 1


def test_the_compile_cache_folder_is_one_per_engine_code(tmp_path, monkeypatch):
    """Inductor keys a graph that calls one of evalrun's Triton ops by the op and its kernels' source, not by the
    Python launching them (blocks chosen there): another engine code compiles into another folder, never replaying
    graphs compiled by the code before it."""
    from evalrun import fingerprint
    from evalrun.compile_cache import cache_folder

    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path / "cache"))
    now = cache_folder()
    assert now.name.endswith(f"-engine-{fingerprint.engine_code_digest()[:12]}")
    assert now.parent == tmp_path / "cache" / "compile" and cache_folder() == now
    monkeypatch.setattr(fingerprint, "engine_code_digest", lambda: "0" * 32)
    assert cache_folder() != now and cache_folder().name.endswith("-engine-000000000000")


def test_the_compile_cache_folder_is_one_per_cpp_compiler(tmp_path, monkeypatch):
    """Inductor keys a CPU kernel's binary by its source and command line ("g++ ..."), not by the compiler's version:
    a g++ upgraded under the same name replayed the old g++'s binaries (the old bits) while the run's fingerprint named
    the new one. Another compiler version compiles into another folder."""
    from evalrun import fingerprint
    from evalrun.compile_cache import cache_folder

    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path / "cache"))
    now = cache_folder()
    monkeypatch.setattr(fingerprint, "cpp_compiler", lambda: "g++ (Debian 99.1.0-1) 99.1.0")
    assert cache_folder() != now and cache_folder().parent == now.parent


def test_a_cache_variable_naming_a_file_is_one_line_exit_2(tmp_path):
    """TORCHINDUCTOR_CACHE_DIR naming a file crashed the run as evalrun's own failure (FileExistsError while
    torch._dynamo was imported, exit 3, "please report it"): it is bad input, one line naming it, exit 2."""
    import subprocess
    import sys

    file = tmp_path / "not-a-folder"
    file.write_text("")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(file), EVALRUN_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "evalrun", "run", "--model", "random:tiny", "--prompts", "smoke",
                           "--max-new-tokens", "1", "--store", str(tmp_path / "s.db")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "TORCHINDUCTOR_CACHE_DIR" in done.stderr, done.stderr


def test_inductors_default_folders_are_no_choice_and_a_named_folder_is(tmp_path, monkeypatch):
    """Inductor writes its defaults into the environment (TORCHINDUCTOR_CACHE_DIR on first use, TRITON_CACHE_DIR as
    <that>/triton/<device> when it builds a Triton kernel on a GPU): evalrun replaces them with its folders; folders
    the user names stay."""
    from evalrun.compile_cache import cache_folder, inductor_default_folder, use_evalrun_cache

    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_default_folder())
    monkeypatch.setenv("TRITON_CACHE_DIR", os.path.join(inductor_default_folder(), "triton", "0"))
    assert use_evalrun_cache() == {"TORCHINDUCTOR_CACHE_DIR": str(cache_folder() / "inductor"),
                                   "TRITON_CACHE_DIR": str(cache_folder() / "triton")}
    mine = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton" / "0")}
    for variable, folder in mine.items():
        monkeypatch.setenv(variable, folder)
    assert use_evalrun_cache() == mine


@pytest.mark.parametrize("device,graphs", [("cpu", "none")] + [
    pytest.param("cuda", graphs, marks=pytest.mark.gpu) for graphs in ("none", "full", "full-and-piecewise")])
def test_the_kv_write_inside_the_piece_keeps_the_bits_and_runs_no_index_copy(device, graphs):
    """Compiled pieces write the cache in the pre-attention piece: the same
    logits and tokens as the separate index_copy (prefill and decode), as many Dynamo graphs, no recompile or
    fallback, and on CPU no eager cache write left in the run."""
    import torch

    from evalrun.config import CompilationMode, CUDAGraphMode
    from evalrun.engine.driver import generate_batch
    from evalrun.engine.generate import BatchSpec
    from evalrun.engine.modes import ExecutionMode, allow_recompiles_for
    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    loaded = load_model("random:tiny", device, "float32" if device == "cpu" else "bfloat16")
    prompts = [loaded.tokenizer("The cache is written where")["input_ids"], loaded.tokenizer("Keys")["input_ids"]]
    spec = BatchSpec(prompts, 10, pad_id=0, keep_logits=True)
    outputs, writes, graphs_compiled = [], [], []
    for in_piece in (False, True):
        torch._dynamo.reset()
        mode = ExecutionMode(Transformer(loaded.model), CompilationMode.PIECEWISE, CUDAGraphMode(graphs),
                             prefill_buckets=(16,), batch_buckets=(2,), kv_write_in_piece=in_piece)
        allow_recompiles_for(mode.prefill_buckets, mode.batch_buckets)
        generate_batch(mode.transformer, spec, mode)  # warm-up: compiles every piece
        mode.start_measuring()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
            outputs.append(generate_batch(mode.transformer, spec, mode))
        writes.append(sum(event.name == "aten::index_copy_" and len(event.input_shapes[0]) == 5  # a layer's cache
                          for event in profile.events()))  # run eagerly, not inside a compiled kernel
        evidence = mode.evidence()
        assert evidence["fallbacks"] == [] and evidence["recompiles_after_warmup"] == 0, evidence
        assert evidence["inductor_cudagraph_skips"] == 0, evidence
        graphs_compiled.append(evidence["dynamo_graphs"])
    assert outputs[0].tokens.tolist() == outputs[1].tokens.tolist()
    assert outputs[0].logits.tobytes() == outputs[1].logits.tobytes()
    assert graphs_compiled[0] == graphs_compiled[1]  # the writing piece replaces the plain one, shape for shape
    layers = len(loaded.model.model.layers)
    if device == "cpu":  # every forward (prefill and 9 decode steps) wrote each layer eagerly, then none did
        assert writes == [layers * 10, 0]


@pytest.mark.parametrize("graphs", ["none", "piecewise", "full", "full-decode-only", "full-and-piecewise"])
def test_the_writing_piece_goes_to_pieces_without_piecewise_graphs_which_wrap_exactly_the_graphed_steps(graphs):
    """The writing piece (the KV write inside the pre-attention piece) serves exactly the compiled pieces without
    piecewise graphs (every piece at full, the decode pieces of full-and-piecewise); piecewise graphs wrap the
    prefill's pieces (piecewise, full-and-piecewise) and the decode's (piecewise) and read the weights in place;
    the mode's own Transformer is left as it was."""
    from evalrun.config import CompilationMode, CUDAGraphMode
    from evalrun.engine.modes import ExecutionMode
    from evalrun.engine.piece_graphs import GraphedPiece, storages
    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    transformer = Transformer(load_model("random:tiny", "cpu", "float32").model)
    cudagraph_mode = CUDAGraphMode(graphs)
    mode = ExecutionMode(transformer, CompilationMode.PIECEWISE, cudagraph_mode)
    prefill, decode = mode.prefill_forward.__self__, mode.decode_forward.__self__
    prefill_graphed, decode_graphed = cudagraph_mode.has_piecewise_cudagraphs(), cudagraph_mode is CUDAGraphMode.PIECEWISE
    assert (prefill.pre_attention_writing is None) == prefill_graphed
    assert (decode.pre_attention_writing is None) == decode_graphed
    assert transformer.pre_attention_writing is None
    assert isinstance(prefill.pre_attention, GraphedPiece) == prefill_graphed
    assert isinstance(decode.head, GraphedPiece) == decode_graphed
    if mode.piece_graphs:
        weights = transformer.weights()
        layer = transformer.layers[0]
        assert any(w is layer.qkv for w in weights) and any(w is layer.gate_up for w in weights)
        assert storages(weights) <= mode.piece_graphs.stable
    off = ExecutionMode(transformer, CompilationMode.PIECEWISE, cudagraph_mode, kv_write_in_piece=False)
    assert off.prefill_forward.__self__.pre_attention_writing is None
    assert off.decode_forward.__self__.pre_attention_writing is None


def test_combo_kernels_is_an_inductor_knob_hashed_only_when_set(cli, tiny_args):
    """`combo_kernels` (Inductor launches a piece's independent kernels as one) reaches torch.compile's options, is
    in the config hash only when on (every stored hash stays), and a golden's reference turns it off."""
    from evalrun.config import EffectiveConfig, RunConfig, resolve
    from evalrun.engine.modes import build_execution_mode
    from evalrun.engine.transformer import Transformer
    from evalrun.golden import reference_config
    from evalrun.hashing import hash_value
    from evalrun.models import load_model

    plain = resolve(RunConfig(model="random:tiny", opt_level=2), cuda_available=False)
    combo = resolve(RunConfig(model="random:tiny", opt_level=2, combo_kernels=True), cuda_available=False)
    unset = {k: v for k, v in plain.factors().items()
             if k not in ("combo_kernels", "blas_library", "linear_kernel", "attention_kernel", "norm_kernel", "engine",
                          "tensor_parallel", "served_model", "server_config")}
    assert plain.combo_kernels is False and plain.compute_hash() == hash_value(unset)
    assert combo.compute_hash() != plain.compute_hash() and reference_config(combo).combo_kernels is False
    stored = {k: v for k, v in combo.as_dict().items() if k != "combo_kernels"}  # a config stored before the knob
    assert EffectiveConfig.from_dict(stored).combo_kernels is False
    mode = build_execution_mode(Transformer(load_model("random:tiny", "cpu", "float32").model), combo)
    assert mode.inductor_options["combo_kernels"] is True
    code, out, err = cli("run", *tiny_args, "-O2", "--set", "combo_kernels=true", "--json", "--quiet")
    assert code == 0, err
    run = json.loads(out)
    assert run["config"]["combo_kernels"] is True and run["evidence"]["fallbacks"] == []


def test_inductor_knobs_where_nothing_compiles_are_a_fallback_that_strict_refuses(cli, tiny_args):
    """`-O0 --set combo_kernels=true --set max_autotune=true` ran eagerly under those knobs' names and hash, its
    logits plain -O0's, and said nothing: now the run's fallbacks name the knobs, and --strict-config refuses the
    config before anything runs (exit 2, one line)."""
    knobs = ("-O0", "--set", "combo_kernels=true", "--set", "max_autotune=true")
    code, out, err = cli("run", *tiny_args, *knobs, "--json", "--quiet")
    assert code == 0, err
    run = json.loads(out)
    assert run["evidence"]["fallbacks"] == [
        "max_autotune=true, combo_kernels=true: compilation_mode=none compiles nothing, so these Inductor options "
        "changed nothing; pick a compiled mode (-O2) or drop them"]
    code, out, err = cli("run", *tiny_args, "-O0", "--json", "--quiet")
    plain = json.loads(out)
    assert plain["evidence"]["fallbacks"] == [] and plain["logits_digest"] == run["logits_digest"]
    one_line_exit_2(cli("run", *tiny_args, *knobs, "--strict-config"), "falls back (max_autotune=true, "
                    "combo_kernels=true: compilation_mode=none compiles nothing", "drop --strict-config")


@pytest.mark.gpu
def test_gpu_combo_kernels_launch_fewer_kernels_with_the_same_bits():
    """On the GPU Inductor's combo kernels merge a piece's independent kernels (the rotary of q and of k) into one
    launch: fewer kernels in a decode step, the same digests (on the H200 the 8B step too, decode_breakdown.py)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from evalrun.config import CompilationMode, CUDAGraphMode
    from evalrun.engine.driver import generate_batch
    from evalrun.engine.generate import BatchSpec
    from evalrun.engine.modes import ExecutionMode, allow_recompiles_for
    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    loaded = load_model("random:tiny", "cuda", "bfloat16")
    transformer = Transformer(loaded.model)
    spec = BatchSpec([loaded.tokenizer("Kernels side by side")["input_ids"]], 6, pad_id=0, keep_logits=True)
    outputs, kernels = [], []
    for combo in (False, True):
        torch._dynamo.reset()
        mode = ExecutionMode(transformer, CompilationMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE,
                             prefill_buckets=(16,), batch_buckets=(1,), inductor_options={"combo_kernels": combo})
        allow_recompiles_for(mode.prefill_buckets, mode.batch_buckets)
        for _ in range(mode.calls_to_warm):
            generate_batch(transformer, spec, mode)
        outputs.append(generate_batch(transformer, spec, mode))
        workspace = next(iter(mode.workspaces.values()))
        workspace.point_at(1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            mode.decode(workspace)
            torch.cuda.synchronize()
        kernels.append(sum(1 for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA))
        assert mode.evidence()["fallbacks"] == []
    assert kernels[1] < kernels[0], kernels
    assert outputs[0].digests.tolist() == outputs[1].digests.tolist()
    assert outputs[0].logits.tobytes() == outputs[1].logits.tobytes()
