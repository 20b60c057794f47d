"""Bench figures count each prompt's own tokens: evalrun's rows and transformers' baseline alike."""

import json
import sys

from conftest import one_line_exit_2

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


def test_repeats_run_each_row_again_and_show_its_medians_and_spread(cli, write_prompts):
    """The rounds' order and the medians of three runs: the test below, without processes (each costs seconds)."""
    code, out, err = cli("bench", "--model", "random:tiny", "--prompts", str(write_prompts(PROMPTS[1:])),
                         "--max-new-tokens", "4", "--matrix", "O0", "--no-baselines", "--repeats", "2", "--json")
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("bench:")] == [
        "bench: O0 (run 1 of 2)", "bench: O0 (run 2 of 2)"]
    [row] = json.loads(out)
    runs = row["tokens_per_s_runs"]
    assert row["repeats"] == 2 and len(runs) == 2 and row["tokens_per_s"] == (runs[0] + runs[1]) / 2  # the median
    assert row["tokens_per_s_spread_percent"] == abs(runs[0] - runs[1]) / row["tokens_per_s"] * 100
    assert row["identical_to_first"] is True


def fake_result(speed: float, digest: str = "d1") -> dict:
    timings = {"compile_s": 1.0, "peak_memory": {"bytes": 2**30}, "ttft_ms": {"p50": 5.0, "first_request": 9.0},
               "tokens_per_s": speed, "step_latency": {"p50_ms": 1000 / speed, "p95_ms": 2.0, "p99_ms": 3.0}}
    return {"timings": timings, "logits_digest": digest, "config": {"batch_size": 1},
            "evidence": {"fallbacks": []}, "model": {"hash": "m"}, "prompt_set": {"hash": "p"}}


def test_a_row_is_identical_to_first_only_where_every_run_was_and_a_failed_run_is_its_error(monkeypatch):
    from evalrun import bench

    answers = iter([(fake_result(10.0), None), (fake_result(20.0), None), (fake_result(12.0), None),  # round 1
                    (None, "evalrun: error: boom"), (fake_result(30.0, "d2"), None), (fake_result(14.0), None),
                    (fake_result(40.0), None), (fake_result(16.0), None)])  # round 3: O0 failed, not run again
    started = []
    monkeypatch.setattr(bench, "run_json_child", lambda command, timeout, timeout_hint: next(answers))
    rows = bench.table_rows(bench.run_matrix([], [("O0", []), ("O2", []), ("O3", [])], (), started.append,
                                             repeats=3))
    assert started == [f"{name} (run {i} of 3)" for i in (1, 2, 3) for name in ("O0", "O2", "O3")
                       if (name, i) != ("O0", 3)]
    assert rows[0]["error"] == "evalrun: error: boom" and "tokens_per_s" not in rows[0]
    assert rows[1]["tokens_per_s"] == 30.0 and rows[1]["identical_to_first"] is False  # its second run's bits differ
    assert rows[2]["tokens_per_s"] == 14.0 and rows[2]["identical_to_first"] is True
    assert rows[2]["tokens_per_s_runs"] == [12.0, 14.0, 16.0] and rows[2]["tokens_per_s_spread_percent"] == 4 / 14 * 100
    assert rows[2]["p50_ms"] == 1000 / 14.0  # every figure the median of the row's runs


def test_repeats_outside_1_to_100_are_one_line_and_exit_2(cli):
    one_line_exit_2(cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--matrix", "O0", "--no-baselines",
                        "--repeats", "0"), "--repeats", "1<=x<=100")


def test_identical_to_first_stays_against_the_first_rows_first_run_when_that_row_fails_in_a_later_round(monkeypatch):
    from evalrun import bench

    answers = iter([(fake_result(10.0), None), (fake_result(20.0, "d2"), None), (fake_result(30.0), None),  # round 1
                    (None, "evalrun: error: boom"), (fake_result(20.0, "d2"), None), (fake_result(30.0), None)])
    monkeypatch.setattr(bench, "run_json_child", lambda command, timeout, timeout_hint: next(answers))
    rows = bench.table_rows(bench.run_matrix([], [("O0", []), ("O2", []), ("O3", [])], (), lambda name: None,
                                             repeats=2))
    assert rows[0]["error"] == "evalrun: error: boom" and "identical_to_first" not in rows[0]
    assert rows[1]["identical_to_first"] is False  # d2, not O0's d1: not the new reference
    assert rows[2]["identical_to_first"] is True  # O0's first run's bits


def test_where_the_first_row_fails_at_once_the_table_names_the_row_its_bits_are_compared_with(monkeypatch):
    """O0 failed in its first run: 'identical to first' was O2's bits against themselves, under O0's name."""
    from evalrun import bench, report

    answers = iter([(None, "evalrun: error: boom"), (fake_result(20.0, "d2"), None), (fake_result(30.0), None)])
    monkeypatch.setattr(bench, "run_json_child", lambda command, timeout, timeout_hint: next(answers))
    rows = bench.table_rows(bench.run_matrix([], [("O0", []), ("O2", []), ("O3", [])], (), lambda name: None))
    assert [row.get("identical_to") for row in rows] == [None, "O2", "O2"]
    assert [row.get("identical_to_first") for row in rows] == [None, True, False]
    header = report.bench_table(rows).splitlines()[0]
    assert "identical to O2" in header and "identical to first" not in header
    answers = iter([(fake_result(10.0), None), (fake_result(20.0, "d2"), None)])
    rows = bench.table_rows(bench.run_matrix([], [("O0", []), ("O2", [])], (), lambda name: None))
    assert [row["identical_to"] for row in rows] == ["O0", "O0"]
    assert "identical to first" in report.bench_table(rows).splitlines()[0]


def test_the_reference_row_named_in_the_header_is_printable_as_its_config_cell_is():
    """A row's name holds what --matrix gave it (served_model=... is free text): the config column escapes it, so
    must the header that names it (a line break there started a line of its own, e.g. a forged ::error::)."""
    from evalrun import report

    name = "O0@openai:http://127.0.0.1:1/v1+served_model=a\n::error::forged"
    text = report.bench_table([{"config": "O0", "error": "boom"},
                               {"config": name, "identical_to": name, "identical_to_first": True}])
    assert len(text.splitlines()) == 4 and "identical to O0@openai:http://127.0.0.1:1/v1+served_model=a\\n::" in text


def test_an_interrupted_bench_keeps_the_rows_it_measured(cli, monkeypatch):
    """Ctrl-C in the second row threw the first row's figures away (a long bench lost every finished row); the
    message said a run was stored as interrupted, where bench stores nothing. The rows measured are shown now, the
    running one and those never run say so, exit 2."""
    from evalrun import bench

    answers = iter([(fake_result(10.0), None), KeyboardInterrupt()])

    def child(command, timeout, timeout_hint):
        answer = next(answers)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(bench, "run_json_child", child)
    code, out, err = cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4",
                         "--matrix", "O0,O1", "--json", "--quiet")
    rows = json.loads(out)
    assert code == 2 and [row["config"] for row in rows] == ["O0", "O1", "transformers eager",
                                                             "transformers static-compile"]
    assert rows[0]["tokens_per_s"] == 10.0 and rows[0]["error"] is None
    assert rows[1]["error"] == "interrupted (Ctrl-C) before its run finished"
    assert {row["error"] for row in rows[2:]} == {"not run: the bench was interrupted (Ctrl-C)"}
    assert err.strip().splitlines()[-1].startswith("evalrun: error: 3 of 4 bench configurations failed (O1, ")
