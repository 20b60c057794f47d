"""The run store: plain SQLite, opened through sqlite-utils, readable by Datasette.

Tables
  meta     (key, value)                      schema_version
  runs     one row per run: status running -> complete | failed, JSON provenance columns
  results  one row per (run, prompt): ids, lengths, decoded text, digests over all steps
  arrays   one row per (run, prompt, name): raw little-endian bytes + dtype + shape (never pickle)

Writes happen in explicit `BEGIN IMMEDIATE` transactions with a busy timeout, in WAL mode, so
several processes can write one store at once and a killed process leaves it consistent.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import sqlite_utils

from .errors import StoreError
from .hashing import array_from_bytes, array_to_bytes

SCHEMA_VERSION = 1
DEFAULT_STORE = Path("store") / "evalrun.db"
BUSY_TIMEOUT_MS = 60_000
RUN_JSON_COLUMNS = ("config", "environment", "model", "prompt_set", "timings", "evidence", "batches", "applied_flags")
RESULT_COLUMNS = ("run_id", "prompt_index", "prompt_id", "record_json", "batch_index", "batch_row", "input_tokens",
                  "new_tokens", "eos_step", "output_text", "tokens_digest", "logits_digest")
ARRAY_COLUMNS = ("run_id", "prompt_index", "name", "dtype", "shape", "encoding", "data")


def default_store_path() -> Path:
    return Path(os.environ.get("EVALRUN_STORE", DEFAULT_STORE))


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _migration_1(db: sqlite_utils.Database) -> None:
    db["runs"].create({
        "id": str, "created_at": str, "finished_at": str, "status": str, "label": str, "host": str, "pid": int,
        "config_hash": str, "environment_hash": str, "model_hash": str, "prompts_hash": str,
        "tokens_digest": str, "logits_digest": str, "error": str,
        **{f"{name}_json": str for name in RUN_JSON_COLUMNS},
    }, pk="id")
    db["results"].create({
        "run_id": str, "prompt_index": int, "prompt_id": str, "record_json": str, "batch_index": int,
        "batch_row": int, "input_tokens": int, "new_tokens": int, "eos_step": int, "output_text": str,
        "tokens_digest": str, "logits_digest": str,
    }, pk=("run_id", "prompt_index"), foreign_keys=[("run_id", "runs", "id")])
    db["arrays"].create({
        "run_id": str, "prompt_index": int, "name": str, "dtype": str, "shape": str, "encoding": str, "data": bytes,
    }, pk=("run_id", "prompt_index", "name"), foreign_keys=[("run_id", "runs", "id")])
    db["runs"].create_index(["created_at"])
    db["runs"].create_index(["status"])


MIGRATIONS = {1: _migration_1}  # version -> function that brings the schema from version-1 to version


@dataclass
class PromptResult:
    """One prompt's outcome in a run; `arrays` holds tokens, digests, topk_ids, topk_values, margins, ..."""

    prompt_index: int
    prompt_id: str
    record: dict[str, Any]
    batch_index: int
    batch_row: int
    input_tokens: int
    new_tokens: int
    eos_step: int
    output_text: str
    tokens_digest: str
    logits_digest: str
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class RunRecord:
    id: str
    status: str
    created_at: str
    finished_at: str | None
    label: str | None
    config_hash: str
    environment_hash: str
    model_hash: str
    prompts_hash: str
    tokens_digest: str | None
    logits_digest: str | None
    error: str | None
    json: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        return self.json["config"]

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status, "created_at": self.created_at, "label": self.label,
                "model": (self.json.get("model") or {}).get("ref"), "prompts": (self.json.get("prompt_set") or {}).get("name"),
                "device": (self.config or {}).get("device"), "dtype": (self.config or {}).get("dtype"),
                "opt_level": (self.config or {}).get("opt_level"), "logits_digest": self.logits_digest}


class Store:
    """A SQLite store of runs. `Store(path)` creates the file and schema if needed."""

    def __init__(self, path: str | Path, create: bool = True, readonly: bool = False):
        """Open (and create, migrate) a store; `readonly` opens an existing file without writing to it."""
        self.path = Path(path)
        if (readonly or not create) and not self.path.exists():
            raise StoreError(f"store {self.path} does not exist; run `evalrun run` first or pass --store PATH")
        try:
            if readonly:
                conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA foreign_keys = ON")
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"cannot open store {self.path}: {error}; pass a writable --store PATH") from None
        self.db = sqlite_utils.Database(conn)
        if readonly:
            if self.schema_version() != SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema {self.schema_version()}, this evalrun reads {SCHEMA_VERSION}")
        else:
            self.migrate()

    def compact(self) -> None:
        """Fold the WAL into the file, switch to a rollback journal and VACUUM: one file to commit."""
        self.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.db.conn.execute("PRAGMA journal_mode = DELETE")
        self.db.conn.execute("VACUUM")
        self.close()

    def close(self) -> None:
        self.db.conn.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """An immediate write transaction: all or nothing, waiting out other writers."""
        conn = self.db.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as error:
            raise StoreError(f"cannot write store {self.path}: {error}; check permissions or pass --store") from None
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # ------------------------------------------------------------ schema

    def schema_version(self) -> int:
        if "meta" not in self.db.table_names():
            return 0
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", ["schema_version"]).fetchone()
        return int(row[0]) if row else 0

    def migrate(self) -> None:
        """Apply pending migrations in order, each in its own transaction."""
        if self.schema_version() == SCHEMA_VERSION:
            return
        with self.transaction():
            current = self.schema_version()
            if current > SCHEMA_VERSION:
                raise StoreError(f"store {self.path} has schema {current}, newer than this evalrun "
                                 f"({SCHEMA_VERSION}); upgrade evalrun")
            if "meta" not in self.db.table_names():
                self.db["meta"].create({"key": str, "value": str}, pk="key")
            for version in range(current + 1, SCHEMA_VERSION + 1):
                MIGRATIONS[version](self.db)
                self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                                ["schema_version", str(version)])

    # ------------------------------------------------------------ writing

    def begin_run(self, header: dict[str, Any], label: str | None = None) -> str:
        """Insert a run in state `running`; `header` holds config, environment, model, prompt_set dicts."""
        run_id = uuid.uuid4().hex
        row = {"id": run_id, "created_at": now(), "status": "running", "label": label, "host": socket.gethostname(),
               "pid": os.getpid(), "config_hash": header["config_hash"], "environment_hash": header["environment_hash"],
               "model_hash": header["model"]["hash"], "prompts_hash": header["prompt_set"]["hash"]}
        for name in RUN_JSON_COLUMNS:
            row[f"{name}_json"] = json.dumps(header.get(name), sort_keys=True, default=str)
        columns = ", ".join(row)
        with self.transaction() as conn:
            conn.execute(f"INSERT INTO runs ({columns}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
        return run_id

    def finish_run(self, run_id: str, results: list[PromptResult], extra: dict[str, Any],
                   tokens_digest: str, logits_digest: str) -> None:
        """Write every result and mark the run complete, in one transaction."""
        result_rows, array_rows = [], []
        for r in results:
            result_rows.append([run_id, r.prompt_index, r.prompt_id, json.dumps(r.record, sort_keys=True),
                                r.batch_index, r.batch_row, r.input_tokens, r.new_tokens, r.eos_step,
                                r.output_text, r.tokens_digest, r.logits_digest])
            for name, array in r.arrays.items():
                array_rows.append(encode_array_row(run_id, r.prompt_index, name, array))
        with self.transaction() as conn:
            conn.executemany(_insert("results", RESULT_COLUMNS), result_rows)
            conn.executemany(_insert("arrays", ARRAY_COLUMNS), array_rows)
            sets = {f"{name}_json": json.dumps(value, sort_keys=True, default=str) for name, value in extra.items()}
            sets.update(status="complete", finished_at=now(), tokens_digest=tokens_digest, logits_digest=logits_digest)
            assignments = ", ".join(f"{column} = ?" for column in sets)
            conn.execute(f"UPDATE runs SET {assignments} WHERE id = ?", [*sets.values(), run_id])

    def fail_run(self, run_id: str, error: str) -> None:
        with self.transaction() as conn:
            conn.execute("UPDATE runs SET status = ?, error = ?, finished_at = ? WHERE id = ?",
                         ["failed", error, now(), run_id])

    # ------------------------------------------------------------ reading

    def _record(self, row: dict[str, Any]) -> RunRecord:
        blobs = {name: json.loads(row[f"{name}_json"]) if row[f"{name}_json"] else None for name in RUN_JSON_COLUMNS}
        return RunRecord(row["id"], row["status"], row["created_at"], row["finished_at"], row["label"],
                         row["config_hash"], row["environment_hash"], row["model_hash"], row["prompts_hash"],
                         row["tokens_digest"], row["logits_digest"], row["error"], blobs)

    def list_runs(self, limit: int | None = None) -> list[RunRecord]:
        rows = self.db["runs"].rows_where(order_by="created_at desc", limit=limit)
        return [self._record(row) for row in rows]

    def get_run(self, id_or_prefix: str) -> RunRecord:
        """A run by full id or unique prefix; StoreError names the problem otherwise."""
        prefix = id_or_prefix.strip().lower()
        if not prefix or any(c not in "0123456789abcdef" for c in prefix):
            raise StoreError(f"run id {id_or_prefix!r} is not a hex id or prefix; see `evalrun store ls`")
        rows = list(self.db["runs"].rows_where("id LIKE ?", [prefix + "%"], limit=3))
        if not rows:
            raise StoreError(f"no run {id_or_prefix!r} in {self.path}; see `evalrun store ls`")
        if len(rows) > 1:
            raise StoreError(f"run id prefix {id_or_prefix!r} is ambiguous in {self.path}; give more characters")
        return self._record(rows[0])

    def load_results(self, run_id: str, names: tuple[str, ...] | None = None) -> list[PromptResult]:
        """All prompt results of a run, with their arrays (all, or only `names`)."""
        results = {}
        for row in self.db["results"].rows_where("run_id = ?", [run_id], order_by="prompt_index"):
            results[row["prompt_index"]] = PromptResult(
                row["prompt_index"], row["prompt_id"], json.loads(row["record_json"]), row["batch_index"],
                row["batch_row"], row["input_tokens"], row["new_tokens"], row["eos_step"], row["output_text"],
                row["tokens_digest"], row["logits_digest"])
        for row in self.db["arrays"].rows_where("run_id = ?", [run_id]):
            if names is None or row["name"] in names:
                results[row["prompt_index"]].arrays[row["name"]] = decode_array_row(row)
        return [results[index] for index in sorted(results)]

    # ------------------------------------------------------------ checking

    def check(self) -> dict[str, Any]:
        """integrity_check, schema, orphans and incomplete runs. `ok` is False on any real problem."""
        problems: list[str] = []
        integrity = [row[0] for row in self.db.execute("PRAGMA integrity_check").fetchall()]
        if integrity != ["ok"]:
            problems += [f"integrity: {line}" for line in integrity]
        if self.schema_version() != SCHEMA_VERSION:
            problems.append(f"schema version {self.schema_version()} != {SCHEMA_VERSION}")
        missing = {"meta", "runs", "results", "arrays"} - set(self.db.table_names())
        problems += [f"missing table {name}" for name in sorted(missing)]
        for table in ("results", "arrays"):
            count = self.db.execute(
                f"SELECT count(*) FROM {table} WHERE run_id NOT IN (SELECT id FROM runs)").fetchone()[0]
            if count:
                problems.append(f"{count} orphan rows in {table}")
        count = self.db.execute("SELECT count(*) FROM arrays a WHERE NOT EXISTS (SELECT 1 FROM results r WHERE "
                                "r.run_id = a.run_id AND r.prompt_index = a.prompt_index)").fetchone()[0]
        if count:
            problems.append(f"{count} arrays without a result row")
        for run_id, expected, found in self.db.execute(
                "SELECT r.id, json_extract(r.prompt_set_json, '$.count'), count(x.prompt_index) FROM runs r "
                "LEFT JOIN results x ON x.run_id = r.id WHERE r.status = 'complete' GROUP BY r.id").fetchall():
            if expected != found:
                problems.append(f"run {run_id[:12]} is complete with {found} of {expected} results")
        statuses = dict(self.db.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall())
        return {"path": str(self.path), "ok": not problems, "problems": problems, "runs": statuses,
                "interrupted": self.interrupted_runs(), "schema_version": self.schema_version()}

    def interrupted_runs(self) -> list[str]:
        """Runs still `running` whose process on this host is gone (killed): never complete, never counted."""
        host = socket.gethostname()
        rows = self.db.execute("SELECT id, host, pid FROM runs WHERE status = 'running'").fetchall()
        return [run_id for run_id, run_host, pid in rows if run_host == host and not _alive(pid)]


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _insert(table: str, columns: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def encode_array_row(run_id: str, prompt_index: int, name: str, array: np.ndarray) -> list[Any]:
    import zlib

    raw = array_to_bytes(array)
    compress = name == "logits"  # full logits are large; everything else is small
    data = zlib.compress(raw, 6) if compress else raw
    return [run_id, prompt_index, name, array.dtype.name, json.dumps(list(array.shape)),
            "zlib" if compress else "raw", data]


ARRAY_DTYPES = ("bool", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")


def decode_array_row(row: dict[str, Any]) -> np.ndarray:
    """Raw bytes + dtype + shape -> array; only plain numeric dtypes (stores and goldens are untrusted input)."""
    import zlib

    if row["dtype"] not in ARRAY_DTYPES or row["encoding"] not in ("raw", "zlib"):
        raise StoreError(f"array {row['name']!r} has dtype {row['dtype']!r} / encoding {row['encoding']!r}; "
                         f"only {', '.join(ARRAY_DTYPES)} raw or zlib are read")
    data = zlib.decompress(row["data"]) if row["encoding"] == "zlib" else row["data"]
    return array_from_bytes(data, row["dtype"], json.loads(row["shape"]))
