import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest
import sqlite_utils

from evalrun.errors import StoreError
from evalrun.hashing import array_from_bytes, array_to_bytes
from evalrun.store import SCHEMA_VERSION, PromptResult, Store


def _header(name="x"):
    return {"config": {"device": "cpu"}, "config_hash": "c", "environment": {}, "environment_hash": "e",
            "model": {"hash": "m", "ref": name}, "prompt_set": {"hash": "p", "name": "s", "count": 1}}


def _result(index=0):
    arrays = {"tokens": np.arange(5, dtype=np.int64), "digests": np.arange(10, dtype=np.int64).reshape(5, 2),
              "topk_values": np.linspace(0, 1, 20, dtype=np.float32).reshape(5, 4)}
    return PromptResult(index, f"p{index}", {"id": f"p{index}"}, 0, 0, 3, 5, -1, "text", "t", "l", arrays)


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
    assert store.check()["ok"]


def test_store_opens_with_sqlite_utils_own_api(store_path):
    store = Store(store_path)
    run_id = store.begin_run(_header())
    store.finish_run(run_id, [_result()], {}, "td", "ld")
    store.close()
    db = sqlite_utils.Database(store_path)
    assert {"meta", "runs", "results", "arrays"} <= set(db.table_names())
    assert db["runs"].get(run_id)["status"] == "complete"
    assert db["arrays"].count == 3
    row = next(db["arrays"].rows_where("name = ?", ["digests"]))
    assert (row["dtype"], row["shape"]) == ("int64", "[5, 2]")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db["meta"].get("schema_version")["value"] == str(SCHEMA_VERSION)


def test_failed_run_is_marked(store_path):
    store = Store(store_path)
    run_id = store.begin_run(_header())
    store.fail_run(run_id, "boom")
    assert (store.get_run(run_id).status, store.get_run(run_id).error) == ("failed", "boom")
    assert store.check()["ok"]


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
    problems = " ".join(Store(store_path).check()["problems"])
    assert "orphan rows in results" in problems and "arrays without a result row" in problems
    assert "complete with 0 of 1 results" in problems


def test_newer_schema_is_refused(store_path):
    Store(store_path).close()
    conn = sqlite3.connect(store_path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    with pytest.raises(StoreError, match="newer than this evalrun"):
        Store(store_path)


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
    assert store.check()["ok"]


def test_sigkill_mid_generation_leaves_store_consistent(store_path):
    args = ["run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "3000", "--quiet",
            "--store", str(store_path)]
    process = subprocess.Popen(_evalrun(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if store_path.exists() and Store(store_path).list_runs():
            break
        time.sleep(0.2)
    time.sleep(1.0)  # well inside generation
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    store = Store(store_path)
    (run,) = store.list_runs()
    assert run.status == "running"  # never marked complete
    assert store.load_results(run.id) == []
    check = store.check()
    assert check["ok"] and check["interrupted"] == [run.id]


def test_store_path_from_environment(cli, monkeypatch, tmp_path):
    target = tmp_path / "env-store.db"
    monkeypatch.setenv("EVALRUN_STORE", str(target))
    code, _, err = cli("run", "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "2", "--quiet")
    assert code == 0, err
    assert [r.status for r in Store(target).list_runs()] == ["complete"]
