"""golden verify: the verdict lifecycle on real runs of random:tiny (CPU): gates, the cheap identical path,
forced decoding, the function check, the execution check, and planted faults."""

import json
import os
import shutil
from pathlib import Path

import pytest

from evalrun import fingerprint, runner
from evalrun.engine.faults import Fault, fault_hook
from evalrun.golden import open_golden
from evalrun.verify import candidate_config, verify_golden


@pytest.fixture
def o0(golden_factory):
    return golden_factory()


def _verdict(directory, hook=None, mode="auto", **flags):
    golden = open_golden("g", directory)
    return verify_golden(golden, candidate_config(golden, None, flags, ()), hook=hook, function_check=mode)


def test_same_config_is_identical_with_no_extra_run(verify, o0, monkeypatch):
    calls, real = [], runner.execute
    monkeypatch.setattr("evalrun.verify.execute", lambda *a, **k: calls.append(1) or real(*a, **k))
    code, verdict, _ = verify(o0)
    assert (code, verdict["verdict"]) == (0, "identical") and len(calls) == 1
    assert verdict["function_check"].startswith("skipped")


def test_batch_change_is_drift_and_strict_fails(verify, o0, tmp_path):
    import xml.etree.ElementTree as ElementTree

    junit = tmp_path / "report.xml"
    code, verdict, _ = verify(o0, "--batch-size", "3", "--junit", str(junit))
    assert (code, verdict["verdict"]) == (0, "drift")
    assert any(c["key"] == "batch_size" for c in verdict["config_diff"])
    assert any(c.startswith("batch composition: the only difference is the batch") and "3 of 3 prompts" in c
               for c in verdict["causes"]), verdict["causes"]
    # the function config at the candidate's batch size (its run: the candidate's own), judged by its numbers
    assert verdict["function_check"].startswith("float32 eager in this environment"), verdict["function_check"]
    assert 0 < verdict["distance"] < 1 and verdict["closest"]
    assert all(p["execution"]["distance"] < 1 for p in verdict["prompts"])
    root = ElementTree.parse(junit).getroot()
    assert [c.get("name") for c in root.findall("testcase")] == ["capital", "chat-hello", "zh-short"]
    assert {p.get("name") for p in root.iter("property")} >= {"evalrun.verdict", "evalrun.distance"}
    code, verdict, _ = verify(o0, "--batch-size", "3", "--strict")
    assert (code, verdict["verdict"]) == (1, "drift")


def test_another_dtype_is_judged_against_a_reference_of_that_dtype(verify, o0):
    code, verdict, _ = verify(o0, "--dtype", "bfloat16")
    assert (code, verdict["verdict"]) == (0, "drift"), verdict["causes"]
    assert "run here" in verdict["envelope"][0] and "envelope_s" in verdict["timings"]
    assert not any("batch composition" in cause for cause in verdict["causes"])
    assert verdict["function_check"].startswith("reproduced")


@pytest.mark.parametrize("mode", ["stock", "trace-once", "piecewise"])
def test_compiled_candidates_of_an_o0_golden_are_never_changed(verify, o0, mode):
    code, verdict, err = verify(o0, "--compilation-mode", mode)
    assert code == 0 and verdict["verdict"] in ("identical", "drift"), (err, verdict and verdict["causes"])
    assert verdict["candidate_config"]["compilation_mode"] == mode


def test_more_tokens_than_the_golden_holds_is_incomparable(verify, o0):
    code, verdict, err = verify(o0, "--max-new-tokens", "9")
    assert code == 2 and verdict["verdict"] == "incomparable" and "holds 6" in verdict["causes"][0]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_tokens_chosen_another_way_are_incomparable_not_changed(verify, o0, golden_factory):
    """A greedy golden verified at temperature=1.0 was `changed` (exit 1), blamed on the execution config,
    though its logits were within the envelope: sampled tokens are another workload. The seed counts only where
    tokens are sampled; a golden that samples verifies at its own temperature and seed."""
    code, verdict, err = verify(o0, "--set", "temperature=1.0")
    assert (code, verdict["verdict"]) == (2, "incomparable"), verdict and verdict["causes"]
    assert verdict["causes"][0].startswith("the golden chose its tokens greedily (temperature=0) and the candidate "
                                           "chooses them by sampling (temperature=1, seed=0)")
    assert "--set temperature=0" in verdict["causes"][0]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, verdict, _ = verify(o0, "--set", "seed=5")  # greedy both: the seed chooses nothing
    assert (code, verdict["verdict"]) == (0, "identical")
    sampled = golden_factory("--set", "temperature=0.7", "--set", "seed=3", tokens=3)
    code, verdict, _ = verify(sampled, "--max-new-tokens", "3")
    assert (code, verdict["verdict"]) == (0, "identical")
    for other in (("--set", "seed=4"), ("--set", "temperature=0.8"), ("--set", "temperature=0")):
        code, verdict, _ = verify(sampled, "--max-new-tokens", "3", *other)
        assert (code, verdict["verdict"]) == (2, "incomparable"), (other, verdict and verdict["causes"])
        assert "--set temperature=0.7 --set seed=3" in verdict["causes"][0]


def test_fewer_tokens_verify_the_prefix_and_say_so(verify, o0):
    code, verdict, _ = verify(o0, "--max-new-tokens", "4")
    assert code == 0 and verdict["verdict"] in ("identical", "drift") and verdict["steps_verified"] == 4
    assert any("first 4 of 6" in c for c in verdict["causes"])
    assert all(p["first_divergent_step"] < 4 for p in verdict["prompts"])


def test_changed_model_code_in_the_same_environment_is_changed(verify, o0, monkeypatch):
    from evalrun.engine import transformer

    original = transformer.rms_norm
    monkeypatch.setattr(transformer, "rms_norm", lambda x, w, eps: original(x, w, eps) * 1.01)
    code, verdict, _ = verify(o0, "--no-deterministic")  # a knob outside the function config: its own run
    assert (code, verdict["verdict"]) == (1, "changed")
    assert verdict["function_check"].startswith("NOT reproduced")
    assert any("no longer reproduces" in c for c in verdict["causes"])


FAULTS = [Fault("scale", 1e-4), Fault("int8"), Fault("rope_theta", 0.01), Fault("norm_eps", 10),
          Fault("mask_position"), Fault("sign_flip"), Fault("swap_layers", layer=0)]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.describe())
def test_planted_model_changes_fail_the_function_check_by_its_numbers(o0, fault):
    """Statistical mode: as in another environment, where bit-for-bit reproduction is not expected."""
    verdict = _verdict(o0, fault_hook(fault), mode="statistical")
    assert verdict.verdict == "changed" and verdict.exit_code == 1
    assert any(cause.startswith("function check failed") for cause in verdict.causes)
    assert all(p.function.distance > 1 for p in verdict.prompts)


def test_an_unchanged_model_passes_the_statistical_function_check(o0):
    verdict = _verdict(o0, mode="statistical", batch_size=3)
    assert verdict.verdict == "drift" and all(p.function.distance < 1 for p in verdict.prompts)


def test_a_fault_only_in_the_candidates_execution_fails_the_execution_check(o0):
    """The function run and the reference are clean; the candidate's engine computes the model wrongly (a fault
    in its execution, not in the shared weights). Any knob outside the function config singles the candidate
    out; deterministic=false compiles nothing (the stock mode in bfloat16 did: 73 s on 2 cores)."""
    hook = fault_hook(Fault("scale", 0.25), only=lambda prepared: prepared.config.deterministic is False)
    verdict = _verdict(o0, hook, batch_size=3, deterministic=False)
    assert verdict.verdict == "changed", verdict.causes
    assert any(c.startswith("execution check failed") and "function check passed" in c for c in verdict.causes)


def test_a_fault_in_the_batched_path_fails_the_function_check_of_a_bfloat16_golden(golden_factory):
    """A bug that only batches of more than one row run (padding, masks, a row-dependent op): a bfloat16 golden
    verified at batch 3 said drift even for a 5% scale of an MLP tensor (0.72 of the budget), since the function
    check ran at the golden's batch of one and the execution check judges against bfloat16's envelope (found by
    a red-team pass: every batched row's logits x 1.01, drift at 0.59). The function config now runs at the
    candidate's batch size, in float32: thousands of budgets out."""
    golden = open_golden("g", golden_factory("--dtype", "bfloat16"))
    hook = fault_hook(Fault("scale", 0.01), only=lambda prepared: prepared.config.batch_size > 1)
    verdict = verify_golden(golden, candidate_config(golden, None, {"batch_size": 3}, ()), hook=hook)
    assert verdict.verdict == "changed" and verdict.distance > 100, (verdict.distance, verdict.causes)
    assert any(c.startswith("function check failed") for c in verdict.causes), verdict.causes
    clean = verify_golden(golden, candidate_config(golden, None, {"batch_size": 3}, ()))
    assert clean.verdict == "drift" and clean.distance < 1, clean.causes


def test_another_environment_uses_the_statistical_function_check(verify, o0, monkeypatch):
    real = fingerprint.environment
    monkeypatch.setattr(runner, "environment", lambda device: dict(real(device), cpu="another CPU"))
    code, verdict, _ = verify(o0)
    assert code == 0 and verdict["verdict"] in ("identical", "drift")
    code, verdict, _ = verify(o0, "--batch-size", "3")
    assert (code, verdict["verdict"]) == (0, "drift")
    assert verdict["function_check"].startswith("float32 eager in this environment")
    assert any(d["key"] == "cpu" for d in verdict["environment_diff"])


def test_a_changed_model_file_is_changed_naming_weights(verify, golden_factory, tiny_hf_dir, tmp_path):
    import torch

    from conftest import copy_model_dir

    model_dir = copy_model_dir(tiny_hf_dir, tmp_path / "model")
    directory = golden_factory(model=str(model_dir))
    shutil.rmtree(model_dir)

    def perturb(state):
        state["model.layers.1.self_attn.o_proj.weight"].view(torch.int32)[3, 5] += 1

    copy_model_dir(tiny_hf_dir, model_dir, perturb)
    code, verdict, _ = verify(directory)
    assert (code, verdict["verdict"]) == (1, "changed")
    assert verdict["model_diff"] == ["weights"] and "model identity: weights differ" in verdict["causes"][0]


def test_an_edited_prompt_file_is_incomparable(cli, verify, write_prompts, tmp_path):
    path = write_prompts([{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}])
    directory = tmp_path / "g"
    code, _, err = cli("golden", "create", "g", "--model", "random:tiny", "--prompts", str(path),
                       "--max-new-tokens", "4", "--dir", str(directory), "--quiet")
    assert code == 0, err
    # a prompt's text edited, a prompt dropped (the verify crashed: exit 3, IndexError), a prompt added
    for records in ([{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two!"}], [{"id": "a", "prompt": "one"}],
                    [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}, {"id": "c", "prompt": "three"}]):
        write_prompts(records)
        code, verdict, err = verify(directory)
        assert code == 2 and verdict["verdict"] == "incomparable" and "prompt set differs" in verdict["causes"][0], err
        assert "incomparable" in err


def test_markdown_output_is_a_pr_comment(cli, o0):
    code, out, _ = cli("golden", "verify", "g", "--dir", str(o0), "--quiet", "--format", "markdown", "--batch-size", "3")
    assert code == 0 and out.startswith("### ") and "| prompt | verdict |" in out and "function check" in out


def test_json_is_strict(cli, o0):
    code, out, _ = cli("golden", "verify", "g", "--dir", str(o0), "--quiet", "--json", "--batch-size", "3")
    json.loads(out, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))


def _cpu_has(flag: str) -> bool:
    try:
        return f" {flag} " in open("/proc/cpuinfo").read().replace("\n", " ")
    except OSError:
        return False


@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_a_golden_verifies_under_every_cpu_instruction_set(golden_factory, isa):
    """Another CPU instruction set is legitimate variation: identical or drift, never changed (exit 0)."""
    import subprocess
    import sys

    if isa != "default" and not _cpu_has({"avx2": "avx2", "avx512": "avx512f"}[isa]):
        pytest.skip(f"this CPU has no {isa}")
    directory = golden_factory()
    process = subprocess.run([sys.executable, "-m", "evalrun", "golden", "verify", "g", "--dir", str(directory),
                              "--quiet", "--json"], env=dict(__import__("os").environ, ATEN_CPU_CAPABILITY=isa),
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr
    verdict = json.loads(process.stdout)
    assert verdict["verdict"] in ("identical", "drift")
    assert verdict["distance"] < 1


def _golden_then_edited_tokenizer(golden_factory, tiny_hf_dir, tmp_path, edit):
    """A golden of a model folder, then the folder replaced by a copy whose tokenizer config `edit` changed."""
    from conftest import copy_model_dir

    model_dir = copy_model_dir(tiny_hf_dir, tmp_path / "model")
    directory = golden_factory(model=str(model_dir))
    shutil.rmtree(model_dir)
    copy_model_dir(tiny_hf_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    edit(config, model_dir)
    config_path.write_text(json.dumps(config))
    return directory


def test_a_tokenizer_that_encodes_the_prompts_alike_is_not_a_model_change(verify, golden_factory, tiny_hf_dir, tmp_path):
    """Seen on the H200: the same GGUF converted by transformers 5.17 and 5.24 gave two eos ids."""

    def new_eos(config, _):
        config["eos_token"] = "<|endoftext|>"

    directory = _golden_then_edited_tokenizer(golden_factory, tiny_hf_dir, tmp_path, new_eos)
    code, verdict, _ = verify(directory)
    assert (code, verdict["verdict"]) == (0, "identical"), verdict["causes"]
    assert any(c.startswith("tokenizer differs (eos_token_id") for c in verdict["causes"])


def test_a_tokenizer_that_encodes_the_prompts_otherwise_is_incomparable(verify, golden_factory, tiny_hf_dir, tmp_path):
    def new_template(config, path):
        config["chat_template"] = "{{ messages[0]['content'] }}!"
        (path / "chat_template.jinja").unlink(missing_ok=True)

    directory = _golden_then_edited_tokenizer(golden_factory, tiny_hf_dir, tmp_path, new_template)
    code, verdict, err = verify(directory)
    assert (code, verdict["verdict"]) == (2, "incomparable") and "encodes to other token ids" in verdict["causes"][0]
    assert len(err.strip().splitlines()) == 1


def test_a_normalizer_rule_and_generation_defaults_no_prompt_meets_are_named(verify, golden_factory, tiny_hf_dir,
                                                                             tmp_path):
    """A normalizer rule no prompt of the golden meets (a user's 'Paris' now encodes as 'London') and a new
    generation_config.json (sampling, other stop ids): the golden's prompts and tokens are unchanged, so the
    verdict stands, but both verified identical with no cause at all (a red-team pass). Each is named now."""
    from conftest import copy_model_dir

    model_dir = copy_model_dir(tiny_hf_dir, tmp_path / "model")
    directory = golden_factory(model=str(model_dir))
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["normalizer"] = {"type": "Replace", "pattern": {"String": "Paris"}, "content": "London"}
    path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 69], "do_sample": True, "temperature": 1.5}))
    code, verdict, err = verify(directory)
    assert (code, verdict["verdict"]) == (0, "identical"), (err, verdict["causes"])
    assert any(c.startswith("tokenizer differs (normalizer ") for c in verdict["causes"]), verdict["causes"]
    generation = next(c for c in verdict["causes"] if c.startswith("generation config differs ("))
    assert '"do_sample" null -> true' in generation and '"temperature" null -> 1.5' in generation
    assert '"eos_token_id" 2 -> [2, 69]' in generation


@pytest.mark.parametrize("edit", ["vocabulary", "decoder"])
def test_a_tokenizer_that_reads_the_goldens_tokens_as_other_text_is_changed(verify, golden_factory, tiny_hf_dir,
                                                                            tmp_path, edit):
    """Two vocabulary entries swapped (' Paris' for ' London' on SmolLM2), or a decoder rule, where no prompt uses
    them: every prompt encodes to the golden's ids and every token id is the golden's, so this verified identical
    with no cause (a red-team pass). The same ids now read as other text: changed, naming the tokenizer."""
    from conftest import copy_model_dir

    model_dir = copy_model_dir(tiny_hf_dir, tmp_path / "model")
    directory = golden_factory(model=str(model_dir))
    pinned = open_golden("g", directory).results("pinned")
    in_prompts = {int(i) for r in pinned for i in r.arrays["input_ids"]}
    said = next(int(i) for r in pinned for i in r.arrays["tokens"][:r.eos_step if r.eos_step >= 0 else None]
                if int(i) not in in_prompts)
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    text_of = {index: text for text, index in vocab.items()}
    if edit == "vocabulary":
        other = next(i for i in sorted(text_of) if i not in in_prompts and i != said and text_of[i] != text_of[said])
        vocab[text_of[said]], vocab[text_of[other]] = other, said
    else:
        rule = {"type": "Replace", "pattern": {"String": text_of[said]}, "content": text_of[said] * 2}
        tokenizer["decoder"] = {"type": "Sequence", "decoders": [rule, tokenizer["decoder"]]}
    path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    code, verdict, err = verify(directory)
    assert (code, verdict["verdict"], verdict["model_diff"]) == (1, "changed", ["tokenizer"]), verdict["causes"]
    field = "vocab" if edit == "vocabulary" else "decoder"
    assert verdict["causes"][0].startswith("model identity: the tokenizer's ") and field in verdict["causes"][0]
    assert "differ and it reads the golden's tokens for prompt" in verdict["causes"][0], verdict["causes"]


def test_a_library_that_decodes_the_same_tokenizer_otherwise_is_named_not_changed(verify, golden_factory, tiny_hf_dir,
                                                                                  tmp_path, monkeypatch):
    """Other text from a tokenizer whose vocabulary, added tokens, decoder and rules are the golden's is a library
    that decodes otherwise (transformers once changed its clean-up of spaces): named, not changed."""
    from conftest import copy_model_dir

    from evalrun import verify as verify_module

    model_dir = copy_model_dir(tiny_hf_dir, tmp_path / "model")
    directory = golden_factory(model=str(model_dir))

    class OtherRelease:  # the same tokenizer, decoded by a library that ends the text otherwise
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def decode(self, ids, **options):
            return self.tokenizer.decode(ids, **options) + "!"

    reading = verify_module.decoding_difference
    monkeypatch.setattr(verify_module, "decoding_difference",
                        lambda results, tokenizer: reading(results, OtherRelease(tokenizer)))
    code, verdict, err = verify(directory)
    assert (code, verdict["verdict"]) == (0, "identical"), (err, verdict["causes"])
    assert any(c.startswith("tokenizer: it reads the golden's tokens for prompt") and "this transformers or "
               "tokenizers version decodes them otherwise" in c for c in verdict["causes"]), verdict["causes"]


def test_a_float32_oracle_still_gives_a_function_check(golden_factory, monkeypatch):
    """Where float64 weights do not fit, the oracle is float32 like the function run: the budget is then
    a floor of float32 ulps, so an unchanged model passes and a planted change still fails."""
    from evalrun import golden as golden_module

    monkeypatch.setattr(golden_module, "ORACLE_MEMORY_SHARE", 1e-12)
    directory = golden_factory("--set", "seed=1")
    assert open_golden("g", directory).config("oracle").dtype == "float32"
    assert _verdict(directory, mode="statistical", batch_size=3).verdict == "drift"
    changed = _verdict(directory, fault_hook(Fault("scale", 1e-2)), mode="statistical")
    assert changed.verdict == "changed" and "float32 oracle" in changed.function_check


def test_on_github_actions_verify_writes_the_step_summary_and_annotates_drift(cli, o0, tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    code, out, err = cli("golden", "verify", "g", "--dir", str(o0), "--quiet", "--batch-size", "3")
    assert code == 0, err
    assert out.strip().splitlines()[-1] == "::warning title=evalrun golden g::drift: config: batch_size 1 -> 3"
    assert summary.read_text().startswith("### 🟡 evalrun golden `g`: **drift**")
    code, out, err = cli("golden", "verify", "g", "--dir", str(o0), "--quiet", "--batch-size", "3", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "drift"  # stdout stays one JSON document
    assert summary.read_text().count("evalrun golden `g`") == 2


def test_a_whole_verify_with_store_keeps_its_candidate_run_and_names_it(cli, golden_factory, tmp_path):
    """`--store` on a whole verify used to be accepted and ignored; the candidate run is now stored as
    `evalrun run` stores one, and the JSON verdict names it (null without --store, and nothing written)."""
    directory = golden_factory()
    store = tmp_path / "kept.db"
    code, out, _ = cli("golden", "verify", "g", "--dir", str(directory), "--store", str(store), "--json", "--quiet")
    verdict = json.loads(out)
    assert code == 0 and verdict["verdict"] == "identical"
    kept = verdict["candidate_run"]
    assert kept["store"] == str(store)
    code, out, _ = cli("store", "show", kept["run_id"], "--store", str(store), "--json")
    shown = json.loads(out)
    assert code == 0 and shown["label"] == "verify:g" and shown["status"] == "complete"
    assert {r["prompt_id"] for r in shown["results"]} == {p["prompt_id"] for p in verdict["prompts"]}

    code, out, _ = cli("golden", "verify", "g", "--dir", str(directory), "--json", "--quiet")
    assert code == 0 and json.loads(out)["candidate_run"] is None
    code, out, _ = cli("golden", "verify", "g", "--dir", str(directory), "--store", str(store), "--quiet")
    assert code == 0 and "candidate run " in out and "kept in" in out  # the text verdict names it too


def test_a_golden_is_never_written_as_a_store_or_an_output(cli, golden_factory, tmp_path):
    """--store or --junit naming a golden (directly or through a link), or --junit naming the kept store:
    one line, exit 2, before any model runs, and the golden keeps its bytes."""
    import hashlib
    import os

    from conftest import one_line_exit_2

    directory = golden_factory()
    golden_file = directory / "g.db"
    before = hashlib.sha256(golden_file.read_bytes()).hexdigest()
    link = tmp_path / "link.db"
    os.symlink(golden_file, link)
    verify = ("golden", "verify", "g", "--dir", str(directory), "--quiet")
    one_line_exit_2(cli(*verify, "--store", str(golden_file)), "is a golden")
    one_line_exit_2(cli(*verify, "--store", str(link)), "is a golden")
    one_line_exit_2(cli("run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "2",
                        "--store", str(golden_file)), "is a golden")
    one_line_exit_2(cli(*verify, "--junit", str(golden_file)), "--junit", "would destroy it")
    kept = tmp_path / "kept.db"
    one_line_exit_2(cli(*verify, "--store", str(kept), "--junit", str(kept)), "--junit", "would destroy it")
    one_line_exit_2(cli(*verify, "--store", str(tmp_path / ("a" * 300 + ".db"))), "unusable")
    assert hashlib.sha256(golden_file.read_bytes()).hexdigest() == before
    assert not kept.exists()


def test_an_unusable_store_is_refused_before_the_candidate_runs(cli, golden_factory, tmp_path, monkeypatch):
    from conftest import one_line_exit_2
    from evalrun import verify

    def never(*args, **kwargs):
        raise AssertionError("the candidate ran before the store was checked")

    monkeypatch.setattr(verify, "execute", never)  # would exit 3 (an internal error), not 2
    (tmp_path / "not-sqlite.db").write_text("hello")
    one_line_exit_2(cli("golden", "verify", "g", "--dir", str(golden_factory()), "--quiet",
                        "--store", str(tmp_path / "not-sqlite.db")), "not-sqlite.db")


def test_an_output_that_cannot_be_written_fails_before_the_run_and_never_hides_the_verdict(cli, o0, tmp_path,
                                                                                            monkeypatch):
    """--junit through a dangling link passed the folder check and failed after the whole verify, turning its
    verdict (changed: exit 1, identical: exit 0) into exit 2. It is refused before any model runs now; a report
    file that fails after the verdict (the step summary) keeps a verdict's exit code, and is exit 2 only where the
    verdict has none."""
    from conftest import one_line_exit_2

    dangling = tmp_path / "r.xml"
    dangling.symlink_to(tmp_path / "no-folder" / "r.xml")
    verify = ("golden", "verify", "g", "--dir", str(o0), "--quiet")
    code, out, err = cli(*verify, "--junit", str(dangling))
    one_line_exit_2((code, out, err), "--junit", "cannot write there")
    assert out == "" and not (tmp_path / "no-folder").exists()  # refused before the verify ran
    fifo = tmp_path / "fifo.xml"
    os.mkfifo(fifo)  # nobody reads it: checking it waited forever, as writing it would after the verify
    one_line_exit_2(cli(*verify, "--junit", str(fifo)), "--junit", "is a pipe")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path))  # a folder: appending to it fails
    code, out, err = cli(*verify, "--model", "random:smollm2")
    assert code == 1 and "CHANGED" in out, err  # the verdict's exit code stands
    assert err.strip().startswith("evalrun: warning: golden g: changed, but could not write GITHUB_STEP_SUMMARY")
    code, out, err = cli(*verify)
    one_line_exit_2((code, out, err), "identical, but could not write GITHUB_STEP_SUMMARY")
    assert "IDENTICAL" in out
    code, out, err = cli(*verify, "--set", "temperature=1.0")  # incomparable: its one line says both
    one_line_exit_2((code, out, err), "incomparable", "(and could not write GITHUB_STEP_SUMMARY")


def test_the_output_check_leaves_no_file_and_lets_a_link_write_where_it_points(tmp_path):
    """The check opens the path as the write will and removes what it made: through a link whose target's folder
    exists, the target (not the link) is made and removed; a file that was there keeps its bytes."""
    from evalrun.cli import writable_output

    (tmp_path / "out").mkdir()
    link = tmp_path / "r.xml"
    link.symlink_to(tmp_path / "out" / "r.xml")
    writable_output(link, "--junit")
    assert link.is_symlink() and not (tmp_path / "out" / "r.xml").exists()
    kept = tmp_path / "kept.xml"
    kept.write_text("old")
    writable_output(kept, "--junit")
    assert kept.read_text() == "old"
    writable_output(Path(os.devnull), "--junit")  # a device takes writes
