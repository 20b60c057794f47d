"""What attention costs in a decode step: by SDPA backend, and by the engine's split-KV kernel (issue #16).

  python benchmarks/decode_attention.py [--layers 32] [--json PATH]

The engine's decode attention at batch 1 on Llama-3-8B's shapes: the 4 query heads that share a key/value
head stacked as 4 query rows of that head (q [1, 8, 4, 128]), keys and values [1, 8, S, 128] of distinct
caches per layer, and the engine's additive mask [1, 1, 4, S] (transformer.build_mask). Each SDPA backend
that takes the mask (cuDNN, memory-efficient, math) is timed per layer over `--layers` layers replayed from
one CUDA graph, at several cache lengths S, beside the bytes of keys and values it must read.

Beside them, the engine's split-KV decode attention (`attention_kernel=triton-split-kv`,
engine/attention_triton.py; flash-decoding), at its chunk count (about 16 per head) and at 8 and 32. SDPA's
time grows with the cache far slower than its bytes allow (88.9 us a layer for 16.8 MB at 4096 slots, 0.19
TB/s, in the first run), as if a few programs walked each head's whole cache; the split-KV kernel cuts each
head's cache into chunks of whole 64-slot blocks, one program each, and combines them in a fixed order, so
the bits depend on the shapes alone: by a second kernel, or (as the engine runs it eagerly since stop 19) by
each head's last program to finish, the row "one kernel" beside "two kernels" at the same chunking. The
prototype of this kernel, measured the same way before it was built in, is in
`benchmarks/results/h200-decode-attention-split-kv.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_breakdown import graphed_ms, per_layer_arguments  # noqa: E402
from evalrun.engine.attention_triton import BLOCK_S, arrival_counters, chunk_for  # noqa: E402
from evalrun.engine.attention_triton_kernel import launch  # noqa: E402
from evalrun.engine.transformer import build_mask  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def main() -> None:
    args = per_layer_arguments(__doc__)
    bf16, cuda = torch.bfloat16, "cuda"
    rows_per_head = HEADS // KV_HEADS
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "us_per_layer": {}}
    for slots in (144, 256, 1024, 4096):  # 144: a 16-slot prompt bucket + 128 steps, the bench's context
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
        arrivals = arrival_counters(q.device)
        for target, counters in ((8, None), (16, None), (32, None), (16, arrivals)):
            def split(k, v, target=target, counters=counters):
                return launch(q, k, v, mask, HEAD_DIM ** -0.5, chunk_for(slots, target), BLOCK_S, arrivals=counters)
            us = graphed_ms(split, caches, warmups=2) * 1000
            difference = float((split(*caches[0]).float() - reference.float()).abs().max())
            kernels = "one kernel, the last program combining" if counters is not None else "two kernels"
            report["us_per_layer"][f"S={slots} triton split-KV ~{target} chunks, {kernels}"] = {
                "us": us, "max_abs_difference_from_default": difference, "kv_mb": 2 * caches[0][0].nbytes / 1e6,
                "chunk": chunk_for(slots, target)}
    print(f"{report['device']}  torch {report['torch']}  per layer, one CUDA graph over {args.layers} layers")
    for name, row in report["us_per_layer"].items():
        us = f"{row['us']:7.2f} us" if row["us"] is not None else "refused"
        print(f"  {name:72s} {us}  ({row['kv_mb']:.1f} MB of keys and values)  "
              f"{row['max_abs_difference_from_default']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
