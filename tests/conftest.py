"""Shared fixtures: a temporary store, an in-process CLI runner, a tiny loaded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evalrun.cli import main


def pytest_configure(config):
    share_cores_between_workers(os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
    trust_the_cpus_vector_instruction_sets()


def trust_the_cpus_vector_instruction_sets() -> None:
    """Tell Inductor that the vector instruction sets the CPU reports build here (TORCHINDUCTOR_VEC_ISA_OK=1), in
    the workers and the processes they start. Without it each process whose Inductor folder is new (each test has a
    cache folder of its own) first compiles and loads a probe program per instruction set: ten g++ builds and ten
    Python processes, about 20 s of a 2-core machine, before its first kernel. The per-instruction-set cache test
    took 192 s with them and 136 s without. It decides only whether Inductor vectorizes at all, which every
    compiled kernel of the suite then checks by building; it is in no cache key of evalrun's nor in a run's
    environment fingerprint (not a numerics variable). A value the caller set is kept."""
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    import torch._inductor.config as inductor_config  # read its environment when first imported, maybe before

    inductor_config.cpp.vec_isa_ok = {"1": True, "0": False}.get(os.environ["TORCHINDUCTOR_VEC_ISA_OK"])


def share_cores_between_workers(worker_count: str | None) -> int | None:
    """Under pytest-xdist, give each worker its share of the cores (and the processes it starts, which
    inherit OMP_NUM_THREADS). Two workers each running OpenMP on both cores of a 2-core machine spin against
    each other: SmolLM2's eager decode took 2.5x longer so (13.4 s against 5.3 s, both workers busy). The
    thread count is part of a run's environment fingerprint; a worker and the processes it starts run with
    the same count (tests that set their own, like the torchrun ones, excepted). A thread count the caller
    set (OMP_NUM_THREADS) is kept.

    Inductor's compile threads get the same share (TORCHINDUCTOR_COMPILE_THREADS, a count the caller set
    kept; Inductor leaves it out of its cache keys, and it changes nothing compiled): with a share of one a
    process compiles in itself rather than starting a pool of compile processes beside each worker (four tests
    that compile cold took 160-189 s against 198-208 s on two cores); a share of two or more is a pool that
    size."""
    workers = int(worker_count or 1)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return None
    threads = max(1, len(os.sched_getaffinity(0)) // workers)  # the cores this process may run on
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    import torch._inductor.config as inductor_config  # read its environment when first imported, maybe before

    inductor_config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    return threads


def pytest_collection_modifyitems(config, items):
    servers = pytest.mark.skip(reason="starts llama.cpp's server: run `make test-servers` (pytest -m servers)")
    if "servers" not in (config.getoption("-m") or ""):
        for item in items:
            if "servers" in item.keywords:
                item.add_marker(servers)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_under_triton_interpreter(source: str):
    """Run `source` in a child process under Triton's interpreter (TRITON_INTERPRET=1 must be set before
    Triton is imported) and return the JSON it prints: Triton kernels tested on the CPU. The child first gives
    the interpreter numpy's xor reduction (interpreter_reductions.py: the same bits, 3x faster tl.topk)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    prelude = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
               "import interpreter_reductions; interpreter_reductions.install(); del sys.path[0]\n")
    done = subprocess.run([sys.executable, "-c", prelude + source], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store" / "evalrun.db"


@pytest.fixture
def cli(capsys):
    """cli("run", "--json", ...) -> (exit code, stdout, stderr), run in-process through main()."""

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            main(list(args))
        except SystemExit as exit:
            code = exit.code or 0
        else:
            code = 0
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return invoke


@pytest.fixture
def tiny_args(store_path) -> list[str]:
    """Run options for a fast run: random:tiny, smoke prompts, 6 tokens, a temporary store."""
    return ["--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "6", "--store", str(store_path)]


@pytest.fixture
def write_prompts(tmp_path: Path):
    def write(records: list[dict] | str, name: str = "prompts.jsonl") -> Path:
        path = tmp_path / name
        text = records if isinstance(records, str) else "\n".join(json.dumps(r) for r in records) + "\n"
        path.write_text(text)
        return path

    return write


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """random:tiny saved as a Hugging Face directory (weights, config, tokenizer)."""
    from evalrun.models import load_model

    loaded = load_model("random:tiny", "cpu", "float32")
    directory = tmp_path_factory.mktemp("tiny-hf")
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)
    return directory


def tiny_gpu_run(level: int, dtype: str = "bfloat16", **knobs):
    """An -O`level` run of random:tiny on CUDA (smoke prompts, 8 tokens), Dynamo reset after it: (each prompt's logits
    digest, the run)."""
    from evalrun.config import RunConfig
    from evalrun.runner import execute_run

    done = execute_run(RunConfig(model="random:tiny", device="cuda", dtype=dtype, prompts="smoke", max_new_tokens=8,
                                 opt_level=level, **knobs), None)
    torch._dynamo.reset()
    return [r.logits_digest for r in done.results], done


def residuals_seen(monkeypatch) -> list:
    """From here on, transformer.py's projections.linear records whether each call was handed a residual (its GEMV's
    epilogue adds it) in the list returned, then computes as before."""
    from evalrun.engine import transformer

    seen, original = [], transformer.projections.linear

    def spy(*args, **kwargs):
        seen.append(kwargs.get("residual") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformer.projections, "linear", spy)
    return seen


def count_calls(monkeypatch, ops: dict, name: str) -> list:
    """Replace the registered op ops[name] (a kernel module's _OP) by one that records each call, eager or while Dynamo
    traces, in the list returned."""
    calls, original = [], ops[name]

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setitem(ops, name, counted)
    return calls


def one_line_exit_2(result, *needles):
    """A CLI result (code, out, err) that is exit 2 with one stderr line holding every needle."""
    code, out, err = result
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def copy_model_dir(source: Path, target: Path, edit=None) -> Path:
    """Copy a HF directory; `edit(state_dict)` may change weights before saving."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if edit is not None:
        weights = target / "model.safetensors"
        state = load_file(weights)
        edit(state)
        save_file(state, weights, metadata={"format": "pt"})
    return target


@pytest.fixture(scope="session")
def golden_factory(tmp_path_factory):
    """make(*options, model=..., prompts=..., tokens=...) -> a folder holding golden `g`, made once per
    distinct call in this test session through the CLI. Tests that alter a golden copy it first."""
    made: dict[tuple, Path] = {}

    def make(*options: str, model: str = "random:tiny", prompts: str = "smoke", tokens: int = 6) -> Path:
        key = (model, prompts, tokens, options)
        if key not in made:
            directory = tmp_path_factory.mktemp("golden")
            with pytest.raises(SystemExit) as exit:
                main(["golden", "create", "g", "--model", model, "--prompts", prompts, "--max-new-tokens",
                      str(tokens), *options, "--dir", str(directory), "--quiet"])
            assert exit.value.code == 0
            made[key] = directory
        return made[key]

    return make


@pytest.fixture
def verify(cli):
    """verify(directory, *options) -> (exit code, verdict dict or None, stderr) of `golden verify g`."""

    def run(directory: Path, *options: str, name: str = "g") -> tuple[int, dict | None, str]:
        code, out, err = cli("golden", "verify", name, "--dir", str(directory), "--quiet", "--format", "json", *options)
        printed = json.loads(out) if out.strip().startswith("{") else None
        if printed is not None and "verdict" not in printed:  # an error before any verdict: its JSON object
            assert printed == {"error": err.strip(), "exit_code": code}, (printed, err)
            printed = None
        return code, printed, err

    return run
