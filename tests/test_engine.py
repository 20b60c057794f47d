import numpy as np
import pytest
import torch

from evalrun.engine.generate import generate_batch
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
    out = generate_batch(model, [ids], 6, pad_id=0)
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(loaded.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert out.tokens[0].tolist() == tokens[len(ids):]


def test_padded_batch_gives_the_unbatched_tokens(tiny):
    loaded, model = tiny
    prompts = [_ids(loaded, text) for text in ("A long prompt about rivers and towns", "Hi", "Numbers: 1 2 3")]
    batched = generate_batch(model, prompts, 10, pad_id=0)
    for row, ids in enumerate(prompts):
        alone = generate_batch(model, [ids], 10, pad_id=0)
        assert batched.tokens[row].tolist() == alone.tokens[0].tolist()


def test_two_eager_runs_are_bit_identical(tiny):
    loaded, model = tiny
    prompts = [_ids(loaded, "Repeat after me"), _ids(loaded, "x")]
    first, second = generate_batch(model, prompts, 8, pad_id=0), generate_batch(model, prompts, 8, pad_id=0)
    assert np.array_equal(first.digests, second.digests) and np.array_equal(first.tokens, second.tokens)


def test_capture_buffers_have_the_documented_shapes(tiny):
    loaded, model = tiny
    out = generate_batch(model, [_ids(loaded, "a"), _ids(loaded, "bb")], 5, pad_id=0, top_k=4, keep_logits=True)
    assert out.tokens.shape == (2, 5) and out.digests.shape == (2, 5, 2)
    assert out.topk_ids.shape == (2, 5, 4) and out.topk_values.dtype == np.float32
    assert out.logits.shape == (2, 5, model.vocab_size) and out.step_ms.shape == (5,)
    assert np.array_equal(out.topk_ids[:, :, 0], out.tokens)  # greedy picks top-1
    np.testing.assert_allclose(out.margins, out.topk_values[:, :, 0] - out.topk_values[:, :, 1])


def test_forced_decoding_follows_the_given_tokens(tiny):
    loaded, model = tiny
    ids = _ids(loaded, "Force me")
    free = generate_batch(model, [ids], 6, pad_id=0)
    forced_path = np.array([5, 6, 7, 8, 9, 10])
    forced = generate_batch(model, [ids], 6, pad_id=0, forced_tokens=[forced_path])
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
    a = generate_batch(model, ids, 12, pad_id=0, temperature=1.0, row_seeds=[1])
    b = generate_batch(model, ids, 12, pad_id=0, temperature=1.0, row_seeds=[1])
    c = generate_batch(model, ids, 12, pad_id=0, temperature=1.0, row_seeds=[2])
    greedy = generate_batch(model, ids, 12, pad_id=0)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.tokens.tolist() != c.tokens.tolist() or a.tokens.tolist() != greedy.tokens.tolist()
