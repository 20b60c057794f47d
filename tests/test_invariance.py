"""evalrun invariance: placement of prompts among companions, the per-prompt analysis, the default engine's
batch dependence on CPU and the batch-invariant mode's bit-identity, the CLI's formats and bad input."""

import json

import pytest

from evalrun.config import RunConfig
from evalrun.errors import ConfigError
from evalrun.invariance import (Cell, cells_for, measure_invariance, parse_batch_sizes, parse_positions,
                                placement)

from conftest import one_line_exit_2


def test_batch_sizes_and_positions_parse_and_alone_is_always_the_reference():
    assert parse_batch_sizes("16,4") == [1, 4, 16]
    assert parse_positions("last, first") == ["first", "last"]
    assert [c.name for c in cells_for([1, 4], ["first", "last"])] == ["alone", "b4/first", "b4/last"]
    for bad in ("", "0", "a,b", "1,99999", "1" * 5000, "4," + "0" * 5000):  # 5000 digits: int() raised ValueError
        with pytest.raises(ConfigError):
            parse_batch_sizes(bad)
    with pytest.raises(ConfigError):
        parse_positions("side")


@pytest.mark.parametrize("position, row", [("first", 0), ("middle", 2), ("last", 3)])
def test_each_prompt_is_placed_at_its_row_among_other_prompts(position, row):
    layout = placement(5, Cell(4, position))
    assert layout.recorded_rows == [row] * 5
    for target, batch in enumerate(layout.batches):
        assert len(batch) == 4 and batch[row] == target and batch.count(target) == 1


def test_a_set_smaller_than_the_batch_repeats_companions():
    layout = placement(2, Cell(16, "middle"))
    assert [b[8] for b in layout.batches] == [0, 1] and layout.batches[0].count(1) == 15
    assert placement(1, Cell(4, "first")).batches == [[0, 0, 0, 0]]


def _measure(**flags):
    config = RunConfig(model="random:tiny", prompts="smoke", max_new_tokens=4, **flags)
    return measure_invariance(config, [1, 4, 16], ["first", "middle", "last"], 2, None)


def test_the_default_engine_on_cpu_changes_bits_with_the_batch_not_run_to_run():
    """Measured on CPU fp32: a prompt in a batch of 4 or 16 has other logits bits than alone (tokens
    stay), while repeats are bit-identical."""
    report = _measure()
    assert report.run_to_run_deterministic and not report.batch_invariant
    assert len(report.runs) == 14 and {r["batch_size"] for r in report.runs} == {1, 4, 16}
    for prompt in report.prompts:
        assert prompt.unique_logits_digests > 1 and prompt.first_divergent_step == 0
        assert prompt.margin_at_divergence is not None and {"b4/first", "b16/last"} <= set(prompt.differs_in)


def test_batch_invariant_mode_is_bit_identical_across_batch_sizes_and_positions():
    report = _measure(batch_invariant=True)
    assert report.batch_invariant and report.run_to_run_deterministic
    assert report.config["batch_invariant"] is True
    for prompt in report.prompts:
        assert (prompt.unique_token_sequences, prompt.unique_logits_digests) == (1, 1)
        assert (prompt.first_divergent_step, prompt.differs_in) == (-1, [])


@pytest.mark.gpu
@pytest.mark.parametrize("opt_level", [0, 2])
def test_on_cuda_batch_invariant_mode_is_bit_identical_eager_and_with_cuda_graphs(opt_level):
    """The GPU half: bfloat16, eager and -O2 (piecewise compile, full-and-piecewise CUDA graphs)."""
    report = _measure(device="cuda", dtype="bfloat16", opt_level=opt_level, batch_invariant=True)
    assert report.batch_invariant and report.run_to_run_deterministic
    assert all((p.unique_token_sequences, p.unique_logits_digests) == (1, 1) for p in report.prompts)
    default = _measure(device="cuda", dtype="bfloat16", opt_level=opt_level)
    assert default.run_to_run_deterministic  # what varies with the batch is reported either way
    print(f"-O{opt_level} default engine: batch-invariant {default.batch_invariant}; "
          f"{[(p.prompt_id, p.unique_logits_digests, p.differs_in) for p in default.prompts]}")


def test_cli_json_stores_ordinary_runs_that_diff_compares(cli, tiny_args, store_path):
    # a batch size set by --set (or a preset) is what --batch-sizes replaces: the report's config is the alone cell's
    code, out, err = cli("invariance", *tiny_args, "--batch-sizes", "4", "--positions", "last", "--repeats", "1",
                         "--set", "batch_size=8", "--json", "--quiet")
    assert code == 0, err
    report = json.loads(out)
    assert report["config"]["batch_size"] == 1, report["config"]
    assert [r["cell"] for r in report["runs"]] == ["alone", "b4/last"]
    assert report["batch_invariant"] is False and len(report["prompts"]) == 3
    alone, batched = (r["run_id"] for r in report["runs"])
    code, out, err = cli("diff", alone, batched, "--store", str(store_path), "--json")
    assert code == 0, err
    assert json.loads(out)["config"] == [{"key": "batch_size", "a": 1, "b": 4}]
    code, out, _ = cli("store", "show", batched, "--store", str(store_path), "--json")
    batches = json.loads(out)["batches"]
    assert [(b["recorded_row"], b["prompt_ids"][3]) for b in batches] == [(3, "capital"), (3, "chat-hello"), (3, "zh-short")]


def test_cli_markdown_names_the_summary_and_escapes_prompt_ids(cli, tiny_args):
    code, out, err = cli("invariance", *tiny_args, "--batch-sizes", "1,4", "--positions", "first", "--repeats", "1",
                         "--set", "batch_invariant=true", "--format", "markdown", "--quiet")
    assert code == 0, err
    assert out.startswith("### evalrun invariance: batch-invariant: yes; run-to-run deterministic: not measured "
                          "(one repeat)")
    assert "| chat\\-hello | 1 | 1 |" in out


@pytest.mark.parametrize("options, needle", [
    (("--batch-sizes", "0,4"), "--batch-sizes"), (("--batch-sizes", "x"), "--batch-sizes"),
    (("--positions", "side"), "--positions"), (("--repeats", "0"), "repeats"),
    (("--set", "batch_invariant=maybe"), "batch_invariant"),
    (("--batch-sizes", "1_000"), "--batch-sizes"), (("--batch-sizes", "\u0663"), "--batch-sizes"),
    (("--batch-sizes", "4096", "--repeats", "100"), "limit 20,000"),  # a time bomb, refused before any run
    (("--batch-sizes", "1", "--repeats", "1"), "compares nothing"),  # it said deterministic and invariant: yes
    (("--batch-sizes", "1" * 5000), "give sizes from 1 to 4096"),  # int() raised ValueError past 4300 digits: exit 3
    (("--batch-sizes", "1,2", "--batch-size", "8"), "drop it"),  # reported as its batch size, and unused
])
def test_cli_bad_input_is_one_line_and_exit_2(cli, tiny_args, options, needle, tmp_path):
    store = tmp_path / "never.db"
    one_line_exit_2(cli("invariance", *tiny_args, *options, "--quiet", "--store", str(store)), needle)
    assert not store.exists()  # refused before the store is opened


def test_what_one_repeat_or_no_batch_cannot_show_is_not_measured_not_yes(cli, tiny_args):
    """One repeat cannot show run-to-run determinism and batch size 1 alone cannot show batch invariance: each is
    null in JSON and "not measured" in the summary (both said yes, measuring nothing)."""
    code, out, err = cli("invariance", *tiny_args, "--batch-sizes", "1,2", "--positions", "first", "--repeats", "1",
                         "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["run_to_run_deterministic"] is None and data["batch_invariant"] is False  # the engine's batch bits
    code, out, err = cli("invariance", *tiny_args, "--batch-sizes", "1", "--repeats", "2", "--quiet")
    assert code == 0, err
    assert out.splitlines()[0] == ("batch-invariant: not measured (no batch size but 1); "
                                   "run-to-run deterministic: yes")


def test_a_row_is_one_cell_however_many_positions_name_it():
    """In a batch of 2 the middle row is the last: it ran twice and was reported as two cells, then as one named
    `b2/middle` (a batch of 2 has no middle row): it is `b2/last`, whichever positions name it."""
    cells = cells_for([1, 2, 4], ["first", "middle", "last"])
    assert [cell.name for cell in cells] == ["alone", "b2/first", "b2/last", "b4/first", "b4/middle", "b4/last"]
    assert len({(cell.batch_size, cell.row()) for cell in cells}) == len(cells)
    assert [cell.name for cell in cells_for([2, 3], ["middle"])] == ["alone", "b2/last", "b3/middle"]
    assert [(cell.position, cell.row()) for cell in cells_for([2], ["first", "middle"])[1:]] == [("first", 0),
                                                                                                 ("last", 1)]


def test_cli_json_and_text_name_the_second_row_of_a_batch_of_2_last(cli, tiny_args):
    """The cell, its position and the cells a prompt differs in agree: `b2/last`, never `b2/middle`."""
    code, out, err = cli("invariance", *tiny_args, "--batch-sizes", "2", "--positions", "middle", "--repeats", "1",
                         "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert [(r["cell"], r["position"]) for r in data["runs"]] == [("alone", "alone"), ("b2/last", "last")]
    assert data["batch_invariant"] is False  # the engine's batch bits: the cell is named where prompts differ
    assert {cell for prompt in data["prompts"] for cell in prompt["differs_in"]} == {"b2/last"}
    code, out, err = cli("invariance", *tiny_args, "--batch-sizes", "2", "--positions", "middle", "--repeats", "1",
                         "--quiet")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines() if line.startswith("b2/")] == ["b2/last"]
    assert "b2/middle" not in out
