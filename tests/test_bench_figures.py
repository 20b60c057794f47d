"""Bench figures count each prompt's own tokens: evalrun's rows and transformers' baseline alike."""

import json
import sys

from evalrun import hf_baseline

PROMPTS = [{"id": "short", "prompt": "The capital of France is", "max_new_tokens": 1},
           {"id": "long", "prompt": "Once upon a time there"}]


def test_tokens_per_s_counts_each_rows_own_steps_not_the_batchs_padding(cli, write_prompts, store_path):
    prompts = write_prompts(PROMPTS)
    code, out, err = cli("run", "--model", "random:tiny", "--prompts", str(prompts), "--max-new-tokens", "8",
                         "--batch-size", "2", "--json", "--quiet", "--store", str(store_path))
    assert code == 0, err
    data = json.loads(out)
    returned = sum(len(r["tokens"]) for r in data["results"])
    assert returned == 9 and data["timings"]["tokens_generated"] == returned  # not 2 rows x 8 steps = 16


def test_transformers_baseline_decodes_each_prompts_own_max_new_tokens(write_prompts, monkeypatch, capsys):
    prompts = write_prompts(PROMPTS)
    calls = []
    timed = hf_baseline.timed_generate

    def record(model, ids, new_tokens, kind, device):
        calls.append(new_tokens)
        return timed(model, ids, new_tokens, kind, device)

    monkeypatch.setattr(hf_baseline, "timed_generate", record)
    monkeypatch.setattr(sys, "argv", ["hf_baseline", "--kind", "eager", "--model", "random:tiny", "--prompts",
                                      str(prompts), "--max-new-tokens", "8", "--device", "cpu"])
    hf_baseline.main()
    json.loads(capsys.readouterr().out)
    assert calls[1:] == [1, 1, 8, 8, 1, 8]  # warm-up twice each, then measured: the prompt's 1, the config's 8
