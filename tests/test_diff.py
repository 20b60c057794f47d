import json

import numpy as np
import pytest

from conftest import one_line_exit_2

from evalrun.compare import sketch_series, ulp_distance


def _run(cli, tiny_args, *extra):
    code, out, err = cli("run", *tiny_args, "--json", "--quiet", *extra)
    assert code == 0, err
    return json.loads(out)["run_id"]


def test_diff_of_identical_runs(cli, tiny_args):
    a, b = _run(cli, tiny_args), _run(cli, tiny_args)
    code, out, _ = cli("diff", a[:8], b[:8], "--store", tiny_args[-1], "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["config"] == [] and data["not_comparable"] == []
    for prompt in data["prompts"]:
        assert prompt["tokens_identical"] and all(prompt["series"]["digest_equal"])
        assert max(prompt["series"]["ulp_max"]) == 0 and min(prompt["series"]["topk_overlap"]) == 1.0


def test_diff_shows_key_changes_and_element_level_figures(cli, tiny_args):
    a = _run(cli, tiny_args, "--keep-logits", "all")
    b = _run(cli, tiny_args, "--keep-logits", "capital@1-3", "--batch-size", "3")
    code, out, _ = cli("diff", a, b, "--store", tiny_args[-1], "--format", "json")
    data = json.loads(out)
    keys = {entry["key"] for entry in data["config"]}
    assert code == 0 and {"batch_size", "keep_logits"} <= keys
    capital = next(p for p in data["prompts"] if p["prompt_id"] == "capital")
    figures = capital["logits"]
    assert figures["steps"] == [1, 2, 3] and figures["elements"] == 3 * 320
    assert 0.0 <= figures["bit_identical_share"] < 1.0 and figures["max_abs_delta"] > 0
    assert sum(figures["ulp_histogram"].values()) == figures["elements"]
    assert all(p["logits"] is None for p in data["prompts"] if p["prompt_id"] != "capital")


def test_diff_of_diverging_runs_shows_the_divergence(cli, tiny_args):
    a = _run(cli, tiny_args)
    b = _run(cli, tiny_args, "--set", "temperature=1.0")
    code, out, _ = cli("diff", a, b, "--store", tiny_args[-1], "--prompt", "capital")
    assert code == 0 and "tokens part at step" in out and "margin" in out
    code, out, _ = cli("diff", a, b, "--store", tiny_args[-1], "--format", "markdown")
    assert code == 0 and out.startswith("### evalrun diff") and "| temperature |" in out.replace("config | ", "")


def test_diff_against_a_golden_and_across_prompt_sets(cli, tiny_args, write_prompts, tmp_path):
    code, _, err = cli("golden", "create", "g", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "6",
                       "--dir", str(tmp_path / "golden"), "--quiet")
    assert code == 0, err
    path = write_prompts([{"id": "capital", "prompt": "The capital of France is"}, {"id": "other", "prompt": "x"}])
    other = _run(cli, [a if a != "smoke" else str(path) for a in tiny_args])
    code, out, _ = cli("diff", "golden:g", other, "--store", tiny_args[-1], "--golden-dir", str(tmp_path / "golden"),
                       "--format", "json")
    data = json.loads(out)
    assert code == 0 and "prompt sets differ" in data["note"]
    assert [p["prompt_id"] for p in data["prompts"]] == ["capital"] and data["prompts"][0]["tokens_identical"]
    assert set(data["not_comparable"]) == {"chat-hello", "zh-short", "other"}


def test_markdown_renders_its_tables_and_says_what_it_did_not_compare(cli, tiny_args, write_prompts):
    """The per-prompt header held an unescaped "max |delta|": 11 header cells against 9, so GitHub rendered no table;
    the comment also left out the not-comparable prompts and the full-logits figures the text prints."""
    from markdown_it import MarkdownIt

    a = _run(cli, tiny_args, "--keep-logits", "all")
    path = write_prompts([{"id": "capital", "prompt": "The capital of France is"}, {"id": "other", "prompt": "x"}])
    b = _run(cli, [x if x != "smoke" else str(path) for x in tiny_args], "--keep-logits", "all", "--batch-size", "2")
    code, out, err = cli("diff", a, b, "--store", tiny_args[-1], "--format", "markdown")
    assert code == 0, err
    html = MarkdownIt("commonmark").enable("table").render(out)
    assert html.count("<table>") == 2 and html.count("<th>") == 4 + 9, html  # the key table and the prompts' table
    assert "not comparable" in out and "chat\\-hello" in out and "other" in out  # escaped: `report.markdown_cell`
    assert "capital: full logits over" in out


def test_a_diff_that_compares_no_prompt_exits_2_after_its_report(cli, tiny_args, write_prompts):
    """Two runs of prompt sets with no prompt in common exited 0 with an empty comparison (JSON `prompts: []`)."""
    a = _run(cli, tiny_args)
    path = write_prompts([{"id": "other", "prompt": "x"}])
    b = _run(cli, [x if x != "smoke" else str(path) for x in tiny_args])
    for output in ("text", "json", "markdown"):
        code, out, err = cli("diff", a, b, "--store", tiny_args[-1], "--format", output)
        one_line_exit_2((code, out, err), "is comparable", "capital, chat-hello, zh-short, other", "--prompt")
        assert "prompt sets differ" in out  # the report still says how the runs differ
        if output == "json":
            assert json.loads(out)["prompts"] == [] and "error" not in json.loads(out)


def test_plot(cli, tiny_args, tmp_path):
    pytest.importorskip("matplotlib")
    a, b = _run(cli, tiny_args), _run(cli, tiny_args, "--batch-size", "2")
    code, _, _ = cli("diff", a, b, "--store", tiny_args[-1], "--plot", str(tmp_path / "d.png"))
    assert code == 0 and (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", ["d.txt", "d"])
def test_a_plot_path_in_no_format_matplotlib_writes_is_refused_before_the_report(cli, tiny_args, tmp_path, name):
    """--plot d.txt printed the report, then crashed in savefig (exit 3): now one line, exit 2, no file."""
    pytest.importorskip("matplotlib")
    a = _run(cli, tiny_args)
    code, out, err = cli("diff", a, a, "--store", tiny_args[-1], "--plot", str(tmp_path / name))
    assert (code, out) == (2, "") and "does not end in a format matplotlib writes" in err and ".png" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / name).exists()


def test_a_pgf_plot_without_latex_is_refused_before_the_report(cli, tiny_args, tmp_path, monkeypatch):
    """matplotlib lists .pgf, but writes it by measuring text with LaTeX: without it, savefig crashed after the
    report (exit 3). Refused first, naming what .pgf needs."""
    pytest.importorskip("matplotlib")
    import shutil

    a = _run(cli, tiny_args)
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kw: None)
    code, out, err = cli("diff", a, a, "--store", tiny_args[-1], "--plot", str(tmp_path / "d.pgf"))
    assert (code, out) == (2, "") and ".pgf needs xelatex" in err and ".svg" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "d.pgf").exists()


def test_plot_without_matplotlib_says_how_to_install(cli, tiny_args, tmp_path, monkeypatch):
    import builtins

    a = _run(cli, tiny_args)
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *args, **kw: (_ for _ in ()).throw(ImportError(name))
                        if name.startswith("matplotlib") else real_import(name, *args, **kw))
    code, _, err = cli("diff", a, a, "--store", tiny_args[-1], "--plot", str(tmp_path / "d.png"))
    assert code == 2 and "pip install 'evalrun[plot]'" in err


@pytest.mark.parametrize("ids,needle", [(("ffffffff", None), "no run"), (("zz", None), "not a hex id")])
def test_diff_bad_ids(cli, tiny_args, ids, needle):
    a = _run(cli, tiny_args)
    code, _, err = cli("diff", ids[0], a, "--store", tiny_args[-1])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_diff_refuses_incomplete_runs(cli, tiny_args):
    from evalrun.store import Store

    a = _run(cli, tiny_args)
    store = Store(tiny_args[-1])
    running = store.begin_run({**store.get_run(a).json, "config_hash": "c", "environment_hash": "e",
                               "model": store.get_run(a).json["model"], "prompt_set": store.get_run(a).json["prompt_set"]})
    code, _, err = cli("diff", a, running, "--store", tiny_args[-1])
    assert code == 2 and "running, not complete" in err


def test_diff_unknown_prompt(cli, tiny_args):
    a = _run(cli, tiny_args)
    code, _, err = cli("diff", a, a, "--store", tiny_args[-1], "--prompt", "nosuch")
    assert code == 2 and "no prompt named nosuch" in err


def test_sketch_metrics_by_hand():
    ids_a, values_a = np.array([[1, 2, 3]]), np.array([[3.0, 2.0, 1.0]], dtype=np.float32)
    ids_b, values_b = np.array([[2, 1, 9]]), np.array([[2.5, 2.0, 0.5]], dtype=np.float32)
    figures = sketch_series(ids_a, values_a, ids_b, values_b, "float32")
    assert figures["topk_overlap"].tolist() == pytest.approx([2 / 3])
    assert figures["max_abs_delta"].tolist() == pytest.approx([1.0])  # id 2: 2.0 vs 2.5 ... id 1: 3.0 vs 2.0
    assert figures["kl"][0] > 0
    assert sketch_series(ids_a, values_a, ids_a, values_a, "float32")["kl"].tolist() == pytest.approx([0.0])
    nudged = values_a.copy()
    nudged[0, :2] = np.nextafter(values_a[0, :2], np.float32(10))
    nudged[0, 2] = np.nextafter(np.nextafter(values_a[0, 2], np.float32(10)), np.float32(10))
    figures = sketch_series(ids_a, values_a, ids_a, nudged, "float32")
    assert (figures["ulp_max"].tolist(), figures["ulp_median"].tolist()) == ([2.0], [1.0])
    assert sketch_series(ids_a, values_a, ids_a, nudged, "bfloat16")["ulp_max"].tolist() == [0.0]


def test_ulp_distance_across_zero_and_dtypes():
    a = np.array([0.0, -0.0, 1.0], dtype=np.float32).view(np.int32)
    b = np.array([-0.0, 1e-45, -1.0], dtype=np.float32).view(np.int32)
    assert ulp_distance(a, b).tolist() == [0, 1, 2 * 0x3F800000]


def test_diff_between_two_dtypes_with_full_logits(cli, tiny_args):
    a = _run(cli, tiny_args, "--keep-logits", "all")
    b = _run(cli, tiny_args, "--keep-logits", "all", "--dtype", "bfloat16")
    code, out, err = cli("diff", a, b, "--store", tiny_args[-1], "--json")
    assert code == 0, err
    logits = json.loads(out)["prompts"][0]["logits"]
    assert logits["ulp_histogram"] == {} and logits["max_abs_delta"] > 0


def test_a_shorter_run_with_the_same_tokens_is_not_called_different(cli, tiny_args):
    """Another max_new_tokens: over the shared steps the tokens agree; the text says so, not "differ"."""
    short = _run(cli, tiny_args, "--max-new-tokens", "3")  # the later flag wins over tiny_args' 6
    long = _run(cli, tiny_args)  # 6 tokens
    code, out, _ = cli("diff", short, long, "--store", tiny_args[-1])
    assert code == 0 and "same 3, one run longer" in out and " differ " not in out
    data = json.loads(cli("diff", short, long, "--store", tiny_args[-1], "--format", "json")[1])
    assert all(p["first_divergent_step"] == 3 and not p["tokens_identical"] for p in data["prompts"])


def _damage(store_path, run_id, statement, *values):
    import sqlite3

    with sqlite3.connect(store_path) as conn:
        conn.execute(statement.replace("RUN", "?"), [*values, run_id])
    conn.close()


def _flip_a_bit(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[5] ^= 0x01
    return bytes(flipped)


def test_diff_refuses_array_bytes_that_do_not_match_their_digest(cli, tiny_args):
    """A flipped bit in a stored array (its digest left as written) is damage, never a difference: diff exits 2
    naming the run and `store check`, rather than report digest-unequal steps between bit-identical runs."""
    import sqlite3

    a, b = _run(cli, tiny_args), _run(cli, tiny_args)
    with sqlite3.connect(tiny_args[-1]) as conn:
        data = conn.execute("SELECT data FROM arrays WHERE run_id = ? AND prompt_index = 0 AND name = 'digests'",
                            [b]).fetchone()[0]
    conn.close()
    _damage(tiny_args[-1], b, "UPDATE arrays SET data = ? WHERE run_id = RUN AND prompt_index = 0 AND name = 'digests'",
            _flip_a_bit(data))
    code, out, err = cli("diff", a, b, "--store", tiny_args[-1])
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, (out, err)
    assert b[:12] in err and "digest" in err and "evalrun store check" in err


def test_diff_refuses_tokens_stored_as_floats(cli, tiny_args):
    """Token ids relabelled float64 (same bytes, same digest) are damage: comparing them as floats would call
    identical runs different."""
    a, b = _run(cli, tiny_args), _run(cli, tiny_args)
    _damage(tiny_args[-1], b, "UPDATE arrays SET dtype = 'float64' WHERE run_id = RUN AND name = 'tokens'")
    code, out, err = cli("diff", a, b, "--store", tiny_args[-1])
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, (out, err)
    assert b[:12] in err and "tokens" in err and "evalrun store check" in err


def test_diff_refuses_a_prompt_set_record_without_a_name(cli, tiny_args):
    """Prompt sets that differ are named in the note: a record with a hash but no name is damage (exit 2), not a
    KeyError (exit 3)."""
    a, b = _run(cli, tiny_args), _run(cli, tiny_args)
    _damage(tiny_args[-1], a, "UPDATE runs SET prompt_set_json = json_set(json_remove(prompt_set_json, '$.name'), "
                              "'$.hash', 'other') WHERE id = RUN")
    code, out, err = cli("diff", a, b, "--store", tiny_args[-1])
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, (out, err)
    assert a[:12] in err and "prompt-set record" in err and "evalrun store check" in err


def test_stored_text_cannot_add_a_line_to_diff_text(cli, tiny_args):
    """A prompt id forged with a line break (a GitHub `::error::` workflow command after it) is printed escaped
    in every line of the text report: the divergence, the full-logits figures, the not-comparable list."""
    a = _run(cli, tiny_args, "--keep-logits", "all")
    b = _run(cli, tiny_args, "--keep-logits", "all", "--set", "temperature=1.0")
    forged = "capital\n::error::forged\x1b[2J"
    for run in (a, b):
        _damage(tiny_args[-1], run, "UPDATE results SET prompt_id = ? WHERE prompt_id = 'capital' AND run_id = RUN", forged)
    _damage(tiny_args[-1], a, "UPDATE results SET prompt_id = 'zh\n::error::one run only' WHERE run_id = RUN "
                              "AND prompt_id = 'zh-short'")
    code, out, err = cli("diff", a, b, "--store", tiny_args[-1])
    assert code == 0, err
    assert "capital\\n::error::forged\\x1b[2J: tokens part at step" in out and "full logits over" in out
    assert "zh\\n::error::one run only" in out
    assert not any(line.startswith("::error::") for line in out.splitlines()) and "\x1b" not in out, out


def test_a_compile_cache_one_run_took_graphs_from_is_named_where_the_bits_differ(cli, tiny_args):
    """A cached graph is what the process that wrote it compiled (a C++ compiler upgraded under the same name
    replayed the old one's binaries): where two runs' bits differ and one took graphs from a cache the other did
    not, diff names it beside the figures (it said "same config, environment, model and prompt set", no more)."""
    import sqlite3

    a, b = _run(cli, tiny_args), _run(cli, tiny_args, "--batch-size", "3")  # other bits
    code, out, _ = cli("diff", a, b, "--store", tiny_args[-1], "--format", "json")
    assert code == 0 and "compile cache" not in json.loads(out)["note"]  # neither compiled
    with sqlite3.connect(tiny_args[-1]) as conn:
        for run_id, counts in ((a, {"misses": 3}), (b, {"hits": 3, "folder": "/cache/compile/x"})):
            evidence = json.loads(conn.execute("SELECT evidence_json FROM runs WHERE id = ?", [run_id]).fetchone()[0])
            evidence["compile_cache"] = {**evidence["compile_cache"], **counts}
            conn.execute("UPDATE runs SET evidence_json = ? WHERE id = ?", [json.dumps(evidence), run_id])
    conn.close()
    code, out, _ = cli("diff", a, b, "--store", tiny_args[-1], "--format", "json")
    assert code == 0 and f"{b[:12]} took 3 compiled graphs from /cache/compile/x" in json.loads(out)["note"]
    assert "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in json.loads(out)["note"]
    code, out, _ = cli("diff", b, b, "--store", tiny_args[-1], "--format", "json")
    assert code == 0 and "compile cache" not in json.loads(out)["note"]  # the same bits: no candidate cause


def test_no_compile_cache_is_named_beside_a_run_that_compiled_nothing(cli, tiny_args):
    """Eager against a compiled run whose graphs came from the cache (the usual -O0 vs -O2 diff with a warm cache):
    the modes explain the bits; naming the cache as a candidate cause sent users to recompile for nothing."""
    import sqlite3

    a, b = _run(cli, tiny_args), _run(cli, tiny_args, "--batch-size", "3")
    with sqlite3.connect(tiny_args[-1]) as conn:
        evidence = json.loads(conn.execute("SELECT evidence_json FROM runs WHERE id = ?", [b]).fetchone()[0])
        evidence["compile_cache"] = {**evidence["compile_cache"], "hits": 3, "folder": "/cache/compile/x"}
        conn.execute("UPDATE runs SET evidence_json = ? WHERE id = ?", [json.dumps(evidence), b])
    conn.close()
    code, out, _ = cli("diff", a, b, "--store", tiny_args[-1], "--format", "json")
    assert code == 0 and "compile cache" not in json.loads(out)["note"]
