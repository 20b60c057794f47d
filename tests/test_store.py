import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sqlite_utils

from evalrun.errors import StoreError
from evalrun.hashing import array_from_bytes, array_to_bytes, hash_bytes
from evalrun.store import SCHEMA_VERSION, PromptResult, Store
from evalrun.store_check import check_store


def _header(name="x"):
    return {"config": {"device": "cpu"}, "config_hash": "c", "environment": {}, "environment_hash": "e",
            "model": {"hash": "m", "ref": name}, "prompt_set": {"hash": "p", "name": "s", "count": 1}}


def _result(index=0):
    arrays = {"input_ids": np.arange(3, dtype=np.int64), "tokens": np.arange(5, dtype=np.int64),
              "digests": np.arange(10, dtype=np.int64).reshape(5, 2),
              "topk_ids": np.arange(20, dtype=np.int64).reshape(5, 4),
              "topk_values": np.linspace(0, 1, 20, dtype=np.float32).reshape(5, 4),
              "margins": np.linspace(0, 1, 5, dtype=np.float32)}
    return PromptResult(index, f"p{index}", {"id": f"p{index}"}, 0, 0, 3, 5, -1, "text",
                        hash_bytes(arrays["tokens"].astype("<i8").tobytes()),
                        hash_bytes(arrays["digests"].astype("<i8").tobytes()), arrays)


@pytest.mark.parametrize("dtype", ["int64", "int32", "float32", "int16", "float64"])
def test_arrays_round_trip_as_little_endian_bytes(dtype):
    array = (np.arange(24) - 7).astype(dtype).reshape(2, 3, 4)
    raw = array_to_bytes(array)
    assert raw == array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert np.array_equal(array_from_bytes(raw, dtype, [2, 3, 4]), array)


def test_run_lifecycle_and_arrays(store_path):
    store = Store(store_path)
    run_id = store.begin_run(_header())
    assert store.get_run(run_id[:6]).status == "running"
    store.finish_run(run_id, [_result()], {"timings": {"x": 1}}, "td", "ld")
    record = store.get_run(run_id)
    assert (record.status, record.logits_digest, record.json["timings"]) == ("complete", "ld", {"x": 1})
    loaded = store.load_results(run_id)[0]
    for name, array in _result().arrays.items():
        assert np.array_equal(loaded.arrays[name], array) and loaded.arrays[name].dtype == array.dtype
    assert check_store(store)["ok"]


def test_store_opens_with_sqlite_utils_own_api(store_path):
    store = Store(store_path)
    run_id = store.begin_run(_header())
    store.finish_run(run_id, [_result()], {}, "td", "ld")
    store.close()
    db = sqlite_utils.Database(store_path)
    assert {"meta", "runs", "results", "arrays"} <= set(db.table_names())
    assert db["runs"].get(run_id)["status"] == "complete"
    assert db["arrays"].count == 6
    row = next(db["arrays"].rows_where("name = ?", ["digests"]))
    assert (row["dtype"], row["shape"]) == ("int64", "[5, 2]")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db["meta"].get("schema_version")["value"] == str(SCHEMA_VERSION)


def test_failed_run_is_marked(store_path):
    store = Store(store_path)
    run_id = store.begin_run(_header())
    store.fail_run(run_id, "boom")
    assert (store.get_run(run_id).status, store.get_run(run_id).error) == ("failed", "boom")
    assert check_store(store)["ok"]


def test_unknown_and_ambiguous_ids(store_path):
    store = Store(store_path)
    ids = [store.begin_run(_header()) for _ in range(20)]
    with pytest.raises(StoreError, match="not a hex id"):
        store.get_run("zz")
    with pytest.raises(StoreError, match="no run"):
        store.get_run("ffff0000ffff")
    shared = next(a[0] for a in ids if sum(b[0] == a[0] for b in ids) > 1)
    with pytest.raises(StoreError, match="ambiguous"):
        store.get_run(shared)


def test_check_finds_orphans_and_partial_runs(store_path):
    store = Store(store_path)
    run_id = store.begin_run(_header())
    store.finish_run(run_id, [_result()], {}, "td", "ld")
    conn = sqlite3.connect(store_path)
    conn.execute("PRAGMA foreign_keys = OFF")
    conn.execute("INSERT INTO results (run_id, prompt_index, prompt_id) VALUES ('nosuchrun', 0, 'x')")
    conn.execute("DELETE FROM results WHERE run_id = ?", [run_id])
    conn.commit()
    problems = " ".join(check_store(Store(store_path))["problems"])
    assert "orphan rows in results" in problems and "arrays without a result row" in problems
    assert "complete with 0 of 1 results" in problems


def test_newer_schema_is_refused(store_path):
    Store(store_path).close()
    conn = sqlite3.connect(store_path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    with pytest.raises(StoreError, match="newer than this evalrun"):
        Store(store_path)
    with pytest.raises(StoreError, match="newer than this evalrun .2.; upgrade evalrun$"):
        Store(store_path, readonly=True)  # not "open it with a writing command to migrate": that cannot help
    with pytest.raises(StoreError, match="newer than this evalrun .2.; upgrade evalrun$"):  # not "damaged"
        check_store(Store(store_path, readonly=True, require_schema=False))


def _evalrun(*args):
    return [sys.executable, "-m", "evalrun", *args]


def test_four_processes_write_one_store(store_path):
    args = ["run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4", "--quiet",
            "--store", str(store_path)]
    processes = [subprocess.Popen(_evalrun(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(4)]
    errors = [p.communicate(timeout=300)[1] for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0, 0], errors
    store = Store(store_path)
    assert [r.status for r in store.list_runs()] == ["complete"] * 4
    assert check_store(store)["ok"]


def _wait_inside_generation(store_path, limit_s: float = 120) -> None:
    """Until the run another process makes is stored as begun (a store still being created reads as not
    yet), then one second more: well inside generation."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        try:
            if store_path.exists() and Store(store_path, readonly=True).list_runs():
                break
        except StoreError:  # the writer is creating the file or its schema
            pass
        time.sleep(0.2)
    time.sleep(1.0)


def test_sigkill_mid_generation_leaves_store_consistent(store_path):
    args = ["run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "3000", "--quiet",
            "--store", str(store_path)]
    process = subprocess.Popen(_evalrun(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_inside_generation(store_path)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    store = Store(store_path)
    (run,) = store.list_runs()
    assert run.status == "running"  # never marked complete
    assert store.load_results(run.id) == []
    check = check_store(store)
    assert check["ok"] and check["interrupted"] == [run.id]


def test_store_path_from_environment(cli, monkeypatch, tmp_path):
    target = tmp_path / "env-store.db"
    monkeypatch.setenv("EVALRUN_STORE", str(target))
    code, _, err = cli("run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "2", "--quiet")
    assert code == 0, err
    assert [r.status for r in Store(target).list_runs()] == ["complete"]


def _complete_store(store_path):
    store = Store(store_path)
    run_id = store.begin_run(_header())
    store.finish_run(run_id, [_result()], {}, "td", "ld")
    store.close()
    return run_id


def _sql(store_path, *statements):
    conn = sqlite3.connect(store_path)
    for statement in statements:
        conn.execute(statement)
    conn.commit()
    conn.close()


@pytest.mark.parametrize("damage,needle", [
    ("UPDATE arrays SET data = CAST(zeroblob(length(data)) AS BLOB) WHERE name = 'topk_values'", "do not match their digest"),
    ("DELETE FROM arrays WHERE name = 'tokens'", "are missing"),
    ("UPDATE results SET tokens_digest = 'x'", "tokens do not match"),
    ("DROP TABLE arrays", "missing table arrays"),
    ("UPDATE arrays SET shape = '[99]' WHERE name = 'tokens'", "needs"),
    ("UPDATE meta SET value = 'x' WHERE key = 'schema_version'", "not a number"),
])
def test_check_finds_damage_and_never_crashes(store_path, damage, needle):
    _complete_store(store_path)
    _sql(store_path, damage)
    outcome = check_store(Store(store_path, readonly=True, require_schema=False)) if "schema" not in damage else None
    if outcome is None:
        with pytest.raises(StoreError, match=needle):
            Store(store_path, readonly=True)
        return
    assert not outcome["ok"] and needle in " ".join(outcome["problems"]), outcome["problems"]


@pytest.mark.parametrize("damage", [
    "UPDATE runs SET config_json = '{bad'", "UPDATE runs SET config_json = '[1]'", "UPDATE runs SET status = NULL",
    "UPDATE runs SET model_json = NULL", "UPDATE results SET record_json = '{bad'",
])
def test_check_lists_every_row_the_readers_refuse(store_path, damage):
    """What `ls`, `show` and `diff` refuse as damaged (pointing at `store check`), check lists: it parses every
    run and result row as they do."""
    run_id = _complete_store(store_path)
    _sql(store_path, damage)
    store = Store(store_path, readonly=True)
    with pytest.raises(StoreError, match="is damaged .*`evalrun store check` lists what is wrong"):
        store.load_results(store.get_run(run_id).id)
    outcome = check_store(store)
    assert not outcome["ok"] and any(p.startswith(f"run {run_id[:12]}") and "damaged" in p
                                     for p in outcome["problems"]), outcome["problems"]


def test_check_and_merge_refuse_an_array_diff_refuses_though_its_digest_was_made_again(cli, store_path, tmp_path):
    """An array cut short (or given another shape) with its digest made again: `diff` and `store show` refuse the run
    as damaged; `store check` said ok (it decoded tokens and digests only) and `store merge` copied it."""
    run_id = _complete_store(store_path)
    conn = sqlite3.connect(store_path)
    data = conn.execute("SELECT data FROM arrays WHERE name = 'topk_values'").fetchone()[0][:-4]
    conn.execute("UPDATE arrays SET data = ?, digest = ? WHERE name = 'topk_values'", [data, hash_bytes(data)])
    conn.commit()
    conn.close()
    outcome = check_store(Store(store_path, readonly=True))
    assert not outcome["ok"] and any(p.startswith(f"run {run_id[:12]}") and "topk_values" in p
                                     for p in outcome["problems"]), outcome["problems"]
    code, _, err = cli("store", "merge", str(tmp_path / "all.db"), str(store_path))
    assert code == 2 and "fails `evalrun store check`" in err and not (tmp_path / "all.db").exists()


def test_a_run_holding_one_prompt_id_twice_is_damaged_not_diffed(cli, store_path):
    """`diff` pairs prompts by id: a run holding one id twice had one of them compared and the other never (all
    "identical" while that one's tokens and digests differed), and `store check` said ok. Ids are unique on input."""
    store = Store(store_path)
    header = _header()
    header["prompt_set"]["count"] = 2
    header["config"]["dtype"] = "float32"
    run_id = store.begin_run(header)
    store.finish_run(run_id, [_result(0), _result(1)], {}, "td", "ld")
    store.close()
    _sql(store_path, "UPDATE results SET prompt_id = 'p0' WHERE prompt_index = 1")
    outcome = check_store(Store(store_path, readonly=True))
    assert not outcome["ok"] and f"run {run_id[:12]}: holds prompt 'p0' twice" in outcome["problems"], outcome
    code, out, err = cli("diff", run_id[:8], run_id[:8], "--store", str(store_path))
    assert code == 2 and not out and "holds prompt 'p0' twice" in err, (out, err)


def test_a_grown_json_value_is_damage_named_by_its_size_not_parsed(store_path):
    """A valid JSON object of 4.4 MB in a result row: store check (and merge) read every row, and parsing one costs
    ~30x its size; a value past the 4 MiB evalrun writes is refused by its length."""
    run_id = _complete_store(store_path)
    _sql(store_path, "UPDATE results SET record_json = '{\"a\": [' || replace(hex(zeroblob(2200000)), '00', '0,') "
                     "|| '0]}' WHERE prompt_index = 0")
    problems = check_store(Store(store_path, readonly=True))["problems"]
    assert any(p.startswith(f"run {run_id[:12]} prompt 0") and "bytes, past the 4,194,304 evalrun writes" in p
               for p in problems), problems


def test_a_run_without_its_creation_time_is_damaged_not_a_crash(cli, store_path):
    run_id = _complete_store(store_path)
    _sql(store_path, "UPDATE runs SET created_at = NULL")
    code, out, err = cli("store", "ls", "--store", str(store_path))
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
    assert f"run {run_id[:12]} is damaged" in err and "`evalrun store check`" in err
    assert any(p.startswith(f"run {run_id[:12]}") and "created_at" in p
               for p in check_store(Store(store_path, readonly=True))["problems"])


def test_store_merge_refuses_a_run_row_the_readers_refuse(cli, store_path, tmp_path):
    run_id = _complete_store(store_path)
    _sql(store_path, "UPDATE runs SET config_json = '{bad'")
    code, out, _ = cli("store", "check", "--store", str(store_path))
    assert code == 2 and f"run {run_id[:12]}: the row is damaged" in out
    code, _, err = cli("store", "merge", str(tmp_path / "all.db"), str(store_path))
    assert code == 2 and "fails `evalrun store check`" in err and run_id[:12] in err
    assert not (tmp_path / "all.db").exists()


def _flip_a_bit(store_path, name: str, index: int, mask: int) -> None:
    """Flip bits of the first stored array called `name`, its digest left as it was."""
    conn = sqlite3.connect(store_path)
    data = bytearray(conn.execute("SELECT data FROM arrays WHERE name = ?", [name]).fetchone()[0])
    data[index] ^= mask
    conn.execute("UPDATE arrays SET data = ? WHERE rowid = (SELECT rowid FROM arrays WHERE name = ? LIMIT 1)",
                 [bytes(data), name])
    conn.commit()
    conn.close()


def test_a_flipped_bit_inside_array_data_is_found(store_path):
    _complete_store(store_path)
    _flip_a_bit(store_path, "margins", 3, 0x10)
    problems = check_store(Store(store_path))["problems"]
    assert any("margins: bytes do not match their digest" in p for p in problems)


def test_arrays_are_read_only_when_their_bytes_match_their_digest(store_path):
    """Every reader of a run's arrays (diff, show, a golden, a sharded verify's --from-shards and the ranks'
    results) goes through load_results, which checks each row's stored bytes against its digest as it is read."""
    from evalrun.sharding import runs_from_bytes

    run_id = _complete_store(store_path)
    _flip_a_bit(store_path, "digests", 0, 0x01)
    with pytest.raises(StoreError, match=f"run {run_id[:12]} is damaged .array 'digests' of prompt 0: bytes do not "
                                         "match their digest.; `evalrun store check`"):
        Store(store_path, readonly=True).load_results(run_id)
    assert Store(store_path, readonly=True).load_results(run_id, names=("tokens",))[0].arrays.keys() == {"tokens"}
    with pytest.raises(StoreError, match="bytes do not match their digest"):
        runs_from_bytes(store_path.read_bytes())


def test_stored_text_cannot_add_a_line_to_store_show_or_check(cli, store_path):
    """Text read from a store (error, status, created_at, hashes, config values, run ids) is printed escaped: a
    forged line break cannot start a GitHub `::error::` workflow command on a line of its own."""
    run_id = _complete_store(store_path)
    forge = "'x' || char(10) || '::error::forged' || char(27)"
    _sql(store_path, f"UPDATE runs SET error = {forge}, status = {forge}, created_at = {forge}, "
                     f"finished_at = {forge}, config_hash = {forge}, model_hash = 'ab' || char(13) || '::error::m', "
                     "config_json = json_set(config_json, '$.dtype', 'f' || char(10) || '::error::dtype', "
                     "'$.engine', 'e' || char(10) || '::error::engine')",
         "INSERT INTO runs (id, status) VALUES ('f' || char(10) || '::error::id', 'failed')")
    code, out, err = cli("store", "show", run_id, "--store", str(store_path))
    assert code == 0, err
    assert "x\\n::error::forged\\x1b" in out and "f\\n::error::dtype" in out and "e\\n::error::engine" in out
    code, check, check_err = cli("store", "check", "--store", str(store_path))
    assert code == 2 and "run f\\n::error::i: the row is damaged" in check
    assert len(check_err.splitlines()) == 1 and "is damaged: run f" in check_err
    for text in (out, check):
        assert not any(line.startswith("::error::") for line in text.splitlines()) and "\x1b" not in text, text


def test_reading_commands_never_write(cli, tiny_args):
    """Read-only commands leave the .db file's bytes (and time) as they were. On a WAL store SQLite may leave an
    empty -wal and its -shm index beside it (the README's contract says why evalrun leaves them): no data."""
    code, out, _ = cli("run", *tiny_args, "--quiet", "--json")
    run_id = json.loads(out)["run_id"]
    path = tiny_args[-1]
    before = (Path(path).read_bytes(), os.stat(path).st_mtime_ns)
    other = "1" if run_id.startswith("0") else "0"  # a prefix of no run (run ids are random hex: 1 in 16 began 0)
    for args, exit_code in ((("store", "ls"), 0), (("store", "check"), 0), (("store", "show", run_id), 0),
                            (("store", "show", other), 2), (("diff", run_id, run_id), 0)):
        assert cli(*args, "--store", path)[0] == exit_code, args  # each read the store (or named no run)
        assert (Path(path).read_bytes(), os.stat(path).st_mtime_ns) == before, args
    wal = Path(path + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0


def test_a_schema_1_store_is_migrated_with_array_digests(store_path):
    from evalrun.store import MIGRATIONS

    store_path.parent.mkdir(parents=True)  # build a version-1 file by hand: migration 1 only
    conn = sqlite3.connect(store_path, isolation_level=None)
    db = sqlite_utils.Database(conn)
    db["meta"].create({"key": str, "value": str}, pk="key")
    MIGRATIONS[1](db)
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.execute("INSERT INTO runs (id, status) VALUES ('ab', 'failed')")
    db.execute("INSERT INTO results (run_id, prompt_index, prompt_id) VALUES ('ab', 0, 'x')")
    db.execute("INSERT INTO arrays (run_id, prompt_index, name, dtype, shape, encoding, data) VALUES "
               "('ab', 0, 'tokens', 'int64', '[1]', 'raw', ?)", [np.arange(1, dtype="<i8").tobytes()])
    conn.close()
    migrated = Store(store_path)
    assert migrated.schema_version() == SCHEMA_VERSION
    row = migrated.db.execute("SELECT data, digest FROM arrays").fetchone()
    assert row[1] == hash_bytes(row[0])


@pytest.mark.parametrize("row,needle", [
    ({"dtype": "object"}, "only bool"), ({"shape": "[2, -1]"}, "expected a list"), ({"shape": "oops"}, "expected a list"),
    ({"data": None}, "no byte data"), ({"data": "text"}, "no byte data"), ({"shape": "[3]"}, "needs"),
    ({"shape": "[1099511627775, 1099511627775]"}, "claims"), ({"encoding": "zlib", "data": b"not zlib"}, "corrupt"),
])
def test_array_rows_are_validated_before_decoding(row, needle):
    from evalrun.store import decode_array_row

    base = {"name": "x", "dtype": "int64", "shape": "[2]", "encoding": "raw", "data": np.arange(2, dtype="<i8").tobytes()}
    with pytest.raises(StoreError, match=needle):
        decode_array_row({**base, **row})


def test_a_compression_bomb_stops_at_the_declared_size():
    import zlib

    from evalrun.store import decode_array_row

    bomb = zlib.compress(bytes(200_000_000), 9)  # 200 MB of zeros in ~200 KB
    with pytest.raises(StoreError, match="needs 16"):
        decode_array_row({"name": "x", "dtype": "int64", "shape": "[2]", "encoding": "zlib", "data": bomb})


@pytest.mark.parametrize("pid", [99999999999999999, -1])
def test_a_running_row_with_a_pid_no_process_has_is_interrupted_not_a_crash(cli, tiny_args, tmp_path, pid):
    """A forged row (status running, this host): a pid past what os.kill takes crashed store check and merge with
    OverflowError (exit 3); -1 counted as alive (os.kill(-1, 0) signals every process it may). Neither is a run's
    process: the run is interrupted."""
    import sqlite3

    assert cli("run", *tiny_args, "--quiet")[0] == 0
    with sqlite3.connect(tiny_args[-1]) as db:
        db.execute("update runs set pid = ?, status = 'running'", (pid,))
    (run,) = Store(tiny_args[-1]).list_runs()
    code, out, err = cli("store", "check", "--store", tiny_args[-1], "--json")
    assert code == 0 and json.loads(out)["interrupted"] == [run.id], err
    code, _, err = cli("store", "merge", str(tmp_path / "out.db"), tiny_args[-1])
    assert code == 0, err


def test_store_check_cli_lists_a_dropped_table_and_exits_2(cli, tiny_args):
    """A damaged store is bad input (exit 2, one stderr line naming the first problem); exit 1 is a verdict's alone
    (it was 1 here, which a CI step reads as `changed`)."""
    cli("run", *tiny_args, "--quiet")
    _sql(tiny_args[-1], "DROP TABLE arrays")
    code, out, err = cli("store", "check", "--store", tiny_args[-1])
    assert code == 2 and "missing table arrays" in out
    assert len(err.strip().splitlines()) == 1 and "is damaged: missing table arrays" in err and "--store" in err, err
    code, out, err = cli("store", "check", "--store", tiny_args[-1], "--json")
    assert code == 2 and json.loads(out)["ok"] is False and len(err.strip().splitlines()) == 1
    code, _, err = cli("store", "ls", "--store", tiny_args[-1])
    assert code == 2 and "missing table arrays" in err and len(err.strip().splitlines()) == 1


def test_a_limit_past_sqlites_integers_blames_the_flag(cli, store_path):
    _complete_store(store_path)
    code, out, err = cli("store", "ls", "--limit", str(2**63), "--store", str(store_path))
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "--limit" in err, err
    assert "damaged" not in err


def test_a_command_leaves_every_run_in_the_db_file_alone(cli, tiny_args, store_path, tmp_path):
    """The command closes the stores it opened, so the write-ahead log is folded in: a copy of the .db file
    alone (a CI artifact, a shard file moved for `store merge`) holds the run, even read as immutable."""
    code, out, _ = cli("run", *tiny_args, "--json", "--quiet")
    run_id = json.loads(out)["run_id"]
    assert code == 0 and not (store_path.parent / (store_path.name + "-wal")).exists()
    copy = tmp_path / "copy.db"
    shutil.copy(store_path, copy)
    assert Store(copy, immutable=True).get_run(run_id).status == "complete"


def test_a_sqlite_file_of_another_program_is_refused_unchanged(tmp_path):
    """Its tables are not evalrun's: refused before anything is written (no WAL switch, no tables added)."""
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE foo (x)")
        conn.execute("CREATE TABLE \"line\nbreak\" (y)")
    before = other.read_bytes()
    with pytest.raises(StoreError, match="another program") as refused:
        Store(other)
    assert "\n" not in str(refused.value).replace("\\n", "")
    with pytest.raises(StoreError, match="another program.*pass --store with an evalrun store$"):
        Store(other, readonly=True)  # read (store ls): not "migrate it with evalrun run", which refuses it
    assert other.read_bytes() == before


def test_sigterm_mid_generation_stores_the_run_as_interrupted(store_path):
    """A cancelled CI job or a scheduler's stop (SIGTERM) ends the command as Ctrl-C does: one line,
    exit 2, and the run it was making is stored as interrupted, not left running."""
    args = ["run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "3000", "--quiet",
            "--store", str(store_path)]
    process = subprocess.Popen(_evalrun(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_inside_generation(store_path)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    # one line: click's own main printed a blank line first and dropped why (a bare Abort)
    assert process.returncode == 2 and err.splitlines() == [err.rstrip("\n")] and "interrupted" in err, err
    assert "stopped by signal 15 (SIGTERM)" in err and "run the command again" in err, err
    store = Store(store_path, readonly=True)
    (run,) = store.list_runs()
    assert run.status == "interrupted" and store.load_results(run.id) == []
