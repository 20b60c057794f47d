"""Why the split-KV kernel's float32 bits differed compiled against eager in the GPU suite (stops 16-18).

  python benchmarks/split_kv_compile_bits.py OUT.json     (CUDA)

`tests/test_attention_triton.py` compiled one lambda (one code object) at 144, then 4,096, then 1,000 cache
slots. Each sequence below compiles such a lambda per case, in order, Dynamo reset first, and counts the values of
the compiled op's output that differ from the eager op's (eager: one kernel, each head's last program combining;
compiled: traced, a second kernel combining; the same code and order). Sequences: the 1,000-slot float32 case
alone; in the test's order as torch.compile defaults (dynamic=None: Dynamo's automatic dynamic shapes make the
cache length symbolic once it has changed); the same with dynamic=False; with automatic dynamic shapes off; and
dynamic=True (every dimension symbolic), which Inductor refused to compile on torch 2.11 (`KeyError: 'op6'`).
Result on the H200: `benchmarks/results/h200-split-kv-compile-bits.json`.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evalrun.engine import attention_triton  # noqa: E402
from evalrun.engine.transformer import attention, build_mask  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
TEST_ORDER = [(144, BF16), (4096, BF16), (1000, F32)]  # the test's cases, in its order


def case(slots: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The test's inputs at `slots` cache slots: q [1, 32, 1, 128], k/v [1, 8, S, 128], the mask of S - 7 keys."""
    generator = torch.Generator(device="cuda").manual_seed(slots)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=dtype, generator=generator)
    k, v = (torch.randn(1, 8, slots, 128, device="cuda", dtype=dtype, generator=generator) for _ in range(2))
    valid = torch.zeros(1, slots, dtype=torch.bool, device="cuda")
    valid[:, :slots - 7] = True
    return q, k, v, build_mask(torch.tensor([slots - 8], device="cuda"), valid, 4, dtype)


def closed_over(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    return lambda query: attention(query, k, v, mask, "sdpa", kernel="triton-split-kv")  # one code object


def sequence(cases: list[tuple[int, torch.dtype]], dynamic: bool | None = None) -> list[dict]:
    """Each case compiled in order (Dynamo reset first): values differing compiled against eager, and by how much."""
    torch._dynamo.reset()
    rows = []
    for slots, dtype in cases:
        q, k, v, mask = case(slots, dtype)
        forward = closed_over(k, v, mask)
        got, eager = torch.compile(forward, fullgraph=True, dynamic=dynamic)(q), forward(q)
        rows.append({"slots": slots, "dtype": str(dtype), "differ": int((got != eager).sum()),
                     "gap": float((got.double() - eager.double()).abs().max())})
    return rows


def main() -> None:
    attention_triton.prepare("triton-split-kv", "cuda")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["1000-f32 alone"] = sequence([(1000, F32)])
    report["test order, dynamic=None"] = sequence(TEST_ORDER)
    report["test order, dynamic=False"] = sequence(TEST_ORDER, dynamic=False)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        report["test order, automatic_dynamic_shapes off"] = sequence(TEST_ORDER)
    report["144f then 1000f, dynamic=None"] = sequence([(144, F32), (1000, F32)])
    try:
        report["1000-f32 dynamic=True"] = sequence([(1000, F32)], dynamic=True)
    except Exception as error:  # torch 2.11: Inductor's scheduler fails on the symbolic shapes of the op
        report["1000-f32 dynamic=True"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    for name, rows in report.items():
        print(f"{name:42s} {rows}")
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
