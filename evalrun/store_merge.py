"""`evalrun store merge OUT A B ...`: the runs of several stores in one (the jobs of a sharded run).

Each source must pass `store check` first (nothing damaged is copied). A run is copied with its results
and arrays, rows as they are; the whole merge is one transaction, so a merge refused midway leaves OUT as it
was (and makes no OUT file that was not there). A run already in OUT with the same content is skipped, so
merging twice changes nothing (idempotent). A run id in OUT (or copied there by an earlier source of the
same merge) with other content is a conflict: refused with one line, nothing written. A run still `running` in a source (its job
killed) is copied as `interrupted`: OUT is not the store its process would ever finish. If that job was
only slow and finishes after all, merging its store again replaces the `interrupted` copy with the
complete run (same run row but for its end). OUT is checked with the same rules afterwards.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from .errors import StoreError
from .hashing import hash_value
from .store import ARRAY_COLUMNS, RESULT_COLUMNS, Store, _insert
from .store_check import check_store


def _run_row(store: Store, run_id: str) -> dict[str, Any]:
    return dict(next(store.db["runs"].rows_where("id = ?", [run_id])))


def run_content(store: Store, run_id: str) -> str:
    """Digest of a run's row (its final state), its results and its arrays' digests: what makes two
    copies of a run the same run."""
    row = _run_row(store, run_id)
    results = store.db.execute(f"SELECT {', '.join(RESULT_COLUMNS)} FROM results WHERE run_id = ? ORDER BY prompt_index",
                               [run_id]).fetchall()
    arrays = store.db.execute("SELECT prompt_index, name, digest FROM arrays WHERE run_id = ? ORDER BY prompt_index, "
                              "name", [run_id]).fetchall()
    return hash_value([sorted(row.items()), [list(r) for r in results], [list(a) for a in arrays]])


STILL_RUNNING = "interrupted: still running in "  # the error a `running` run copied as interrupted carries
END_COLUMNS = {"status", "error", "finished_at", "tokens_digest", "logits_digest", "timings_json", "evidence_json",
               "batches_json"}  # what a run's row gains when it ends


def _copy_run(source: Store, conn: sqlite3.Connection, run_id: str, replace: bool = False) -> None:
    """Copy one run (rows, results, arrays) through OUT's connection, inside the merge's transaction; `replace`:
    first drop OUT's copy of it (an `interrupted` copy of a run that has since completed)."""
    row = _run_row(source, run_id)
    if row["status"] == "running":
        row.update(status="interrupted", error=row.get("error") or f"{STILL_RUNNING}{source.path} "
                   "when merged (its job stopped?)")
    if replace:
        for table, column in (("arrays", "run_id"), ("results", "run_id"), ("runs", "id")):
            conn.execute(f"DELETE FROM {table} WHERE {column} = ?", [run_id])
    conn.execute(_insert("runs", tuple(row)), list(row.values()))
    results = source.db.execute(f"SELECT {', '.join(RESULT_COLUMNS)} FROM results WHERE run_id = ?", [run_id])
    conn.executemany(_insert("results", RESULT_COLUMNS), results.fetchall())
    arrays = source.db.execute(f"SELECT {', '.join(ARRAY_COLUMNS)} FROM arrays WHERE run_id = ?", [run_id])
    for chunk in iter(lambda: arrays.fetchmany(256), []):  # arrays can be large: a chunk at a time
        conn.executemany(_insert("arrays", ARRAY_COLUMNS), chunk)


def merge_stores(out_path: str | Path, sources: list[str | Path]) -> dict[str, Any]:
    """Copy every run of `sources` into the store at `out_path` (created when missing). Returns counts
    per source and OUT's check; StoreError (one line) for a damaged source or a conflicting run id."""
    out_path = Path(out_path)
    if any(Path(s).resolve() == out_path.resolve() for s in sources if out_path.exists()):
        raise StoreError(f"{out_path} is among the stores to merge into it; pass another OUT path")
    opened = []
    for path in sources:
        source = Store(path, readonly=True)
        problems = check_store(source)["problems"]
        if problems:
            raise StoreError(f"{path} fails `evalrun store check` ({problems[0]}); repair or leave it out")
        opened.append(source)
    existed = out_path.exists()
    out = Store(out_path)
    try:
        with out.transaction() as conn:  # OUT's reads below see this transaction's copies (one connection)
            counts = [_merge_source(source, out, conn) for source in opened]
    except BaseException:  # a conflict, an interrupt: nothing copied stays, and no OUT that was not there
        written = out.db.execute("SELECT count(*) FROM runs").fetchone()[0]  # another writer's, since it was made
        out.close()
        if not existed and written == 0:
            for leftover in (out_path, *(out_path.with_name(out_path.name + end) for end in ("-wal", "-shm"))):
                leftover.unlink(missing_ok=True)
        raise
    for source in opened:
        source.close()
    check = check_store(out)
    out.close()
    return {"out": str(out_path), "sources": counts, "check": check}


def _merge_source(source: Store, out: Store, conn: sqlite3.Connection) -> dict[str, Any]:
    """Copy the runs of `source` that OUT lacks (or holds as interrupted, since completed); StoreError for a
    run OUT holds with other content."""
    copied = skipped = 0
    for (run_id,) in source.db.execute("SELECT id FROM runs ORDER BY created_at").fetchall():
        if out.db.execute("SELECT 1 FROM runs WHERE id = ?", [run_id]).fetchone():
            if _finished_since(source, out, run_id):
                _copy_run(source, conn, run_id, replace=True)
                copied += 1
                continue
            if not _same_run(source, out, run_id):
                raise StoreError(f"run {run_id[:12]} differs between {source.path} and {out.path}; merge it "
                                 "into another OUT store")
            skipped += 1
            continue
        _copy_run(source, conn, run_id)
        copied += 1
    return {"store": str(source.path), "copied": copied, "already_there": skipped}


def _same_run(source: Store, out: Store, run_id: str) -> bool:
    """The copy in OUT is this run: equal content, or equal but for `running` merged as `interrupted`."""
    if run_content(source, run_id) == run_content(out, run_id):
        return True
    mine, theirs = _run_row(source, run_id), _run_row(out, run_id)
    if mine["status"] == "running" and theirs["status"] == "interrupted":
        keys = set(mine) - {"status", "error"}
        return all(mine[k] == theirs[k] for k in keys)
    return False


def _finished_since(source: Store, out: Store, run_id: str) -> bool:
    """OUT holds the run as merged while its job still ran (`interrupted`, no results), and the source now
    holds it complete: the same run row but for what a run gains when it ends."""
    mine, theirs = _run_row(source, run_id), _run_row(out, run_id)
    if mine["status"] != "complete" or theirs["status"] != "interrupted" or \
            not str(theirs.get("error") or "").startswith(STILL_RUNNING):
        return False
    if out.db.execute("SELECT 1 FROM results WHERE run_id = ?", [run_id]).fetchone():
        return False
    return all(mine[k] == theirs[k] for k in set(mine) - END_COLUMNS)
