"""The run store: plain SQLite, opened through sqlite-utils, readable by Datasette.

Tables
  meta     (key, value)                      schema_version
  runs     one row per run: status running -> complete | failed, JSON provenance columns
  results  one row per (run, prompt): ids, lengths, decoded text, digests over all steps
  arrays   one row per (run, prompt, name): raw little-endian bytes + dtype + shape (never pickle),
           and the xxh3-128 digest of the stored bytes (schema 2), so `store check` finds a flipped bit

Writes happen in explicit `BEGIN IMMEDIATE` transactions with a busy timeout, in WAL mode, so
several processes can write one store at once and a killed process leaves it consistent. Read-only
commands open the file read-only (no migration, no journal switch), never immutable (that would read
past a concurrent writer's log): the .db bytes stay as they were, while SQLite may leave an empty -wal
and its -shm index beside a WAL store. Goldens are opened immutable, so nothing is ever written beside
them. Every array read is untrusted input: its stored bytes must match their stored digest, and dtype,
shape, size and compressed size are validated before any byte is decoded.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import tempfile
import uuid
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import sqlite_utils

from . import routing
from .errors import StoreError
from .json_input import RepeatedKey, object_without_repeated_keys
from .hashing import array_from_bytes, array_to_bytes, hash_bytes

SCHEMA_VERSION = 2
DEFAULT_STORE = Path("store") / "evalrun.db"
BUSY_TIMEOUT_MS = 60_000
RUN_JSON_COLUMNS = ("config", "environment", "model", "prompt_set", "timings", "evidence", "batches", "applied_flags")
RESULT_COLUMNS = ("run_id", "prompt_index", "prompt_id", "record_json", "batch_index", "batch_row", "input_tokens",
                  "new_tokens", "eos_step", "output_text", "tokens_digest", "logits_digest")
ARRAY_COLUMNS = ("run_id", "prompt_index", "name", "dtype", "shape", "encoding", "data", "digest")
MAX_ARRAY_BYTES = 1 << 31  # 2 GiB decoded: far past any run's array; a larger claim is a damaged file
MAX_RUN_BYTES = 1 << 33  # all arrays of one run decoded together; goldens set far smaller budgets
EXPECTED_COLUMNS = {"runs": ("id", "status", "created_at", "config_json", "model_json", "prompt_set_json"),
                    "results": RESULT_COLUMNS, "arrays": ARRAY_COLUMNS, "meta": ("key", "value")}


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


def _migration_2(db: sqlite_utils.Database) -> None:
    """Each array row carries the digest of its stored bytes."""
    db.execute("ALTER TABLE arrays ADD COLUMN digest TEXT")
    rows = db.execute("SELECT rowid, data FROM arrays").fetchall()
    db.conn.executemany("UPDATE arrays SET digest = ? WHERE rowid = ?",
                        [(hash_bytes(data if isinstance(data, bytes) else b""), rowid) for rowid, data in rows])


MIGRATIONS = {1: _migration_1, 2: _migration_2}  # version -> function that brings the schema from version-1 to version
REQUIRED_ARRAYS = ("input_ids", "tokens", "digests", "topk_ids", "topk_values", "margins")
PROBE_ARRAYS = ("probe_ids", "probe_values")
ID_ARRAYS = ("input_ids", "tokens", "digests", "topk_ids")  # integer ids and digest words: never floats


def result_problem(result: "PromptResult", probed: bool = False) -> str:
    """What is wrong with one stored result's arrays ('' when nothing): each array a comparison reads,
    with the shapes evalrun writes (N steps, K top-k ids, K' probe ids), ids and digests of an integer dtype."""
    arrays = result.arrays
    needed = REQUIRED_ARRAYS + (PROBE_ARRAYS if probed else ())
    missing = [name for name in needed if name not in arrays]
    if missing:
        return f"lacks {', '.join(missing)} for prompt {result.prompt_id!r}"
    tokens = arrays["tokens"]
    steps = tokens.shape[0] if tokens.ndim == 1 else -1
    fine = (steps > 0 and arrays["input_ids"].ndim == 1 and arrays["digests"].shape == (steps, 2)
            and arrays["margins"].shape == (steps,) and arrays["topk_ids"].ndim == 2
            and arrays["topk_ids"].shape == arrays["topk_values"].shape and arrays["topk_ids"].shape[0] == steps
            and arrays["topk_ids"].shape[1] >= 2)
    if probed:
        fine = fine and arrays["probe_ids"].ndim == 2 and arrays["probe_ids"].shape[0] == steps \
            and arrays["probe_ids"].shape == arrays["probe_values"].shape and arrays["probe_ids"].shape[1] > 0
    if not fine:
        return f"has arrays of inconsistent shapes for prompt {result.prompt_id!r}"
    for name in ID_ARRAYS + (("probe_ids",) if probed else ()):  # compared as ids: float bits would differ
        if not np.issubdtype(arrays[name].dtype, np.integer):
            return f"has {name} of dtype {arrays[name].dtype}, not integer ids, for prompt {result.prompt_id!r}"
    wrong = routing.problem(arrays, steps, len(arrays["input_ids"]))
    return f"has {wrong} for prompt {result.prompt_id!r}" if wrong else ""


def results_problem(results: list["PromptResult"]) -> str:
    """What is wrong with a run's results ('' when nothing): each one's arrays (`result_problem`), and each prompt
    id once: `diff` pairs prompts by id, so a second result under one id would go uncompared."""
    seen: set[str] = set()
    for result in results:
        if result.prompt_id in seen:
            return f"holds prompt {result.prompt_id!r} twice"
        seen.add(result.prompt_id)
        problem = result_problem(result)
        if problem:
            return problem
    return ""


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
        return self.json.get("config") or {}

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status, "created_at": self.created_at, "label": self.label,
                "model": (self.json.get("model") or {}).get("ref"), "prompts": (self.json.get("prompt_set") or {}).get("name"),
                "device": self.config.get("device"), "dtype": self.config.get("dtype"),
                "opt_level": self.config.get("opt_level"), "logits_digest": self.logits_digest}


def damage_reason(error: BaseException) -> str:
    """Why a row could not be read, in a few words of one line."""
    if isinstance(error, RecursionError):
        return "JSON nested too deeply"
    return (str(error).splitlines() or [type(error).__name__])[0][:200] or type(error).__name__


REQUIRED_RUN_JSON = ("config", "environment", "model", "prompt_set")  # every run's header holds them (begin_run)
MAX_JSON_CELL_BYTES = 1 << 22  # a run's or result's JSON value: 4 MiB (they hold KBs; parsed JSON grows ~30x)


def _json_cell(row: dict[str, Any], column: str) -> Any:
    """A JSON column of a row, parsed only when its text is of a size evalrun writes (a grown value would cost
    ~30x its size in memory to parse: `store check` and `merge` read every row)."""
    text = row[column]
    if isinstance(text, (str, bytes)) and len(text) > MAX_JSON_CELL_BYTES:
        raise ValueError(f"its {column} is {len(text):,} bytes, past the {MAX_JSON_CELL_BYTES:,} evalrun writes")
    try:
        return json.loads(text, object_pairs_hook=object_without_repeated_keys) if text else None
    except RepeatedKey as key:  # read as its last value here, maybe as its first by a reviewer's SQLite tool
        raise ValueError(f"its {column} names the key {str(key)!r} twice") from None


def run_from_row(row: dict[str, Any]) -> RunRecord:
    """A runs row as evalrun writes it, validated; ValueError (or TypeError, KeyError, RecursionError) when
    it is not: the JSON columns objects (batches: a list) or empty, the header's objects present, the prompt
    set's hash and name text, id, status and created_at text."""
    blobs = {name: _json_cell(row, f"{name}_json") for name in RUN_JSON_COLUMNS}
    for name, value in blobs.items():  # what evalrun writes: objects (batches: a list), or nothing yet
        if value is not None and not isinstance(value, list if name == "batches" else dict):
            raise ValueError(f"{name} is not what evalrun writes")
    missing = [name for name in REQUIRED_RUN_JSON if blobs[name] is None]
    if missing:
        raise ValueError(f"no {', '.join(missing)} record")
    if not all(isinstance(blobs["prompt_set"].get(key), str) for key in ("hash", "name")):
        raise ValueError("its prompt-set record lacks a text hash or name")
    if not all(isinstance(row[column], str) for column in ("id", "status", "created_at")):
        raise ValueError("id, status or created_at is not text")
    return RunRecord(row["id"], row["status"], row["created_at"], row["finished_at"], row["label"],
                     row["config_hash"], row["environment_hash"], row["model_hash"], row["prompts_hash"],
                     row["tokens_digest"], row["logits_digest"], row["error"], blobs)


def result_from_row(row: dict[str, Any]) -> PromptResult:
    """A results row as evalrun writes it (its arrays not yet read); ValueError when it is not."""
    record = _json_cell(row, "record_json")
    if not isinstance(record, dict) or not isinstance(row["prompt_index"], int):
        raise ValueError("a result row is not what evalrun writes")
    return PromptResult(row["prompt_index"], str(row["prompt_id"]), record, row["batch_index"], row["batch_row"],
                        row["input_tokens"], row["new_tokens"], row["eos_step"], str(row["output_text"]),
                        str(row["tokens_digest"]), str(row["logits_digest"]))


_OPEN_FOR_WRITING: list["Store"] = []  # held until closed: a dropped Store's connection stays open until collected


class ForeignFileError(StoreError):
    """An existing SQLite file that is no evalrun store (another program's): read, it is named so."""


def _not_a_run_store(conn: sqlite3.Connection) -> str | None:
    """What an existing SQLite file is, if it is not a run store evalrun may write: a golden (its `golden`
    table) or another program's file (tables, but not evalrun's `meta`). None for a run store or a new file."""
    tables = [str(row[0]) for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    if "golden" in tables:
        return "a golden, not a run store"
    if tables and "meta" not in tables:
        shown = ", ".join(repr(name[:40]) for name in tables[:4]) + (", ..." if len(tables) > 4 else "")
        return f"a SQLite file of another program (tables {shown}), not an evalrun store"
    return None


def open_stores() -> list["Store"]:
    """The stores open for writing now (to close, after a command, those it opened)."""
    return list(_OPEN_FOR_WRITING)


def close_open_stores(keep: list["Store"] = ()) -> None:
    """Close every store open for writing but those in `keep` (end of a command): the last connection to
    close folds the write-ahead log into the file, so the .db alone holds every run (a process ended by
    os._exit, as a torchrun rank over NCCL is, would otherwise leave committed runs only in the -wal file)."""
    for store in list(_OPEN_FOR_WRITING):
        if store not in keep:
            store.close()


def unwritable_folder(folder: str | Path) -> Path | None:
    """The nearest existing folder at or above `folder` when a new file could not be made below it (not a folder,
    or not writable), else None: what a command checks before any model runs."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not (probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)):
        return probe
    try:  # permissions do not tell for root, or a file system that takes no new file (/sys, /proc, read-only)
        handle, made = tempfile.mkstemp(prefix=".evalrun-probe-", dir=probe)
    except OSError:
        return probe
    os.close(handle)
    os.unlink(made)
    return None


def check_store_path(path: str | Path) -> None:
    """StoreError where `Store(path)` would fail, found without creating anything: a command checks its store
    before a model runs and creates it only once its input is known to be good (a typo leaves no store file). An
    existing file is opened and closed; a link to nothing is refused (its folder's permissions do not tell); a new
    file needs its nearest existing folder to be writable."""
    path = Path(path)
    try:
        exists, dangling = path.exists(), os.path.lexists(path) and not path.exists()
    except OSError:
        exists, dangling = True, False  # Store names the unusable path
    if dangling:
        raise StoreError(f"cannot open store {path}: it is a link to {os.readlink(path)}, which does not exist; "
                         "pass a writable --store PATH")
    if exists:
        Store(path).close()
        return
    blocked = unwritable_folder(path.parent)
    if blocked is not None:
        raise StoreError(f"cannot open store {path}: {blocked} is not a writable folder; pass a writable --store PATH")


class Store:
    """A SQLite store of runs. `Store(path)` creates the file and schema if needed."""

    def __init__(self, path: str | Path, create: bool = True, readonly: bool = False, immutable: bool = False,
                 require_schema: bool = True):
        """Open (and create, migrate) a store. `readonly` opens an existing file without writing to it;
        `immutable` also promises SQLite that nobody else writes it (no locks, no -wal/-shm files);
        `require_schema=False` opens a damaged file anyway (for `check`, which reports what is missing)."""
        self.path = Path(path)
        readonly = readonly or immutable
        try:
            exists, regular = self.path.exists(), self.path.is_file()
        except OSError as error:  # a name too long, a loop of links: the path itself is unusable
            raise StoreError(f"store path {str(self.path)[:120]!r} is unusable ({error.strerror}); "
                             f"pass --store with another path") from None
        if (readonly or not create) and not exists:
            raise StoreError(f"store {self.path} does not exist; run `evalrun run` first or pass --store PATH")
        if exists and not regular:
            raise StoreError(f"store {self.path} is not a regular file; pass --store with a SQLite file")
        try:
            if readonly:
                flags = "mode=ro" + ("&immutable=1" if immutable else "")
                conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?{flags}", uri=True, isolation_level=None)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                refusal = _not_a_run_store(conn)  # by content, not name (links are caught too); nothing written yet
                if refusal:
                    conn.close()
                    raise StoreError(f"{self.path} is {refusal}: writing runs into it would change it; pass "
                                     f"--store with a new file or an evalrun store")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA foreign_keys = ON")
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"cannot open store {self.path}: {error}; pass a writable --store PATH") from None
        conn.text_factory = lambda raw: raw.decode("utf-8", "replace")  # a damaged file's bytes never crash a read
        self.db = sqlite_utils.Database(conn)
        self.readonly = readonly
        self.max_array_bytes = MAX_ARRAY_BYTES
        self.max_run_bytes = MAX_RUN_BYTES
        try:
            if readonly and require_schema:
                version = self.schema_version()
                if version > SCHEMA_VERSION:
                    raise self._newer_schema(version)
                if version != SCHEMA_VERSION:
                    foreign = _not_a_run_store(conn)  # not "migrate it with evalrun run", which refuses it
                    if foreign:
                        raise ForeignFileError(f"{self.path} is {foreign}; pass --store with an evalrun store")
                    raise StoreError(f"{self.path} has schema {version}, this evalrun reads "
                                     f"{SCHEMA_VERSION}; open it once with a writing command (evalrun run) to migrate")
                lacking = self.schema_problems()
                if lacking:
                    raise StoreError(f"{self.path} is damaged ({lacking[0]}); `evalrun store check` lists what is wrong")
            elif not readonly:
                self.migrate()
                _OPEN_FOR_WRITING.append(self)
        except sqlite3.DatabaseError as error:
            conn.close()
            raise StoreError(f"{self.path} is not a usable evalrun store ({str(error).splitlines()[0]}); "
                             "pass --store with another file") from None

    def compact(self) -> None:
        """Fold the WAL into the file, switch to a rollback journal and VACUUM: one file to commit."""
        self.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.db.conn.execute("PRAGMA journal_mode = DELETE")
        self.db.conn.execute("VACUUM")
        self.close()

    def close(self) -> None:
        if self in _OPEN_FOR_WRITING:
            _OPEN_FOR_WRITING.remove(self)
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
            if conn.in_transaction:  # SQLite rolls back by itself on some errors (a full disk)
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # ------------------------------------------------------------ schema

    def schema_problems(self) -> list[str]:
        """Tables and columns evalrun reads that the file lacks (empty when the schema is whole)."""
        tables = set(self.db.table_names())
        problems = [f"missing table {name}" for name in sorted(set(EXPECTED_COLUMNS) - tables)]
        for table, expected in EXPECTED_COLUMNS.items():
            if table in tables:
                found = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
                lacking = [column for column in expected if column not in found]
                if lacking:
                    problems.append(f"table {table} lacks columns {', '.join(lacking)}")
        return problems

    def schema_version(self) -> int:
        if "meta" not in self.db.table_names():
            return 0
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", ["schema_version"]).fetchone()
        try:
            return int(row[0]) if row else 0
        except (TypeError, ValueError):
            raise StoreError(f"{self.path}: schema_version {row[0]!r} is not a number; the file is damaged") from None

    def _newer_schema(self, version: int) -> StoreError:
        """A store written by a newer evalrun: no migration goes backwards; the fix is to upgrade."""
        return StoreError(f"store {self.path} has schema {version}, newer than this evalrun ({SCHEMA_VERSION}); "
                          "upgrade evalrun")

    def migrate(self) -> None:
        """Apply pending migrations in order, each in its own transaction."""
        if self.schema_version() == SCHEMA_VERSION:
            return
        with self.transaction():
            current = self.schema_version()
            if current > SCHEMA_VERSION:
                raise self._newer_schema(current)
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

    def fail_run(self, run_id: str, error: str, status: str = "failed") -> None:
        """Mark a run `failed` (an error) or `interrupted` (stopped: Ctrl-C, or a torchrun rank gone)."""
        with self.transaction() as conn:
            conn.execute("UPDATE runs SET status = ?, error = ?, finished_at = ? WHERE id = ?",
                         [status, error, now(), run_id])

    # ------------------------------------------------------------ reading

    def _record(self, row: dict[str, Any]) -> RunRecord:
        try:
            return run_from_row(row)
        except (TypeError, ValueError, KeyError, RecursionError) as error:
            raise StoreError(f"{self.path}: run {str(row.get('id'))[:12]} is damaged ({damage_reason(error)}); "
                             "`evalrun store check` lists what is wrong") from None

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

    def find_complete_runs(self, header: dict[str, Any], label_prefix: str = "") -> list[RunRecord]:
        """Complete runs, newest first, with the config, environment, model and prompt-set hashes of
        `header` (a run's header, as `begin_run` takes it) and a label starting with `label_prefix`."""
        rows = self.db["runs"].rows_where(
            "status = 'complete' AND config_hash = ? AND environment_hash = ? AND model_hash = ? AND prompts_hash = ? "
            "AND substr(coalesce(label, ''), 1, ?) = ?",
            [header["config_hash"], header["environment_hash"], header["model"]["hash"], header["prompt_set"]["hash"],
             len(label_prefix), label_prefix], order_by="created_at desc")
        return [self._record(row) for row in rows]

    def load_results(self, run_id: str, names: tuple[str, ...] | None = None) -> list[PromptResult]:
        """All prompt results of a run, with their arrays (all, or only `names`), each one validated: its
        stored bytes against the digest stored beside them, then dtype, shape and size. Declared sizes are
        checked against `max_array_bytes` each and `max_run_bytes` together before any array is decoded,
        so a file that claims huge arrays costs no memory."""
        try:
            return self._read_results(run_id, names)
        except (StoreError, TypeError, ValueError, KeyError, RecursionError, sqlite3.DatabaseError) as error:
            raise StoreError(f"{self.path}: run {run_id[:12]} is damaged ({damage_reason(error)}); "
                             "`evalrun store check` lists what is wrong") from None

    def _read_results(self, run_id: str, names: tuple[str, ...] | None = None) -> list[PromptResult]:
        """`load_results` without naming the store: the exceptions as raised."""
        results = {}
        self._check_declared_sizes(run_id, names)
        for row in self.db["results"].rows_where("run_id = ?", [run_id], order_by="prompt_index"):
            results[row["prompt_index"]] = result_from_row(row)
        for row in self.db["arrays"].rows_where("run_id = ?", [run_id]):
            if names is None or row["name"] in names:
                if row["prompt_index"] not in results:
                    raise ValueError(f"array {row['name']!r} belongs to no result")
                verify_digest(row)  # the bytes as read, one row at a time, before anything is decoded
                results[row["prompt_index"]].arrays[str(row["name"])] = decode_array_row(row)
        return [results[index] for index in sorted(results)]

    def _check_declared_sizes(self, run_id: str, names: tuple[str, ...] | None) -> None:
        total = 0
        for name, dtype, shape in self.db.execute("SELECT name, dtype, shape FROM arrays WHERE run_id = ?", [run_id]):
            if names is not None and name not in names:
                continue
            _, size = declared_shape({"name": name, "dtype": dtype, "shape": shape})
            if size > self.max_array_bytes:
                raise StoreError(f"{self.path}: run {run_id[:12]} array {name!r} claims {size:,} bytes, past the "
                                 f"{self.max_array_bytes:,} allowed; the file is damaged")
            total += size
        if total > self.max_run_bytes:
            raise StoreError(f"{self.path}: run {run_id[:12]} claims {total:,} bytes of arrays, past the "
                             f"{self.max_run_bytes:,} allowed; the file is damaged")

    def interrupted_runs(self) -> list[str]:
        """Runs marked `interrupted`, and runs still `running` whose process on this host is gone (killed):
        never complete, never counted."""
        host = socket.gethostname()
        rows = self.db.execute("SELECT id, host, pid, status FROM runs WHERE status IN ('running', 'interrupted') "
                               "ORDER BY created_at").fetchall()
        return [run_id for run_id, run_host, pid, status in rows
                if status == "interrupted" or (run_host == host and not _alive(pid))]


def _alive(pid: int | None) -> bool:
    if not pid or pid < 0:  # os.kill(-1, 0) signals every process it may: a forged row, never a run's
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # a pid past the system's (a forged row): no such process
        return False
    except PermissionError:
        return True
    return True


def _insert(table: str, columns: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def encode_array_row(run_id: str, prompt_index: int, name: str, array: np.ndarray) -> list[Any]:
    raw = array_to_bytes(array)
    compress = name == "logits"  # full logits are large; everything else is small
    data = zlib.compress(raw, 6) if compress else raw
    return [run_id, prompt_index, name, array.dtype.name, json.dumps(list(array.shape)),
            "zlib" if compress else "raw", data, hash_bytes(data)]


ARRAY_DTYPES = ("bool", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")
MAX_DIMENSIONS = 4


def declared_shape(row: dict[str, Any]) -> tuple[list[int], int]:
    """The shape an array row declares and the decoded size it implies (dtype x shape), validated;
    StoreError when unusable."""
    name = row.get("name")
    if row.get("dtype") not in ARRAY_DTYPES:
        raise StoreError(f"array {name!r} has dtype {row.get('dtype')!r}; only {', '.join(ARRAY_DTYPES)} are read")
    try:
        shape = json.loads(row["shape"]) if isinstance(row.get("shape"), str) and len(row["shape"]) < 200 else None
    except (json.JSONDecodeError, RecursionError):
        shape = None
    if (not isinstance(shape, list) or len(shape) > MAX_DIMENSIONS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)):
        raise StoreError(f"array {name!r} has shape {str(row.get('shape'))[:60]!r}; expected a list of up to "
                         f"{MAX_DIMENSIONS} sizes")
    return shape, int(np.prod(shape, dtype=object)) * np.dtype(row["dtype"]).itemsize


def digest_matches(data: Any, digest: Any) -> bool:
    """Whether an array row's stored bytes hash to the digest stored beside them (schema 2)."""
    return isinstance(data, bytes) and hash_bytes(data) == digest


def verify_digest(row: dict[str, Any]) -> None:
    """An array row's stored bytes against their digest: a flipped bit, or bytes edited without their digest,
    is damage (StoreError), never a value a comparison reads."""
    if not digest_matches(row.get("data"), row.get("digest")):
        raise StoreError(f"array {row.get('name')!r} of prompt {row.get('prompt_index')}: bytes do not match "
                         "their digest")


def decode_array_row(row: dict[str, Any], max_bytes: int = MAX_ARRAY_BYTES) -> np.ndarray:
    """Raw bytes + dtype + shape -> array. Stores and goldens are untrusted input: only plain numeric
    dtypes, a shape of at most 4 non-negative dimensions whose size matches the bytes exactly, and a
    decompressed size capped at what dtype x shape declares (a compression bomb stops there)."""
    name = row.get("name")
    if row.get("encoding") not in ("raw", "zlib"):
        raise StoreError(f"array {name!r} has encoding {row.get('encoding')!r}; only raw or zlib are read")
    shape, expected = declared_shape(row)
    data = row.get("data")
    if not isinstance(data, bytes) or expected > max_bytes:
        raise StoreError(f"array {name!r} has no byte data or claims {expected:,} bytes; the file is damaged")
    if row["encoding"] == "zlib":
        try:
            inflater = zlib.decompressobj()
            data = inflater.decompress(data, expected + 1)
        except zlib.error as error:
            raise StoreError(f"array {name!r}: compressed data is corrupt ({error})") from None
    if len(data) != expected:
        raise StoreError(f"array {name!r}: {len(data):,} bytes where dtype {row['dtype']} x shape {shape} needs "
                         f"{expected:,}; the file is damaged")
    return array_from_bytes(data, row["dtype"], shape)
