"""Qwen3-MoE in evalrun's engine (engine/moe.py): it matches transformers over a greedy decode, in every
CPU execution mode, and each step's routing (chosen experts, router margin) is captured."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from evalrun.engine.driver import generate_batch
from evalrun.engine.generate import BatchSpec
from evalrun.engine.model_support import check_config
from evalrun.engine.transformer import Transformer
from evalrun.errors import UnsupportedModelError
from evalrun.models import byte_tokenizer, load_model
from evalrun.store import Store
from test_model_support import MAX_ABS_LOGITS, STEPS, TINY, _hf_greedy, _randomize

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
PROMPT = "The engine must compute this model and no other"


def moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY, **MOE, "head_dim": 32, "architectures": ["Qwen3MoeForCausalLM"], **overrides})


def moe_checkpoint(directory: Path, seed: int = 0, fused_experts: bool = False, **overrides) -> Path:
    """A tiny random Qwen3-MoE checkpoint saved by transformers (router, experts, norms all random).

    By default in the Hub's layout: one tensor per expert and projection, which transformers fuses as it loads.
    `fused_experts` saves the experts as transformers holds them instead (one gate/up and one down tensor a
    layer): the same model, bit for bit, loaded 10x faster at 128 experts x 24 layers (0.4 s against 4)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(**overrides))
    _randomize(model, seed)
    if fused_experts:
        directory.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(directory)
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    else:
        model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


CASES = {
    "qwen3-moe": {},
    "qwen3-moe-unnormalized-top3": {"norm_topk_prob": False, "num_experts_per_tok": 3},
    "qwen3-moe-sparse-step-2": {"decoder_sparse_step": 2, "num_hidden_layers": 3},
    "qwen3-moe-mlp-only-layer-0": {"mlp_only_layers": [0]},
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_moe_matches_transformers_over_a_32_token_greedy_decode(tmp_path, case):
    loaded = load_model(str(moe_checkpoint(tmp_path / case, **CASES[case])), "cpu", "float32")
    assert loaded.model.config.model_type == "qwen3_moe"
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    transformer = Transformer(loaded.model, "sdpa")
    out = generate_batch(transformer, BatchSpec([ids], STEPS, pad_id=0, keep_logits=True))
    expected_tokens, expected_logits = _hf_greedy(loaded.model, ids, STEPS)
    difference = float(np.abs(out.logits[0].view(np.float32) - expected_logits).max())
    print(f"{case}: max abs logits difference {difference:.2e}")
    assert out.tokens[0].tolist() == expected_tokens
    assert difference < MAX_ABS_LOGITS, difference
    assert np.abs(expected_logits).max() > 0.1
    dense_layers = sum(w.moe is None for w in transformer.layers)
    assert dense_layers == {"qwen3-moe-sparse-step-2": 2, "qwen3-moe-mlp-only-layer-0": 1}.get(case, 0)


def test_a_checkpoint_with_fused_experts_loads_as_the_same_model_as_the_hubs_layout(tmp_path):
    """The tests' fast layout (moe_checkpoint(fused_experts=True)) is the Hub layout's model, weight for weight."""
    hub, fused = (moe_checkpoint(tmp_path / name, seed=3, fused_experts=name == "fused") for name in ("hub", "fused"))
    from safetensors import safe_open

    with safe_open(str(hub / "model.safetensors"), "pt") as handle:
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in handle.keys()
    with safe_open(str(fused / "model.safetensors"), "pt") as handle:
        assert "model.layers.0.mlp.experts.gate_up_proj" in handle.keys()
    states = [load_model(str(path), "cpu", "float32").model.state_dict() for path in (hub, fused)]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return load_model(str(moe_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt")), "cpu", "float32")


def _generate(loaded, compilation: str, steps: int = 12):
    from evalrun.config import CompilationMode
    from evalrun.engine.modes import ExecutionMode, allow_recompiles_for

    transformer = Transformer(loaded.model, "sdpa")
    mode = ExecutionMode(transformer, CompilationMode(compilation))
    if mode.static:
        torch._dynamo.reset()
        allow_recompiles_for(mode.prefill_buckets, mode.batch_buckets)
    prompts = [loaded.tokenizer(PROMPT)["input_ids"], loaded.tokenizer("Routing")["input_ids"]]
    mode.plan(max(len(p) for p in prompts), steps)
    spec = BatchSpec(prompts, steps, pad_id=0)
    generate_batch(transformer, spec, mode)  # warm-up: compiles
    mode.start_measuring()
    return generate_batch(transformer, spec, mode), mode.evidence()


def test_routing_is_captured_per_step_and_moe_layer(moe_model):
    out, _ = _generate(moe_model, "none")
    assert out.routing_experts.shape == (2, 12, 2, 2) and out.routing_margins.shape == (2, 12, 2)
    experts = out.routing_experts
    assert ((experts >= 0) & (experts < 8)).all()
    assert (experts[..., 0] != experts[..., 1]).all()  # k distinct experts
    assert (out.routing_margins >= 0).all() and (out.routing_margins > 0).any()
    assert len({tuple(row) for row in experts.reshape(-1, 2).tolist()}) > 1  # routing varies by token


def test_routing_matches_transformers_router_choice(moe_model):
    """The captured experts and margin are the router's: recomputed from transformers' router logits."""
    model, steps = moe_model.model, 6
    ids = moe_model.tokenizer(PROMPT)["input_ids"]
    out = generate_batch(Transformer(model, "sdpa"), BatchSpec([ids], steps, pad_id=0))
    sequence = ids + out.tokens[0].tolist()
    with torch.no_grad():
        router_logits = model(torch.tensor([sequence]), output_router_logits=True).router_logits  # L x [S, E]
    for layer, logits in enumerate(router_logits):
        probs = torch.softmax(logits.float(), dim=-1)[len(ids) - 1:len(ids) - 1 + steps]  # the step tokens
        values, chosen = torch.topk(probs, 3, dim=-1)
        assert out.routing_experts[0, :, layer].tolist() == chosen[:, :2].tolist()
        np.testing.assert_allclose(out.routing_margins[0, :, layer], (values[:, 1] - values[:, 2]).numpy(), atol=1e-6)


def test_prompt_routing_is_each_prompt_tokens_router_choice_in_a_left_padded_batch(moe_model):
    """A prefill records the experts of every prompt token; in a batch of two prompts of different lengths each
    row's tokens before its last are those of its prompt routed alone by transformers (the shorter row left-padded:
    its experts sit at the end, as its tokens do)."""
    model = moe_model.model
    prompts = [moe_model.tokenizer(PROMPT)["input_ids"], moe_model.tokenizer("Routing")["input_ids"]]
    out = generate_batch(Transformer(model, "sdpa"), BatchSpec(prompts, 2, pad_id=0))
    padded = out.padded_length
    assert out.prompt_routing.shape == (2, padded, 2, 2) and padded == max(len(ids) for ids in prompts)
    for row, ids in enumerate(prompts):
        with torch.no_grad():
            router_logits = model(torch.tensor([ids]), output_router_logits=True).router_logits  # L x [P, E]
        for layer, logits in enumerate(router_logits):
            chosen = torch.topk(torch.softmax(logits.float(), dim=-1), 2, dim=-1).indices[:-1]  # [P - 1, k]
            recorded = out.prompt_routing[row, padded - len(ids):padded - 1, layer]
            assert recorded.tolist() == chosen.tolist(), (row, layer)


def _forced_routing_runs(loaded, compilation: str, steps: int = 8, graphs: str = "none"):
    """Two prompts, free then forced along the free run's tokens: with the free run's own routing (its steps' and
    its prompts'), with the routing of the first MoE layer at step 2 of row 0 replaced (an unchosen expert in, its
    k-th out), and with the first MoE layer's routing of row 1's first prompt token replaced (the shorter prompt:
    left-padded, so its tokens sit at other slots than row 0's)."""
    from evalrun.config import CompilationMode, CUDAGraphMode
    from evalrun.engine.modes import ExecutionMode, allow_recompiles_for

    transformer = Transformer(loaded.model, "sdpa")
    mode = ExecutionMode(transformer, CompilationMode(compilation), CUDAGraphMode(graphs))
    if mode.static:
        torch._dynamo.reset()
        allow_recompiles_for(mode.prefill_buckets, mode.batch_buckets)
    prompts = [loaded.tokenizer(PROMPT)["input_ids"], loaded.tokenizer("Routing")["input_ids"]]
    mode.plan(max(len(p) for p in prompts), steps)
    free = generate_batch(transformer, BatchSpec(prompts, steps, pad_id=0, keep_logits=True), mode)
    tokens = [free.tokens[row] for row in range(2)]
    own = [free.routing_experts[row] for row in range(2)]  # [N, L, k] each
    padded = free.padded_length
    own_prompt = [free.prompt_routing[row, padded - len(ids):padded - 1] for row, ids in enumerate(prompts)]
    forced = lambda routing, prompt: generate_batch(transformer, BatchSpec(  # noqa: E731
        prompts, steps, pad_id=0, keep_logits=True, forced_tokens=tokens, forced_routing=routing,
        forced_prompt_routing=prompt), mode)
    forced_own = forced(own, own_prompt)
    other = [experts.copy() for experts in own]
    other[0][2, 0] = [e for e in range(8) if e not in own[0][2, 0]][:1] + own[0][2, 0, :1].tolist()
    forced_other = forced(other, own_prompt)
    other_prompt = [experts.copy() for experts in own_prompt]
    other_prompt[1][0, 0] = [e for e in range(8) if e not in own_prompt[1][0, 0]][:1] + own_prompt[1][0, 0, :1].tolist()
    forced_other_prompt = forced(own, other_prompt)
    return free, forced_own, forced_other, other, (own_prompt, other_prompt, forced_other_prompt)


def _check_forced_routing(free, forced_own, forced_other, other, prompt_runs, exact: bool) -> None:
    """Each run's token is the argmax of its own logits. Forced along its own routing a run computes its free tokens
    and experts, and its free bits where `exact` (eagerly; compiled, the forced graph is not the free one and may
    round otherwise: a token then differs only at a near-tie, as the H200 showed once, piecewise with full graphs,
    stop 22). Forced along other experts
    at one step and layer, its logits leave the forced-own run's from that step on, in that row only, and it
    still records its own choice there."""
    from evalrun.compare import bits_to_float

    dtype = "bfloat16" if free.logits.dtype == np.int16 else "float32"
    ours, theirs = (bits_to_float(out.logits, dtype) for out in (forced_own, free))  # [B, N, V]
    for out in (free, forced_own, forced_other):  # each run's own choice is the argmax of its own logits
        assert np.array_equal(out.tokens, bits_to_float(out.logits, dtype).argmax(axis=-1))
    if exact:
        assert np.array_equal(forced_own.tokens, free.tokens)
        assert np.array_equal(forced_own.logits, free.logits) and np.array_equal(forced_own.digests, free.digests)
    else:
        assert np.abs(ours - theirs).max() <= 0.05 * np.abs(theirs).max(), np.abs(ours - theirs).max()
        # compiled, the forced graph rounds otherwise: a token may differ only at a near-tie of the free logits, one no
        # wider than twice the step's largest logit difference (forced[b] >= forced[a] bounds free[a] - free[b])
        for row, step in zip(*np.nonzero(forced_own.tokens != free.tokens)):
            a, b = free.tokens[row, step], forced_own.tokens[row, step]
            gap = theirs[row, step, a] - theirs[row, step, b]
            assert gap <= 2 * np.abs(ours[row, step] - theirs[row, step]).max(), (row, step, gap)
    assert np.array_equal(forced_own.routing_experts, free.routing_experts)
    changed = [not np.array_equal(a, b) for a, b in zip(forced_other.logits[0], forced_own.logits[0])]
    assert changed[:2] == [False, False] and changed[2], changed  # step 2 on
    assert np.array_equal(forced_other.logits[1], forced_own.logits[1])  # the other row routes as it chose
    assert forced_other.routing_experts[0, 2, 0].tolist() == free.routing_experts[0, 2, 0].tolist()  # its own
    assert forced_other.routing_experts[0, 2, 0].tolist() != other[0][2, 0].tolist()
    own_prompt, other_prompt, forced_other_prompt = prompt_runs  # a prompt token's experts replaced in row 1
    assert np.array_equal(forced_own.prompt_routing, free.prompt_routing)
    assert not np.array_equal(forced_other_prompt.logits[1, 0], forced_own.logits[1, 0])  # from the first step on
    assert np.array_equal(forced_other_prompt.logits[0], forced_own.logits[0])  # the other row routes as it chose
    padded, length = forced_other_prompt.padded_length, len(own_prompt[1]) + 1
    recorded = forced_other_prompt.prompt_routing[1, padded - length:padded - 1]  # [P - 1, L, k]
    # its own choice in the first MoE layer, whose router saw nothing the replaced experts computed (later layers
    # attend to that token's new output: their choices may move)
    assert np.array_equal(recorded[:, 0], own_prompt[1][:, 0])
    assert recorded[0, 0].tolist() != other_prompt[1][0, 0].tolist()


@pytest.mark.parametrize("compilation", ["none", "piecewise"])
def test_forced_routing_applies_the_given_experts_and_records_the_models_own(moe_model, compilation):
    """Forced along its own routing a run computes its free bits; forced along other experts at one step and
    layer, its logits change from that step on, in that row only, and it still records its own choice there."""
    _check_forced_routing(*_forced_routing_runs(moe_model, compilation), exact=compilation == "none")


def test_free_runs_keep_the_graph_they_had_before_forced_routing(moe_model):
    """Only a workspace that forces routing holds the forced-experts buffer: a free run's MoE pieces get None, so
    they trace the graph (and, compiled, the bits) they had before forced routing existed."""
    from evalrun.engine.generate import Workspace

    transformer = Transformer(moe_model.model, "sdpa")
    free = Workspace.allocate(transformer, 2, 16, 4, BatchSpec([[5, 6]], 4, pad_id=0))
    assert free.forced_routing is None and free.cache.routing.forced is None
    assert free.cache.routing.forced_for(0) is None
    forcing = Workspace.allocate(transformer, 2, 16, 4, BatchSpec([[5, 6]], 4, pad_id=0, forced_tokens=[np.zeros(4)],
                                                                  forced_routing=[np.zeros((4, 2, 2))]))
    assert forcing.forced_routing.shape == (2, 4, 2, 2) and forcing.cache.routing.forced_for(1).shape == (2, 2)
    # a prefill of 5 tokens is given experts for every token, whether or not the workspace captures
    for capture in (True, False):
        spec = BatchSpec([[5, 6]], 4, pad_id=0, forced_tokens=[np.zeros(4)], forced_routing=[np.zeros((4, 2, 2))],
                         capture=capture)
        routing = Workspace.allocate(transformer, 2, 16, 4, spec).cache.routing
        assert routing.forced_for(1, 5).shape == (2, 5, 2) and (routing.prompt is not None) == capture


@pytest.mark.gpu
@pytest.mark.parametrize("compilation,graphs", [("none", "none"), ("piecewise", "piecewise"), ("piecewise", "full")])
def test_gpu_forced_routing_under_compile_and_cuda_graphs(tmp_path, compilation, graphs):
    """The same on the GPU in bfloat16, with the decode step (and prefill) replayed from CUDA graphs: the
    forced experts are read from the workspace at each replay's step."""
    loaded = load_model(str(moe_checkpoint(tmp_path / "moe")), "cuda", "bfloat16")
    _check_forced_routing(*_forced_routing_runs(loaded, compilation, graphs=graphs), exact=compilation == "none")


def test_dense_models_capture_no_routing(tmp_path):
    from evalrun.models import load_model as load

    loaded = load("random:tiny", "cpu", "float32")
    out = generate_batch(Transformer(loaded.model), BatchSpec([[5, 6, 7]], 3, pad_id=0))
    assert out.routing_experts is None and out.routing_margins is None


@pytest.mark.parametrize("compilation", ["trace-once", "piecewise"])
def test_compiled_modes_give_eagers_tokens_and_routing(moe_model, compilation):
    eager, _ = _generate(moe_model, "none")
    compiled, evidence = _generate(moe_model, compilation)
    assert evidence["dynamo_graphs"] > 0 and evidence["fallbacks"] == [], evidence["fallbacks"]
    assert compiled.tokens.tolist() == eager.tokens.tolist()
    assert compiled.routing_experts.tolist() == eager.routing_experts.tolist()
    np.testing.assert_allclose(compiled.routing_margins, eager.routing_margins, atol=1e-5)


@pytest.mark.parametrize("overrides,needle", [
    ({"num_experts_per_tok": 0}, "'num_experts_per_tok' = 0"),
    ({"use_sliding_window": True, "sliding_window": 8}, "'use_sliding_window' = True"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' = 'yes'"),
    ({"mlp_only_layers": "all"}, "'mlp_only_layers' = 'all'"),
    ({"router_jitter_noise": 0.1}, "'router_jitter_noise' = 0.1 is not a field evalrun knows for Qwen3-MoE"),
])
def test_moe_configs_the_engine_does_not_compute_are_refused(overrides, needle):
    config = moe_config().to_dict()
    config.update(overrides)
    with pytest.raises(UnsupportedModelError, match="evalrun") as error:
        check_config(config)
    assert needle in str(error.value)


def test_every_field_of_the_qwen3_moe_config_has_a_rule():
    assert check_config(moe_config().to_dict()) == "qwen3_moe"


@pytest.mark.parametrize("shape,family,billions", [("qwen3-8b", "qwen3", 8.19), ("qwen3-moe", "qwen3_moe", 15.6)])
def test_random_presets_have_their_shape_and_pass_the_engines_field_audit(shape, family, billions):
    """Built on the meta device (no memory): the family, the parameter count, every config field accepted."""
    from evalrun.models import _random_module

    model = _random_module(shape, torch.device("meta"))
    assert check_config(model.config.to_dict()) == family
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.05)


def test_seeded_fill_scales_expert_matrices_by_their_fan_in():
    from evalrun.models import fill_seeded

    model = moe_checkpoint_module()
    fill_seeded(model, 0)
    experts = model.model.layers[0].mlp.experts
    for tensor in (experts.gate_up_proj, experts.down_proj):  # [E, out, in]: std 1/sqrt(in)
        assert float(tensor.detach().std()) == pytest.approx(tensor.shape[-1] ** -0.5, rel=0.1)


def moe_checkpoint_module():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(moe_config())


# ---------------------------------------------------------------- on the GPU (the lead runs these on the H200)

@pytest.mark.gpu
def test_qwen3_moe_in_bfloat16_on_cuda_stays_within_transformers_bfloat16_envelope(tmp_path):
    """Along the float64 greedy path, the engine's bfloat16 logits are within 3x the error of transformers'
    own bfloat16 forward against its float64 forward (the rule of test_model_support's dense families)."""
    from transformers import AutoModelForCausalLM

    from evalrun.compare import bits_to_float
    from test_model_support import ENVELOPE_MULTIPLIER, _relative_rms

    directory = moe_checkpoint(tmp_path / "moe")
    # float64 with transformers' eager experts (its default, grouped_mm, has no float64 kernel), on the CPU
    reference_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                           experts_implementation="eager").eval()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).cuda().eval()
    loaded = load_model(str(directory), "cuda", "bfloat16")
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(STEPS):
            tokens.append(int(reference_model(torch.tensor([tokens])).logits[0, -1].argmax()))
        sequence = torch.tensor([tokens])
        span = slice(len(ids) - 1, len(tokens) - 1)
        reference = reference_model(sequence).logits[0, span].numpy()
        theirs = hf_bf16(sequence.cuda()).logits[0, span].double().cpu().numpy()
    forced = [np.array(tokens[len(ids):], dtype=np.int64)]
    out = generate_batch(Transformer(loaded.model, "sdpa"),
                         BatchSpec([ids], STEPS, pad_id=0, keep_logits=True, forced_tokens=forced))
    ours_error = _relative_rms(bits_to_float(out.logits[0], "bfloat16"), reference)
    their_error = _relative_rms(theirs, reference)
    print(f"qwen3-moe: engine bf16 {ours_error:.3g}, transformers bf16 {their_error:.3g} "
          f"(ratio {ours_error / their_error:.2f})")
    assert 0 < their_error and ours_error <= ENVELOPE_MULTIPLIER * their_error, (ours_error, their_error)


@pytest.mark.gpu
@pytest.mark.parametrize("opt", ["-O1", "-O2"])
def test_qwen3_moe_runs_compiled_with_cuda_graphs_and_verifies_against_an_eager_golden(cli, golden_factory,
                                                                                       tmp_path, store_path, opt):
    """Piecewise compile and CUDA graphs (full decode capture at -O2) run the MoE block without a fallback,
    capture routing, and a bfloat16 -O0 golden verifies them as identical or drift, never changed."""
    directory = moe_checkpoint(tmp_path / "moe")
    code, out, err = cli("run", "--model", str(directory), "--prompts", "smoke", "--max-new-tokens", "16",
                         "--device", "cuda", "--dtype", "bfloat16", opt, "--strict-config", "--store",
                         str(store_path), "--json", "--quiet")
    assert code == 0, err
    run = json.loads(out)
    assert run["evidence"]["fallbacks"] == [] and run["evidence"]["dynamo_graphs"] > 0
    if opt == "-O2":
        assert run["evidence"]["cudagraph_replays"] > 0
    results = Store(store_path).load_results(run["run_id"])
    assert all(r.arrays["routing_experts"].shape == (16, 2, 2) for r in results)
    golden = golden_factory("--device", "cuda", "--dtype", "bfloat16", "-O0", model=str(directory), tokens=16)
    code, out, err = cli("golden", "verify", "g", "--dir", str(golden), opt, "--format", "json", "--quiet")
    assert json.loads(out)["verdict"] in ("identical", "drift"), out


def test_random_moe_preset_loads_and_generates_at_a_small_scale(monkeypatch):
    """The random:qwen3-moe path (config, device build, seeded fill of expert tensors, SmolLM2's tokenizer,
    the engine) on a scaled-down copy of its shape: the real one needs a GPU."""
    from evalrun import models

    small = dict(models.RANDOM_SHAPES["qwen3-moe"], hidden_size=64, moe_intermediate_size=32, num_experts=16,
                 num_experts_per_tok=4, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=49152)
    monkeypatch.setitem(models.RANDOM_SHAPES, "qwen3-moe", small)
    loaded = load_model("random:qwen3-moe", "cpu", "float32")
    assert loaded.model.config.model_type == "qwen3_moe" and loaded.source["shape"] == "qwen3-moe"
    again = load_model("random:qwen3-moe", "cpu", "float32")
    assert loaded.weights_hash == again.weights_hash
    ids = loaded.tokenizer("Seeded experts")["input_ids"]
    outs = [generate_batch(Transformer(m.model), BatchSpec([ids], 4, pad_id=0)) for m in (loaded, again)]
    assert outs[0].tokens.tolist() == outs[1].tokens.tolist()  # seeded: the same model twice
    assert outs[0].routing_experts.shape == (1, 4, 2, 4)


def test_forward_states_of_an_moe_model_end_in_the_forwards_logits(moe_model):
    """bisect's layer stage runs MoE layers too: the last state's last-token logits are the forward's."""
    transformer = Transformer(moe_model.model, "sdpa")
    ids = torch.tensor([moe_model.tokenizer(PROMPT)["input_ids"]])
    positions, count = torch.arange(ids.shape[1])[None], ids.shape[1]
    key_valid = torch.ones(1, count, dtype=torch.bool)
    with torch.no_grad():
        states = transformer.forward_states(ids, positions, positions[0], key_valid, transformer.new_cache(1, count))
        logits = transformer.forward(ids, positions, positions[0], key_valid, transformer.new_cache(1, count))
    assert len(states) == 2 * 2 + 1
    torch.testing.assert_close(states[-1][:, -1], logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind,magnitude", [("scale", 0.01), ("sign_flip", 0.0), ("int8", 0.0), ("router", 0.5)])
def test_each_fault_in_an_moe_layer_changes_the_logits(moe_model, kind, magnitude):
    from evalrun.engine.faults import Fault, apply

    ids = moe_model.tokenizer(PROMPT)["input_ids"]

    def logits(fault=None):
        transformer = Transformer(moe_model.model, "sdpa")
        if fault is not None:
            apply(transformer, fault)
        return generate_batch(transformer, BatchSpec([ids], 4, pad_id=0, keep_logits=True)).logits

    clean = logits()
    assert not np.array_equal(clean, logits(Fault(kind, magnitude, layer=1)))
    assert np.array_equal(clean, logits())  # the fault lives in the engine's own copy, never in the model
