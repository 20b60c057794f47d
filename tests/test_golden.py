import json
import shutil
import sqlite3
import xml.etree.ElementTree as ElementTree

import numpy as np
import pytest
import torch

from evalrun.compare import drift_check
from evalrun.golden import open_golden
from evalrun.errors import GoldenError

from conftest import copy_model_dir

GOLDEN_ARGS = ["--prompts", "smoke", "--max-new-tokens", "6", "--quiet"]


@pytest.fixture(scope="module")
def tiny_golden(tmp_path_factory):
    """A random:tiny golden, made once per module through the CLI."""
    from evalrun.cli import main

    directory = tmp_path_factory.mktemp("golden")
    with pytest.raises(SystemExit) as exit:
        main(["golden", "create", "tiny", "--model", "random:tiny", *GOLDEN_ARGS, "--dir", str(directory)])
    assert exit.value.code == 0
    return directory


def _verify(cli, directory, *args, name="tiny"):
    code, out, err = cli("golden", "verify", name, "--dir", str(directory), "--quiet", "--format", "json", *args)
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def test_same_config_same_environment_is_identical(cli, tiny_golden):
    code, verdict, _ = _verify(cli, tiny_golden)
    assert (code, verdict["verdict"]) == (0, "identical")
    assert verdict["reference_rerun"].startswith("skipped")  # no extra model runs when identical


def test_golden_file_is_small_and_self_contained(tiny_golden):
    path = tiny_golden / "tiny.db"
    assert path.stat().st_size < 5_000_000
    assert not (tiny_golden / "tiny.db-wal").exists()
    golden = open_golden("tiny", tiny_golden)
    assert set(golden.meta["roles"]) == {"pinned", "reference", "oracle"}
    assert golden.meta["oracle_dtype"] == "float64"
    oracle = golden.results("oracle")[0]
    pinned = golden.results("pinned")[0]
    assert oracle.arrays["probe_values"].shape == pinned.arrays["topk_values"].shape


def test_batch_change_is_drift_with_causes_and_strict_fails(cli, tiny_golden, tmp_path):
    junit = tmp_path / "report.xml"
    code, verdict, _ = _verify(cli, tiny_golden, "--batch-size", "3", "--junit", str(junit))
    assert (code, verdict["verdict"]) == (0, "drift")
    assert any(c["key"] == "batch_size" for c in verdict["config_diff"])
    assert verdict["reference_rerun"] == "reproduced"
    assert all(p["worst_ratio"] < 3 for p in verdict["prompts"])
    cases = ElementTree.parse(junit).getroot().findall("testcase")
    assert [c.get("name") for c in cases] == ["capital", "chat-hello", "zh-short"]
    code, verdict, _ = _verify(cli, tiny_golden, "--batch-size", "3", "--strict")
    assert (code, verdict["verdict"]) == (1, "drift")


def test_markdown_output(cli, tiny_golden):
    code, out, _ = cli("golden", "verify", "tiny", "--dir", str(tiny_golden), "--quiet", "--format", "markdown")
    assert code == 0 and out.startswith("### ") and "| prompt | verdict |" in out


def test_changed_model_code_is_changed(cli, tiny_golden, monkeypatch):
    from evalrun.engine import transformer

    original = transformer.rms_norm
    monkeypatch.setattr(transformer, "rms_norm", lambda x, w, eps: original(x, w, eps) * 1.01)
    code, verdict, _ = _verify(cli, tiny_golden)
    assert (code, verdict["verdict"]) == (1, "changed")
    assert verdict["reference_rerun"] == "not reproduced"


def test_drift_budget_floors_a_lucky_reference_step():
    oracle = np.zeros((3, 4))
    reference = np.array([[0.1] * 4, [0.001] * 4, [0.1] * 4])  # step 1 happens to sit on the oracle
    assert drift_check(np.full((3, 4), 0.15), reference, oracle, "bfloat16").within_budget


def test_drift_budget_is_pytorch_rule():
    oracle = np.zeros((4, 8))
    reference = np.full((4, 8), 0.1)
    assert drift_check(np.full((4, 8), 0.19), reference, oracle, "float32").within_budget  # 1.9x
    failing = drift_check(np.full((4, 8), 0.25), reference, oracle, "float32")  # 2.5x > m = 2
    assert not failing.within_budget and failing.worst_ratio == pytest.approx(2.5)
    assert drift_check(np.full((4, 8), 0.29), reference, oracle, "bfloat16").within_budget
    assert drift_check(np.full((4, 8), 0.200005), reference, oracle, "float32").within_budget  # inside the floor
    assert not drift_check(np.full((4, 8), 0.201), reference, oracle, "float32").within_budget
    assert drift_check(np.full((4, 8), 0.3), reference, oracle, "float32").fails().startswith("step 0")


@pytest.fixture(scope="module")
def hf_golden(tmp_path_factory, tiny_hf_dir):
    from evalrun.cli import main

    directory = tmp_path_factory.mktemp("hf-golden")
    model_dir = copy_model_dir(tiny_hf_dir, directory / "model")
    with pytest.raises(SystemExit) as exit:
        main(["golden", "create", "hf", "--model", str(model_dir), *GOLDEN_ARGS, "--dir", str(directory)])
    assert exit.value.code == 0
    return directory, model_dir



@pytest.mark.parametrize("edit", ["scale", "ulp"])
def test_perturbed_weights_are_changed_naming_weights(cli, hf_golden, tiny_hf_dir, edit):
    directory, model_dir = hf_golden

    def perturb(state):
        weight = state["model.layers.1.self_attn.o_proj.weight"]
        if edit == "scale":
            weight.mul_(1.001)
        else:
            weight.view(torch.int32)[3, 5] += 1

    try:
        shutil.rmtree(model_dir)
        copy_model_dir(tiny_hf_dir, model_dir, perturb)
        code, verdict, _ = _verify(cli, directory, name="hf")
        assert (code, verdict["verdict"]) == (1, "changed")
        assert verdict["model_diff"] == ["weights"] and "model identity: weights differ" in verdict["causes"]
    finally:
        shutil.rmtree(model_dir)
        copy_model_dir(tiny_hf_dir, model_dir)
    assert _verify(cli, directory, name="hf")[1]["verdict"] == "identical"


def test_edited_prompt_file_is_incomparable(cli, tiny_args, write_prompts, tmp_path):
    path = write_prompts([{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}])
    directory = tmp_path / "g"
    code, _, err = cli("golden", "create", "p", "--model", "random:tiny", "--prompts", str(path),
                       "--max-new-tokens", "4", "--dir", str(directory), "--quiet")
    assert code == 0, err
    write_prompts([{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two!"}])
    code, verdict, err = _verify(cli, directory, name="p")
    assert code == 2 and verdict["verdict"] == "incomparable" and "prompt set differs" in verdict["causes"][0]
    assert "incomparable" in err


def _damaged_copy(tiny_golden, tmp_path, damage):
    directory = tmp_path / "damaged"
    directory.mkdir()
    target = directory / "tiny.db"
    shutil.copy(tiny_golden / "tiny.db", target)
    damage(target)
    return directory


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    golden_arrays = data.rfind(b"float32")  # inside a row of the arrays table
    data[golden_arrays + 40] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_row(path):
    conn = sqlite3.connect(path)
    conn.execute("UPDATE results SET output_text = 'edited' WHERE prompt_index = 0")
    conn.commit()
    conn.close()


def _hostile_table(path):
    conn = sqlite3.connect(path)
    conn.execute('CREATE TABLE "x; DROP TABLE runs; --" ("a""b" TEXT)')
    conn.execute('INSERT INTO "x; DROP TABLE runs; --" VALUES (?)', ["payload"])
    conn.commit()
    conn.close()


def _object_dtype(path):
    conn = sqlite3.connect(path)
    conn.execute("UPDATE arrays SET dtype = 'object' WHERE name = 'tokens'")
    conn.commit()
    conn.close()


@pytest.mark.parametrize("damage", [_truncate, _flip_byte, _edit_row, _hostile_table, _object_dtype],
                         ids=["truncated", "byte-flipped", "sql-edited", "hostile-table", "object-dtype"])
def test_damaged_golden_is_refused_naming_the_file(cli, tiny_golden, tmp_path, damage):
    directory = _damaged_copy(tiny_golden, tmp_path, damage)
    code, out, err = cli("golden", "verify", "tiny", "--dir", str(directory), "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(directory / "tiny.db") in err and ("damaged" in err or "edited" in err)


def test_missing_golden_says_how_to_create_it(cli, tmp_path):
    code, _, err = cli("golden", "verify", "nosuch", "--dir", str(tmp_path))
    assert code == 2 and "evalrun golden create nosuch" in err


def test_create_refuses_to_overwrite_without_force(cli, tiny_golden):
    before = (tiny_golden / "tiny.db").read_bytes()
    code, _, err = cli("golden", "create", "tiny", "--model", "random:tiny", *GOLDEN_ARGS, "--dir", str(tiny_golden))
    assert code == 2 and "--force" in err
    assert (tiny_golden / "tiny.db").read_bytes() == before


def test_list_and_show(cli, tiny_golden):
    code, out, _ = cli("golden", "list", "--dir", str(tiny_golden), "--json")
    assert code == 0 and json.loads(out)[0]["name"] == "tiny"
    code, out, _ = cli("golden", "show", "tiny", "--dir", str(tiny_golden), "--json")
    data = json.loads(out)
    assert code == 0 and data["oracle_dtype"] == "float64" and len(data["results"]) == 3


def test_bad_golden_name(cli, tmp_path):
    code, _, err = cli("golden", "verify", "../etc/passwd", "--dir", str(tmp_path))
    assert code == 2 and "not valid" in err
