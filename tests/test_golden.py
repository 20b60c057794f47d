"""The golden file: what create writes, how it is read, and how damage is refused."""

import json
import shutil
import sqlite3

import numpy as np
import pytest

from evalrun.golden import GOLDEN_FORMAT, PROBE_SAMPLE, REQUIRED_ROLES, open_golden

GOLDEN_ARGS = ["--prompts", "smoke", "--max-new-tokens", "6", "--quiet"]


@pytest.fixture
def tiny_golden(golden_factory):
    return golden_factory()


def test_golden_file_is_small_self_contained_and_versioned(tiny_golden):
    path = tiny_golden / "g.db"
    assert path.stat().st_size < 5_000_000
    assert not (tiny_golden / "g.db-wal").exists() and not (tiny_golden / "g.db-shm").exists()
    golden = open_golden("g", tiny_golden)
    assert golden.meta["format"] == GOLDEN_FORMAT and set(REQUIRED_ROLES) <= set(golden.meta["roles"])
    assert golden.config("oracle").dtype == "float64" and golden.config("function").dtype == "float32"
    # float32: the reference and the function run are one config, stored once
    assert golden.run_id("envelope:reference") == golden.run_id("function") != golden.run_id("envelope:pinned")
    assert set(golden.meta["create_seconds"]) == {"pinned_s", "oracle_s", "envelope_s"}
    assert golden.summary()["create_seconds"] == golden.meta["create_seconds"]  # in `golden show/create --json`


@pytest.mark.parametrize("stored", [None, "fast", {"pinned_s": "1"}, {"pinned_s": float("nan")}, {"x": True}, [1.0],
                                    {"pinned_s": 10 ** 400}])
def test_a_golden_that_misstates_its_create_time_reads_as_not_saying(stored):
    """An integer past 1e308 made math.isfinite raise OverflowError: golden list and show exited 3."""
    from evalrun.golden import create_seconds

    assert create_seconds(stored) is None
    assert create_seconds({"pinned_s": 1, "oracle_s": 2.5}) == {"pinned_s": 1.0, "oracle_s": 2.5}


def test_create_text_names_each_phase(cli, tmp_path):
    code, out, err = cli("golden", "create", "t", "--model", "random:tiny", "--dir", str(tmp_path), *GOLDEN_ARGS)
    assert code == 0, err
    assert "made in pinned " in out and " + oracle " in out and " + envelope " in out
    code, out, err = cli("golden", "show", "t", "--dir", str(tmp_path), "--json")
    assert code == 0 and set(json.loads(out)["create_seconds"]) == {"pinned_s", "oracle_s", "envelope_s"}


def test_oracle_probes_its_own_top_ids_and_a_fixed_sample(tiny_golden):
    golden = open_golden("g", tiny_golden)
    pinned, oracle = golden.results("pinned")[0], golden.results("oracle")[0]
    steps = len(pinned.arrays["tokens"])
    assert oracle.arrays["probe_ids"].shape == (steps, 64 + PROBE_SAMPLE)
    assert oracle.arrays["probe_values"].dtype == np.float64
    own = oracle.arrays["probe_ids"][:, :64]
    best = np.take_along_axis(oracle.arrays["probe_values"], np.argmax(oracle.arrays["probe_values"], 1)[:, None], 1)
    assert np.array_equal(own[:, 0], oracle.arrays["topk_ids"][:, 0])  # its top id first
    assert np.allclose(best[:, 0], oracle.arrays["probe_values"][:, 0])
    sample = oracle.arrays["probe_ids"][:, 64:]
    assert (sample == sample[0]).all()  # the same sample at every step
    member = golden.results("function")[0]
    assert np.array_equal(member.arrays["probe_ids"], oracle.arrays["probe_ids"])  # members probed at the oracle's ids


def test_the_oracle_follows_the_pinned_tokens(tiny_golden):
    golden = open_golden("g", tiny_golden)
    for pinned, oracle in zip(golden.results("pinned"), golden.results("oracle")):
        assert len(oracle.arrays["tokens"]) == len(pinned.arrays["tokens"])
        assert oracle.arrays["probe_values"].shape[0] == len(pinned.arrays["tokens"])


def test_golden_pins_device_and_dtype(tiny_golden):
    requested = open_golden("g", tiny_golden).meta["requested_config"]
    assert (requested["device"], requested["dtype"]) == ("cpu", "float32")


def test_an_old_format_golden_says_recreate(cli, tiny_golden, tmp_path):
    from evalrun.golden import content_digest

    directory = tmp_path / "old"
    directory.mkdir()
    shutil.copy(tiny_golden / "g.db", directory / "g.db")
    conn = sqlite3.connect(directory / "g.db")
    conn.execute("DELETE FROM golden WHERE key IN ('format', 'content_digest')")
    conn.execute("INSERT INTO golden VALUES ('content_digest', ?)", [content_digest(conn)])
    conn.commit()
    conn.close()
    code, _, err = cli("golden", "verify", "g", "--dir", str(directory), "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "format 1" in err and "--force" in err


def _damaged_copy(tiny_golden, tmp_path, damage):
    directory = tmp_path / "damaged"
    directory.mkdir()
    target = directory / "g.db"
    shutil.copy(tiny_golden / "g.db", target)
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
    code, out, err = cli("golden", "verify", "g", "--dir", str(directory), "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(directory / "g.db") in err and ("damaged" in err or "edited" in err)


def test_missing_golden_says_how_to_create_it(cli, tmp_path):
    code, _, err = cli("golden", "verify", "nosuch", "--dir", str(tmp_path))
    assert code == 2 and "evalrun golden create nosuch" in err


def test_create_refuses_to_overwrite_without_force(cli, tiny_golden):
    before = (tiny_golden / "g.db").read_bytes()
    code, _, err = cli("golden", "create", "g", "--model", "random:tiny", *GOLDEN_ARGS, "--dir", str(tiny_golden))
    assert code == 2 and "--force" in err
    assert (tiny_golden / "g.db").read_bytes() == before


def test_a_create_of_a_name_another_create_wrote_meanwhile_is_refused_not_written_over(tiny_golden, tmp_path):
    """Two `golden create g` at once both passed the exists check before their minutes of runs, and the second
    replaced the first silently (exit 0). Without --force the file is now linked into place only where nothing is."""
    from evalrun.config import build_config
    from evalrun.errors import GoldenError
    from evalrun.golden import create_golden, make_runs

    directory = tmp_path / "g"
    directory.mkdir()
    first = (tiny_golden / "g.db").read_bytes()

    def other_create_finishes_first(request, progress, hook):
        created = make_runs(request, progress, hook)
        shutil.copyfile(tiny_golden / "g.db", directory / "g.db")  # the other create's golden lands meanwhile
        return created

    config = build_config(flags={"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 4})
    with pytest.raises(GoldenError, match="was created meanwhile .by another golden create.; pass --force"):
        create_golden("g", config, directory, cuda_available=False, make=other_create_finishes_first)
    assert (directory / "g.db").read_bytes() == first and [p.name for p in directory.iterdir()] == ["g.db"]
    create_golden("g", config, directory, force=True, cuda_available=False, make=other_create_finishes_first)
    assert (directory / "g.db").read_bytes() != first  # --force writes over it


def test_list_and_show(cli, tiny_golden):
    code, out, _ = cli("golden", "list", "--dir", str(tiny_golden), "--json")
    assert code == 0 and json.loads(out)[0]["name"] == "g"
    code, out, _ = cli("golden", "show", "g", "--dir", str(tiny_golden), "--json")
    data = json.loads(out)
    assert code == 0 and data["oracle_dtype"] == "float64" and len(data["results"]) == 3


def test_bad_golden_name(cli, tmp_path):
    code, _, err = cli("golden", "verify", "../etc/passwd", "--dir", str(tmp_path))
    assert code == 2 and "not valid" in err
    code, _, err = cli("golden", "show", "x.db", "--dir", str(tmp_path))  # looked for x.db.db
    assert code == 2 and "ends in .db; name the golden without it ('x'" in err, err


def test_a_golden_an_older_evalrun_wrote_as_name_db_db_is_named_with_its_rename(cli, tiny_golden, tmp_path):
    """`golden create x.db` once wrote golden/x.db.db; the name is refused now, and the line says how to keep it."""
    shutil.copy(tiny_golden / "g.db", tmp_path / "x.db.db")
    code, _, err = cli("golden", "verify", "x.db", "--dir", str(tmp_path), "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"an older evalrun wrote it as {tmp_path / 'x.db.db'}: rename that file to {tmp_path / 'x.db'}" in err
    (tmp_path / "x.db.db").rename(tmp_path / "x.db")
    code, out, err = cli("golden", "show", "x", "--dir", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["name"] == "x", err


def test_another_programs_sqlite_file_is_named_so_and_never_offered_to_force(cli, tmp_path):
    """Its one line advised `golden create other --force`, which would write over another program's database."""
    with sqlite3.connect(tmp_path / "other.db") as conn:
        conn.execute("CREATE TABLE foo (x)")
    conn.close()
    before = (tmp_path / "other.db").read_bytes()
    for command in ("show", "verify"):
        code, _, err = cli("golden", command, "other", "--dir", str(tmp_path))
        assert code == 2 and "a SQLite file of another program, not a golden" in err and "--force" not in err, err
    assert (tmp_path / "other.db").read_bytes() == before


def test_golden_list_of_a_folder_that_is_not_there_is_refused(cli, tmp_path):
    """A typo in --dir listed no golden and exited 0."""
    code, out, err = cli("golden", "list", "--dir", str(tmp_path / "nosuch"))
    assert code == 2 and "golden folder" in err and "does not exist" in err and len(err.splitlines()) == 1


def test_create_refuses_a_dangling_link_and_a_folder_that_takes_no_file_before_any_run(cli, tmp_path, monkeypatch):
    """A link to nothing under the golden's name passed the exists check, and after every run the create said the
    name "was created meanwhile"; a folder root may write by its permissions but that takes no file (/proc, a
    read-only mount) failed after every run too. Both are refused before a model loads."""
    import os

    from evalrun import golden as golden_module

    monkeypatch.setattr(golden_module, "make_runs", lambda *args: pytest.fail("a model ran"))
    os.symlink(tmp_path / "nowhere.db", tmp_path / "g.db")
    code, _, err = cli("golden", "create", "g", "--dir", str(tmp_path), *GOLDEN_ARGS[:-1], "--model", "random:tiny")
    assert code == 2 and "exists (a link to" in err and "which does not exist); pass --force" in err, err
    if os.path.isdir("/proc/self"):
        code, _, err = cli("golden", "create", "g", "--dir", "/proc/evalrun-goldens", *GOLDEN_ARGS[:-1], "--model",
                           "random:tiny")
        assert code == 2 and "cannot write goldens into /proc/evalrun-goldens: /proc is not writable" in err, err


def test_a_format_of_another_type_is_named_as_it_is_stored():
    """A forged golden whose format is the string "2" was refused as "has format 2; this evalrun reads format 2":
    the value shows its type, so the message names what differs."""
    from pathlib import Path

    from evalrun.errors import GoldenError
    from evalrun.golden import _check_meta

    with pytest.raises(GoldenError, match=rf"has format '{GOLDEN_FORMAT}'; this evalrun reads format {GOLDEN_FORMAT};"):
        _check_meta("g", Path("/goldens/g.db"), {"format": str(GOLDEN_FORMAT), "roles": {}})
    with pytest.raises(GoldenError, match=rf"has format 1; this evalrun reads format {GOLDEN_FORMAT};"):
        _check_meta("g", Path("/goldens/g.db"), {"roles": {}})


def test_a_create_whose_runs_hold_nan_writes_nothing_and_keeps_the_golden_there(tiny_golden):
    """A model whose logits are not finite made a golden that every verify then refused as damaged (NaN in what the
    checks measure), written over the good one with --force. Create now refuses it (exit 2) and keeps what was there."""
    from evalrun.config import build_config
    from evalrun.engine.faults import Fault, fault_hook
    from evalrun.errors import GoldenError
    from evalrun.golden import create_golden

    before = (tiny_golden / "g.db").read_bytes()
    config = build_config(flags={"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 4})
    with pytest.raises(GoldenError, match=r"g.db not written: its \S+ run has NaN in its .*check that the model's "
                                          r"logits are finite"):
        create_golden("g", config, tiny_golden, force=True, cuda_available=False,
                      hook=fault_hook(Fault("scale", float("nan"))))
    assert (tiny_golden / "g.db").read_bytes() == before and [p.name for p in tiny_golden.iterdir()] == ["g.db"]
