"""`evalrun store check`: everything a store's readers would refuse, listed before they meet it.

SQLite's integrity check, the schema, every run and result row parsed as `ls`, `show` and `diff` parse them,
orphans, complete runs missing results or arrays, every array's bytes against their digest, tokens and digests
against the result's digests, and every complete run's results read as `diff` reads them. A damaged file is a list
of problems, never a crash; `store merge` refuses a source with any (store_merge.py).
"""

from __future__ import annotations

import sqlite3
from typing import Any, Callable, Iterable, Iterator

from .errors import StoreError
from .hashing import hash_bytes
from .store import (REQUIRED_ARRAYS, SCHEMA_VERSION, Store, damage_reason, decode_array_row, digest_matches,
                    result_from_row, results_problem, run_from_row)


def _unreadable(rows: Iterable[dict[str, Any]], parse: Callable[[dict[str, Any]], Any]
                ) -> Iterator[tuple[dict[str, Any], str]]:
    """(row, why) for each row that `parse` refuses as damaged."""
    for row in rows:
        try:
            parse(row)
        except (TypeError, ValueError, KeyError, RecursionError) as error:
            yield row, damage_reason(error)


def _list_the_first_ten(problems: list[str], found: Iterable[str], more: str) -> None:
    """Append the first ten problems found, then how many more there were."""
    count = 0
    for count, problem in enumerate(found, 1):
        if count <= 10:
            problems.append(problem)
    if count > 10:
        problems.append(f"... {count - 10} more {more}")


def check_store(store: Store) -> dict[str, Any]:
    """integrity_check, schema, every run and result row read as the readers read them, orphans,
    incomplete runs, missing arrays, array bytes against their digests, results against their token and
    logits digests. `ok` is False on any real problem;
    a damaged file is reported, never a crash."""
    problems: list[str] = []
    try:
        integrity = [row[0] for row in store.db.execute("PRAGMA integrity_check").fetchall()]
    except sqlite3.DatabaseError as error:
        integrity = [str(error)]
    if integrity != ["ok"]:
        problems += [f"integrity: {line}" for line in integrity[:20]]
    schema = _checked(problems, store.schema_problems, ["schema unreadable"])
    problems += schema
    missing = {"meta", "runs", "results", "arrays"} if schema else set()
    version = _checked(problems, store.schema_version, 0)
    if isinstance(version, int) and version > SCHEMA_VERSION:  # not damaged: written by a newer evalrun
        raise store._newer_schema(version)
    if version != SCHEMA_VERSION:
        problems.append(f"schema version {version} != {SCHEMA_VERSION}")
    statuses: dict[str, int] = {}
    if not missing:
        for check in (_check_rows, _check_orphans, _check_complete_runs, _check_array_bytes, _check_complete_results):
            _checked(problems, lambda: check(store, problems), None)
        statuses = _checked(problems, lambda: dict(store.db.execute(
            "SELECT status, count(*) FROM runs GROUP BY status").fetchall()), {})
    interrupted = _checked(problems, store.interrupted_runs, []) if "runs" not in missing else []
    return {"path": str(store.path), "ok": not problems, "problems": problems, "runs": statuses,
            "interrupted": interrupted, "schema_version": version}


def _checked(problems: list[str], function, fallback):
    """Run one check; a file too damaged for it becomes a problem line, not a crash."""
    try:
        return function()
    except (sqlite3.DatabaseError, StoreError, ValueError, TypeError, UnicodeError, RecursionError) as error:
        problems.append(f"cannot check: {(str(error).splitlines() or [type(error).__name__])[0]}")
        return fallback


def _check_rows(store: Store, problems: list[str]) -> None:
    """Every run row and result row parsed as `ls`, `show` and `diff` read them: what they refuse as
    damaged is listed here (the first 10 of each table)."""
    for table, parse, where in (("runs", run_from_row, lambda row: f"run {str(row.get('id'))[:12]}"),
                                ("results", result_from_row, lambda row: f"run {str(row.get('run_id'))[:12]} "
                                                                         f"prompt {row.get('prompt_index')}")):
        _list_the_first_ten(problems, (f"{where(row)}: the row is damaged ({reason})"
                                       for row, reason in _unreadable(store.db[table].rows, parse)),
                            f"damaged rows in {table}")


def _check_orphans(store: Store, problems: list[str]) -> None:
    for table in ("results", "arrays"):
        count = store.db.execute(
            f"SELECT count(*) FROM {table} WHERE run_id NOT IN (SELECT id FROM runs)").fetchone()[0]
        if count:
            problems.append(f"{count} orphan rows in {table}")
    count = store.db.execute("SELECT count(*) FROM arrays a WHERE NOT EXISTS (SELECT 1 FROM results r WHERE "
                             "r.run_id = a.run_id AND r.prompt_index = a.prompt_index)").fetchone()[0]
    if count:
        problems.append(f"{count} arrays without a result row")


def _check_complete_runs(store: Store, problems: list[str]) -> None:
    for run_id, expected, found in store.db.execute(
            "SELECT r.id, coalesce(json_extract(r.prompt_set_json, '$.shard.prompts'), "
            "json_extract(r.prompt_set_json, '$.count')), count(x.prompt_index) FROM runs r "
            "LEFT JOIN results x ON x.run_id = r.id WHERE r.status = 'complete' GROUP BY r.id").fetchall():
        if expected != found:
            problems.append(f"run {str(run_id)[:12]} is complete with {found} of {expected} results")
    names = ", ".join("?" * len(REQUIRED_ARRAYS))
    for run_id, index, count in store.db.execute(
            f"SELECT x.run_id, x.prompt_index, (SELECT count(DISTINCT a.name) FROM arrays a WHERE a.run_id = "
            f"x.run_id AND a.prompt_index = x.prompt_index AND a.name IN ({names})) FROM results x JOIN runs r "
            "ON r.id = x.run_id WHERE r.status = 'complete'", list(REQUIRED_ARRAYS)).fetchall():
        if count != len(REQUIRED_ARRAYS):
            problems.append(f"run {str(run_id)[:12]} prompt {index}: {len(REQUIRED_ARRAYS) - count} of its "
                            f"arrays ({', '.join(REQUIRED_ARRAYS)}) are missing")


def _check_array_bytes(store: Store, problems: list[str]) -> None:
    """Every array's bytes against its digest, then tokens and digests against the result's digests."""
    rows = store.db.execute("SELECT run_id, prompt_index, name, data, digest FROM arrays")
    _list_the_first_ten(problems, (f"run {str(run_id)[:12]} prompt {index} array {name}: bytes do not match "
                                   "their digest" for run_id, index, name, data, digest in rows
                                   if not digest_matches(data, digest)), "damaged arrays")
    for run_id, index, name, data, dtype, shape, encoding, expected in store.db.execute(
            "SELECT a.run_id, a.prompt_index, a.name, a.data, a.dtype, a.shape, a.encoding, CASE a.name WHEN "
            "'tokens' THEN r.tokens_digest ELSE r.logits_digest END FROM arrays a JOIN results r ON r.run_id = "
            "a.run_id AND r.prompt_index = a.prompt_index WHERE a.name IN ('tokens', 'digests')"):
        row = {"name": name, "data": data, "dtype": dtype, "shape": shape, "encoding": encoding}
        try:
            actual = hash_bytes(decode_array_row(row).astype("<i8").tobytes())
        except StoreError as error:
            problems.append(f"run {str(run_id)[:12]} prompt {index}: {error}")
            continue
        if actual != expected:
            problems.append(f"run {str(run_id)[:12]} prompt {index}: {name} do not match the result's digest")


def _check_complete_results(store: Store, problems: list[str]) -> None:
    """Every complete run's results read as `diff` and `store show` read them: each array decoded (dtype, shape,
    size), their shapes consistent, each prompt id once. What they refuse as damaged is listed here, so that
    `store merge` copies none of it (a blob cut short with its digest made again passed before)."""
    found = []
    complete = store.db.execute("SELECT id FROM runs WHERE status = 'complete' ORDER BY created_at").fetchall()
    for (run_id,) in complete:
        try:
            problem = results_problem(store._read_results(str(run_id)))
        except (StoreError, TypeError, ValueError, KeyError, RecursionError) as error:
            problem = damage_reason(error)
        if problem:
            found.append(f"run {str(run_id)[:12]}: {problem}")
    _list_the_first_ten(problems, found, "complete runs that cannot be read")
