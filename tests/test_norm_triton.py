"""The RMSNorm by one Triton kernel (`norm_kernel=triton`, engine/norm_triton.py, issue #16): a numerics knob in the
config hash, refused where it cannot run, reset by a golden's reference.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported, so in a child
process); on a GPU it runs compiled, also inside torch.compile and a CUDA graph.
"""

from __future__ import annotations


import pytest
import torch
from conftest import (count_calls, one_line_exit_2, residuals_seen, run_under_triton_interpreter,
                      tiny_gpu_run)

from evalrun.config import RunConfig, resolve

pytest.importorskip("triton")

# Llama's and Gemma's norms of rows of several lengths (a power of two, SmolLM2's 576, one below a warp, rows of a
# batch), each against float64 and against the engine's torch norm; computed twice.
INTERPRETED_CASES = r"""
import json
import torch
from evalrun.engine import norm_triton
from evalrun.engine.transformer import LLAMA_VARIANT, Variant, norm

g = torch.Generator().manual_seed(5)
cases = []
for dtype in (torch.float32, torch.bfloat16):
    for shape in ((1, 1, 4096), (3, 5, 576), (2, 100), (1, 1, 7)):
        x = (3 * torch.randn(*shape, generator=g)).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
        for offset in (False, True):
            fused = Variant(norm_offset=offset, norm_kernel="triton")
            y = norm(x, w, 1e-6, fused)
            torch_norm = norm(x, w, 1e-6, Variant(norm_offset=offset))
            wide = x.double()
            exact = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * ((1 + w.double()) if offset
                                                                                      else w.double())
            cases.append({"dtype": str(dtype), "shape": list(shape), "offset": offset, "out_shape": list(y.shape),
                          "out_dtype": str(y.dtype), "applies": norm_triton.applies(x, w),
                          "error": (y.double() - exact).abs().max().item(),
                          "torch_error": (torch_norm.double() - exact).abs().max().item(),
                          "scale": exact.abs().max().item(), "repeatable": torch.equal(y, norm(x, w, 1e-6, fused))})
x, w = torch.randn(2, 3, 64, generator=g), torch.randn(64, generator=g)
strided = x.transpose(0, 1)  # not contiguous: left to torch, the same bits as norm_kernel=aten
refused = {"strided": norm_triton.applies(strided, w), "other dtype": norm_triton.applies(x, w.double()),
           "other length": norm_triton.applies(x, w[:32]), "float64": norm_triton.applies(x.double(), w.double()),
           "too long": norm_triton.applies(torch.zeros(1, norm_triton.MAX_LENGTH + 1),
                                           torch.zeros(norm_triton.MAX_LENGTH + 1))}
falls_back = torch.equal(norm(strided, w, 1e-6, Variant(norm_kernel="triton")), norm(strided, w, 1e-6, LLAMA_VARIANT))
last = x[:, -1]  # [2, 64], rows 3 * 64 apart: a batch's last tokens before the head
spaced = {"applies": norm_triton.applies(last, w),
          "same_bits": torch.equal(norm_triton.rms_norm(last, w, 1e-6, False),
                                   norm_triton.rms_norm(last.contiguous(), w, 1e-6, False))}
print(json.dumps({"cases": cases, "refused": refused, "falls_back": falls_back, "spaced": spaced}))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(INTERPRETED_CASES)


def test_the_norm_kernel_computes_llamas_and_gemmas_norms_within_their_roundings(interpreted):
    """float32 within a few units in the last place of float64's norm (as close as torch's); bfloat16 within a few
    of the rounded output (Triton's interpreter rounds bfloat16 toward zero, so up to twice torch's error); the
    input's shape and dtype; repeatable."""
    cases = interpreted["cases"]
    assert len(cases) == 16 and all(c["applies"] and c["repeatable"] for c in cases)
    for case in cases:
        assert case["out_shape"] == case["shape"] and case["out_dtype"] == case["dtype"], case
        if case["dtype"] == "torch.float32":
            assert case["error"] <= case["scale"] * 4 * 2.0 ** -23, case
            assert case["error"] <= case["torch_error"] * 2 + 1e-7, case
        else:
            assert case["error"] <= case["scale"] * 3 * 2.0 ** -8, case


def test_what_the_norm_kernel_cannot_take_stays_with_torch(interpreted):
    assert interpreted["refused"] == {"strided": False, "other dtype": False, "other length": False,
                                      "float64": False, "too long": False}
    assert interpreted["falls_back"]
    assert interpreted["spaced"] == {"applies": True, "same_bits": True}  # rows evenly spaced: taken, read in place


def test_the_per_head_query_and_key_norms_stay_with_torch(monkeypatch):
    """Qwen3's and Gemma 3's norms of each query and key head (fused by Inductor with the rotary after them) are
    torch's under norm_kernel=triton, even where the heads are contiguous (one token); the input norm is the
    kernel's."""
    from evalrun.engine import norm_triton, transformer

    monkeypatch.setattr(norm_triton, "INTERPRETED", True)  # CPU tensors count as a device it runs on
    taken = []

    def recorded(x, weight, eps, offset):
        taken.append(tuple(x.shape))
        return transformer.torch_norm(x, weight, eps, transformer.Variant(norm_offset=offset))

    monkeypatch.setattr(norm_triton, "rms_norm", recorded)
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, hidden = 4, 2, 8, 32
    x = torch.randn(1, 1, hidden, generator=g)
    wqkv = torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=g)
    cos, sin = torch.ones(1, 1, 1, dim), torch.zeros(1, 1, 1, dim)
    fused = transformer.Variant(norm_kernel="triton")
    q, kv = transformer.pre_attention(x, cos, sin, torch.ones(hidden), wqkv, heads, kv_heads, dim, 1e-6,
                                      q_norm=torch.ones(dim), k_norm=torch.ones(dim), variant=fused)
    assert taken == [(1, 1, hidden)]
    plain = transformer.pre_attention(x, cos, sin, torch.ones(hidden), wqkv, heads, kv_heads, dim, 1e-6,
                                      q_norm=torch.ones(dim), k_norm=torch.ones(dim))
    assert torch.equal(q, plain[0]) and torch.equal(kv, plain[1])


def test_the_knob_at_its_default_leaves_the_hash_and_the_reference_alone():
    from evalrun.golden import reference_config

    plain = resolve(RunConfig(model="random:tiny", device="cuda"), cuda_available=True)
    fused = resolve(RunConfig(model="random:tiny", device="cuda", norm_kernel="triton"), True)
    assert plain.norm_kernel == "aten" and fused.compute_hash() != plain.compute_hash()
    assert plain.compute_hash() == resolve(RunConfig(model="random:tiny", device="cuda", norm_kernel="aten"),
                                           True).compute_hash()
    assert reference_config(fused).norm_kernel == "aten"


@pytest.mark.parametrize("sets, engine, message", [
    ("norm_kernel=triton", "evalrun", "norm_kernel=triton is a CUDA kernel; on CPU use norm_kernel=aten"),
    ("norm_kernel=triton", "transformers", "replaces evalrun's own norms; use --engine evalrun"),
    ("norm_kernel=apex", "evalrun", "norm_kernel='apex' is not valid; use one of: aten, triton"),
])
def test_the_knob_where_it_cannot_run_is_one_line_and_exit_2(cli, tiny_args, monkeypatch, sets, engine, message):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    one_line_exit_2(cli("run", *tiny_args, "--device", "cpu", "--engine", engine, "--set", sets), message)


def test_the_kernel_asked_for_where_it_was_never_prepared_is_refused_not_run_as_torch(monkeypatch):
    from evalrun.engine import norm_triton
    from evalrun.errors import ConfigError

    monkeypatch.setattr(norm_triton, "INTERPRETED", False)
    monkeypatch.setattr(norm_triton, "_OP", {})
    with pytest.raises(ConfigError, match="norm_kernel=triton needs a CUDA device with Triton; use norm_kernel=aten"):
        norm_triton.rms_norm(torch.randn(1, 8), torch.ones(8), 1e-6, False)


def test_under_the_norm_kernel_the_attention_residual_is_added_by_the_output_projection(monkeypatch):
    """norm_kernel=triton makes the norm after the attention's residual add a kernel of its own, so output_projection
    hands x to the o projection as its residual (the GEMV's epilogue adds it; eagerly the bits of x + the product),
    unless the output is normed first (Gemma) or summed over ranks; without the knob it adds x itself."""
    import torch.nn.functional as F

    from evalrun.engine import transformer

    g = torch.Generator().manual_seed(2)
    x, attended = torch.randn(1, 1, 16, generator=g), torch.randn(1, 2, 1, 8, generator=g)
    wo, out_norm = torch.randn(16, 16, generator=g), torch.rand(16, generator=g) + 0.5
    fused, plain = transformer.Variant(norm_kernel="triton"), transformer.Variant()
    seen = residuals_seen(monkeypatch)
    added = transformer.output_projection(x, attended, wo, variant=fused)
    transformer.output_projection(x, attended, wo, out_norm=out_norm, eps=1e-5, variant=fused)
    transformer.output_projection(x, attended, wo, variant=fused, reduce=lambda t: t)
    transformer.output_projection(x, attended, wo, variant=plain)
    assert seen == [True, False, False, False]
    assert torch.equal(added, x + F.linear(attended.transpose(1, 2).reshape(1, 1, 16), wo))


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("shape,offset", [((1, 1, 4096), False), ((4, 1, 4096), False), ((1, 7, 576), False),
                                          ((2, 1, 2304), True)])
def test_gpu_norm_kernel_eager_compiled_and_graphed_agree_bitwise(shape, offset):
    """Llama-3-8B's, SmolLM2's and Gemma 2's rows in bfloat16: within the output rounding of float64's norm, the
    same bits eagerly, under torch.compile and replayed from a CUDA graph."""
    from evalrun.engine import norm_triton
    from evalrun.engine.transformer import Variant, norm

    norm_triton.prepare("triton", "cuda")
    variant = Variant(norm_offset=offset, norm_kernel="triton")
    x = 3 * torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(torch.bfloat16)
    assert norm_triton.applies(x, w)

    def normed(a):
        return norm(a, w, 1e-6, variant)

    y = normed(x)
    wide = x.double()
    exact = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * ((1 + w.double()) if offset else w.double())
    assert y.shape == x.shape and (y.double() - exact).abs().max().item() <= exact.abs().max().item() * 2 * 2 ** -8
    assert torch.equal(torch.compile(normed, fullgraph=True)(x), y)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    normed(static)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = normed(static)
    static.copy_(x.flip(-1))
    graph.replay()
    assert torch.equal(out, normed(x.flip(-1)))


@gpu
@needs_cuda
@pytest.mark.parametrize("level", [0, 2])
def test_gpu_runs_with_the_norm_kernel_take_it_for_every_norm_and_repeat_their_bits(level, monkeypatch):
    """-O0 and -O2 runs with norm_kernel=triton: the kernel computes the engine's norms (counted where the engine
    calls it, eagerly or while Dynamo traces: none without the knob), and each run repeats its digests. (Not -O3: the
    counting wrapper's list is state Dynamo guards on, so each run recompiles, and under -O3 a recompile inside the
    CUDA graph's capture tunes its kernels there, which CUDA refuses; the next test runs -O3 without it.)"""
    from evalrun.engine import norm_triton

    def run(**knobs):
        return tiny_gpu_run(level, **knobs)[0]

    from evalrun.engine import transformer

    norm_triton.prepare("triton", "cuda")
    calls = count_calls(monkeypatch, norm_triton._OP, "op")
    torch_norms, torch_norm = [], transformer.rms_norm

    def counted_torch_norm(*args):
        torch_norms.append(1)
        return torch_norm(*args)

    monkeypatch.setattr(transformer, "rms_norm", counted_torch_norm)
    run()
    assert not calls and torch_norms
    plain_norms, torch_norms[:] = len(torch_norms), []
    fused = run(norm_kernel="triton")
    assert calls
    if level == 0:  # eagerly each norm is a call: every one torch computed without the knob, by the kernel
        assert len(calls) == plain_norms and not torch_norms
    assert run(norm_kernel="triton") == fused


@gpu
@needs_cuda
def test_gpu_an_o3_run_with_the_norm_kernel_repeats_its_bits_and_records_the_knob():
    """-O3 (Inductor's max-autotune and coordinate descent, which tune Inductor's own norms by timing; the knob's
    kernel is launched as it is) with norm_kernel=triton and the GEMVs (so o's GEMV adds the attention's residual):
    two runs, the same digests, the knobs in the config."""
    first, run = tiny_gpu_run(3, norm_kernel="triton", linear_kernel="triton-gemv-glu")
    second, _ = tiny_gpu_run(3, norm_kernel="triton", linear_kernel="triton-gemv-glu")
    config = run.header["config"]
    assert config["norm_kernel"] == "triton" and config["max_autotune"] and config["coordinate_descent_tuning"]
    assert first == second
