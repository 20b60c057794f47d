"""GPU tests: marked `gpu`, skipped without CUDA (see conftest)."""

import json
import os

import numpy as np
import pytest
import torch

from evalrun.engine.capture import logits_digest
from evalrun.engine.driver import generate_batch
from evalrun.engine.generate import BatchSpec
from evalrun.engine.transformer import Transformer
from evalrun.models import load_model, seeded_uniform

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_digest_equals_cpu_digest_for_the_same_bytes(dtype):
    logits = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(logits_digest(logits.cuda()).cpu(), logits_digest(logits))


def test_seeded_weights_are_equal_on_cpu_and_cuda():
    assert torch.equal(seeded_uniform((257, 33), 7, 0.5, "cuda").cpu(), seeded_uniform((257, 33), 7, 0.5, "cpu"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_eager_runs_on_cuda_are_bit_identical(dtype):
    loaded = load_model("random:tiny", "cuda", dtype)
    model = Transformer(loaded.model)
    prompts = [loaded.tokenizer(text)["input_ids"] for text in ("A longer prompt on a GPU", "Hi")]
    first, second = (generate_batch(model, BatchSpec(prompts, 16, pad_id=0)) for _ in range(2))
    assert np.array_equal(first.digests, second.digests) and np.array_equal(first.tokens, second.tokens)


def test_padded_batch_gives_the_unbatched_tokens_on_cuda():
    loaded = load_model("random:tiny", "cuda", "float32")
    model = Transformer(loaded.model)
    prompts = [loaded.tokenizer(text)["input_ids"] for text in ("Rivers and towns and ledgers", "Hi", "1 2 3")]
    batched = generate_batch(model, BatchSpec(prompts, 10, pad_id=0))
    for row, ids in enumerate(prompts):
        assert batched.tokens[row].tolist() == generate_batch(model, BatchSpec([ids], 10, pad_id=0)).tokens[0].tolist()


def test_cli_run_on_cuda_twice_is_identical(cli, tiny_args):
    first = json.loads(cli("run", *tiny_args, "--device", "cuda", "-O0", "--json", "--quiet")[1])
    second = json.loads(cli("run", *tiny_args, "--device", "cuda", "-O0", "--json", "--quiet")[1])
    assert first["config"]["device"] == "cuda" and first["config"]["dtype"] == "bfloat16"
    assert first["logits_digest"] == second["logits_digest"]
    assert first["timings"]["peak_memory"]["kind"] == "cuda_max_allocated"


@pytest.mark.parametrize("graphs", ["none", "full", "full-and-piecewise"])
def test_batches_overlapped_on_cuda_give_the_bits_of_one_batch_at_a_time(graphs, monkeypatch):
    """The runner enqueues batch i + 1 into the same workspace (-O2: one static workspace per shape; its inputs
    copied from pinned memory) before it copies out batch i's arrays from pinned memory: the stream orders it, so each
    prompt's tokens, digests and kept logits are those of one batch at a time, for compiled steps run as they are,
    replayed from whole CUDA graphs and from piecewise ones."""
    from evalrun import runner
    from evalrun.config import build_config

    flags = {"model": "random:tiny", "device": "cuda", "dtype": "bfloat16", "prompts": "smoke", "max_new_tokens": 24,
             "keep_logits": "all", "opt_level": 2, "cudagraph_mode": graphs}
    prepared = runner.prepare(build_config(flags=flags))
    assert prepared.execution_mode().static
    runs = []
    for overlap in (False, True, True):
        monkeypatch.setattr(runner, "OVERLAP_BATCHES", overlap)
        runs.append(runner.execute(prepared))
    assert len(runs[0].plan) == 3
    for run in runs[1:]:
        for alone, overlapped in zip(runs[0].results, run.results):
            assert (alone.prompt_id, alone.tokens_digest, alone.logits_digest) == \
                (overlapped.prompt_id, overlapped.tokens_digest, overlapped.logits_digest)
            assert alone.arrays["logits"].tobytes() == overlapped.arrays["logits"].tobytes()
        assert 0.0 <= run.timings["outside_steps_s"] < run.timings["generate_s"]


def test_a_one_token_run_on_cuda_counts_no_decode_launches(cli, tiny_args):
    """-O2 on CUDA with --max-new-tokens 1: no workspace holds a decode step, so the launch count (one profiled decode
    step after warm-up) is not taken; taking it would write step 1 past the one-step capture buffers."""
    code, out, err = cli("run", *tiny_args[:-4], "--max-new-tokens", "1", *tiny_args[-2:], "--device", "cuda", "-O2",
                         "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert all(len(r["tokens"]) == 1 for r in data["results"])
    assert data["evidence"]["kernel_launches_per_decode_step"] is None


COMBINATIONS = [(c, g) for c in ("none", "stock", "trace-once", "piecewise")
                for g in ("none", "piecewise", "full", "full-decode-only", "full-and-piecewise")
                if c == "piecewise" or g not in ("piecewise", "full-and-piecewise")]


# The issue asks for random:smollm2 in bf16 on the H200: EVALRUN_GPU_MODEL=random:smollm2 (needs the GGUF).
GPU_MODEL = os.environ.get("EVALRUN_GPU_MODEL", "random:tiny")


@pytest.mark.parametrize("compilation,graphs", COMBINATIONS)
def test_every_mode_combination_repeats_bit_for_bit_on_cuda(cli, tiny_args, compilation, graphs):
    options = ["--device", "cuda", "--dtype", "bfloat16", "--compilation-mode", compilation, "--cudagraph-mode", graphs,
               "--json", "--quiet", "--model", GPU_MODEL, "--max-new-tokens", "16"]
    runs = []
    for _ in range(2):
        code, out, err = cli("run", *tiny_args, *options)
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[0]["logits_digest"] == runs[1]["logits_digest"]
    evidence = runs[0]["evidence"]
    assert evidence["fallbacks"] == [], evidence["fallbacks"]
    if graphs in ("full", "full-decode-only", "full-and-piecewise"):
        assert evidence["cudagraph_replays"] > 0
    assert evidence["kernel_launches_per_decode_step"] is not None
    timings = runs[0]["timings"]
    print(json.dumps({"model": GPU_MODEL, "compilation": compilation, "graphs": graphs,
                      "digest": runs[0]["logits_digest"][:12], "tokens_per_s": round(timings["tokens_per_s"], 1),
                      "ttft_ms": round(timings["ttft_ms"]["p50"], 2), "step_p50_ms": round(timings["step_latency"]["p50_ms"], 3),
                      "launches_per_step": evidence["kernel_launches_per_decode_step"],
                      "captures": evidence["cudagraph_captures_warmup"], "replays": evidence["cudagraph_replays"]}))


def test_a_cuda_golden_at_o2_verifies_every_level_and_catches_a_planted_change(golden_factory, verify):
    """Probed and forced runs inside CUDA graphs; the float32 function check on the GPU."""
    from evalrun.engine.faults import Fault, fault_hook
    from evalrun.golden import open_golden
    from evalrun.verify import candidate_config, verify_golden

    directory = golden_factory("--device", "cuda", "--dtype", "bfloat16", "-O2")
    for level in ("-O0", "-O1", "-O2", "-O3"):
        code, verdict, err = verify(directory, level)
        assert code == 0 and verdict["verdict"] in ("identical", "drift"), (level, err, verdict and verdict["causes"])
    golden = open_golden("g", directory)
    changed = verify_golden(golden, candidate_config(golden, None, {}, ()), hook=fault_hook(Fault("scale", 0.01)),
                            function_check="statistical")
    assert changed.verdict == "changed" and any("function check failed" in c for c in changed.causes)
