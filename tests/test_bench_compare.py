"""`evalrun bench --compare BASELINE.json --fail-on METRIC:PCT`: a slower PR fails like a wrong one."""

from __future__ import annotations

import json
import re

import pytest

from conftest import one_line_exit_2
from evalrun.bench_compare import FailRule, compare, parse_fail_on, regressions
from evalrun.errors import ConfigError

ROWS = [{"config": "O0", "tokens_per_s": 90.0, "ttft_ms": 12.0}, {"config": "O2", "tokens_per_s": 200.0, "ttft_ms": 5.0},
        {"config": "new", "tokens_per_s": 1.0}]
BASELINE = {"O0": {"config": "O0", "tokens_per_s": 100.0, "ttft_ms": 10.0},
            "O2": {"config": "O2", "tokens_per_s": 190.0, "ttft_ms": 5.0}}


def test_worse_by_more_than_the_allowance_regresses_in_the_metrics_direction():
    changes = compare(ROWS, BASELINE, [FailRule("tokens_per_s", 5), FailRule("ttft_ms", 25)])
    by = {(c.config, c.metric): c for c in changes}
    assert by["O0", "tokens_per_s"].status == "regressed" and by["O0", "tokens_per_s"].change_percent == pytest.approx(-10)
    assert by["O0", "ttft_ms"].status == "ok" and by["O0", "ttft_ms"].change_percent == pytest.approx(-20)  # slower
    assert by["O2", "tokens_per_s"].status == "ok" and by["O2", "tokens_per_s"].change_percent > 0
    assert by["new", "tokens_per_s"].status == "missing"  # no baseline yet: reported, never a failure
    assert [(c.config, c.metric) for c in regressions(changes)] == [("O0", "tokens_per_s")]
    assert {c.status for c in compare(ROWS, BASELINE, [])} <= {"reported", "missing"}


def test_a_change_exactly_at_the_allowance_passes_whatever_the_rounding():
    """7.3 -> 6.935 tokens/s is 5 % slower; in floating point -5.000000000000003 %, and it was `regressed`."""
    rows = [{"config": "O0", "tokens_per_s": 6.935, "ttft_ms": 10.5}, {"config": "O2", "tokens_per_s": 6.934}]
    baseline = {"O0": {"config": "O0", "tokens_per_s": 7.3, "ttft_ms": 10.0},
                "O2": {"config": "O2", "tokens_per_s": 7.3}}
    changes = compare(rows, baseline, [FailRule("tokens_per_s", 5), FailRule("ttft_ms", 5)])
    assert [(c.config, c.metric, c.status) for c in changes] == [
        ("O0", "tokens_per_s", "ok"), ("O0", "ttft_ms", "ok"), ("O2", "tokens_per_s", "regressed"),
        ("O2", "ttft_ms", "missing")]


@pytest.mark.parametrize("text,needle", [("speed:5%", "unknown metric 'speed'"), ("tokens_per_s:-1%", "percentage"),
                                         ("tokens_per_s:lots", "percentage"), ("tokens_per_s", "percentage")])
def test_bad_rules_name_the_fix(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_fail_on(text)
    assert parse_fail_on("ttft_ms:10%") == FailRule("ttft_ms", 10.0)


def _bench(cli, *options):
    return cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4", "--matrix", "O0",
               "--no-baselines", *options)


def test_bench_against_a_baseline_passes_or_exits_1_on_a_regression(cli, tmp_path):
    code, out, err = _bench(cli, "--json")
    assert code == 0, err
    measured = json.loads(out)
    fast = tmp_path / "fast.json"  # a baseline 1e6x faster than anything measured here: a regression
    fast.write_text(json.dumps([{**measured[0], "tokens_per_s": measured[0]["tokens_per_s"] * 1e6}]))
    code, out, err = _bench(cli, "--compare", str(fast), "--fail-on", "tokens_per_s:5%", "--json")
    data = json.loads(out)
    assert code == 1 and "O0 tokens_per_s -100.0% (allowed -5%)" in err  # whatever this run measures
    assert data["comparison"][0]["status"] == "regressed" and data["rows"][0]["config"] == "O0"
    other = tmp_path / "other.json"  # a gate whose baseline names other configs compared nothing: refused, not passed
    other.write_text(json.dumps([{**measured[0], "config": "O2"}]))
    code, out, err = _bench(cli, "--compare", str(other), "--fail-on", "tokens_per_s:5%", "--json")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("evalrun: error: --fail-on compared nothing: ")  # after progress
    assert "has no figure of tokens_per_s for the configs measured now (O0)" in err
    assert json.loads(out)["comparison"][0]["status"] == "missing"  # the figures still printed: nothing lost
    another = tmp_path / "another.json"  # measured in bfloat16: a ratio of two workloads, refused, not judged
    another.write_text(json.dumps([{**measured[0], "workload": {**measured[0]["workload"], "dtype": "bfloat16"}}]))
    code, out, err = _bench(cli, "--compare", str(another), "--fail-on", "tokens_per_s:5%", "--json")
    assert code == 2 and "measured config 'O0' on another workload (dtype differ)" in err.strip().splitlines()[-1]
    assert json.loads(out)["comparison"][0]["status"] == "other workload"  # the figures still printed
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"rows": [{**measured[0], "tokens_per_s": measured[0]["tokens_per_s"] / 1e6}]}))
    code, out, err = _bench(cli, "--compare", str(slow), "--fail-on", "tokens_per_s:5%")
    assert code == 0, err
    assert "against" in out and "| ok" not in out and " ok" in out


_one_line_exit_2 = one_line_exit_2


@pytest.mark.parametrize("rows,needle", [
    ([{"config": "O0", "tokens_per_s": 1e9}, {"config": "O0", "tokens_per_s": 1}], "appears twice"),
    ([{"config": "O0", "tokens_per_s": -1e9}], "tokens_per_s = -1000000000.0"),
    ([{"config": "O0", "tokens_per_s": True}], "tokens_per_s = True"),
    ([{"config": "O0", "tokens_per_s": 0}], "tokens_per_s = 0"),
    ([{"config": "O0", "ttft_ms": -1}], "ttft_ms = -1"),
    ('[{"config": "O0", "tokens_per_s": NaN}]', "tokens_per_s = nan"),
    pytest.param('[{"config": "O0", "tokens_per_s": 1' + "0" * 400 + '}]', "tokens_per_s = 1000", id="past-1e308"),
    pytest.param('[{"config": "O0", "tokens_per_s": 1' + "0" * 5000 + '}]', "a number too long to read", id="5000-digits"),
    # the second figure was read, the first lost: a baseline edited to pass
    pytest.param('[{"config": "O0", "tokens_per_s": 100, "tokens_per_s": 1}]', "'tokens_per_s' is given twice",
                 id="key-twice"),
    pytest.param('{"rows": [], "rows": [{"config": "O0", "tokens_per_s": 1}]}', "'rows' is given twice",
                 id="rows-twice"),
])
def test_a_baseline_that_could_disable_the_check_is_refused(tmp_path, rows, needle):
    """A hostile or broken baseline (duplicates, a key given twice, negatives, booleans, zero, NaN) must not turn a regression
    into a pass: each is one line, exit 2. An integer past 1e308 (math.isfinite raised OverflowError) or past
    4300 digits (json raised ValueError) was an internal error (exit 3)."""
    from evalrun.bench_compare import load_baseline

    path = tmp_path / "baseline.json"
    path.write_text(rows if isinstance(rows, str) else json.dumps(rows))
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_baseline(path)


@pytest.mark.parametrize("options,needle", [(["--fail-on", "tokens_per_s:5%"], "--fail-on needs --compare"),
                                            (["--compare", "missing.json"], "cannot read a bench baseline"),
                                            (["--compare", "{json}", "--fail-on", "speed:1"], "unknown metric")])
def test_bad_comparison_input_is_one_line_exit_2_before_any_run(cli, tmp_path, options, needle):
    baseline = tmp_path / "b.json"
    baseline.write_text("[]")
    options = [str(baseline) if o == "{json}" else o for o in options]
    _one_line_exit_2(cli("bench", "--model", "random:tiny", *options), needle)


def _fake_child(command, timeout, timeout_hint):
    """A bench row without a process: evalrun's rows and transformers' baselines alike (tests/test_bench_figures.py)."""
    from test_bench_figures import fake_result

    result = fake_result(20.0)
    if command[0] == "evalrun.hf_baseline":
        return {"timings": result["timings"], "compiled_graphs": 0}, None
    return {**result, "config": {"batch_size": 1, "max_new_tokens": 4, "dtype": "float32", "device": "cpu"}}, None


def test_transformers_rows_of_a_baseline_of_another_workload_are_not_judged(cli, tmp_path, monkeypatch):
    """Transformers' baseline rows carry no workload of their own: a baseline of another model (its evalrun rows named
    other configs) compared them and said `regressed` (exit 1), or passed a slower bench. They are judged by their
    bench's workload: refused, exit 2, as an evalrun row of another workload is."""
    from evalrun import bench

    monkeypatch.setattr(bench, "run_json_child", _fake_child)
    workload = {"model": "other-model", "prompt_set": "p", "max_new_tokens": 4, "dtype": "float32", "device": "cpu",
                "batch_size": 1}
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps([{"config": "O0", "tokens_per_s": 500.0, "workload": workload},
                                    {"config": "transformers eager", "tokens_per_s": 500.0},
                                    {"config": "transformers static-compile", "tokens_per_s": 500.0}]))
    code, out, err = cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4", "--matrix",
                         "none", "--compare", str(baseline), "--fail-on", "tokens_per_s:5%", "--json", "--quiet")
    assert code == 2, err
    assert "measured config 'transformers eager' on another workload (model differ)" in err.strip().splitlines()[-1]
    assert {c["status"] for c in json.loads(out)["comparison"]} == {"missing", "other workload"}
    same = tmp_path / "same.json"  # the same workload (batch size aside: transformers runs batch 1): judged
    same.write_text(json.dumps([{"config": "O0", "tokens_per_s": 500.0, "workload": {**workload, "model": "m",
                                                                                      "batch_size": 4}},
                                {"config": "transformers eager", "tokens_per_s": 500.0}]))
    code, out, err = cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4", "--matrix",
                         "none", "--compare", str(same), "--fail-on", "tokens_per_s:5%", "--quiet")
    assert code == 1 and "transformers eager tokens_per_s -96.0% (allowed -5%)" in err, err


def test_a_matrix_name_cannot_print_a_line_of_its_own_on_stderr(cli, monkeypatch):
    """A knob's free text (server_config) is part of the row's name: the progress line printed it raw, so a newline
    in it started a GitHub `::error::` workflow command of its own."""
    from evalrun import bench

    monkeypatch.setattr(bench, "run_json_child", lambda command, timeout, timeout_hint: (None, "evalrun: error: no"))
    code, out, err = cli("bench", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4",
                         "--no-baselines", "--matrix", "O0@openai:http://127.0.0.1:9/v1+server_config=a\n::error::x")
    assert code == 2, err
    assert not [line for line in err.splitlines() if line.startswith("::")], err
    assert "bench: O0@openai:http://127.0.0.1:9/v1+server_config=a\\n::error::x" in err.splitlines()
