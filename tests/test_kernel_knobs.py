"""The Triton kernel knobs end to end on the CPU (issue #16): `linear_kernel` (engine/linear.py),
`attention_kernel` (engine/attention_triton.py) and `norm_kernel` (engine/norm_triton.py) each reach the engine
under Triton's interpreter (other logits bits, the same greedy tokens on the tiny model) and the config hash names
them; a golden made with one verifies without it as drift, and a verify that keeps it where it cannot run is
refused, not run on torch while recorded as the kernel.

The interpreter must be chosen before Triton is imported, so the runs go in one child process (TRITON_INTERPRET=1),
each through the CLI as a user runs it: every knob in one batch of three (the kernels' three-row paths, and a third
of the interpreted launches), and the split-KV kernel at batch 1 too (its one-row decode). One process for every
knob, not one per run: each start imports torch and transformers (7 s on a 2-core machine), and every knob's test
compared against the same plain run."""

from __future__ import annotations

import json
import os

import pytest
from conftest import run_under_triton_interpreter

pytest.importorskip("triton")

RUN = ["run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4", "--dtype", "float32", "--json",
       "--quiet"]
KNOBS = {
    "plain": [],
    "gemv": ["linear_kernel=triton-gemv"],
    "gemv-glu": ["linear_kernel=triton-gemv-glu"],
    "split-kv": ["attention_kernel=triton-split-kv"],
    "norm": ["norm_kernel=triton"],
    # o's GEMV then adds the attention's residual in its epilogue (the norm after it is a kernel of its own)
    "gemv+norm": ["linear_kernel=triton-gemv", "norm_kernel=triton"],
}
ONE_ROW = {"plain, one row": [], "split-kv, one row": ["attention_kernel=triton-split-kv"]}  # batch 1: its decode path
RUNS = {**{name: (sets, 3) for name, sets in KNOBS.items()}, **{name: (sets, 1) for name, sets in ONE_ROW.items()}}
# Runs each knob set through evalrun's CLI in this one interpreted process and prints {name: the run's --json}.
RUNS_IN_ONE_PROCESS = r"""
import contextlib, io, json, os, sys
os.environ["EVALRUN_CACHE"] = {cache!r}
from evalrun.cli import main

runs = {{}}
for name, (sets, batch) in {runs!r}.items():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            knobs = [arg for knob in sets for arg in ("--set", knob)]
            main({run!r} + ["--batch-size", str(batch), "--store", {store!r}] + knobs)
        except SystemExit as exit:
            assert not exit.code, (name, exit.code, out.getvalue()[-2000:])
    runs[name] = json.loads(out.getvalue())
print(json.dumps(runs))
"""


@pytest.fixture(scope="module")
def interpreted_runs(tmp_path_factory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("interpreted")
    return run_under_triton_interpreter(RUNS_IN_ONE_PROCESS.format(
        cache=str(folder / "cache"), runs=RUNS, run=RUN, store=str(folder / "s.db")))


def tokens(run: dict) -> list[list[int]]:
    return [result["tokens"] for result in run["results"]]


def test_each_knob_computes_other_bits_under_another_hash_and_the_same_tokens(interpreted_runs):
    runs = {name: interpreted_runs[name] for name in KNOBS}  # all in one batch of three
    plain = runs["plain"]
    assert [len(t) for t in tokens(plain)] == [4, 4, 4]
    assert (plain["config"]["linear_kernel"], plain["config"]["attention_kernel"], plain["config"]["norm_kernel"]) == (
        "aten", "sdpa", "aten")
    assert runs["gemv"]["config"]["linear_kernel"] == "triton-gemv"
    assert runs["gemv-glu"]["config"]["linear_kernel"] == "triton-gemv-glu"  # the MLP's activation in the GEMV too
    assert runs["split-kv"]["config"]["attention_kernel"] == "triton-split-kv"
    assert runs["norm"]["config"]["norm_kernel"] == "triton"
    both = runs["gemv+norm"]["config"]
    assert (both["linear_kernel"], both["norm_kernel"]) == ("triton-gemv", "triton")
    assert len({run["config_hash"] for run in runs.values()}) == len(KNOBS)
    assert len({run["logits_digest"] for run in runs.values()}) == len(KNOBS)
    for name, run in runs.items():
        assert tokens(run) == tokens(plain), name


def test_the_split_kv_kernel_at_batch_one_computes_other_bits_and_the_same_tokens(interpreted_runs):
    plain, split = interpreted_runs["plain, one row"], interpreted_runs["split-kv, one row"]
    assert plain["config"]["batch_size"] == split["config"]["batch_size"] == 1
    assert split["config"]["attention_kernel"] == "triton-split-kv" and split["config_hash"] != plain["config_hash"]
    assert split["logits_digest"] != plain["logits_digest"]
    assert tokens(split) == tokens(plain) and [len(t) for t in tokens(plain)] == [4, 4, 4]


def test_a_golden_made_with_the_gemv_verifies_without_it_as_drift_not_changed(tmp_path, cli, monkeypatch):
    """The golden's reference, float64 oracle and function check run with the decode levers at their defaults
    (they are execution knobs, like Inductor's), so a verify without the GEMV is drift; and a verify that keeps
    the golden's GEMV where it cannot run is refused, not run on cuBLAS while recorded as the GEMV. The golden is
    made under the interpreter (a child process); the verifies run here, where Triton is not interpreted."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    directory = str(tmp_path / "golden")
    made = run_under_triton_interpreter(f"""
import contextlib, io, json, os
os.environ["EVALRUN_CACHE"] = {str(tmp_path / "cache")!r}
from evalrun.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(["golden", "create", "g", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4",
              "--batch-size", "3", "--set", "linear_kernel=triton-gemv", "--dir", {directory!r}, "--quiet", "--json"])
    except SystemExit as exit:
        assert not exit.code, exit.code
print(out.getvalue())
""")
    assert made["name"] == "g" and made["device"] == "cpu", made  # the GEMV it holds: the refused verify below
    code, out, err = cli("golden", "verify", "g", "--set", "linear_kernel=aten", "--dir", directory, "--quiet",
                         "--json")
    assert code == 0, out[-2000:] + err[-2000:]
    verdict = json.loads(out)
    assert verdict["verdict"] == "drift" and any(c["key"] == "linear_kernel" for c in verdict["config_diff"])
    code, out, err = cli("golden", "verify", "g", "--dir", directory, "--quiet")
    assert code == 2 and "linear_kernel=triton-gemv is a CUDA kernel" in err
    assert len(err.strip().splitlines()) == 1
    assert os.path.isdir(directory)  # a refusal loses nothing
