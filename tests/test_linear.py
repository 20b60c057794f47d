"""The decode-speed levers (issue #16): the Triton GEMV (`linear_kernel=triton-gemv`) and the preferred BLAS
library (`blas_library`), each a numerics knob in the config hash, refused where it cannot run.

On CPU the GEMV runs under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported, so in
a child process); on a GPU it runs compiled, also inside torch.compile and a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import re
import sqlite3

import pytest
import torch
from conftest import (count_calls, one_line_exit_2, residuals_seen, run_under_triton_interpreter,
                      tiny_gpu_run)

from evalrun.bench import BenchRequest
from evalrun.config import RunConfig, resolve
from evalrun.errors import ConfigError
from evalrun.hashing import hash_value

# Products the GEMV computes (rows 1-4, with and without bias, sizes no multiple of the blocks, a strided
# input) and one it leaves to F.linear (5 rows); each against float64, and each computed twice.
INTERPRETED_CASES = r"""
import json
import torch
import torch.nn.functional as F
from evalrun.engine import linear

g = torch.Generator().manual_seed(3)
cases = []
for dtype in (torch.float32, torch.bfloat16):
    for rows, n, k, bias in ((1, 48, 256, False), (2, 40, 300, True), (3, 64, 512, True), (4, 24, 96, False),
                             (5, 48, 256, True)):
        x = torch.randn(rows, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        y = linear.linear(x, w, b, "triton-gemv")
        again = linear.linear(x, w, b, "triton-gemv")
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        cases.append({"dtype": str(dtype), "rows": rows, "n": n, "k": k, "shape": list(y.shape),
                      "out_dtype": str(y.dtype), "applies": linear.gemv_applies(x, w),
                      "error": (y.double() - exact).abs().max().item(), "scale": exact.abs().max().item(),
                      "repeatable": torch.equal(y, again), "aten_bits": torch.equal(y, F.linear(x, w, b))})
x3 = torch.randn(2, 3, 256, generator=g)[:, -1:, :]  # [2, 1, K], rows 3*256 apart
w3 = torch.randn(32, 256, generator=g)
strided = linear.linear(x3, w3, None, "triton-gemv")
cases.append({"dtype": "strided", "rows": 2, "shape": list(strided.shape), "applies": True, "repeatable": True,
              "error": (strided.double() - F.linear(x3.double(), w3.double())).abs().max().item(),
              "scale": 16.0, "out_dtype": str(strided.dtype), "aten_bits": False})
wb, xb = torch.randn(32, 256, generator=g), torch.randn(1, 256, generator=g)
bias_every_other = torch.randn(64, generator=g)[::2]  # not contiguous: the GEMV leaves it to F.linear
cases.append({"dtype": "strided-bias", "rows": 1, "shape": [1, 32], "repeatable": True, "error": 0.0, "scale": 1.0,
              "out_dtype": "strided-bias", "applies": linear.gemv_applies(xb, wb, bias_every_other),
              "aten_bits": torch.equal(linear.linear(xb, wb, bias_every_other, "triton-gemv"),
                                       F.linear(xb, wb, bias_every_other))})
glu = []  # linear_kernel=triton-gemv-glu: silu(gate) * up of a stacked gate/up weight [2I, K] in one GEMV
for dtype in (torch.float32, torch.bfloat16):
    for rows, n, k, bias in ((1, 48, 256, False), (2, 40, 300, True), (3, 64, 512, True), (4, 24, 96, False),
                             (1, 37, 200, True)):  # I = 37: the last block of outputs part outside
        x = torch.randn(rows, 1, k, generator=g).to(dtype)
        w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(dtype)
        b = torch.randn(2 * n, generator=g).to(dtype) if bias else None
        y = linear.gated_linear(x, w, b)
        gate, up = F.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, -1)
        exact = F.silu(gate) * up
        glu.append({"dtype": str(dtype), "rows": rows, "shape": list(y.shape), "out_dtype": str(y.dtype),
                    "applies": linear.glu_applies(x, w, b, "silu", "triton-gemv-glu"),
                    "error": (y.double() - exact).abs().max().item(), "scale": exact.abs().max().item(),
                    "repeatable": torch.equal(y, linear.gated_linear(x, w, b))})
from evalrun.engine.transformer import gated

wide = torch.randn(2 * 37, 208, generator=g)  # a weight whose rows lie 208 elements apart, 200 of them used
x1, b1 = torch.randn(1, 200, generator=g), torch.randn(2 * 37, generator=g)
padded = torch.equal(linear.gated_linear(x1, wide[:, :200], b1), linear.gated_linear(x1, wide[:, :200].contiguous(), b1))
x5 = torch.randn(5, 200, generator=g)
falls_back = {  # where the gate/up GEMV does not apply, gated() computes what triton-gemv computes
    "gelu": torch.equal(gated(x1, wide[:, :200], b1, "gelu", "triton-gemv-glu"),
                        gated(x1, wide[:, :200], b1, "gelu", "triton-gemv")),
    "five rows": torch.equal(gated(x5, wide[:, :200], b1, "silu", "triton-gemv-glu"),
                             gated(x5, wide[:, :200], b1, "silu", "triton-gemv")),
    "one row": torch.equal(gated(x1, wide[:, :200], b1, "silu", "triton-gemv-glu"),
                           linear.gated_linear(x1, wide[:, :200], b1))}
x, w = torch.randn(1, 64), torch.randn(32, 64)
refused = {"gelu": linear.glu_applies(x, w, None, "gelu", "triton-gemv-glu"),
           "plain gemv": linear.glu_applies(x, w, None, "silu", "triton-gemv"),
           "five rows": linear.glu_applies(torch.randn(5, 64), w, None, "silu", "triton-gemv-glu"),
           "odd rows": linear.glu_applies(x, torch.randn(31, 64), None, "silu", "triton-gemv-glu")}
print(json.dumps({"gemv": cases, "glu": glu, "glu_refused": refused, "glu_padded_rows": padded,
                  "glu_falls_back": falls_back}))
"""

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def interpreted_all() -> dict:
    return run_under_triton_interpreter(INTERPRETED_CASES)


@pytest.fixture(scope="module")
def interpreted(interpreted_all) -> list[dict]:
    return interpreted_all["gemv"]


def test_gemv_computes_the_product_within_rounding(interpreted):
    for case in interpreted:
        if not case["applies"]:
            continue
        # float32 accumulation over K terms, then one rounding to the output dtype: within one unit in the
        # last place of the largest output (Triton's interpreter may round bfloat16 toward zero)
        unit = 2.0 ** -7 if case["dtype"] == "torch.bfloat16" else 2.0 ** -22
        assert case["error"] <= case["scale"] * unit + 1e-4, case
        assert case["out_dtype"] == case["dtype"] or case["dtype"] == "strided", case


def test_gemv_takes_one_to_four_rows_and_is_repeatable(interpreted):
    assert [c["applies"] for c in interpreted if c["dtype"] == "torch.float32"] == [True] * 4 + [False]
    assert all(case["repeatable"] for case in interpreted)
    five_rows = [c for c in interpreted if c["rows"] == 5]
    assert five_rows and all(c["aten_bits"] for c in five_rows)  # more rows: F.linear itself
    strided, strided_bias = interpreted[-2], interpreted[-1]
    assert strided["shape"] == [2, 1, 32]
    assert not strided_bias["applies"] and strided_bias["aten_bits"]  # a strided bias: F.linear, not wrong numbers


def test_the_gate_up_gemv_computes_silu_gate_times_up_within_its_roundings(interpreted_all):
    """linear_kernel=triton-gemv-glu: gate and up accumulated in float32 and rounded, silu(gate) rounded, the
    product rounded (where eager rounds): within a few units in the last place of the largest output of float64's
    silu(gate) * up; repeatable; only for a SiLU activation, that kernel, 1-4 rows and a stacked (even) weight."""
    glu = interpreted_all["glu"]
    assert len(glu) == 10 and all(case["applies"] and case["repeatable"] for case in glu)
    for case in glu:
        unit = 2.0 ** -7 if case["dtype"] == "torch.bfloat16" else 2.0 ** -22
        assert case["error"] <= case["scale"] * 3 * unit + 1e-4, case
        assert case["out_dtype"] == case["dtype"] and case["shape"][:2] == [case["rows"], 1], case
    assert {(c["rows"], c["shape"][-1]) for c in glu} == {(1, 48), (2, 40), (3, 64), (4, 24), (1, 37)}
    assert interpreted_all["glu_refused"] == {"gelu": False, "plain gemv": False, "five rows": False,
                                              "odd rows": False}


def test_the_gate_up_gemv_reads_rows_by_their_stride_and_leaves_what_it_cannot_compute_to_triton_gemv(
        interpreted_all):
    assert interpreted_all["glu_padded_rows"]  # rows 208 apart: the bits of the same weight stored contiguous
    assert interpreted_all["glu_falls_back"] == {"gelu": True, "five rows": True, "one row": True}


@pytest.mark.parametrize("model, message", [
    ("gelu", "computes SiLU gates only (this model's activation is gelu); use linear_kernel=triton-gemv"),
    ("moe", "computes dense MLP layers only (this model's are all mixture-of-experts); use linear_kernel=triton-gemv"),
])
def test_the_gate_up_gemv_on_a_model_it_would_never_apply_to_is_refused(monkeypatch, model, message):
    """Not run as triton-gemv under another name (and another config hash): at construction and when a forward
    takes the kernel later (with_linear_kernel); a SiLU model with dense layers takes it, a mixture-of-experts model
    with one dense layer too."""
    from test_moe import moe_config
    from transformers import AutoModelForCausalLM, LlamaConfig

    from evalrun.engine import linear
    from evalrun.engine.transformer import Transformer
    from evalrun.models import RANDOM_SHAPES

    monkeypatch.setattr(linear, "INTERPRETED", True)  # the GEMV needs no CUDA device here: only the model refuses
    config = (LlamaConfig(**RANDOM_SHAPES["tiny"], hidden_act="gelu") if model == "gelu"
              else moe_config())
    hf_model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Transformer(hf_model, "sdpa", "triton-gemv-glu")
    with pytest.raises(ConfigError, match=re.escape(message)):
        Transformer(hf_model, "sdpa").with_linear_kernel("triton-gemv-glu")
    assert Transformer(hf_model, "sdpa").with_linear_kernel("triton-gemv").variant.linear_kernel == "triton-gemv"
    silu = AutoModelForCausalLM.from_config(LlamaConfig(**RANDOM_SHAPES["tiny"]))
    assert Transformer(silu, "sdpa", "triton-gemv-glu").variant.linear_kernel == "triton-gemv-glu"
    one_dense = AutoModelForCausalLM.from_config(moe_config(mlp_only_layers=[0]))
    assert Transformer(one_dense, "sdpa", "triton-gemv-glu").variant.linear_kernel == "triton-gemv-glu"


def test_the_gemv_asked_for_where_it_was_never_prepared_is_refused_not_run_as_cublas(monkeypatch):
    from evalrun.engine import linear
    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    monkeypatch.setattr(linear, "INTERPRETED", False)
    monkeypatch.setattr(linear, "_OP", {})
    with pytest.raises(ConfigError, match="needs a CUDA device with Triton"):
        linear.linear(torch.ones(1, 8), torch.ones(4, 8), None, "triton-gemv")
    assert torch.equal(linear.linear(torch.ones(1, 8), torch.ones(4, 8), None, "aten"), torch.full((1, 4), 8.0))
    loaded = load_model("random:tiny", "cpu", "float32")
    with pytest.raises(ConfigError, match="is a CUDA kernel; on CPU use linear_kernel=aten"):
        Transformer(loaded.model, "sdpa", "triton-gemv")


def test_every_projection_of_an_moe_layer_gets_the_runs_kernel(monkeypatch, tmp_path):
    """The o projection of an MoE layer goes through the run's kernel in the forward as in bisect's
    forward_states (it used to be left on aten in the forward only)."""
    from test_moe import moe_checkpoint

    from evalrun.engine import transformer as engine
    from evalrun.models import load_model

    loaded = load_model(str(moe_checkpoint(tmp_path / "ckpt")), "cpu", "float32")
    model = engine.Transformer(loaded.model, "sdpa")
    model.variant = dataclasses.replace(model.variant, linear_kernel="recorded")  # no GEMV needed: only recorded
    kernels = []

    def recorded(x, weight, bias, kernel="aten"):
        kernels.append(kernel)
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(engine.projections, "linear", recorded)
    tokens = torch.tensor([[5, 6, 7]])
    cache = model.new_cache(1, 16)
    model.forward(tokens, torch.arange(3)[None], torch.arange(3), torch.ones(1, 16, dtype=torch.bool), cache)
    moe_layers = sum(w.moe is not None for w in model.layers)
    assert moe_layers and kernels.count("recorded") == len(kernels)
    assert len(kernels) >= 2 * len(model.layers) + 1  # q/k/v and o of every layer, and the head


def test_bisect_says_the_layer_stage_cannot_show_the_gemv():
    from evalrun.bisect_stages import _layer_notes

    good = resolve(RunConfig(model="random:tiny", device="cuda"), cuda_available=True)
    gemv = good.replace(linear_kernel="triton-gemv")
    for notes in (_layer_notes(good, gemv), _layer_notes(gemv, good)):  # whichever side runs the GEMV
        assert len(notes) == 1 and "linear_kernel=triton-gemv computes projections of 1-4 rows" in notes[0]
        assert "step stage" in notes[0]
    assert _layer_notes(good, good) == []


def test_the_levers_at_their_defaults_leave_every_stored_hash_as_it_was():
    effective = resolve(RunConfig(model="random:tiny"), cuda_available=False)
    assert (effective.blas_library, effective.linear_kernel, effective.attention_kernel) == ("cublas", "aten", "sdpa")
    old = {k: v for k, v in effective.factors().items()
           if k not in ("blas_library", "linear_kernel", "attention_kernel", "norm_kernel")}
    old = {k: v for k, v in old.items()
           if k not in ("engine", "tensor_parallel", "served_model", "server_config", "combo_kernels")}
    assert effective.compute_hash() == hash_value(old)
    lever = resolve(RunConfig(model="random:tiny", device="cuda", blas_library="cublaslt"), cuda_available=True)
    assert lever.compute_hash() != resolve(RunConfig(model="random:tiny", device="cuda"), True).compute_hash()


@pytest.mark.parametrize("sets, engine, message", [
    ("blas_library=cublaslt", "evalrun", "blas_library=cublaslt chooses a CUDA library; on CPU use blas_library=cublas"),
    ("linear_kernel=triton-gemv", "evalrun", "linear_kernel=triton-gemv is a CUDA kernel; on CPU use linear_kernel=aten"),
    ("linear_kernel=triton-gemv", "transformers", "replaces evalrun's own projections; use --engine evalrun"),
    ("linear_kernel=cutlass", "evalrun",
     "linear_kernel='cutlass' is not valid; use one of: aten, triton-gemv, triton-gemv-glu, gguf-gemv"),
    ("blas_library=hipblaslt", "evalrun", "blas_library='hipblaslt' is not valid; use one of: cublas, cublaslt"),
])
def test_a_lever_where_it_cannot_run_is_one_line_and_exit_2(cli, tiny_args, store_path, monkeypatch, sets, engine,
                                                           message):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    one_line_exit_2(cli("run", *tiny_args, "--device", "cpu", "--engine", engine, "--set", sets), message)
    if store_path.exists():  # refused before any run began: nothing stored
        with sqlite3.connect(store_path) as db:
            assert db.execute("select count(*) from runs").fetchone() == (0,)


@pytest.mark.parametrize("sets, message", [
    (["--dtype", "float64", "--set", "linear_kernel=triton-gemv"],
     "computes bfloat16, float16 and float32 projections; with dtype float64 use linear_kernel=aten"),
    (["--compilation-mode", "stock", "--set", "linear_kernel=triton-gemv"], "runs eagerly only; use -O0"),
])
def test_the_gemv_where_the_interpreter_cannot_run_it_is_refused(cli, tiny_args, monkeypatch, sets, message):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    one_line_exit_2(cli("run", *tiny_args, "--device", "cpu", *sets), message)


def test_the_gemv_at_a_batch_it_would_not_touch_is_refused(cli, tiny_args, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    one_line_exit_2(cli("run", *tiny_args, "--device", "cpu", "--batch-size", "6", "--set", "linear_kernel=triton-gemv"),
                    "at batch_size 6 it would compute none: use --batch-size 4 or less")


def test_triton_interpret_is_part_of_the_environment_fingerprint(monkeypatch):
    from evalrun.fingerprint import NUMERICS_ENV_VARS

    assert {"TRITON_INTERPRET", "TORCH_BLAS_PREFER_CUBLASLT"} <= set(NUMERICS_ENV_VARS)


def test_bench_measures_a_lever_beside_the_config_without_it():
    matrix = BenchRequest(matrix_names="O2,O2+blas_library=cublaslt+linear_kernel=triton-gemv,O0@transformers"
                                       "+blas_library=cublaslt").matrix(on_gpu=True)
    assert [name for name, _ in matrix][1] == "O2+blas_library=cublaslt+linear_kernel=triton-gemv"
    assert matrix[0][1] == ["-O2"]
    assert matrix[1][1] == ["-O2", "--set", "blas_library=cublaslt", "--set", "linear_kernel=triton-gemv"]
    assert matrix[2][1] == ["-O0", "--engine", "transformers", "--set", "blas_library=cublaslt"]
    lists = BenchRequest(matrix_names="O2 + prefill_buckets=16,32, O3").matrix(on_gpu=True)  # a list value
    assert lists == [("O2+prefill_buckets=16,32", ["-O2", "--set", "prefill_buckets=16,32"]), ("O3", ["-O3"])]
    served = BenchRequest(matrix_names="O0@openai:http://127.0.0.1:9/v1+served_model=m").matrix(on_gpu=False)
    assert served[0][1][-2:] == ["--set", "served_model=m"]  # checked with the row's engine
    for bad, words in (("O2+nosuch=1", "unknown config key 'nosuch'"), ("O2+linear_kernel", "needs the form KEY=VALUE"),
                       ("O9+blas_library=cublaslt", "unknown bench config"),
                       ("O2+blas_library=mkl", "blas_library='mkl' is not valid"),
                       ("O2+opt_level=3", "sets opt_level, which every row shares or its name says; name the level"),
                       ("O2@transformers+engine=evalrun", "sets engine"), ("O2+model=random:tiny", "sets model"),
                       ("O2,32", "unknown bench config '32'"), ("O2+seed=1,O9", "unknown bench config 'O9'"),
                       ("stock+compilation_mode=piecewise", "sets compilation_mode"),
                       ("O0+keep_logits=capital,none", "sets keep_logits"), ("O2+warmup=0", "sets warmup"),
                       ("O2+dtype=float16", "use --dtype for every row")):
        with pytest.raises(ConfigError, match=words):
            BenchRequest(matrix_names=bad).matrix(on_gpu=True)


# One row of a weight past GEMV_MAX_WEIGHT shaped like a down projection takes the GEMV with its longer blocks
# (float32, where the two block sizes give other bits); two rows of it, and one row of a large weight with
# rows no longer than its count (a square o, a gate/up, a head, as on Llama-3-70B), stay with F.linear.
LONG_ROW_CASES = r"""
import json
import torch
import torch.nn.functional as F
from evalrun.engine import linear
from evalrun.engine.linear_triton_kernel import launch

linear.GEMV_MAX_WEIGHT = 1 << 16  # the rule at a small size (the GPU test takes the real 8B down shape)
g = torch.Generator().manual_seed(5)
k = linear.GEMV_LONG_ROW + linear.GEMV_LONG_BLOCKS[1]  # 8 rows of it: past GEMV_MAX_WEIGHT, long rows
w = torch.randn(8, k, generator=g) / k ** 0.5
x = torch.randn(2, k, generator=g)
y = linear.linear(x[:1], w, None, "triton-gemv")
exact = F.linear(x[:1].double(), w.double())
meta = lambda n, k: torch.empty(n, k, device="meta")  # noqa: E731
print(json.dumps({
    "blocks": list(linear.blocks(1, w)), "one_row": linear.gemv_applies(x[:1], w),
    "two_rows": linear.gemv_applies(x, w),
    "not_down_shaped": [linear.gemv_applies(meta(1, 8192), meta(n, 8192)) for n in (8192, 57344, 128256)],
    "long_blocks_bits": torch.equal(y, launch(x[:1], w, None, *linear.GEMV_LONG_BLOCKS)),
    "short_blocks_bits": torch.equal(y, launch(x[:1], w, None, *linear.GEMV_BLOCKS[1])),
    "error": (y.double() - exact).abs().max().item(), "scale": exact.abs().max().item()}))
"""


def test_one_row_of_a_down_shaped_weight_takes_the_gemv_with_long_blocks():
    from evalrun.engine import linear

    case = run_under_triton_interpreter(LONG_ROW_CASES)
    assert case["blocks"] == list(linear.GEMV_LONG_BLOCKS)
    assert case["one_row"] and not case["two_rows"] and case["not_down_shaped"] == [False] * 3
    assert case["long_blocks_bits"] and not case["short_blocks_bits"]  # the long blocks ran, not the usual ones
    assert case["error"] <= case["scale"] * 2.0 ** -20 + 1e-6, case


# A residual added in the GEMV's epilogue against the same product added by torch afterwards (float32: the
# interpreter may round bfloat16 otherwise than the GPU; the GPU test below takes bfloat16), 1-4 rows, with and
# without bias; a residual of another layout or shape is added by torch.
RESIDUAL_CASES = r"""
import json
import torch
from evalrun.engine import linear

g = torch.Generator().manual_seed(7)
cases = []
for rows, n, k, bias in ((1, 48, 256, False), (2, 40, 300, True), (4, 24, 96, True)):
    x = torch.randn(1, rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(1, rows, n, generator=g) * 4
    cases.append(torch.equal(linear.linear(x, w, b, "triton-gemv", residual=r), r + linear.linear(x, w, b, "triton-gemv")))
x, w = torch.randn(2, 64, generator=g), torch.randn(32, 64, generator=g)
r = torch.randn(32, 2, generator=g).t()  # not contiguous
cases.append(torch.equal(linear.linear(x, w, None, "triton-gemv", residual=r), r + linear.linear(x, w, None, "triton-gemv")))
row = torch.randn(32, generator=g)  # broadcast over the rows
cases.append(torch.equal(linear.linear(x, w, None, "triton-gemv", residual=row),
                         row + linear.linear(x, w, None, "triton-gemv")))
print(json.dumps(cases))
"""


def test_the_gemv_adds_a_residual_with_the_bits_of_adding_it_afterwards():
    assert run_under_triton_interpreter(RESIDUAL_CASES) == [True] * 5


def test_the_mlp_residual_is_passed_to_the_projection_only_where_nothing_comes_between(monkeypatch):
    """mlp_block hands x to the down projection as its residual (the GEMV's epilogue adds it) unless the output
    is normed first (Gemma) or summed over tensor-parallel ranks; on the aten path the bits are x + F.linear's."""
    import torch.nn.functional as F

    from evalrun.engine import transformer

    g = torch.Generator().manual_seed(1)
    x, norm_w = torch.randn(1, 1, 16, generator=g), torch.rand(16, generator=g) + 0.5
    gate_up, down = torch.randn(64, 16, generator=g), torch.randn(16, 32, generator=g)
    seen = residuals_seen(monkeypatch)
    fused = transformer.mlp_block(x, norm_w, gate_up, down, 1e-5)
    transformer.mlp_block(x, norm_w, gate_up, down, 1e-5, out_norm=norm_w)
    transformer.mlp_block(x, norm_w, gate_up, down, 1e-5, reduce=lambda t: t)
    assert seen == [False, True, False, False, False, False]
    gate, up = F.linear(transformer.rms_norm(x, norm_w, 1e-5), gate_up).chunk(2, dim=-1)
    assert torch.equal(fused, x + F.linear(F.silu(gate) * up, down))


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("rows,n,k", [(1, 6144, 4096), (2, 6144, 4096), (4, 6144, 4096), (1, 4096, 14336)])
def test_gpu_gemv_eager_compiled_and_graphed_agree_bitwise(rows, n, k):
    import torch.nn.functional as F

    from evalrun.engine import linear

    linear.prepare("triton-gemv", "cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert linear.gemv_applies(x, w, b)  # the last: Llama-3-8B's down at batch 1, past GEMV_MAX_WEIGHT
    y = linear.linear(x, w, b, "triton-gemv")
    from evalrun.engine.linear_triton_kernel import launch

    assert torch.equal(y, launch(x, w, b, *linear.blocks(rows, w)))  # the registered op ran the shape's blocks
    exact = F.linear(x.double(), w.double(), b.double())
    assert (y.double() - exact).abs().max().item() <= exact.abs().max().item() * 2 ** -7 + 1e-3
    compiled = torch.compile(lambda a: linear.linear(a, w, b, "triton-gemv"), fullgraph=True)
    assert torch.equal(compiled(x), y)
    residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)  # added in the epilogue: torch's bits
    assert torch.equal(linear.linear(x, w, b, "triton-gemv", residual=residual), residual + y)
    with_residual = torch.compile(lambda a, r: linear.linear(a, w, b, "triton-gemv", residual=r), fullgraph=True)
    assert torch.equal(with_residual(x, residual), residual + y)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    linear.linear(static, w, b, "triton-gemv")
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = linear.linear(static, w, b, "triton-gemv")
    static.copy_(x.flip(1))
    graph.replay()
    assert torch.equal(out, linear.linear(x.flip(1), w, b, "triton-gemv"))


@gpu
@needs_cuda
@pytest.mark.parametrize("rows,inter,k", [(1, 14336, 4096), (2, 14336, 4096), (4, 1536, 576)])
def test_gpu_gate_up_gemv_eager_compiled_and_graphed_agree_bitwise(rows, inter, k):
    """linear_kernel=triton-gemv-glu's gate/up GEMV (Llama-3-8B's gate/up, SmolLM2's at K = 576, not a multiple of
    the block): its registered op runs the shape's blocks, within bfloat16 roundings of float64, the same bits
    eagerly, under torch.compile and replayed from a CUDA graph."""
    import torch.nn.functional as F

    from evalrun.engine import linear
    from evalrun.engine.linear_triton_kernel import launch_glu

    linear.prepare("triton-gemv-glu", "cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(2 * inter, device="cuda", dtype=torch.bfloat16)
    assert linear.glu_applies(x, w, b, "silu", "triton-gemv-glu")
    y = linear.gated_linear(x, w, b)
    assert y.shape == (rows, inter)
    assert torch.equal(y, launch_glu(x, w, b, *linear.GLU_BLOCKS[{1: 1, 2: 2, 4: 4}[rows]]))
    gate, up = F.linear(x.double(), w.double(), b.double()).chunk(2, -1)
    exact = F.silu(gate) * up
    assert (y.double() - exact).abs().max().item() <= exact.abs().max().item() * 3 * 2 ** -7 + 1e-3
    compiled = torch.compile(lambda a: linear.gated_linear(a, w, b), fullgraph=True)
    assert torch.equal(compiled(x), y)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    linear.gated_linear(static, w, b)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = linear.gated_linear(static, w, b)
    static.copy_(x.flip(1))
    graph.replay()
    assert torch.equal(out, linear.gated_linear(x.flip(1), w, b))


@gpu
@needs_cuda
@pytest.mark.parametrize("level", [0, 2])
def test_gpu_the_gate_up_gemv_computes_each_decode_mlp_and_repeats_its_bits(level, monkeypatch):
    """-O0 and -O2 runs with linear_kernel=triton-gemv-glu: the gate/up GEMV computes the decode steps' MLPs
    (counted where the engine calls it, eagerly or while Dynamo traces) and repeats its digests; in float32 its
    bits differ from linear_kernel=triton-gemv's."""
    from evalrun.engine import linear

    def run(dtype="bfloat16", **knobs):
        return tiny_gpu_run(level, dtype, **knobs)[0]

    linear.prepare("triton-gemv-glu", "cuda")
    calls = count_calls(monkeypatch, linear._OP, "glu")
    run(linear_kernel="triton-gemv")
    assert not calls
    glu = run(linear_kernel="triton-gemv-glu")
    assert calls
    assert run(linear_kernel="triton-gemv-glu") == glu
    assert run("float32", linear_kernel="triton-gemv-glu") != run("float32", linear_kernel="triton-gemv")


@gpu
@needs_cuda
@pytest.mark.parametrize("level", [0, 2])
def test_gpu_runs_with_each_lever_are_repeatable_and_recorded(level, monkeypatch):
    """-O0 and -O2 runs with the GEMV and with cuBLASLt: the GEMV computes the decode projections (counted where
    the engine calls it, eagerly or while Dynamo traces) and repeats its own digests; in float32 its bits differ
    from cuBLAS's (in bfloat16 the output rounding can hide the other order at this tiny model's K = 64); the
    applied flags name the library."""
    from evalrun.engine import linear

    def run(dtype="bfloat16", **knobs):
        return tiny_gpu_run(level, dtype, **knobs)

    linear.prepare("triton-gemv", "cuda")
    calls = count_calls(monkeypatch, linear._OP, "op")
    plain, _ = run()
    assert not calls
    gemv, _ = run(linear_kernel="triton-gemv")
    assert calls
    assert run(linear_kernel="triton-gemv")[0] == gemv
    assert run("float32", linear_kernel="triton-gemv")[0] != run("float32")[0]
    _, lt = run(blas_library="cublaslt")
    _, default = run()
    assert lt.header["applied_flags"]["preferred_blas_library"] == "cublaslt"
    assert default.header["applied_flags"]["preferred_blas_library"] == "cublas"
