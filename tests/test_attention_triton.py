"""Split-KV decode attention (`attention_kernel=triton-split-kv`, engine/attention_triton.py, issue #16): a
numerics knob in the config hash, refused where it cannot run, computing a decode step's attention.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported, so in a
child process; the interpreter multiplies bfloat16 wrongly, so float32 and float16 there); on a GPU they run
compiled, also inside torch.compile and a CUDA graph.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import one_line_exit_2, run_under_triton_interpreter, tiny_gpu_run

from evalrun.config import RunConfig, resolve
from evalrun.errors import ConfigError

# Decode steps (one query token per row) against float64 SDPA: head dims 64, 96 (padded to 128) and 128; caches
# of one chunk and of many, with a partial last chunk; left padding, a one-key row and a sliding window; each
# computed twice. A prefill (several tokens) stays with SDPA, bit for bit.
INTERPRETED_CASES = r"""
import json
import torch
from evalrun.engine import attention_triton
from evalrun.engine.transformer import attention, build_mask

from evalrun.engine import attention_triton_kernel

launches = []  # the grids the second (combine) kernel was launched with


class Counted:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launches.append(grid)
        return self.kernel[grid]


attention_triton_kernel.combine_kernel = Counted(attention_triton_kernel.combine_kernel)
g = torch.Generator().manual_seed(11)
cases = []
for dtype in (torch.float32, torch.float16):
    for slots, used, dim, window in ((40, 3, 96, None), (144, 70, 128, None), (1000, 999, 64, None),
                                     (300, 260, 64, 50)):
        q = torch.randn(2, 8, 1, dim, generator=g).to(dtype)
        k, v = (torch.randn(2, 2, slots, dim, generator=g).to(dtype) for _ in range(2))
        valid = torch.zeros(2, slots, dtype=torch.bool)
        valid[0, :used] = True
        valid[1, used - 1:used] = True  # a row that sees one key: itself
        mask = build_mask(torch.tensor([used - 1]), valid, 4, dtype, window)
        exact = attention(q.double(), k.double(), v.double(), mask.double(), "sdpa")
        before = len(launches)
        out = attention(q, k, v, mask, "sdpa", kernel="triton-split-kv")
        again = attention(q, k, v, mask, "sdpa", kernel="triton-split-kv")
        one_kernel = len(launches) == before and torch.device("cpu") in attention_triton._ARRIVALS
        sdpa = attention(q, k, v, mask, "sdpa")
        attention_triton.COMBINE_IN_LAST_PROGRAM = False  # a second kernel combines the chunks
        separate = attention(q, k, v, mask, "sdpa", kernel="triton-split-kv")
        attention_triton.COMBINE_IN_LAST_PROGRAM = True
        two_kernels = len(launches) == before + 1
        cases.append({"dtype": str(dtype), "slots": slots, "dim": dim, "chunk": attention_triton.chunk_for(slots),
                      "error": (out.double() - exact).abs().max().item(),
                      "sdpa_error": (sdpa.double() - exact).abs().max().item(), "repeatable": torch.equal(out, again),
                      "combined_alike": torch.equal(out, separate), "one_kernel": one_kernel,
                      "two_kernels": two_kernels, "shape": list(out.shape),
                      "out_dtype": str(out.dtype)})
arrivals = attention_triton._ARRIVALS[torch.device("cpu")]
q = torch.randn(1, 8, 3, 64, generator=g)  # three query tokens: a prefill
k, v = torch.randn(1, 2, 16, 64, generator=g), torch.randn(1, 2, 16, 64, generator=g)
valid = torch.ones(1, 16, dtype=torch.bool)
mask = build_mask(torch.arange(3), valid, 4, torch.float32)
prefill_bits = torch.equal(attention(q, k, v, mask, "sdpa", kernel="triton-split-kv"), attention(q, k, v, mask, "sdpa"))
print(json.dumps({"cases": cases, "prefill_bits": prefill_bits, "arrivals_left": int(arrivals.abs().sum()),
                  "arrivals": int(arrivals.numel())}))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(INTERPRETED_CASES)


def test_split_kv_attention_matches_float64_as_closely_as_sdpa(interpreted):
    for case in interpreted["cases"]:
        assert case["shape"][1:] == [8, 1, case["dim"]] and case["out_dtype"] == case["dtype"], case
        assert case["repeatable"], case
        # another order of the same float32 sums: within a few units of SDPA's own error, or a float16 rounding
        bound = 4 * case["sdpa_error"] + (1e-6 if case["dtype"] == "torch.float32" else 2e-3)
        assert case["error"] <= bound, case
    assert {case["chunk"] for case in interpreted["cases"]} == {64}  # 1000 slots: 16 chunks of 64
    assert interpreted["prefill_bits"]


def test_the_last_program_of_a_head_combines_its_chunks_as_a_second_kernel_would(interpreted):
    """One kernel a call (the second kernel never launched, the counters made): the last of a head's programs to
    finish combines its chunks with the bits of the second kernel, and leaves the counters zero for the next call.
    (The interpreter runs programs one after another, so which program combines, and when, is checked on the GPU
    and in the PTX: the next test.)"""
    for case in interpreted["cases"]:
        assert case["one_kernel"] and case["two_kernels"] and case["combined_alike"], case
    assert interpreted["arrivals"] >= 2 * 2 and interpreted["arrivals_left"] == 0


def test_the_combining_program_sees_every_partial_by_the_ptx():
    """The memory-ordering argument, read off the kernel as Triton compiles it for Hopper (a CPU can compile it):
    each program stores its partials, then a barrier of its threads, then one acquire-release atomic add at GPU
    scope, then a barrier handing its result to every thread, and only then the combine's loads, at L2. A Triton
    that lowered any of these otherwise would fail here before it could combine a chunk early on a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from evalrun.engine.attention_triton_kernel import partial_kernel

    names = list(inspect.signature(partial_kernel.fn).parameters)
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*bf16", "acc_ptr": "*fp32",
                "max_ptr": "*fp32", "sum_ptr": "*fp32", "out_ptr": "*bf16", "arrivals_ptr": "*i32", "scale": "fp32"}
    constants = dict(R=4, ROWS=16, D=128, DIMS=128, CHUNK=64, CHUNKS=16, BLOCK_S=64, PRECISION="tf32", COMBINE=True)
    signature = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in names}
    source = ASTSource(fn=partial_kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constants.items()})
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    except Exception as error:  # a Triton without its CUDA backend's tools
        pytest.skip(f"Triton cannot compile for sm_90 here: {str(error).splitlines()[0][:120]}")
    lines = ptx.splitlines()
    at = lambda text: [i for i, line in enumerate(lines) if text in line]  # noqa: E731
    atomics = at("atom.global.gpu.acq_rel.add")
    assert len(atomics) == 1, atomics
    count = atomics[0]
    last_store = max(i for i in at("st.global") if i < count)  # the partials (and nothing after them) come first
    assert any(last_store < i < count for i in at("bar.sync")), "no barrier between the partials' stores and the count"
    loads = at("ld.global.cg")
    assert loads and min(loads) > count, "the combine reads before it counts"
    assert any(count < i < min(loads) for i in at("bar.sync")), "no barrier handing the count to every thread"


def test_the_chunking_is_fixed_by_the_cache_length_alone():
    from evalrun.engine.attention_triton import BLOCK_S, chunk_for

    assert [chunk_for(s) for s in (1, 64, 144, 1024, 1025, 4096)] == [64, 64, 64, 64, 128, 256]
    for slots in (1, 100, 4096, 100_000):
        chunk = chunk_for(slots)
        assert chunk % BLOCK_S == 0 and -(-slots // chunk) <= 16


def test_the_knob_at_its_default_leaves_the_hash_and_the_reference_alone():
    from evalrun.golden import reference_config

    plain = resolve(RunConfig(model="random:tiny", device="cuda"), cuda_available=True)
    split = resolve(RunConfig(model="random:tiny", device="cuda", attention_kernel="triton-split-kv"), True)
    assert plain.attention_kernel == "sdpa" and split.compute_hash() != plain.compute_hash()
    assert reference_config(split).attention_kernel == "sdpa"


@pytest.mark.parametrize("sets, engine, message", [
    ("attention_kernel=triton-split-kv", "evalrun",
     "attention_kernel=triton-split-kv is a CUDA kernel; on CPU use attention_kernel=sdpa"),
    ("attention_kernel=triton-split-kv", "transformers", "replaces evalrun's own attention; use --engine evalrun"),
    ("attention_kernel=flash", "evalrun", "attention_kernel='flash' is not valid; use one of: sdpa, triton-split-kv"),
])
def test_the_knob_where_it_cannot_run_is_one_line_and_exit_2(cli, tiny_args, monkeypatch, sets, engine, message):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    one_line_exit_2(cli("run", *tiny_args, "--device", "cpu", "--engine", engine, "--set", sets), message)


@pytest.mark.parametrize("sets, message", [
    (["--dtype", "float64"], "computes bfloat16, float16 and float32 attention; with dtype float64 use "
                             "attention_kernel=sdpa"),
    (["--dtype", "bfloat16"], "multiplies bfloat16 wrongly; use --dtype float32, or --device cuda"),
    (["--compilation-mode", "stock"], "runs eagerly only; use -O0"),
])
def test_the_knob_where_the_interpreter_cannot_run_it_is_refused(cli, tiny_args, monkeypatch, sets, message):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    one_line_exit_2(cli("run", *tiny_args, "--device", "cpu", *sets, "--set", "attention_kernel=triton-split-kv"),
                    message)


def test_only_a_decode_steps_own_layout_takes_the_kernel(monkeypatch):
    """Anything but its own float mask [B, 1, R, S] goes to SDPA: a broadcast mask, a boolean mask, a mask narrower
    than the cache, another dtype, keys of another batch (several query tokens: attention() checks, and the
    interpreted cases show a prefill's SDPA bits)."""
    from evalrun.engine import attention_triton
    from evalrun.engine.attention_triton import applies

    monkeypatch.setattr(attention_triton, "INTERPRETED", True)  # CPU tensors count as a device it runs on
    q, k = torch.zeros(2, 2, 4, 16), torch.zeros(2, 2, 40, 16)
    mask = torch.zeros(2, 1, 4, 40)
    assert applies(q, k, k, mask)
    assert not applies(q, k, k, mask[:1])  # broadcast over the batch
    assert not applies(q, k, k, mask.bool())
    assert not applies(q, k, k, mask[..., :30])
    assert not applies(q.double(), k.double(), k.double(), mask.double())
    assert not applies(q, k[:1], k[:1], mask)


def test_store_show_names_a_decode_lever_that_is_not_the_default():
    from evalrun.report import config_line

    base = {"model": "m", "device": "cuda", "dtype": "bfloat16", "opt_level": 2}
    assert "attention_kernel" not in config_line(base) and "linear_kernel" not in config_line(base)
    line = config_line({**base, "attention_kernel": "triton-split-kv", "linear_kernel": "aten"})
    assert line.endswith("attention_kernel=triton-split-kv") and "linear_kernel" not in line
    assert config_line({**base, "engine": "transformers"}).endswith("engine=transformers")


def test_a_soft_capped_model_is_refused_not_run_without_its_cap():
    from dataclasses import replace

    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    transformer = Transformer(load_model("random:tiny", "cpu", "float32").model)
    transformer.variant = replace(transformer.variant, attn_softcap=50.0)  # as Gemma 2's config sets it
    with pytest.raises(ConfigError, match="computes no soft-capped scores"):
        transformer.with_attention_kernel("triton-split-kv")
    assert transformer.with_attention_kernel("sdpa") is transformer


def test_bisect_says_the_layer_stage_cannot_show_the_attention_kernel():
    from evalrun.bisect_stages import _layer_notes

    good = resolve(RunConfig(model="random:tiny", device="cuda"), cuda_available=True)
    split = good.replace(attention_kernel="triton-split-kv")
    for notes in (_layer_notes(good, split), _layer_notes(split, good)):
        assert len(notes) == 1 and "attention_kernel=triton-split-kv computes the attention of decode steps" in notes[0]


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("slots,dtype", [(144, torch.bfloat16), (4096, torch.bfloat16), (1000, torch.float32)])
def test_gpu_split_kv_eager_compiled_and_graphed_agree_bitwise(slots, dtype):
    """Llama-3-8B's decode shapes: the registered op, inside torch.compile and inside a CUDA graph, gives the same
    bits; within bfloat16 rounding of float64, and in float32 within float32 rounding (no TF32 products)."""
    from evalrun.engine import attention_triton
    from evalrun.engine.transformer import attention, build_mask

    attention_triton.prepare("triton-split-kv", "cuda")
    # Compiled as the engine compiles (static shapes, Dynamo reset): the lambda below is one code object for every
    # case, so without both, the third case's compile saw the cache length change and made it symbolic (Dynamo's
    # automatic dynamic shapes), and that compile of the op gave float32 bits other than eager's (353 of 4,096
    # values by one unit in the last place, H200, stops 16-19; in this file's order every time)
    torch._dynamo.reset()
    generator = torch.Generator(device="cuda").manual_seed(slots)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=dtype, generator=generator)
    k, v = (torch.randn(1, 8, slots, 128, device="cuda", dtype=dtype, generator=generator) for _ in range(2))
    valid = torch.zeros(1, slots, dtype=torch.bool, device="cuda")
    valid[:, :slots - 7] = True
    mask = build_mask(torch.tensor([slots - 8], device="cuda"), valid, 4, dtype)
    out = attention(q, k, v, mask, "sdpa", kernel="triton-split-kv")
    exact = attention(q.double(), k.double(), v.double(), mask.double(), "sdpa")
    assert (out.double() - exact).abs().max().item() <= (2 ** -7 if dtype == torch.bfloat16 else 1e-5)
    forward = lambda a: attention(a, k, v, mask, "sdpa", kernel="triton-split-kv")  # noqa: E731
    compiled = torch.compile(forward, fullgraph=True, dynamic=False)
    for index, query in enumerate((q, *(torch.randn(q.shape, device="cuda", dtype=dtype, generator=generator)
                                        for _ in range(2)))):
        eager = attention(query, k, v, mask, "sdpa", kernel="triton-split-kv")
        got = compiled(query)
        differ = (got != eager).sum().item()
        if differ:  # say enough to tell the causes apart
            again = (got != compiled(query)).sum().item()
            torch._dynamo.reset()
            with torch._inductor.config.patch(fx_graph_cache=False):
                fresh = torch.compile(forward, fullgraph=True, dynamic=False)(query)
            gap = (got.double() - eager.double()).abs().max().item()
            pytest.fail(f"query {index}: {differ} of {eager.numel()} values differ compiled vs eager, by at most "
                        f"{gap:.3g}; compiled again, {again} differ; compiled afresh without the FX graph cache, "
                        f"{(fresh != eager).sum().item()} differ from eager")
    static = q.clone()
    graph = torch.cuda.CUDAGraph()
    attention(static, k, v, mask, "sdpa", kernel="triton-split-kv")
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        graphed = attention(static, k, v, mask, "sdpa", kernel="triton-split-kv")
    static.copy_(q.flip(-1))
    graph.replay()
    assert torch.equal(graphed, attention(q.flip(-1), k, v, mask, "sdpa", kernel="triton-split-kv"))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_the_last_program_combines_as_the_second_kernel_would_replay_after_replay(dtype):
    """Batch 4 x 8 key/value heads, 144 to 4096 slots: the one-kernel launch (each head's last program combines,
    counted by the arrival counters) gives the bits of the two-kernel launch, eagerly and in a CUDA graph replayed
    60 times with changing queries (a combine that read a chunk before its writer's stores were visible would
    differ), and leaves every counter zero."""
    from evalrun.engine import attention_triton
    from evalrun.engine.attention_triton_kernel import launch
    from evalrun.engine.transformer import build_mask

    attention_triton.prepare("triton-split-kv", "cuda")
    arrivals = attention_triton.arrival_counters(torch.device("cuda", torch.cuda.current_device()))
    generator = torch.Generator(device="cuda").manual_seed(7)
    for slots in (144, 1000, 4096):
        chunk = attention_triton.chunk_for(slots)
        queries = [torch.randn(4, 8, 4, 128, device="cuda", dtype=dtype, generator=generator) for _ in range(3)]
        k, v = (torch.randn(4, 8, slots, 128, device="cuda", dtype=dtype, generator=generator) for _ in range(2))
        valid = torch.rand(4, slots, device="cuda", generator=generator) < 0.9
        valid[:, slots - 1] = True
        mask = build_mask(torch.tensor([slots - 1], device="cuda"), valid, 4, dtype)
        separate = [launch(q, k, v, mask, 128**-0.5, chunk, attention_triton.BLOCK_S) for q in queries]
        assert all(torch.equal(launch(q, k, v, mask, 128**-0.5, chunk, attention_triton.BLOCK_S, arrivals=arrivals), s)
                   for q, s in zip(queries, separate))
        static = queries[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = launch(static, k, v, mask, 128**-0.5, chunk, attention_triton.BLOCK_S, arrivals=arrivals)
        differ = []
        for replay in range(60):
            static.copy_(queries[replay % 3])
            graph.replay()
            differ.append(int((graphed != separate[replay % 3]).sum()))
        assert differ == [0] * 60, (slots, differ)
    torch.cuda.synchronize()
    assert int(arrivals.abs().sum()) == 0


@gpu
@needs_cuda
def test_gpu_the_op_launches_one_kernel_eagerly_and_two_when_traced():
    """Through the engine's attention: eagerly the registered op launches the partial kernel alone (its last
    programs combine), compiled it launches the partial kernel and the second kernel; the same bits."""
    from torch.profiler import ProfilerActivity, profile

    from evalrun.engine import attention_triton
    from evalrun.engine.transformer import attention, build_mask

    attention_triton.prepare("triton-split-kv", "cuda")
    torch._dynamo.reset()
    generator = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(1, 8, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(2))
    mask = build_mask(torch.tensor([999], device="cuda"), torch.ones(1, 1000, dtype=torch.bool, device="cuda"), 4,
                      torch.bfloat16)
    forward = lambda a: attention(a, k, v, mask, "sdpa", kernel="triton-split-kv")  # noqa: E731
    compiled = torch.compile(forward, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q), forward(q))  # compiled (and warmed) before the profile
    launched = {}
    for name, function in (("eager", forward), ("compiled", compiled)):
        with profile(activities=[ProfilerActivity.CUDA]) as profiled:
            function(q)
            torch.cuda.synchronize()
        kernels = [event.name for event in profiled.events() if event.device_type.name == "CUDA"]
        launched[name] = (sum("partial_kernel" in kernel for kernel in kernels),
                          sum("combine_kernel" in kernel for kernel in kernels))
    assert launched == {"eager": (1, 0), "compiled": (1, 1)}, launched
    assert attention_triton.arrivals_left() == 0


@gpu
@needs_cuda
@pytest.mark.parametrize("level", [0, 2])
def test_gpu_runs_with_the_split_kv_kernel_are_repeatable_and_recorded(level):
    def run(**knobs):
        return tiny_gpu_run(level, **knobs)

    split, done = run(attention_kernel="triton-split-kv")
    assert run(attention_kernel="triton-split-kv")[0] == split
    assert done.header["config"]["attention_kernel"] == "triton-split-kv" and done.evidence["fallbacks"] == []
