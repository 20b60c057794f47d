"""Piecewise CUDA graphs (engine/piece_graphs.py): each compiled piece call in a graph of its own, attention eager
between them. On the CPU the graphs are stood in for by a backend that reruns the captured work, which checks
everything but the capture itself: the numbering of calls, what is read in place and what is copied, the shared
output buffers, a capture again when an argument moved. The GPU test runs real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from evalrun.config import CompilationMode, CUDAGraphMode
from evalrun.engine.driver import generate_batch
from evalrun.engine.generate import BatchSpec
from evalrun.engine.modes import ExecutionMode, allow_recompiles_for
from evalrun.engine.piece_graphs import PieceGraphs, RerunGraphs, storages
from evalrun.engine.transformer import Transformer
from evalrun.models import load_model


def runs(device: str, dtype: str, graphed_backend) -> tuple[list, ExecutionMode, Transformer]:
    """The same batch through the compiled pieces without graphs, then with piecewise graphs (warm-up, capture,
    two replays): their outputs, the graphed mode and its transformer."""
    loaded = load_model("random:tiny", device, dtype)
    transformer = Transformer(loaded.model)
    prompts = [loaded.tokenizer("Each piece in its own graph")["input_ids"], loaded.tokenizer("Attention")["input_ids"]]
    spec = BatchSpec(prompts, 6, pad_id=0, keep_logits=True)
    outputs = []
    for graphs in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        torch._dynamo.reset()
        mode = ExecutionMode(transformer, CompilationMode.PIECEWISE, graphs, prefill_buckets=(16,), batch_buckets=(2,))
        allow_recompiles_for(mode.prefill_buckets, mode.batch_buckets)
        if mode.piece_graphs and graphed_backend is not None:
            mode.piece_graphs.backend = graphed_backend
        for _ in range(mode.calls_to_warm):
            generate_batch(transformer, spec, mode)
        mode.start_measuring()
        outputs += [generate_batch(transformer, spec, mode) for _ in range(2)]
    return outputs, mode, transformer


def check(outputs: list, mode: ExecutionMode, transformer: Transformer) -> None:
    plain, _, graphed, again = outputs
    for output in (graphed, again):
        assert output.tokens.tolist() == plain.tokens.tolist()
        assert output.logits.tobytes() == plain.logits.tobytes()
    evidence = mode.evidence()
    assert evidence["fallbacks"] == [], evidence["fallbacks"]
    layers = len(transformer.layers)
    per_forward = 2 + 2 * layers  # prologue, each layer's pre-attention and post-attention, head
    assert evidence["piece_graph_captures_warmup"] == 2 * per_forward  # the prefill's pieces and the decode step's
    assert evidence["piece_graph_captures"] == 0 and evidence["piece_graph_recaptures"] == 0
    assert evidence["piece_graph_replays"] == 2 * 6 * per_forward  # two batches: a prefill and five decode steps
    graphs = mode.piece_graphs
    workspace = next(iter(mode.workspaces.values()))
    # the last forward (a decode step) copied each layer's attention output; never a weight, the KV cache, a buffer
    # of the graphs' own, or the prologue's token, position and slot (the workspace's own token and counters)
    copied = set(graphs.copied_storages)
    assert not copied & storages(transformer.weights()) and not copied & storages(workspace)
    assert len(graphs.copied_storages) == layers
    # one buffer per piece output and shape: the residual stream is shared by every layer
    assert len({key for key in graphs.buffers if key[:2] == ("out", "post_attention")}) == 2  # prefill, decode
    assert len({key for key in graphs.buffers if key[:2] == ("in", "post_attention")}) == 2  # attention outputs


def test_piecewise_graphs_replay_the_pieces_with_their_own_bits_reading_weights_in_place():
    check(*runs("cpu", "float32", RerunGraphs()))


def test_a_call_whose_stable_argument_moved_is_captured_again_with_the_same_bits():
    """A replay checks that each tensor read in place is still where its graph read it; one that moved (here a
    layer's weight, replaced by a copy) makes that call capture again, never read the old address."""
    loaded = load_model("random:tiny", "cpu", "float32")
    transformer = Transformer(loaded.model)
    spec = BatchSpec([loaded.tokenizer("Moved")["input_ids"]], 3, pad_id=0, keep_logits=True)
    mode = ExecutionMode(transformer, CompilationMode.PIECEWISE, CUDAGraphMode.PIECEWISE, prefill_buckets=(16,),
                         batch_buckets=(1,))
    mode.piece_graphs.backend = RerunGraphs()
    for _ in range(mode.calls_to_warm):
        first = generate_batch(transformer, spec, mode)
    layer = transformer.layers[0]
    original = layer.qkv
    layer.qkv = original.clone()  # the same values elsewhere: not registered, so copied into the graph's buffer
    try:
        moved = generate_batch(transformer, spec, mode)
    finally:
        layer.qkv = original
    # layer 0's pre-attention, once in the prefill and once in the decode steps (the second step's copy matches)
    assert mode.piece_graphs.counts["piece_graph_recaptures"] == 2
    assert moved.logits.tobytes() == first.logits.tobytes()


def test_a_forward_that_calls_other_pieces_than_recorded_is_refused():
    graphs = PieceGraphs(RerunGraphs())
    double = graphs.wrap("double", lambda x: x * 2)
    square = graphs.wrap("square", lambda x: x * x)
    x = torch.arange(4.0)
    for _ in range(3):
        graphs.begin(("step",))
        assert double(x).tolist() == [0.0, 2.0, 4.0, 6.0]
    graphs.begin(("step",))
    with pytest.raises(RuntimeError, match="call 0 of this forward is square, where the first forward had double"):
        square(x)


@pytest.mark.gpu
def test_gpu_piecewise_graphs_replay_the_pieces_with_their_own_bits_reading_weights_in_place():
    """Real CUDA graphs, one per piece call (the default backend): the bits of the graphless pieces, weights and the
    KV cache read in place."""
    outputs, mode, transformer = runs("cuda", "bfloat16", None)
    check(outputs, mode, transformer)
    assert mode.kernel_launches_per_decode_step is not None
