"""Does programmatic dependent launch (PDL) hide the GEMV's kernel boundaries? (issue #16)

  python benchmarks/gemv_pdl.py [--layers 32] [--json PATH]

A decode step's small projections read their weights well under the bandwidth: per layer on the H200 q/k/v
(50 MB) about 14.7 us, o (33.5 MB) 11.2 us, down (117 MB) 29.4 us: a line through them costs about 4 us a
kernel before any weight streams (launch, the first loads, the tail). With PDL a kernel lets the next one launch
early (`gdc_launch_dependents`); the next waits (`gdc_wait`) before it reads what the one before wrote. Each
projection of Llama-3-8B's shape, over every layer's weights in turn in one CUDA graph (the L2 never holds them),
by the engine's GEMV launched three ways: as now; with PDL; with PDL and the first weight tile asked for before the
wait. Twice each: every GEMV reading the same input (independent), and each reading the one before's output
(a chain, where the wait matters). Same bits in every variant (checked).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_breakdown import graphed_ms, per_layer_arguments  # noqa: E402
from evalrun.engine import linear  # noqa: E402
from evalrun.engine.linear_triton_kernel import launch  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
VARIANTS = {"as now": 0, "PDL": 1, "PDL, first tile before the wait": 2}


def main() -> None:
    args = per_layer_arguments(__doc__)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers, "rows": {}}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(args.layers)]
        blocks = linear.blocks(1, weights[0])
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k * 2
        outputs = {}
        for label, pdl in VARIANTS.items():
            def independent(w, pdl=pdl):
                return launch(x, w, None, *blocks, pdl=pdl)

            def chain(w, pdl=pdl):  # the next reads this one's output (its first k columns, n >= k or padded)
                y = launch(chain.x, w, None, *blocks, pdl=pdl)
                chain.x = y[:, :k] if n >= k else torch.nn.functional.pad(y, (0, k - n))
                return y

            for how, step in (("independent", independent), ("chain", chain)):
                chain.x = x
                us = graphed_ms(step, [(w,) for w in weights]) * 1000
                report["rows"].setdefault(name, {})[f"{label}, {how}"] = {"us": us, "tb_per_s": nbytes / us / 1e6}
            chain.x = x
            outputs[label] = [chain(w) for w in weights] + [independent(w) for w in weights]
        report["rows"][name]["same bits"] = all(torch.equal(a, b) for label in VARIANTS
                                                for a, b in zip(outputs["as now"], outputs[label]))
    for name, rows in report["rows"].items():
        print(f"{name}: same bits {rows['same bits']}")
        for label, row in rows.items():
            if label != "same bits":
                print(f"  {label:45s} {row['us']:7.2f} us  {row['tb_per_s']:.2f} TB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
