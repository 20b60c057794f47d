import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evalrun.engine.driver import generate_batch
from evalrun.engine.generate import BatchSpec
from evalrun.engine.transformer import Transformer
from evalrun.models import load_model


@pytest.fixture(scope="module")
def tiny():
    loaded = load_model("random:tiny", "cpu", "float32")
    return loaded, Transformer(loaded.model, "sdpa")


def _ids(loaded, text):
    return loaded.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_matches_hugging_face(tiny, attn):
    loaded, _ = tiny
    model = Transformer(loaded.model, attn)
    ids = _ids(loaded, "The quick brown fox jumps over the lazy dog")
    with torch.no_grad():
        expected = loaded.model(torch.tensor([ids])).logits[0, -1]
        cache = model.new_cache(1, len(ids) + 2)
        ours = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], torch.arange(len(ids)),
                             torch.ones(1, len(ids) + 2, dtype=torch.bool), cache)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_decode_matches_hugging_face_greedy(tiny):
    loaded, model = tiny
    ids = _ids(loaded, "Hello there")
    out = generate_batch(model, BatchSpec([ids], 6, pad_id=0))
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(loaded.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert out.tokens[0].tolist() == tokens[len(ids):]


def test_padded_batch_gives_the_unbatched_tokens(tiny):
    loaded, model = tiny
    prompts = [_ids(loaded, text) for text in ("A long prompt about rivers and towns", "Hi", "Numbers: 1 2 3")]
    batched = generate_batch(model, BatchSpec(prompts, 10, pad_id=0))
    for row, ids in enumerate(prompts):
        alone = generate_batch(model, BatchSpec([ids], 10, pad_id=0))
        assert batched.tokens[row].tolist() == alone.tokens[0].tolist()


def test_two_eager_runs_are_bit_identical(tiny):
    loaded, model = tiny
    prompts = [_ids(loaded, "Repeat after me"), _ids(loaded, "x")]
    first, second = generate_batch(model, BatchSpec(prompts, 8, pad_id=0)), generate_batch(model, BatchSpec(prompts, 8, pad_id=0))
    assert np.array_equal(first.digests, second.digests) and np.array_equal(first.tokens, second.tokens)


def test_capture_buffers_have_the_documented_shapes(tiny):
    loaded, model = tiny
    out = generate_batch(model, BatchSpec([_ids(loaded, "a"), _ids(loaded, "bb")], 5, pad_id=0, top_k=4, keep_logits=True))
    assert out.tokens.shape == (2, 5) and out.digests.shape == (2, 5, 2)
    assert out.topk_ids.shape == (2, 5, 4) and out.topk_values.dtype == np.float32
    assert out.logits.shape == (2, 5, model.vocab_size) and out.step_ms.shape == (5,)
    assert np.array_equal(out.topk_ids[:, :, 0], out.tokens)  # greedy picks top-1
    np.testing.assert_allclose(out.margins, out.topk_values[:, :, 0] - out.topk_values[:, :, 1])


def test_forced_decoding_follows_the_given_tokens(tiny):
    loaded, model = tiny
    ids = _ids(loaded, "Force me")
    free = generate_batch(model, BatchSpec([ids], 6, pad_id=0))
    forced_path = np.array([5, 6, 7, 8, 9, 10])
    forced = generate_batch(model, BatchSpec([ids], 6, pad_id=0, forced_tokens=[forced_path]))
    assert forced.digests[0, 0].tolist() == free.digests[0, 0].tolist()  # step 0 comes from the prompt alone
    expected = []
    tokens = list(ids)
    with torch.no_grad():
        for step in range(6):
            expected.append(int(loaded.model(torch.tensor([tokens])).logits[0, -1].argmax()))
            tokens.append(int(forced_path[step]))
    assert forced.tokens[0].tolist() == expected


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(tiny):
    loaded, model = tiny
    ids = [_ids(loaded, "Sample")]
    a = generate_batch(model, BatchSpec(ids, 12, pad_id=0, temperature=1.0, row_seeds=[1]))
    b = generate_batch(model, BatchSpec(ids, 12, pad_id=0, temperature=1.0, row_seeds=[1]))
    c = generate_batch(model, BatchSpec(ids, 12, pad_id=0, temperature=1.0, row_seeds=[2]))
    greedy = generate_batch(model, BatchSpec(ids, 12, pad_id=0))
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.tokens.tolist() != c.tokens.tolist() or a.tokens.tolist() != greedy.tokens.tolist()


def test_stacked_projections_are_views_of_the_models_own_weights():
    loaded = load_model("random:tiny", "cpu", "float32")
    attention = loaded.model.model.layers[0].self_attn
    before = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).clone()
    first = Transformer(loaded.model, "sdpa")
    qkv = first.layers[0].qkv
    assert torch.equal(qkv, before)
    assert attention.q_proj.weight.data_ptr() == qkv.data_ptr()  # the module now reads the stacked rows
    assert attention.k_proj.weight.data_ptr() == qkv[attention.q_proj.weight.shape[0]:].data_ptr()
    second = Transformer(loaded.model, "eager")  # a second engine over the same module stacks nothing again
    assert second.layers[0].qkv.data_ptr() == qkv.data_ptr()
    assert second.layers[1].gate_up.data_ptr() == first.layers[1].gate_up.data_ptr()


def test_grouped_query_attention_equals_attention_over_repeated_heads():
    from evalrun.engine.transformer import attention, build_mask

    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, tokens, slots, dim = 2, 6, 2, 3, 21, 8
    q = torch.randn(batch, heads, tokens, dim, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, slots, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    key_valid = torch.ones(batch, slots, dtype=torch.bool)
    key_valid[1, :4] = False  # row 1 left-padded
    query_slots = torch.tensor([9, 10, 11])
    mask = build_mask(query_slots, key_valid, heads // kv_heads, torch.float64)
    assert mask.shape == (batch, 1, heads // kv_heads * tokens, slots)
    repeated_k, repeated_v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    visible = (torch.arange(slots)[None, :] <= query_slots[:, None])[None] & key_valid[:, None, :]  # [B, T, S]
    scores = (q @ repeated_k.transpose(-1, -2)) * dim**-0.5
    expected = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1) @ repeated_v
    for implementation in ("sdpa", "eager"):
        torch.testing.assert_close(attention(q, k, v, mask, implementation), expected, rtol=1e-12, atol=1e-12)


def test_rms_norm_matches_transformers_bit_for_bit_in_bfloat16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from evalrun.engine.transformer import rms_norm

    generator = torch.Generator().manual_seed(1)
    reference = LlamaRMSNorm(96, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(96, generator=generator))
    x = (torch.randn(2, 5, 96, generator=generator) * 4).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, reference.weight, 1e-5), reference(x))


def test_attention_takes_any_output_layout_of_the_fused_kernel(monkeypatch):
    """CUDA's memory-efficient kernel returns [B, M, H, K]-ordered memory: the result must not rely on a view."""
    import evalrun.engine.transformer as transformer

    real = F.scaled_dot_product_attention
    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention",
                        lambda *args, **kw: real(*args, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 8, generator=generator)
    k, v = (torch.randn(1, 2, 5, 8, generator=generator) for _ in range(2))
    mask = transformer.build_mask(torch.tensor([2, 3, 4]), torch.ones(1, 5, dtype=torch.bool), 2, torch.float32)
    out = transformer.attention(q, k, v, mask, "sdpa")
    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", real)
    torch.testing.assert_close(out, transformer.attention(q, k, v, mask, "sdpa"), rtol=0, atol=0)


def test_batch_invariant_mode_gives_every_row_the_bits_of_the_prompt_alone(tiny):
    """Default: the same prompts batched change logits bits (measured on CPU fp32: gemm vs gemv rows,
    SDPA with padding and cache length). batch_invariant: every row, at any position, equals the prompt
    alone with its own step count (the cache length follows it)."""
    from evalrun.engine.modes import ExecutionMode

    loaded, model = tiny
    prompts = [_ids(loaded, text) for text in ("A long prompt about rivers and towns", "Hi", "Numbers: 1 2 3")]
    steps = [8, 5, 8]
    invariant = ExecutionMode(model, batch_invariant=True)
    alone = [generate_batch(model, BatchSpec([ids], n, pad_id=0)) for ids, n in zip(prompts, steps)]
    default = generate_batch(model, BatchSpec(prompts, 8, pad_id=0))
    assert any(not np.array_equal(default.digests[row, :5], alone[row].digests[0, :5]) for row in range(3))
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        spec = BatchSpec([prompts[i] for i in order], 8, pad_id=0, keep_logits=True, row_steps=[steps[i] for i in order])
        batched = generate_batch(model, spec, invariant)
        for row, index in enumerate(order):
            assert np.array_equal(batched.digests[row, :steps[index]], alone[index].digests[0])
            assert np.array_equal(batched.tokens[row, :steps[index]], alone[index].tokens[0])
        assert batched.logits.shape[:2] == (3, 8) and not batched.tokens[order.index(1), 5:].any()
