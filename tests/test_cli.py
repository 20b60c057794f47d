import json
import os
import re

import pytest

from evalrun.cli import cli as cli_group

from conftest import one_line_exit_2


def test_run_json_stores_a_complete_run(cli, tiny_args):
    code, out, err = cli("run", *tiny_args, "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["config"]["model"] == "random:tiny" and len(data["results"]) == 3
    assert all(len(r["tokens"]) == 6 for r in data["results"])
    timings = data["timings"]  # what tokens/s counts beyond the clocked steps is reported apart
    assert 0.0 < timings["outside_steps_s"] < timings["generate_s"]  # results are made outside the clocked steps
    code, out, _ = cli("store", "show", data["run_id"][:8], "--store", tiny_args[-1], "--json")
    shown = json.loads(out)
    assert code == 0 and shown["status"] == "complete"
    assert [r["tokens"] for r in shown["results"]] == [r["tokens"] for r in data["results"]]


def test_two_runs_of_one_config_are_identical_on_cpu(cli, tiny_args):
    first = json.loads(cli("run", *tiny_args, "--json", "--quiet")[1])
    second = json.loads(cli("run", *tiny_args, "--json", "--quiet")[1])
    assert first["logits_digest"] == second["logits_digest"] and first["tokens_digest"] == second["tokens_digest"]
    assert first["run_id"] != second["run_id"]


def test_run_text_summary_store_ls_and_check(cli, tiny_args):
    code, out, _ = cli("run", *tiny_args, "--quiet", "--label", "first")
    assert code == 0 and "capital" in out and "tok/s" in out and "run " in out
    code, out, _ = cli("store", "ls", "--store", tiny_args[-1])
    assert code == 0 and "random:tiny" in out and "first" in out
    code, out, _ = cli("store", "check", "--store", tiny_args[-1], "--json")
    assert code == 0 and json.loads(out)["ok"] is True


def test_fingerprint_json(cli):
    code, out, _ = cli("fingerprint", "--model", "random:tiny", "--prompts", "smoke", "--json")
    data = json.loads(out)
    assert code == 0
    assert {"config", "environment", "model", "prompt_set", "config_hash", "environment_hash"} <= set(data)
    assert set(data["model"]) >= {"weights", "config", "tokenizer", "hash"}
    assert data["config"]["compilation_mode"] == "none" and data["prompt_set"]["count"] == 3


def test_per_prompt_max_new_tokens(cli, tiny_args, write_prompts):
    path = write_prompts([{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two", "max_new_tokens": 3}])
    args = [a if a != "smoke" else str(path) for a in tiny_args]
    data = json.loads(cli("run", *args, "--batch-size", "2", "--json", "--quiet")[1])
    assert [len(r["tokens"]) for r in data["results"]] == [6, 3]


_one_line_exit_2 = one_line_exit_2


def test_bad_input_unknown_model(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--model", "nosuch-model"), "unknown model", "random:tiny")


@pytest.mark.parametrize("args,json_words", [(("run", "--model", "nosuch-model"), ("--json",)),
                                             (("fingerprint", "--model", "random:tiny", "--max-new-tokens", "x"),
                                              ("--format", "json")),
                                             (("golden", "verify", "nosuch"), ("--format=json",)),
                                             (("store", "ls", "--store", "/nonexistent/s.db"), ("--json",))])
def test_bad_input_under_json_is_also_a_json_error_object_on_stdout(cli, args, json_words):
    """`... --json | jq` read nothing on bad input (stdout was empty): stdout now holds one JSON object with the
    stderr line and the exit code, while stderr keeps its one line. Text output leaves stdout empty."""
    code, out, err = cli(*args, *json_words)
    one_line_exit_2((code, out, err))
    assert json.loads(out) == {"error": err.strip(), "exit_code": 2}
    code, out, err = cli(*args)
    one_line_exit_2((code, out, err))
    assert out == ""


@pytest.mark.parametrize("command", ["run", "verify"])
def test_a_reader_that_stops_reading_leaves_the_outcome_and_its_files(golden_factory, tmp_path, command):
    """`evalrun ... | true` (or `| head`): click turned the closed pipe into exit 1, the code of `changed`, with no
    line, and the --junit file was never written. Now the command finishes its work and its own exit code stands."""
    import subprocess
    import sys

    store = str(tmp_path / "s.db")
    args = (["run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4"] if command == "run" else
            ["golden", "verify", "g", "--dir", str(golden_factory()), "--junit", str(tmp_path / "j.xml")])
    process = subprocess.Popen([sys.executable, "-m", "evalrun", *args, "--store", store, "--json", "--quiet"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "EVALRUN_CACHE": str(tmp_path / "cache")})
    process.stdout.close()  # the reader is gone before evalrun writes a byte
    err = process.stderr.read()
    assert process.wait(timeout=300) == 0 and err == "", err
    if command == "run":
        from evalrun.store import Store

        assert [run.status for run in Store(store, readonly=True).list_runs()] == ["complete"]
    else:
        assert "<testsuite" in (tmp_path / "j.xml").read_text()


def test_junit_over_the_commands_own_prompt_file_is_refused(cli, golden_factory, tmp_path):
    """--junit naming the --prompts file replaced the prompts with JUnit XML (exit 0)."""
    import shutil

    from evalrun.prompts import resolve_path

    prompts = tmp_path / "p.jsonl"
    shutil.copy(resolve_path("smoke"), prompts)
    before = prompts.read_bytes()
    code, out, err = cli("golden", "verify", "g", "--dir", str(golden_factory()), "--prompts", str(prompts), "--junit",
                         str(prompts), "--quiet")
    one_line_exit_2((code, out, err), "is one of the command's inputs")
    assert prompts.read_bytes() == before


@pytest.mark.parametrize("group", [(), ("golden",), ("store",)])
def test_no_command_prints_the_help_on_stdout_and_one_line(cli, group):
    """The help page was escaped into one stderr line and cut in its middle."""
    code, out, err = cli(*group)
    one_line_exit_2((code, out, err), "no command given", f"evalrun {' '.join(group)}".strip() + " --help")
    assert "Commands:" in out and "Usage: evalrun" in out


@pytest.mark.parametrize("extra,needle", [(("--max-new-tokens", "99999"), "bench config O0: max_new_tokens=99999 is out "
                                                                         "of range"),
                                          (("--prompts", "DUP"), "duplicate id 'a'")])
def test_bench_checks_its_inputs_before_any_configuration_runs(cli, write_prompts, monkeypatch, extra, needle):
    """A bad value failed in every configuration's own process, and the one line said only that configurations
    failed (the reason sat in the rows on stdout). Now it is refused before any process starts."""
    from evalrun import bench

    monkeypatch.setattr(bench, "run_matrix", lambda *args, **kwargs: pytest.fail("a configuration was started"))
    duplicate = write_prompts([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    extra = tuple(str(duplicate) if word == "DUP" else word for word in extra)
    code, out, err = cli("bench", "--model", "random:tiny", "--matrix", "O0,none", "--no-baselines", *extra)
    one_line_exit_2((code, out, err), needle)


def test_json_is_requested_as_click_reads_the_words():
    from evalrun.cli import json_requested

    assert json_requested(["run", "--json"]) and json_requested(["run", "--format=json"])
    assert json_requested(["run", "--json", "--format", "text"])  # --json wins, as in chosen_format
    assert not json_requested(["run", "--format", "json", "--format", "text"])  # the last --format
    assert not json_requested(["run", "--format"]) and not json_requested(["run"])
    assert not json_requested(["run", "--label", "--json"]) and not json_requested(["bench", "--matrix", "--json"])
    assert json_requested(["run", "--label", "--json", "--json"]) and json_requested(["run", "-O", "2", "--json"])
    assert not json_requested(["run", "--prompts", "--format", "--format", "text"])
    assert not json_requested(["run", "--", "--json"])


def test_shell_completion_is_answered_as_clicks_own_entry_point_did():
    """The entry point invokes click's context itself (for the exit codes above): a shell asking for completions
    got the help page and exit 2."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "evalrun"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "_EVALRUN_COMPLETE": "bash_source"})
    assert done.returncode == 0 and "_EVALRUN_COMPLETE" in done.stdout and "complete " in done.stdout, done


def test_a_command_that_printed_its_json_adds_no_error_object(cli, tiny_args):
    """store check on a damaged store prints its report (JSON) and exits 2: stdout stays one JSON document."""
    cli("run", *tiny_args, "--quiet")
    with __import__("sqlite3").connect(tiny_args[-1]) as conn:
        conn.execute("DROP TABLE arrays")
    conn.close()
    code, out, err = cli("store", "check", "--store", tiny_args[-1], "--json")
    assert code == 2 and json.loads(out)["ok"] is False and "error" not in json.loads(out), out


def test_bad_input_unknown_random_shape(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--model", "random:huge"), "random:tiny")


def test_bad_input_missing_prompt_file(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--prompts", "/nonexistent/p.jsonl"), "does not exist")


def test_a_long_value_in_an_error_gives_way_in_the_middle_keeping_the_problem_and_its_fix(cli, tiny_args):
    """A deep path (CI workspaces nest deeply) made the one line too long; its end was cut, and with it the
    fix (a golden's `--force`). Now the middle gives way: the line starts with the problem and ends with the fix."""
    deep = "/nonexistent/" + "/".join(c * 200 for c in "def") + "/p.jsonl"
    code, out, err = cli("run", *tiny_args, "--prompts", deep)
    _one_line_exit_2((code, out, err), "prompt file /nonexistent/ddd", "…")
    line = err.strip()
    assert line.endswith("does not exist; pass a JSONL file or one of: default, smoke"), line
    assert len(line) <= 600


def test_bad_input_missing_gguf(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--model", "/nonexistent/m.gguf"), "does not exist")


@pytest.mark.parametrize("damage,needle", [("not-gguf", "is not a GGUF file (it does not start with GGUF)"),
                                           ("header-cut", "damaged or truncated: download it again"),
                                           ("smollm2-head", "damaged or truncated: download it again")])
def test_bad_input_a_damaged_gguf_is_named_with_its_fix_not_a_crash(cli, tiny_args, tmp_path, monkeypatch, damage,
                                                                     needle):
    """A truncated or forged .gguf crashed inside transformers' converter (exit 3, "internal error"): SmolLM2's
    file cut to its first 2 MB raised "cannot reshape array ...". It is the input's fault: exit 2, one line."""
    from evalrun.models import smollm2_gguf_path

    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    with open(smollm2_gguf_path(), "rb") as real:
        path.write_bytes({"not-gguf": b"hello\n", "header-cut": b"GGUF garbage",
                          "smollm2-head": real.read(2_000_000)}[damage])
    _one_line_exit_2(cli("run", *tiny_args, "--model", str(path)), "m.gguf", needle)
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").glob("m-*"))


@pytest.mark.parametrize("keep,needle", [("nonexistent@0-1", "names prompt 'nonexistent', which prompt set smoke lacks; "
                                                             "use its ids (capital, chat-hello, zh-short) or all"),
                                        ("capital@6-9", "asks steps 6-9 of prompt 'capital', which runs 6 steps; ask "
                                                        "steps within 0-5"),
                                        ("capital@2-7", "asks steps 2-7"), ("capital@3-1", "asks steps 3-1"),
                                        ("zh-short,capital@1,zh-short@2", "names prompt 'zh-short' twice")])
def test_bad_input_keep_logits_naming_what_the_run_lacks(cli, tiny_args, keep, needle):
    """A prompt id the set lacks, or steps past a prompt's, kept nothing and said nothing (exit 0): a typo lost the
    logits asked for. Now refused before anything runs."""
    _one_line_exit_2(cli("run", *tiny_args, "--keep-logits", keep), needle)
    code, out, err = cli("run", *tiny_args, "--keep-logits", "capital@2-5,zh-short", "--json", "--quiet")
    assert code == 0, err
    assert json.loads(out)["config"]["keep_logits"] == "capital@2-5,zh-short"


@pytest.mark.parametrize("text,needle", [('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n', ":2: not valid JSON"),
                                         ('{"prompt": "x"}\n', ":1: missing 'id'"),
                                         ('{"id": "a"}\n', ":1: give exactly one of"),
                                         # a non-string id read as its Python text: null as "None", 1 and "1" as one
                                         ('{"id": null, "prompt": "x"}\n', ":1: missing 'id'"),
                                         ('{"id": 7, "prompt": "x"}\n', ':1: the id 7 is a int, not a string; write it '
                                                                         'in quotes, e.g. "id": "7"'),
                                         ('{"id": ["a"], "prompt": "x"}\n', ":1: the id [\"a\"] is a list"),
                                         ('{"id": true, "prompt": "x"}\n', ":1: the id true is a bool"),
                                         ('{"id": "  ", "prompt": "x"}\n', ":1: the id is blank"),
                                         ('{"id": "a", "prompt": "x", "colour": 1}\n', "unknown keys"),
                                         ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "duplicate id"),
                                         ('{"id": "a\\n::error::z", "prompt": "x"}\n', ":1: the id"),
                                         ('{"id": "a\\u202eb", "prompt": "x"}\n', "bidirectional"),
                                         # which "prompt" a run took depended on the JSON reader (Python's: the last)
                                         ('{"id": "a", "prompt": "x", "prompt": "y"}\n', ":1: the key 'prompt' is given twice"),
                                         ('{"id": "a", "messages": [{"role": "user", "role": "system", "content": "c"}]}\n',
                                          ":1: the key 'role' is given twice"),
                                         pytest.param('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "x", "max_new_tokens": 1'
                                                      + "0" * 5000 + '}\n', ":2: a number too long to read", id="huge-int")])
def test_bad_input_broken_jsonl_names_file_and_line(cli, tiny_args, write_prompts, text, needle):
    path = write_prompts(text)
    args = [a if a != "smoke" else str(path) for a in tiny_args]
    _one_line_exit_2(cli("run", *args), str(path), needle)


@pytest.mark.parametrize("text, as_messages", [("a " * 2_000_000, False), ("x" * 4_000_000, False),
                                               ("a " * 2_000_000, True)])
def test_bad_input_a_prompt_past_the_context_is_refused_from_a_prefix(cli, tiny_args, write_prompts, monkeypatch,
                                                                      text, as_messages):
    """A 50 MB prompt took 10 GB and 91 s to be told it is too long (a red-team pass): the tokenizer reads prefixes
    until one holds more tokens than the model's positions, never the whole prompt."""
    from evalrun import prompts

    seen = []
    real = prompts.tokens_past_context

    def measured(tokenizer, text, limit):
        class Counting:
            def __call__(self, prefix, **options):
                seen.append(len(prefix))
                return tokenizer(prefix, **options)
        return real(Counting(), text, limit)

    monkeypatch.setattr(prompts, "tokens_past_context", measured)
    encode = prompts.encode
    monkeypatch.setattr(prompts, "encode", lambda tokenizer, record: pytest.fail("the whole prompt was tokenized")
                        if record.id == "long" else encode(tokenizer, record))
    long = {"id": "long", "messages": [{"role": "user", "content": text}]} if as_messages else {"id": "long",
                                                                                                "prompt": text}
    path = write_prompts([{"id": "ok", "prompt": "short"}, long])
    one_line_exit_2(cli("run", *tiny_args[:2], "--prompts", str(path), *tiny_args[4:]),
                    "prompt 'long' has more tokens than the model's")
    assert seen and max(seen) < len(text) // 4, seen


def test_bad_input_a_config_file_with_an_integer_past_4300_digits(cli, tiny_args, tmp_path):
    """tomllib raises ValueError (Python's limit on converting text to int) for such a number: it was an internal
    error (exit 3) in run, bisect and wherever a TOML config is read."""
    path = tmp_path / "big.toml"
    path.write_text("max_new_tokens = 1" + "0" * 5000 + "\n")
    _one_line_exit_2(cli("run", *tiny_args, "--config", str(path)), "big.toml: a number too long to read")
    _one_line_exit_2(cli("bisect", "--good", "O0", "--bad", str(path), "--model", "random:tiny", "--prompts", "smoke",
                         "--in-process", "--quiet"), "big.toml: a number too long to read")


def test_bad_input_keep_logits_steps_past_4300_digits(cli, tiny_args):
    """The steps' digits went to int(), which refuses text past 4300 digits: an internal error (exit 3)."""
    _one_line_exit_2(cli("run", *tiny_args, "--keep-logits", "capital@1" + "0" * 5000), "keep_logits=", "is not valid")


def test_store_show_of_a_run_whose_timings_hold_an_integer_past_1e308(cli, tiny_args, store_path):
    """A store is untrusted input: formatting such a figure as a float raised OverflowError (exit 3). Its timings
    are now "not readable", like any other damaged timings."""
    import sqlite3

    code, out, err = cli("run", *tiny_args, "--json", "--quiet")
    assert code == 0, err
    run_id = json.loads(out)["run_id"]
    with sqlite3.connect(store_path) as conn:
        conn.execute("UPDATE runs SET timings_json = json_set(timings_json, '$.tokens_per_s', json(?))", ["1" + "0" * 400])
    code, out, err = cli("store", "show", run_id[:8], "--store", str(store_path))
    assert code == 0 and "timings: not readable in this record" in out, err


def test_a_prompt_file_with_raw_line_separators_inside_strings_is_read_line_by_line(cli, tiny_args, tmp_path):
    """U+2028, U+2029 and U+0085 are legal unescaped in a JSON string; str.splitlines split records on them ("not
    valid JSON (Unterminated string...)"). Lines end at "\n" (a "\r" before it dropped) and keep their numbers."""
    from evalrun.prompts import read_records

    texts = ["a\u2028b", "c\u2029d", "e\x85f", "g\rh"]
    path = tmp_path / "separators.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": text}, ensure_ascii=False) for i, text in enumerate(texts)]
    path.write_bytes(("\r\n".join(lines) + "\r\n\n").encode("utf-8"))
    assert [r.prompt for r in read_records(path)] == texts
    args = [a if a != "smoke" else str(path) for a in tiny_args]
    code, out, err = cli("run", *args, "--json", "--quiet")
    assert code == 0 and [r["prompt_id"] for r in json.loads(out)["results"]] == ["p0", "p1", "p2", "p3"], err
    path.write_bytes(("\n".join(lines) + '\n\n{"id": "broken", "prompt": \n').encode("utf-8"))
    _one_line_exit_2(cli("run", *args), f"{path}:6: not valid JSON")


def test_bad_input_unknown_key(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--set", "bogus=1"), "unknown config key 'bogus'", "valid keys")


def test_bad_input_unknown_value(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--compilation-mode", "turbo"), "turbo", "trace-once")


def test_bad_input_opt_level_7(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "-O", "7"), "-O0, -O1, -O2 or -O3")


def test_bad_input_unknown_option(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--frobnicate"), "frobnicate")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="machine has a GPU")
def test_bad_input_cuda_without_gpu(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--device", "cuda"), "no CUDA GPU", "--device cpu")


def test_bad_input_cuda_graphs_on_cpu(cli, tiny_args):
    _one_line_exit_2(cli("run", *tiny_args, "--device", "cpu", "--cudagraph-mode", "full"), "needs a GPU")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_bad_input_unwritable_store_as_user(cli, tiny_args, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _one_line_exit_2(cli("run", *tiny_args, "--store", str(locked / "sub" / "x.db")), "store")


def test_bad_input_unwritable_store(cli, tiny_args, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    _one_line_exit_2(cli("run", *tiny_args, "--store", str(blocker / "x.db")), "cannot open store", "--store")


def test_bad_input_a_missing_smollm2_gguf_is_named_with_its_fix(cli, monkeypatch, tmp_path):
    """EVALRUN_SMOLLM2_GGUF naming no file (a GPU machine before the file was copied there): one line naming the
    variable and the fix, not "free space" (what an unexplained missing file used to say)."""
    monkeypatch.setenv("EVALRUN_SMOLLM2_GGUF", str(tmp_path / "nowhere" / "smollm2.gguf"))
    _one_line_exit_2(cli("run", "--prompts", "smoke", "--max-new-tokens", "2", "--store", str(tmp_path / "s.db")),
                     "EVALRUN_SMOLLM2_GGUF", "not a file", "unset it")


def test_bad_input_a_missing_file_is_not_told_to_free_space():
    """The generic OSError line gives the fix that matches the error: a missing path is checked, a full disk freed."""
    import contextlib
    import errno
    import io

    from evalrun.cli import exit_code_of

    for number, fix in ((errno.ENOENT, "check the path"), (errno.ENOSPC, "free space"),
                        (errno.EACCES, "choose a writable path")):
        error = OSError(number, os.strerror(number), "/some/path")
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            assert exit_code_of(error) == 2
        assert fix in said.getvalue() and "/some/path" in said.getvalue(), said.getvalue()


def test_bad_input_store_that_is_not_sqlite(cli, tiny_args, tmp_path):
    bogus = tmp_path / "bogus.db"
    bogus.write_bytes(b"this is not a database" * 100)
    _one_line_exit_2(cli("run", *tiny_args, "--store", str(bogus)), "store")


@pytest.mark.parametrize("command", ["run", "invariance", "golden verify"])
def test_bad_input_leaves_no_new_store_file(cli, tmp_path, golden_factory, command):
    """A typo in the model (or prompts) is refused before the store is created: the store file, and the folders
    --store names, were left behind empty (45 KB of schema) by run, invariance and golden verify --store."""
    words = {"run": ["run"], "invariance": ["invariance", "--batch-sizes", "1,2"],
             "golden verify": ["golden", "verify", "g", "--dir", str(golden_factory()) if command == "golden verify"
                               else ""]}[command]
    store = tmp_path / "new" / "s.db"
    _one_line_exit_2(cli(*words, "--model", "random:nope", "--prompts", "smoke", "--store", str(store), "-q"),
                     "unknown random model")
    assert not (tmp_path / "new").exists()
    code, _, err = cli(*words, "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "2", "--store",
                       str(store), "-q")
    assert code == 0 and store.is_file(), err  # a good command creates it


def test_a_store_that_cannot_be_made_is_refused_before_the_model_loads(cli, tiny_args, tmp_path, monkeypatch):
    """The store is created only once the input is good, but checked before the model loads: a link to nothing
    (its folder's permissions say nothing of it) and a file where its folder should be."""
    from evalrun import runner

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the store was refused")

    monkeypatch.setattr(runner, "load_model", no_loading)
    dangling = tmp_path / "dangling.db"
    dangling.symlink_to(tmp_path / "nowhere" / "x.db")
    args = [a for a in tiny_args if a != tiny_args[-1]]
    _one_line_exit_2(cli("run", *args, str(dangling)), "is a link to", "which does not exist")
    (tmp_path / "file").write_text("not a folder")
    _one_line_exit_2(cli("run", *args, str(tmp_path / "file" / "x.db")), "is not a writable folder")


def test_store_commands_on_missing_store(cli, tmp_path):
    _one_line_exit_2(cli("store", "ls", "--store", str(tmp_path / "none.db")), "does not exist")


def test_store_show_unknown_run(cli, tiny_args):
    cli("run", *tiny_args, "--quiet")
    _one_line_exit_2(cli("store", "show", "ffffffff", "--store", tiny_args[-1]), "no run")


def _commands(group, prefix=()):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, prefix + (name,))
        else:
            yield prefix + (name,), command


@pytest.mark.parametrize("path,command", list(_commands(cli_group)), ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_command_is_documented_with_an_example(path, command):
    assert command.help and "Example:" in command.help and f"evalrun {' '.join(path)}" in command.help


def test_every_command_has_one_output_convention():
    """--format text|json|... everywhere, --json as its alias."""
    for path, command in _commands(cli_group):
        names = {option.name for option in command.params}
        assert {"as_json", "output_format"} <= names, path


@pytest.mark.parametrize("args", [("store", "ls"), ("store", "check"), ("golden", "list")])
def test_json_alias_and_format_json_agree(cli, tiny_args, tmp_path, args):
    cli("run", *tiny_args, "--quiet")
    extra = ["--store", tiny_args[-1]] if args[0] == "store" else ["--dir", str(tmp_path)]
    first, second = cli(*args, *extra, "--json"), cli(*args, *extra, "--format", "json")
    assert first[0] == second[0] == 0
    assert json.loads(first[1]) == json.loads(second[1])


def test_a_crash_is_not_a_verdict(cli, tiny_args, monkeypatch):
    """An unexpected exception exits 3 (never 1, which CI reads as "changed"), one line naming the traceback file."""
    from evalrun import runner

    def broken(*args, **kwargs):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(runner, "execute", broken)
    code, out, err = cli("run", *tiny_args, "--quiet")
    lines = err.strip().splitlines()
    assert code == 3 and len(lines) == 1 and "Traceback" not in err
    assert "internal error: ZeroDivisionError: planted" in lines[0]
    path = lines[0].split("traceback in ")[1].split(";")[0]
    assert "ZeroDivisionError" in open(path).read()
    os.unlink(path)


def test_output_paths_are_checked_before_any_model_runs(cli, golden_factory, tmp_path, monkeypatch):
    directory = golden_factory()

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for module in ("evalrun.verify", "evalrun.golden"):
        monkeypatch.setattr(f"{module}.prepare", no_model)
    _one_line_exit_2(cli("golden", "verify", "g", "--dir", str(directory), "--junit", str(tmp_path / "missing" / "r.xml")),
                     "--junit", "cannot write")
    (tmp_path / "file.txt").write_text("x")
    _one_line_exit_2(cli("golden", "create", "x", "--dir", str(tmp_path / "file.txt" / "sub"), "--model", "random:tiny"),
                     "cannot write goldens")


def test_markdown_cannot_be_injected_through_prompt_ids(cli, write_prompts, tmp_path):
    hostile = 'x --> <!-- hidden | col # Heading [link](http://e) `code`'  # line breaks: refused at load'
    path = write_prompts([{"id": hostile, "prompt": "one"}, {"id": "b", "prompt": "two"}])
    directory = tmp_path / "g"
    assert cli("golden", "create", "g", "--model", "random:tiny", "--prompts", str(path), "--max-new-tokens", "3",
               "--dir", str(directory), "--quiet")[0] == 0
    code, out, _ = cli("golden", "verify", "g", "--dir", str(directory), "--batch-size", "2", "--quiet",
                       "--format", "markdown")
    assert code == 0
    assert "<!--" not in out and "-->" not in out and "\n# Heading" not in out and "](http" not in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert all(line.count(" | ") == rows[0].count(" | ") for line in rows)  # no cell was split by a pipe


HOSTILE_CELLS = ["golden's", 'say "hi"', "a & b &amp; &#x27;", "<b>x</b> <!-- c", "a | b", "`code` ``", "@octocat",
                 "hi @octocat and me@example.com", "#1", "fix #12", "line\nbreak", "[l](http://e) *e* _u_ \\ ~s~",
                 "cost $5 and $6"]


def _render_cell(cell: str) -> str:
    """What a CommonMark reader shows for a cell, renderer-independent: backslash escapes of ASCII punctuation
    and entities decoded, in one pass as CommonMark does."""
    import html

    def decode(match: "re.Match[str]") -> str:
        piece = match.group(0)
        return piece[1] if piece.startswith("\\") else html.unescape(piece)

    return re.sub(r"\\[!-/:-@\[-`{-~]|&(#[0-9]+|#x[0-9a-fA-F]+|[A-Za-z]+);", decode, cell)


@pytest.mark.parametrize("text", HOSTILE_CELLS)
def test_a_markdown_cell_renders_as_its_text_and_pings_no_one(text):
    """html.escape(quote=True) then a backslash before "#" made every apostrophe "&\\#x27;", shown as "&#x27;";
    "@octocat" in a PR comment pinged that user and "#1" linked issue 1. The cell now renders as the text itself
    (its line breaks as escapes), with a zero-width space after "@" and "#"."""
    from evalrun.report import markdown_cell, printable

    cell = markdown_cell(text)
    assert _render_cell(cell).replace("\u200b", "") == printable(text)
    assert "<" not in cell and "\n" not in cell
    assert not re.search(r"(?<!\\)[|`*_\[\]$]", cell)  # nothing splits a cell, opens code, emphasis, a link, math
    assert not re.search(r"@[A-Za-z0-9]|#[0-9]", _render_cell(cell))  # GitHub's mention and issue patterns
    assert not re.search(r"&(?!(amp|lt|gt|#8203);)", cell)  # no "&" but the entities made here
    from markdown_it import MarkdownIt  # a CommonMark renderer (test extra), with GitHub's tables

    rendered = MarkdownIt("commonmark").enable("table").render(f"| a | b |\n|---|---|\n| {cell} | x |\n")
    cells = re.findall(r"<td>(.*?)</td>", rendered)  # the row keeps its two cells: nothing in it split one
    assert len(cells) == 2 and cells[1] == "x" and "<" not in cells[0], rendered
    assert __import__("html").unescape(cells[0]).replace("\u200b", "") == printable(text)


def _docstring_examples() -> list[tuple[str, list[str]]]:
    """(command, arguments) of every `evalrun ...` example in the commands' help that runs on random:tiny alone."""
    import shlex

    import click

    examples, commands = [], [(name, command) for name, command in cli_group.commands.items()]
    while commands:
        name, command = commands.pop(0)
        if isinstance(command, click.Group):
            commands += [(f"{name} {sub}", subcommand) for sub, subcommand in command.commands.items()]
            continue
        for line in (command.help or "").splitlines():
            words = shlex.split(line.partition("#")[0]) if line.strip().startswith("evalrun ") else []
            if "random:tiny" in words and not {">", "&&"} & set(words):
                examples.append((name, words[1:]))
    return examples


@pytest.mark.parametrize("command,args", _docstring_examples(), ids=lambda value: value if isinstance(value, str) else "")
def test_the_help_examples_on_random_tiny_run(cli, monkeypatch, tmp_path, command, args):
    """`evalrun fingerprint --model random:tiny --json`, the fingerprint command's example, exited 2: the default
    prompt set holds a prompt past random:tiny's positions. Every example that needs no real model runs."""
    monkeypatch.setenv("EVALRUN_STORE", str(tmp_path / "store.db"))
    code, out, err = cli(*args, "--quiet") if command in ("run", "invariance") else cli(*args)
    assert code == 0, err


def test_progress_bar_on_stderr_and_quiet_silences_it(cli, tiny_args):
    code, out, err = cli("run", *tiny_args)
    assert code == 0 and "generating" in err and "generating" not in out
    code, _, err = cli("run", *tiny_args, "--quiet")
    assert code == 0 and err == ""


def test_text_tables_show_control_and_bidi_characters_as_escapes():
    """A golden's prompt id (untrusted) in a text table stays on its line and shows what it holds."""
    from evalrun.report import table

    rendered = table(["prompt"], [["a\n::error::forged\u202e"]])
    assert rendered.splitlines()[-1] == "a\\n::error::forged\\u202e" and len(rendered.splitlines()) == 3
