"""The decode step's L2 prefetch (engine/l2_prefetch.py): where it runs, that its kernel reads every word of a
weight once, and on the GPU that it changes no bit of a run.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported, so in
a child process)."""

import pytest

from conftest import run_under_triton_interpreter

READS_EVERY_WORD = r"""
import json
import numpy as np
import torch
from evalrun.engine.l2_prefetch_kernel import launch

cases = []
for words, programs, block in ((4096, 4, 256), (5000, 3, 256), (77, 8, 32), (1 << 16, 132, 1024)):
    values = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32)
    sink = torch.zeros(programs, dtype=torch.int32)
    launch(values, sink, block, 1)
    expected = np.bitwise_xor.reduce(values.numpy())
    cases.append({"words": words, "programs": programs, "folded": int(np.bitwise_xor.reduce(sink.numpy())),
                  "expected": int(expected), "untouched": bool((values.numpy() == values.numpy()).all())})
print(json.dumps(cases))
"""


def test_the_prefetch_kernel_reads_every_word_of_the_weight_once():
    """xor over the programs' sinks equals xor over the weight's words: each word read exactly once (a word
    read twice or never would change it), for sizes that split evenly over the programs and sizes that do not."""
    for case in run_under_triton_interpreter(READS_EVERY_WORD):
        assert case["folded"] == case["expected"], case


@pytest.mark.parametrize("graphs", ["none", "piecewise", "full", "full-and-piecewise"])
def test_only_a_decode_step_captured_whole_on_cuda_prefetches(graphs):
    """No prefetcher on CPU, nor where the decode step is not one CUDA graph; the prefill never prefetches."""
    from evalrun.config import CompilationMode, CUDAGraphMode
    from evalrun.engine.modes import ExecutionMode
    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    transformer = Transformer(load_model("random:tiny", "cpu", "float32").model)
    mode = ExecutionMode(transformer, CompilationMode.PIECEWISE, CUDAGraphMode(graphs))
    assert mode.prefetched == () and mode.evidence()["l2_prefetch"] == []
    assert mode.decode_forward.__self__.l2 is None and mode.prefill_forward.__self__.l2 is None
    assert transformer.l2 is None


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["full", "full-and-piecewise"])
def test_gpu_the_prefetch_changes_no_bit_and_is_recorded(graphs):
    """-O2's decode graph with the output projection (and the next q/k/v) prefetched into L2 gives the same
    tokens and logits, bit for bit, as without; the evidence names what was prefetched; no fallback."""
    import torch

    from evalrun.config import CompilationMode, CUDAGraphMode
    from evalrun.engine.driver import generate_batch
    from evalrun.engine.generate import BatchSpec
    from evalrun.engine.modes import ExecutionMode, allow_recompiles_for
    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    loaded = load_model("random:tiny", "cuda", "bfloat16")
    prompts = [loaded.tokenizer("The weights are read early")["input_ids"], loaded.tokenizer("L2")["input_ids"]]
    spec = BatchSpec(prompts, 12, pad_id=0, keep_logits=True)
    outputs = []
    for targets in ((), ("o",), ("o", "qkv")):
        torch._dynamo.reset()
        mode = ExecutionMode(Transformer(loaded.model), CompilationMode.PIECEWISE, CUDAGraphMode(graphs),
                             prefill_buckets=(16,), batch_buckets=(2,), l2_prefetch=targets)
        allow_recompiles_for(mode.prefill_buckets, mode.batch_buckets)
        generate_batch(mode.transformer, spec, mode)
        mode.start_measuring()
        outputs.append(generate_batch(mode.transformer, spec, mode))
        evidence = mode.evidence()
        assert evidence["l2_prefetch"] == list(targets) and evidence["fallbacks"] == [], evidence
        assert evidence["cudagraph_replays"] > 0
    for other in outputs[1:]:
        assert other.tokens.tolist() == outputs[0].tokens.tolist()
        assert other.logits.tobytes() == outputs[0].logits.tobytes()
