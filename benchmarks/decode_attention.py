"""What attention costs in a decode step, by SDPA backend, before anyone builds a decode kernel (issue #16).

  python benchmarks/decode_attention.py [--layers 32] [--json PATH]

The engine's decode attention at batch 1 on Llama-3-8B's shapes: the 4 query heads that share a key/value
head stacked as 4 query rows of that head (q [1, 8, 4, 128]), keys and values [1, 8, S, 128] of distinct
caches per layer, and the engine's additive mask [1, 1, 4, S] (transformer.build_mask). Each SDPA backend
that takes the mask (cuDNN, memory-efficient, math) is timed per layer over `--layers` layers replayed from
one CUDA graph, at several cache lengths S, beside the bytes of keys and values it must read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_breakdown import graphed_ms  # noqa: E402
from evalrun.engine.transformer import build_mask  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16, cuda = torch.bfloat16, "cuda"
    rows_per_head = HEADS // KV_HEADS
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "us_per_layer": {}}
    for slots in (256, 1024, 4096):
        q = torch.randn(1, KV_HEADS, rows_per_head, HEAD_DIM, dtype=bf16, device=cuda)
        caches = [(torch.randn(1, KV_HEADS, slots, HEAD_DIM, dtype=bf16, device=cuda),
                   torch.randn(1, KV_HEADS, slots, HEAD_DIM, dtype=bf16, device=cuda)) for _ in range(args.layers)]
        used = slots // 2  # half the cache written so far; the rest hidden by the mask
        key_valid = torch.zeros(1, slots, dtype=torch.bool, device=cuda)
        key_valid[:, :used] = True
        mask = build_mask(torch.tensor([used - 1], device=cuda), key_valid, rows_per_head, bf16)
        reference = F.scaled_dot_product_attention(q, *caches[0], attn_mask=mask)
        for name, backend in BACKENDS.items():
            def attend(k, v, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            try:
                us = graphed_ms(attend, caches, warmups=2) * 1000
                difference = float((attend(*caches[0]).float() - reference.float()).abs().max())
            except RuntimeError as error:  # a backend that refuses these shapes or the mask
                us, difference = None, str(error).splitlines()[0][:120]
            report["us_per_layer"][f"S={slots} {name}"] = {"us": us, "max_abs_difference_from_default": difference,
                                                           "kv_mb": 2 * caches[0][0].nbytes / 1e6}
    print(f"{report['device']}  torch {report['torch']}  per layer, one CUDA graph over {args.layers} layers")
    for name, row in report["us_per_layer"].items():
        us = f"{row['us']:7.2f} us" if row["us"] is not None else "refused"
        print(f"  {name:20s} {us}  ({row['kv_mb']:.1f} MB of keys and values)  {row['max_abs_difference_from_default']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
