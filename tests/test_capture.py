import numpy as np
import pytest
import torch

from evalrun.engine.capture import digest_hex, logits_digest, raw_bits, reference_digest, topk_sketch


def _digest(row: torch.Tensor) -> str:
    return digest_hex(logits_digest(row[None])[0].numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_digest_equals_the_independent_reference(dtype):
    row = torch.randn(97, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert _digest(row) == reference_digest(raw_bits(row[None])[0].numpy())


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 32), (torch.bfloat16, 16)])
def test_every_single_bit_flip_changes_the_digest(dtype, bits):
    row = torch.randn(64, generator=torch.Generator().manual_seed(2)).to(dtype)
    word_type = {32: torch.int32, 16: torch.int16}[bits]
    base = _digest(row)
    seen = {base}
    for element in (0, 17, 63):
        for bit in range(bits):
            flipped = row.clone()
            words = flipped.view(word_type)
            words[element] ^= torch.tensor(1 << bit if bit < bits - 1 else -(1 << bit), dtype=word_type)
            seen.add(_digest(flipped))
    assert len(seen) == 1 + 3 * bits


def test_digest_sees_position_and_sign_of_zero():
    row = torch.tensor([1.0, 2.0, 0.0])
    assert _digest(row) != _digest(torch.tensor([2.0, 1.0, 0.0]))
    assert _digest(row) != _digest(torch.tensor([1.0, 2.0, -0.0]))


def test_digest_of_a_row_does_not_depend_on_its_batch():
    rows = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    batched = logits_digest(rows)
    for index in range(4):
        assert torch.equal(batched[index], logits_digest(rows[index:index + 1])[0])


def test_topk_sketch_and_margin():
    logits = torch.tensor([[0.1, 3.0, 2.5, -1.0], [5.0, 5.0, 1.0, 0.0]])
    ids, values, margin = topk_sketch(logits, 2)
    assert ids[0].tolist() == [1, 2] and values.dtype == torch.float32
    assert margin.tolist() == pytest.approx([0.5, 0.0])


def test_capture_compiles_fullgraph():
    compiled = torch.compile(lambda x: (logits_digest(x), *topk_sketch(x, 4)), fullgraph=True, backend="eager")
    logits = torch.randn(2, 33)
    digest, ids, values, margin = compiled(logits)
    assert torch.equal(digest, logits_digest(logits))
    assert np.array_equal(ids.numpy(), topk_sketch(logits, 4)[0].numpy())
