"""Measured and dropped (stop 20): does an L2 prefetch of a projection's weights, issued before a latency-bound
kernel (attention's place in the step, stood in for by torch.cuda._sleep), speed the GEMV after it? 32 layers' weights
in one CUDA graph, per-layer time. `python benchmarks/l2_prefetch.py` (N=6144 for q/k/v, SLEEP=cycles).
Results: benchmarks/results/h200-l2-prefetch.json."""
import json, sys, os
import torch
import triton
import triton.language as tl
import torch.nn.functional as F
sys.path.insert(0, os.getcwd())
from evalrun.engine.linear_triton_kernel import launch

@triton.jit
def bulk_prefetch_kernel(ptr, nbytes, SUB: tl.constexpr, LANES: tl.constexpr):
    """Each lane asks L2 to fetch SUB bytes from ptr (bytes) with one cp.async.bulk.prefetch; returns at once."""
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * SUB  # [LANES]
    size = tl.minimum(nbytes - offs, SUB).to(tl.int32)
    size = tl.where(size > 0, size, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def line_prefetch_kernel(ptr, nbytes, LINES: tl.constexpr):
    """Each thread prefetches 128-byte lines into L2 with prefetch.global.L2."""
    offs = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * 128
    ok = (offs < nbytes).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + offs, ok], dtype=tl.int32, is_pure=False, pack=1)


torch.manual_seed(0)
dev = "cuda"
L, N, K = 32, int(os.environ.get("N", 4096)), 4096
ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(L)]
x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
nbytes = N * K * 2
SLEEP = int(os.environ.get("SLEEP", 14000))

def gemv(w):
    return launch(x, w, None, 8, 512, 4)

def cublas(w):
    return F.linear(x, w)

def bulk(w, frac=1.0, sub=65536):
    nb = int(nbytes * frac) // 16 * 16
    lanes = 32
    grid = (triton_cdiv(nb, sub * lanes),)
    bulk_prefetch_kernel[grid](w.view(torch.uint8).view(-1), nb, SUB=sub, LANES=lanes, num_warps=1)

def line(w, frac=1.0):
    nb = int(nbytes * frac)
    lines = 1024
    line_prefetch_kernel[(triton_cdiv(nb, 128 * lines),)](w.view(torch.uint8).view(-1), nb, LINES=lines, num_warps=4)

def triton_cdiv(a, b):
    return (a + b - 1) // b

def variant(pre, mm, sleep=True):
    def body():
        for w in ws:
            if pre is not None:
                pre(w)
            if sleep:
                torch.cuda._sleep(SLEEP)
            mm(w)
    return body

def timed(body, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / L)
    times.sort()
    return times[len(times) // 2]

rows = {}
rows["sleep only"] = timed(variant(None, lambda w: None))
rows["gemv alone (no sleep)"] = timed(variant(None, gemv, sleep=False))
rows["cublas alone (no sleep)"] = timed(variant(None, cublas, sleep=False))
rows["sleep + gemv"] = timed(variant(None, gemv))
rows["sleep + cublas"] = timed(variant(None, cublas))
rows["bulk + sleep only"] = timed(variant(bulk, lambda w: None))
rows["bulk + sleep + gemv"] = timed(variant(bulk, gemv))
rows["bulk + sleep + cublas"] = timed(variant(bulk, cublas))
rows["bulk half + sleep + gemv"] = timed(variant(lambda w: bulk(w, 0.5), gemv))
rows["bulk 16K + sleep + gemv"] = timed(variant(lambda w: bulk(w, 1.0, 16384), gemv))
rows["line + sleep + gemv"] = timed(variant(line, gemv))
rows["bulk + gemv (no sleep)"] = timed(variant(bulk, gemv, sleep=False))
# bits: the prefetch changes nothing
ref = [gemv(w) for w in ws]
for w in ws: bulk(w)
same = all(torch.equal(r, gemv(w)) for r, w in zip(ref, ws))
out = {"N": N, "K": K, "sleep_cycles": SLEEP, "us_per_layer": {k: round(v, 3) for k, v in rows.items()}, "bits_same": same,
       "device": torch.cuda.get_device_name()}
print(json.dumps(out, indent=1))

# the ceiling: the same weight every layer (L2-resident after the first), and a side-stream prefetch
side = torch.cuda.Stream()
def hot_body():
    for w in ws:
        torch.cuda._sleep(SLEEP)
        gemv(ws[0])
def side_body(frac=1.0):
    def body():
        main = torch.cuda.current_stream()
        for w in ws:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                bulk(w, frac)
            torch.cuda._sleep(SLEEP)
            gemv(w)
        main.wait_stream(side)
    return body
more = {"sleep + gemv, weight L2-hot": timed(hot_body), "side-stream bulk + sleep + gemv": timed(side_body()),
        "side-stream bulk half + sleep + gemv": timed(side_body(0.5)), "sleep + gemv (again)": timed(variant(None, gemv))}
print(json.dumps({k: round(v, 3) for k, v in more.items()}))
