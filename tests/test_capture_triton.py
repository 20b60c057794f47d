"""The fused Triton capture kernel against the torch capture: digests bit-identical, top-k identical.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported,
so in a child process); on a GPU it runs compiled, also inside torch.compile and a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_under_triton_interpreter

from evalrun.engine.capture import logits_digest, reference_digest, topk_sketch

pytest.importorskip("triton")

# Rows that exercise the kernel: several dtypes, a vocab that is no multiple of the chunk and one
# smaller than a chunk, exact ties, a NaN, -0.0 beside 0.0, a top-k that is no power of two.
INTERPRETED_CASES = r"""
import json, sys
import torch
from evalrun.engine import capture_triton
from evalrun.engine.capture import logits_digest

def bits(tensor):
    return (tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor).tolist()

def case(name, logits, top_k):
    digest, ids, values, margin = capture_triton.fused_capture(logits, top_k)
    capture_triton.MERGE_IN_KERNEL = False  # the torch ops' merge
    torch_merge = capture_triton.fused_capture(logits, top_k)
    capture_triton.MERGE_IN_KERNEL = True
    same_merge = [bits(a) for a in (digest, ids, values, margin)] == [bits(b) for b in torch_merge]
    return {"name": name, "logits": logits.double().tolist(), "bits": logits.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[logits.element_size()]).tolist(),
            "dtype": str(logits.dtype), "top_k": top_k, "digest": digest.tolist(), "torch_digest": logits_digest(logits).tolist(),
            "ids": ids.tolist(), "values": values.tolist(), "margin": margin.tolist(), "margin_bits": bits(margin),
            "same_merge": same_merge}

g = torch.Generator().manual_seed(7)
cases = []
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    cases.append(case(f"random-{dtype}", (torch.randn(2, 1500, generator=g) * 5).to(dtype), 8))
small = torch.randn(1, 100, generator=g)
cases.append(case("vocab-below-one-chunk", small, 5))
ties = torch.zeros(1, 1500)
ties[0, [3, 1200, 40, 1499]] = 2.0
ties[0, [7, 1030]] = -0.0
cases.append(case("ties", ties.to(torch.bfloat16), 6))
zeros = -torch.rand(1, 40, generator=g) - 1
zeros[0, [0, 2]] = -0.0
zeros[0, 1] = 0.0
cases.append(case("signed-zeros", zeros, 3))
nan = torch.randn(1, 1100, generator=g)
nan[0, 1050] = float("nan")
cases.append(case("nan", nan, 2))
wide = torch.randn(2, 3, 2100, generator=g)[:, -1, :]  # not contiguous: rows 3*2100 apart; three chunks
cases.append(case("strided-rows", wide, 4))

def at_step(logits, top_k, write_token):  # the merge into [B, 3, ...] buffers at step 1 against fused_capture's
    rows = logits.shape[0]
    filled = lambda *shape, kind=torch.int64: torch.full(shape, -7, dtype=kind)
    buffers = [filled(rows, 3, 2), filled(rows, 3, top_k), filled(rows, 3, top_k, kind=torch.float32),
               filled(rows, 3, kind=torch.float32), filled(rows, 3)]
    next_token = filled(rows)
    step = torch.tensor([1])
    written = capture_triton.fused_capture_at_step(logits, step, *buffers, next_token if write_token else None)
    digest, ids, values, margin = capture_triton.fused_capture(logits, top_k)
    at_1 = [bits(b[:, 1]) for b in buffers]
    want = [bits(digest), bits(ids), bits(values), bits(margin), ids[:, 0].tolist() if write_token else [-7] * rows]
    others = all(bool((b[:, [0, 2]] == -7).all()) for b in buffers)
    return {"written": written, "same": at_1 == want, "others_untouched": others,
            "next_token": next_token.tolist(), "top1": ids[:, 0].tolist()}

steps = [at_step(wide, 4, True), at_step(ties.to(torch.bfloat16), 6, False), at_step(nan, 2, True)]
# a step past the buffers' end (a one-step workspace asked for step 1) writes nothing there, nor beyond: views of a
# larger tensor, so what lies past each buffer can be read back
backing = [torch.full((2, 2, 2), -7), torch.full((2, 2, 4), -7), torch.full((2, 2, 4), -7.0), torch.full((2, 2), -7.0),
           torch.full((2, 2), -7)]
one_step = [t[:, :1] for t in backing]
written = capture_triton.fused_capture_at_step(wide, torch.tensor([1]), *one_step, torch.full((2,), -7))
past_end = {"written": written, "untouched": all(bool((t == -7).all()) for t in backing)}
print(json.dumps({"chunk": capture_triton.CHUNK, "cases": cases, "at_step": steps, "past_end": past_end}))
"""


def stable_topk(values: np.ndarray, k: int) -> np.ndarray:
    """The k largest of a row [V], larger value first, lower index first among equal values; NaN first."""
    ranked = np.where(np.isnan(values), np.inf, values)
    is_nan = np.isnan(values)
    order = np.lexsort((np.arange(values.size), -ranked, ~is_nan))
    return order[:k]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(INTERPRETED_CASES)


def test_interpreted_rows_span_one_chunk_several_and_a_count_the_merge_pads(interpreted):
    chunk = interpreted["chunk"]
    widths = [len(case["logits"][0]) for case in interpreted["cases"]]
    assert min(widths) < chunk, widths  # a row inside one chunk
    chunks = [-(-width // chunk) for width in widths if width % chunk]  # rows whose last chunk is partial
    # the merge pads a chunk count that is no power of two to one (masked slots): some row spans such a count
    assert any(count > 1 for count in chunks) and any(count & (count - 1) for count in chunks), widths


def test_fused_digest_is_bit_identical_to_the_torch_digest(interpreted):
    for case in interpreted["cases"]:
        assert case["digest"] == case["torch_digest"], case["name"]
    first = interpreted["cases"][0]
    assert reference_digest(np.array(first["bits"][0])) == "".join(
        f"{word & (2**64 - 1):016x}" for word in first["digest"][0])


def test_fused_topk_is_the_stable_topk_and_the_torch_values(interpreted):
    for case in interpreted["cases"]:
        for row, logits in enumerate(case["logits"]):
            logits = np.array(logits)
            expected = stable_topk(logits, case["top_k"])
            assert case["ids"][row] == expected.tolist(), case["name"]
            got = np.array(case["values"][row])
            want = logits[expected].astype(np.float32)
            assert np.array_equal(got, want, equal_nan=True), case["name"]
            assert np.isclose(case["margin"][row], got[0] - got[1], equal_nan=True) or np.isnan(got[0]), case["name"]


def test_fused_topk_values_equal_torch_topk_where_there_are_no_ties(interpreted):
    for case in interpreted["cases"]:
        if not case["name"].startswith("random-float32") and case["name"] != "strided-rows":
            continue
        logits = torch.tensor(case["logits"], dtype=torch.float32)
        ids, values, margin = topk_sketch(logits, case["top_k"])
        assert ids.tolist() == case["ids"] and values.tolist() == case["values"] and margin.tolist() == case["margin"]


def test_the_merge_kernel_gives_the_torch_merges_bits(interpreted):
    """The chunks' candidates merged by one Triton program per row: digest, ids, values and margin bit for bit
    those of the torch ops' merge, the margin's sign of zero included (-0.0 first, 0.0 second: -0.0)."""
    assert all(case["same_merge"] for case in interpreted["cases"]), [c["name"] for c in interpreted["cases"]
                                                                      if not c["same_merge"]]
    signed = next(case for case in interpreted["cases"] if case["name"] == "signed-zeros")
    assert signed["margin_bits"] == [-2 ** 31]  # -0.0


def test_the_merge_writes_a_step_into_the_capture_buffers_itself(interpreted):
    """fused_capture_at_step: the merge kernel writes the digest, ids, values, margin (and, asked, the top-1 as the
    step's token and the next input) into [B, N, ...] buffers at the step a device tensor holds: the bits of
    fused_capture, and no other step touched."""
    for case in interpreted["at_step"]:
        assert case["written"] and case["same"] and case["others_untouched"], case
    with_token = [case for case in interpreted["at_step"] if case["next_token"] != [-7] * len(case["top1"])]
    assert len(with_token) == 2 and all(case["next_token"] == case["top1"] for case in with_token)
    # a step past the buffers' end: the merge runs (laid out as asked) but stores nothing in or past them
    assert interpreted["past_end"] == {"written": True, "untouched": True}


def test_ties_go_to_the_lower_index_and_nan_ranks_first(interpreted):
    by_name = {case["name"]: case for case in interpreted["cases"]}
    assert by_name["ties"]["ids"][0][:4] == [3, 40, 1200, 1499]
    assert by_name["nan"]["ids"][0][0] == 1050
    assert by_name["signed-zeros"]["ids"][0] == [0, 1, 2]  # -0.0 ties 0.0: index order, not sign


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_fused_capture_matches_torch_eager_compiled_and_graphed(dtype):
    from evalrun.engine.capture_triton import capture_kernel, fused_capture, prepare

    prepare("cuda")  # where capture buffers are allocated, eagerly
    assert capture_kernel("cuda", dtype, 8) == "triton-fused"
    logits = (torch.randn(4, 128256, device="cuda") * 3).to(dtype)  # Llama-3's vocabulary
    digest, ids, values, margin = fused_capture(logits, 8)
    assert torch.equal(digest, logits_digest(logits))
    assert torch.equal(digest.cpu(), logits_digest(logits.cpu()))  # CPU and GPU agree on the bytes
    for row in range(4):
        want = stable_topk(logits[row].float().cpu().numpy(), 8)
        assert ids[row].tolist() == want.tolist()
    assert torch.equal(values, logits.gather(1, ids).float()) and torch.equal(margin, values[:, 0] - values[:, 1])

    compiled = torch.compile(lambda x: fused_capture(x, 8), fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(compiled(logits), (digest, ids, values, margin)))
    static = logits.clone()
    graph = torch.cuda.CUDAGraph()
    fused_capture(static, 8)  # warm-up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = fused_capture(static, 8)
    static.copy_(logits.flip(1))
    graph.replay()
    assert torch.equal(out[0], logits_digest(logits.flip(1)))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("level", ["0", "2"])
def test_gpu_runs_store_the_same_digests_with_either_capture(level):
    """An -O0 and an -O2 run on the GPU: the fused kernel and the torch capture store the same digests and tokens
    (with the fused kernel a greedy step takes its token from the kernel's top-1, with the torch capture from
    argmax)."""
    from evalrun.config import RunConfig
    from evalrun.engine import generate
    from evalrun.runner import execute_run

    def digests(fused: bool) -> tuple[list[str], str, int]:
        originals = generate.fused_capture_supported, generate.fused_capture, generate.fused_capture_at_step
        calls = []

        def counted(kernel):
            def call(*args):
                calls.append(kernel.__name__)
                return kernel(*args)
            return call

        generate.fused_capture, generate.fused_capture_at_step = counted(originals[1]), counted(originals[2])
        if not fused:
            generate.fused_capture_supported = lambda logits, top_k: False
        try:
            run = execute_run(RunConfig(model="random:tiny", device="cuda", dtype="bfloat16", prompts="smoke",
                                        max_new_tokens=8, opt_level=int(level)), None)
        finally:
            generate.fused_capture_supported, generate.fused_capture, generate.fused_capture_at_step = originals
        torch._dynamo.reset()
        return ([(r.logits_digest, r.tokens_digest) for r in run.results], run.evidence["capture_kernel"],
                calls)

    fused, kernel, fused_calls = digests(True)
    plain, _, plain_calls = digests(False)
    assert kernel == "triton-fused" and fused_calls and set(fused_calls) == {"fused_capture_at_step"}
    assert plain_calls == []
    assert fused == plain


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_gpu_a_greedy_token_from_the_fused_capture_is_argmaxs_choice(dtype, monkeypatch):
    """A greedy step captured by the fused kernel takes the kernel's top-1 as its token instead of reading the logits
    again for argmax: the same choice at exact ties (the lower id), at NaN (the first), at -0.0 beside 0.0, at
    +inf and on a row of -inf. float64 logits keep argmax: two of them may share a float32 key."""
    from evalrun.engine import generate
    from evalrun.engine.capture_triton import prepare

    prepare("cuda")
    vocab = 128256
    logits = torch.randn(8, vocab, device="cuda", dtype=torch.float64) * 3
    logits[1, [5000, 70000, 90000]] = 50.0  # an exact tie: the lowest id
    logits[2, [100000, 7]] = float("nan")  # two NaNs: the first
    logits[3] = -torch.rand(vocab, device="cuda", dtype=torch.float64) - 1
    logits[3, [900, 30]] = -0.0
    logits[3, 2000] = 0.0
    logits[4, [60000, 129]] = float("inf")
    logits[5] = float("-inf")
    logits[6] = -torch.rand(vocab, device="cuda", dtype=torch.float64) - 1
    logits[6, 50], logits[6, 100] = 1.0, 1.0 + 2.0 ** -40  # in float64 100 is larger; in float32 both are 1.0
    logits = logits.to(dtype)
    steps, top_k = 2, 8
    spec = generate.BatchSpec(prompts=[[1]] * 8, steps=steps, pad_id=0, top_k=top_k)
    buffers = generate.CaptureBuffers.allocate(8, steps, vocab, spec, dtype, torch.device("cuda"))
    step, seeds = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(8, dtype=torch.int64, device="cuda")
    chosen = []
    real_choose = generate.choose_token
    monkeypatch.setattr(generate, "choose_token", lambda *args: chosen.append(1) or real_choose(*args))
    token = generate.capture_step(logits, step, buffers, top_k, 0.0, seeds)
    assert chosen == ([1] if dtype == torch.float64 else [])  # the kernel's top-1, not argmax, but for float64
    assert torch.equal(token, logits.argmax(dim=-1)), (token, logits.argmax(dim=-1))
    assert token[1] == 5000 and token[2] == 7 and token[3] == 30 and token[4] == 129 and token[5] == 0
    assert token[6] == (100 if dtype == torch.float64 else 50)  # float64: argmax's; the kernel's top-1 would be 50


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_the_merge_kernel_gives_the_torch_merges_bits(dtype, monkeypatch):
    """Compiled on the GPU, eagerly and under torch.compile: the merge kernel's digest, ids, values and margins are
    the torch merge's bits at Llama-3's vocabulary, with ties, NaN and signed zeros, at top-k 3, 8 and 32 (126 x 32 =
    4,096 candidates: the most one program merges); at 64 the torch merge runs."""
    from evalrun.engine import capture_triton

    capture_triton.prepare("cuda")
    logits = (torch.randn(4, 128256, device="cuda") * 3)
    logits[1, [5, 90000, 128000]] = 40.0
    logits[2, [77, 1000]] = float("nan")
    logits[3] = -torch.rand(128256, device="cuda") - 1
    logits[3, [64, 3]] = -0.0
    logits[3, 2048] = 0.0
    logits = logits.to(dtype)
    merges = []
    real_merge = capture_triton._OP["merge"]
    monkeypatch.setitem(capture_triton._OP, "merge", lambda *args: merges.append(1) or real_merge(*args))

    def bits(outputs):
        return [t.view(torch.int32) if t.dtype == torch.float32 else t for t in outputs]

    for top_k, merged_in_kernel in ((3, True), (8, True), (32, True), (64, False)):
        for run in (lambda x: capture_triton.fused_capture(x, top_k),
                    torch.compile(lambda x: capture_triton.fused_capture(x, top_k), fullgraph=True)):
            torch._dynamo.reset()
            merges.clear()
            kernel = bits(run(logits))
            assert bool(merges) == merged_in_kernel, (top_k, merges)  # the kernel merged them (eagerly or traced)
            monkeypatch.setattr(capture_triton, "MERGE_IN_KERNEL", False)
            torch._dynamo.reset()
            reference = bits(run(logits))
            monkeypatch.setattr(capture_triton, "MERGE_IN_KERNEL", True)
            assert all(torch.equal(a, b) for a, b in zip(kernel, reference)), top_k
        assert torch.equal(capture_triton.fused_capture(logits, top_k)[1][:, 0], logits.argmax(dim=-1))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,temperature", [(torch.bfloat16, 0.0), (torch.float32, 0.0), (torch.bfloat16, 0.7),
                                               (torch.float64, 0.0)])
def test_gpu_a_step_captured_into_the_buffers_by_the_merge_kernel_has_the_copies_bits(dtype, temperature, monkeypatch):
    """Four steps of capture_step replayed from one CUDA graph (the step counter advancing on the device): the merge
    kernel writing the buffers and the next token itself gives, bit for bit, what the merge's outputs copied in by
    index copies gave (MERGE_INTO_BUFFERS off) -- greedy (the token from the kernel), sampled and float64 (the token
    from choose_token)."""
    from evalrun.engine import capture_triton, generate

    capture_triton.prepare("cuda")
    rows, steps, vocab, top_k = 3, 4, 128256, 8
    logits = [(torch.randn(rows, vocab, device="cuda") * 3).to(dtype) for _ in range(steps)]
    logits[1][0, [11, 99000]] = 30.0  # an exact tie at one step

    def replayed(into_buffers: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(capture_triton, "MERGE_INTO_BUFFERS", into_buffers)
        spec = generate.BatchSpec(prompts=[[1]] * rows, steps=steps, pad_id=0, top_k=top_k)
        buffers = generate.CaptureBuffers.allocate(rows, steps, vocab, spec, dtype, torch.device("cuda"))
        static, step = torch.empty_like(logits[0]), torch.zeros(1, dtype=torch.int64, device="cuda")
        seeds = torch.arange(rows, dtype=torch.int64, device="cuda")
        next_token = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
        tokens = []

        def one_step():
            generate.capture_step(static, step, buffers, top_k, temperature, seeds, True, next_token)
            step.add_(1)

        static.copy_(logits[0])
        one_step()  # warm-up outside the capture, as the engine's modes do
        step.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_step()
        step.zero_()
        for values in logits:
            static.copy_(values)
            graph.replay()
            tokens.append(next_token.clone())
        return [buffers.tokens, buffers.digests, buffers.topk_ids, buffers.topk_values.view(torch.int32),
                buffers.margins.view(torch.int32), torch.stack(tokens)]

    into, copied = replayed(True), replayed(False)
    assert all(torch.equal(a, b) for a, b in zip(into, copied))
    assert torch.equal(into[0].T, into[5])  # the next input is the step's recorded token
    if temperature == 0.0:
        assert torch.equal(into[0].T, torch.stack([values.argmax(dim=-1) for values in logits]))
    assert torch.equal(into[1][:, 2], logits_digest(logits[2]))
