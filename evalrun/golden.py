"""Goldens: one self-contained SQLite file per golden (the format), and how one is made.

A golden file is a store (same schema as `store/evalrun.db`) holding these runs, by role:
  pinned              the config the golden was created with, free-running: the tokens every check follows
  oracle              float64, eager, forced along the pinned tokens; each step it probes its own top-64
                      ids plus a fixed sample of the vocabulary: the ids every later run is probed at
  envelope:pinned     known-good implementations, forced along the pinned tokens and probed at the
  envelope:reference  oracle's ids: the pinned config, and the reference (O0, eager, deterministic, same dtype)
  function            float32, eager, deterministic, TF32 off, forced and probed likewise: what the
                      function check holds a candidate environment's float32 run against
Roles with the same config share one run. Mixture-of-experts models: every run but pinned also follows the
pinned run's routing (its experts at each step's token and, since stop 24, at each prompt token, in every MoE
layer: forced routing), so all of a golden's runs share one discrete path, and the table says so (`routing`:
"pinned"); a run's stored routing is still the experts its own router chose. (A golden made before stop 24 keeps
no prompt routing: its runs, and verify's against it, route the prompt's tokens freely.) A `golden` table holds
the format version, the roles, the requested config and a digest of the whole content, so an edited or damaged file is refused. The digest is an unkeyed checksum, not a
signature: anyone can edit a golden and recompute it, so every value read from one is validated as
untrusted input.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash

from . import __version__, distributed
from .config import (DECODE_LEVER_DEFAULTS, INDUCTOR_DEFAULTS, CompilationMode, CUDAGraphMode, EffectiveConfig,
                     RunConfig, resolve)
from .errors import ConfigError, GoldenError, OutputError, StoreError
from .json_input import RepeatedKey, object_without_repeated_keys
from .routing import PROMPT_ARRAY, RoutingPath, has_routing, routing_path
from .rules import EPSILON, logit_scale, step_errors
from .runner import Prepared, Probes, Run, execute, prepare, record
from .store import RUN_JSON_COLUMNS, ForeignFileError, PromptResult, Store, result_problem, unwritable_folder

GOLDEN_FORMAT = 2
DEFAULT_DIR = Path("golden")
ORACLE_MEMORY_SHARE = 0.6  # float64 weights may take this share of the device's memory (the H200: an 8B model)
PROBE_TOPK = 64  # the oracle's own top ids probed each step
PROBE_SAMPLE = 64  # plus this many ids sampled from the whole vocabulary (fixed per golden)
PROBE_SEED = 20261129
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_GOLDEN_BYTES = 1 << 30  # goldens hold sketches, not logits: a few MB; a larger file is refused unread
MAX_TEXT_BYTES = 1 << 22  # a JSON or text value of a golden: 4 MiB (they hold KBs); parsed JSON grows ~30x
MAX_BLOB_BYTES = 1 << 26  # one stored array's bytes: 64 MiB
MAX_DECODED_ARRAY_BYTES = 1 << 26  # one array decoded: 64 MiB (a probe array of 8,192 steps x 1,024 ids)
MAX_DECODED_RUN_BYTES = 1 << 28  # all arrays of one run decoded: 256 MiB
# The memory bound these give: a golden is read within about 1 GiB of resident memory (the fuzz suite's
# bound, tests/test_fuzz.py), whatever a forged file claims.
ROUTING_FOLLOWED = "pinned"  # the golden table's `routing`: every run followed the pinned run's routing (MoE)
ENVELOPE_ROLES = ("envelope:pinned", "envelope:reference")
REQUIRED_ROLES = ("pinned", "oracle", *ENVELOPE_ROLES, "function")
Hook = Callable[[Prepared], None]  # called on every model a golden operation loads (tests, calibration)


def golden_path(name: str, directory: str | Path = DEFAULT_DIR) -> Path:
    if not NAME_PATTERN.fullmatch(name):
        raise GoldenError(f"golden name {name!r} is not valid; use up to 100 letters, digits, '.', '_' and '-'")
    if name.lower().endswith(".db"):  # golden/x.db.db would be read or written
        older = Path(directory) / f"{name}.db"  # where an evalrun before stop 49 wrote it
        renamed = Path(directory) / name
        try:
            written_so = older.is_file() and not renamed.exists()
        except OSError:  # a folder that cannot be searched: the hint below still holds
            written_so = False
        fix = (f"an older evalrun wrote it as {older}: rename that file to {renamed} and name the golden {name[:-3]!r}"
               if written_so else f"name the golden without it ({name[:-3]!r}: its file is NAME.db)")
        raise GoldenError(f"golden name {name!r} ends in .db; {fix}")
    return Path(directory) / f"{name}.db"


# ---------------------------------------------------------------- the configs a golden records

def reference_config(config: EffectiveConfig) -> EffectiveConfig:
    """O0: eager, no CUDA graphs, deterministic, no TF32, Inductor knobs and decode levers (BLAS library,
    projection, attention and norm kernels) at their defaults; all else kept."""
    return config.replace(opt_level=0, compilation_mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.NONE,
                          deterministic=True, tf32=False, adjustments=(), keep_logits="none", strict_config=False,
                          **INDUCTOR_DEFAULTS, **DECODE_LEVER_DEFAULTS)


def function_config(config: EffectiveConfig) -> EffectiveConfig:
    """The function check's config: the reference in float32."""
    return reference_config(config).replace(dtype="float32")


def device_memory_bytes(device: str) -> int:
    """Total memory of the device a golden runs on: the GPU's, or the machine's RAM."""
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def oracle_config(config: EffectiveConfig, parameters: int, memory_bytes: int | None = None) -> EffectiveConfig:
    """The reference in float64 where its weights fit in ORACLE_MEMORY_SHARE of the device's memory.

    Past that the oracle runs in float32, the function run's own dtype: the function check then has no
    more precise reference (its envelope is the float32 run itself) and the golden says so."""
    memory = device_memory_bytes(config.device) if memory_bytes is None else memory_bytes
    fits = parameters * 8 <= ORACLE_MEMORY_SHARE * memory
    return reference_config(config).replace(dtype="float64" if fits else "float32")


def pinned_request(config: RunConfig, cuda_available: bool) -> RunConfig:
    """The request a golden stores: as asked, with device and dtype made concrete, so a golden made on
    the CPU verifies on the CPU on a machine with a GPU too (pass --device to verify elsewhere)."""
    effective = resolve(config, cuda_available)
    return dataclasses.replace(config, device=effective.device, dtype=effective.dtype)


def sample_ids(vocab: int, count: int, seed: int = PROBE_SEED) -> np.ndarray:
    """A fixed sample of `count` distinct vocabulary ids (the probe set's broad part)."""
    return np.sort(np.random.default_rng(seed).choice(vocab, size=min(count, vocab), replace=False)).astype(np.int64)


# ---------------------------------------------------------------- content digest

def content_digest(conn: sqlite3.Connection) -> str:
    """Digest of every row of every table in a canonical order, the stored digest itself excluded.
    Streamed row by row into the hash: memory stays at one row, whatever the file holds."""
    hasher = xxhash.xxh3_128()

    def add(chunk: bytes) -> None:
        hasher.update(len(chunk).to_bytes(8, "little"))
        hasher.update(chunk)

    tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                             "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    for table in tables:  # names come from an untrusted file: always quoted as identifiers
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({_quoted(table)})")]
        add(f"{table}:{','.join(columns)}".encode())
        order = ", ".join(_quoted(column) for column in columns)
        for row in conn.execute(f"SELECT * FROM {_quoted(table)} ORDER BY {order}"):
            if table == "golden" and row[0] == "content_digest":
                continue
            add(b"".join(_cell_bytes(value) for value in row))
    return hasher.hexdigest()


def _quoted(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _cell_bytes(value: Any) -> bytes:
    raw = value if isinstance(value, bytes) else repr(value).encode()
    return type(value).__name__.encode() + len(raw).to_bytes(8, "little") + raw


# ---------------------------------------------------------------- the golden file

@dataclass
class Golden:
    name: str
    path: Path
    store: Store
    meta: dict[str, Any]
    _results: dict[str, list[PromptResult]] = field(default_factory=dict, repr=False)

    def run_id(self, role: str) -> str:
        return self.meta["roles"][role]

    def results(self, role: str) -> list[PromptResult]:
        """A role's results, read once and validated: every array a verdict uses, with consistent shapes."""
        if role not in self._results:
            try:
                results = self.store.load_results(self.run_id(role))
            except StoreError as error:
                raise GoldenError(f"golden {self.path}: {error}; {recreate_hint(self.name)}") from None
            problem = role_problem(role, results, self.results, self.routing_followed)
            if problem:
                raise GoldenError(f"golden {self.path}: the {role} run {problem}; {recreate_hint(self.name)}")
            self._results[role] = results
        return self._results[role]

    def record(self, role: str):
        try:
            return self.store.get_run(self.run_id(role))
        except StoreError as error:
            raise GoldenError(f"golden {self.path}: {error}; {recreate_hint(self.name)}") from None

    @property
    def pinned(self):
        return self.record("pinned")

    @property
    def routing_followed(self) -> bool:
        """Every run of this golden followed the pinned run's routing (an MoE golden made by this evalrun; older
        ones' runs routed freely)."""
        return self.meta.get("routing") == ROUTING_FOLLOWED

    def config(self, role: str = "pinned") -> EffectiveConfig:
        try:
            return EffectiveConfig.from_dict(self.record(role).config)
        except ConfigError as error:
            raise GoldenError(f"golden {self.path}: the {role} run's config is damaged ({error}); "
                              f"{recreate_hint(self.name)}") from None

    def summary(self) -> dict[str, Any]:
        pinned = self.pinned
        return {"name": self.name, "path": str(self.path), "created_at": self.meta["created_at"],
                "model": pinned.json["model"]["ref"], "prompts": pinned.json["prompt_set"]["name"],
                "device": pinned.config["device"], "dtype": pinned.config["dtype"],
                "opt_level": pinned.config["opt_level"], "oracle_dtype": self.config("oracle").dtype,
                "format": self.meta["format"], "bytes": self.path.stat().st_size,
                "evalrun": str(self.meta.get("evalrun_version")), "routing": self.meta.get("routing"),
                "create_seconds": create_seconds(self.meta.get("create_seconds"))}


def create_seconds(value: Any) -> dict[str, float] | None:
    """The time `golden create` spent per phase (pinned_s, oracle_s, envelope_s), as stored; None when the
    golden does not say or says something else (a golden is untrusted input)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and
                                              not isinstance(v, bool) for k, v in value.items()):
        return None
    try:
        seconds = {key: float(figure) for key, figure in value.items()}  # OverflowError: an integer past 1e308
    except OverflowError:
        return None
    return seconds if all(math.isfinite(figure) for figure in seconds.values()) else None


PROBED_ROLES = ("oracle", *ENVELOPE_ROLES, "function")
MEASURED_ARRAYS = ("probe_values", "probe_logsumexp", "topk_values", "margins")  # what the checks measure


def results_problem(role: str, results: list[PromptResult], pinned: list[PromptResult] | None) -> str:
    """What is wrong with a role's results read from a golden (an empty string when nothing is)."""
    if not results:
        return "has no results"
    for result in results:
        problem = result_problem(result, probed=role in PROBED_ROLES)
        if problem:
            return problem
        if role in PROBED_ROLES:  # every budget is measured from these: a NaN made any candidate changed
            spoiled = [name for name in MEASURED_ARRAYS if name in result.arrays
                       and np.issubdtype(result.arrays[name].dtype, np.floating) and np.isnan(result.arrays[name]).any()]
            if spoiled:
                return f"has NaN in its {', '.join(spoiled)} for prompt {result.prompt_id!r}"
    if pinned is not None:
        by_index = {r.prompt_index: r for r in pinned}
        if sorted(by_index) != sorted(r.prompt_index for r in results) or any(
                len(r.arrays["tokens"]) != len(by_index[r.prompt_index].arrays["tokens"]) for r in results):
            return "does not cover the pinned run's prompts and steps"
        if any(routing_layout(r) != routing_layout(by_index[r.prompt_index]) for r in results):
            return "has another routing (MoE layers, experts per token) than the pinned run"
    return ""


FUNCTION_ERROR_CEILING_ULPS = 2.0 ** 14  # float32 epsilons at the logit scale: 144x SmolLM2's worst step (114)


def implausible_function_error(function: list[PromptResult], oracle: list[PromptResult]) -> str:
    """Why the function run (float32, eager, along the pinned tokens) cannot be a float32 run of the oracle's
    model ('' when it can). The function check's budget is a multiple of this run's error against the oracle, so
    a golden whose function run was replaced by noise (its digest resealed, a red-team pass) widened the budget
    until a changed model verified as drift in any other environment. A float32 run's step sits within a few
    hundred float32 epsilons of the float64 oracle at the logit scale (SmolLM2: 114 at worst); one past
    FUNCTION_ERROR_CEILING_ULPS is refused."""
    by_index = {r.prompt_index: r for r in oracle}
    for result in function:
        reference = by_index.get(result.prompt_index)
        if reference is None or "probe_values" not in reference.arrays:
            continue
        if result.arrays["probe_values"].shape != reference.arrays["probe_values"].shape:
            return f"has probe values of another shape than the oracle's for prompt {result.prompt_id!r}"
        scale = logit_scale(reference.arrays["probe_values"])
        worst = float(step_errors(result.arrays["probe_values"], reference.arrays["probe_values"]).max(initial=0.0))
        if scale > 0 and not worst <= FUNCTION_ERROR_CEILING_ULPS * EPSILON["float32"] * scale:
            return (f"sits {worst / (EPSILON['float32'] * scale):.3g} float32 epsilons (at the logit scale) from the "
                    f"golden's own oracle for prompt {result.prompt_id!r}, where a float32 run stays within "
                    f"{FUNCTION_ERROR_CEILING_ULPS:g}: it is no float32 run of that model")
    return ""


def role_problem(role: str, results: list[PromptResult], results_of: Callable[[str], list[PromptResult]],
                 routing_followed: bool) -> str:
    """Why a role's results cannot serve a verdict ('' when they can): what verify refuses a golden for, and what
    create refuses to write. `results_of(role)` gives another role's results (the pinned run's, the oracle's)."""
    problem = results_problem(role, results, results_of("pinned") if role != "pinned" else None)
    if not problem and role == "function" and (routing_followed or not any(
            has_routing(r.arrays) for r in results)):  # an older MoE golden's float32 router could flip
        problem = implausible_function_error(results, results_of("oracle"))
    return problem


def roles_verify_reads(meta: dict[str, Any]) -> tuple[str, ...]:
    """The roles besides the pinned run that a verification of a golden with this meta reads: all of an evalrun
    golden's; of a server golden's, the oracle (its other roles hold its server run, read by what compares
    against it: server_verify)."""
    return ("oracle",) if "server" in meta else ("oracle", *ENVELOPE_ROLES, "function")


def created_problem(created: CreatedRuns) -> str:
    """Why the runs just made cannot be a golden ('' when they can): a golden verify would refuse as damaged
    (NaN in what the checks measure: a model whose logits are not finite) must never be written over a good one.
    Only the roles verify reads are checked: a server golden's (server_golden) are its server run and the oracle;
    its other roles hold the server run too, which computes in the server's dtype, no float32 function run."""
    results_of = lambda role: created.runs[role].results  # noqa: E731
    read = ("pinned", *roles_verify_reads(created.meta))
    for role in read:
        problem = role_problem(role, results_of(role), results_of, created.meta.get("routing") == ROUTING_FOLLOWED)
        if problem:
            return f"its {role} run {problem}"
    return ""


def routing_layout(result: PromptResult) -> tuple[int, ...] | None:
    """(MoE layers, experts per token) of a result's routing, None when it has none."""
    experts = result.arrays.get("routing_experts")
    return None if experts is None else tuple(experts.shape[1:])


def recreate_hint(name: str) -> str:
    return f"restore it from git or re-create it with `evalrun golden create {name} --force`"


def open_golden(name: str, directory: str | Path = DEFAULT_DIR) -> Golden:
    """Open and validate a golden; GoldenError (exit 2) names the file and the fix on any problem."""
    path = golden_path(name, directory)
    if not path.exists():
        raise GoldenError(f"golden {path} does not exist; create it with `evalrun golden create {name}` "
                          "and commit it")
    if not path.is_file():
        raise GoldenError(f"golden {path} is not a regular file; remove it and re-create the golden")
    fix = recreate_hint(name)
    if path.stat().st_size > MAX_GOLDEN_BYTES:
        raise GoldenError(f"golden {path} is {path.stat().st_size:,} bytes, past the {MAX_GOLDEN_BYTES:,} a golden "
                          f"may hold; {fix}")
    try:
        store = Store(path, immutable=True)  # read-only, no locks, nothing written beside the file
        store.max_array_bytes, store.max_run_bytes = MAX_DECODED_ARRAY_BYTES, MAX_DECODED_RUN_BYTES
        integrity = store.db.execute("PRAGMA integrity_check").fetchone()[0]
        if integrity != "ok":
            raise GoldenError(f"golden {path} is damaged ({integrity}); {fix}")
        _check_cell_sizes(store.db.conn, path, fix)
        rows = dict(store.db.execute("SELECT key, value FROM golden").fetchall())
        stored = rows.pop("content_digest", None)
        if stored != content_digest(store.db.conn):
            raise GoldenError(f"golden {path} was edited or damaged (content digest mismatch); {fix}")
        meta = {key: json.loads(value, object_pairs_hook=object_without_repeated_keys) for key, value in rows.items()}
    except RepeatedKey as key:
        raise GoldenError(f"golden {path} is damaged (its golden table names the key {str(key)!r} twice in one "
                          f"object); {fix}") from None
    except ForeignFileError:  # not "re-create it with --force", which would write over another program's file
        raise GoldenError(f"{path} is a SQLite file of another program, not a golden; pass another name or --dir "
                          "(leave that file as it is)") from None
    except RecursionError:
        raise GoldenError(f"golden {path} holds JSON nested too deeply; {fix}") from None
    except (sqlite3.Error, StoreError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise GoldenError(f"golden {path} is damaged or not a golden ({str(error).splitlines()[0]}); {fix}") from None
    _check_meta(name, path, meta)
    golden = Golden(name, path, store, meta)
    _check_pinned_record(golden)
    return golden


def _check_pinned_record(golden: Golden) -> None:
    """The pinned run's provenance, as later steps read it: objects and strings where they expect them."""
    record = golden.pinned
    model, prompt_set = record.json.get("model"), record.json.get("prompt_set")
    fine = (isinstance(model, dict) and all(isinstance(model.get(k), str) for k in ("ref", "weights", "config", "tokenizer"))
            and isinstance(prompt_set, dict) and isinstance(prompt_set.get("name"), str)
            and isinstance(record.json.get("environment"), dict))
    if not fine:
        raise GoldenError(f"golden {golden.path}: the pinned run's model, prompt set or environment record is damaged; "
                          f"{recreate_hint(golden.name)}")
    for role in REQUIRED_ROLES:
        golden.config(role)


def _check_cell_sizes(conn: sqlite3.Connection, path: Path, fix: str) -> None:
    """Refuse a grown value before any is read (SQLite knows each value's length from its header)."""
    cells = [("arrays", "data", MAX_BLOB_BYTES), ("results", "record_json", MAX_TEXT_BYTES),
             ("results", "output_text", MAX_TEXT_BYTES), ("golden", "value", MAX_TEXT_BYTES)]
    cells += [("runs", f"{name}_json", MAX_TEXT_BYTES) for name in RUN_JSON_COLUMNS]
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table, column, limit in cells:
        if table not in tables:
            continue
        largest = conn.execute(f"SELECT max(length({column})) FROM {table}").fetchone()[0] or 0
        if largest > limit:
            raise GoldenError(f"golden {path} holds a {largest:,}-byte value in {table}.{column}, past the "
                              f"{limit:,} a golden may; {fix}")


def _check_meta(name: str, path: Path, meta: dict[str, Any]) -> None:
    """The golden table's values, validated: format version, roles that name stored runs."""
    version = meta.get("format", 1)
    if version != GOLDEN_FORMAT:
        raise GoldenError(f"golden {path} has format {version!r}; this evalrun reads format {GOLDEN_FORMAT!r}; "
                          f"re-create it with `evalrun golden create {name} --force`")
    roles = meta.get("roles")
    if not isinstance(roles, dict) or any(not isinstance(roles.get(role), str) for role in REQUIRED_ROLES):
        raise GoldenError(f"golden {path} lacks the runs {', '.join(REQUIRED_ROLES)}; {recreate_hint(name)}")
    if not isinstance(meta.get("requested_config"), dict) or not isinstance(meta.get("created_at"), str):
        raise GoldenError(f"golden {path} lacks its requested config; {recreate_hint(name)}")
    if meta.get("routing", ROUTING_FOLLOWED) != ROUTING_FOLLOWED:
        raise GoldenError(f"golden {path} says its runs followed the routing {meta['routing']!r}; this evalrun knows "
                          f"only {ROUTING_FOLLOWED!r}; {recreate_hint(name)}")


def list_goldens(directory: str | Path = DEFAULT_DIR) -> list[dict[str, Any]]:
    """Every `*.db` in the folder: its summary, or the one-line problem that keeps it from opening."""
    entries = []
    folder = Path(directory)
    if not folder.exists():  # a typo in --dir listed nothing and exited 0
        raise GoldenError(f"golden folder {folder} does not exist; pass --dir with the folder of goldens, or create "
                          "one with `evalrun golden create NAME`")
    if not folder.is_dir():
        raise GoldenError(f"{folder} is not a folder; pass --dir with the folder of goldens")
    for path in sorted(folder.glob("*.db")):
        try:
            entries.append(open_golden(path.stem, directory).summary())
        except GoldenError as error:
            entries.append({"name": path.stem, "path": str(path), "error": str(error)})
        except StoreError as error:
            entries.append({"name": path.stem, "path": str(path), "error": str(error)})
    return entries


# ---------------------------------------------------------------- create

@dataclass
class CreatedRuns:
    """The runs of a new golden, by role (roles with one config share a run)."""

    runs: dict[str, Run]
    seconds: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)  # more keys for the golden table (a server golden's)


def _forced_probed(prepared: Prepared, tokens: dict[int, np.ndarray], probes: Probes, progress, role: str,
                   routing: dict[int, RoutingPath] | None) -> Run:
    """A golden's run along the pinned run's tokens (and routing), probed. It keeps no prompt routing: it followed
    the pinned run's, which is all verify reads, and prompt routing grows with the prompt's length (768 bytes a
    token at Qwen3-30B-A3B's 48 layers and top-8), so a golden stores it once."""
    run = execute(prepared, forced=tokens, probes=probes, progress=_tick(progress, role, prepared), timed=False,
                  routing=routing)
    results = [dataclasses.replace(r, arrays={k: v for k, v in r.arrays.items() if k != PROMPT_ARRAY})
               for r in run.results]
    return dataclasses.replace(run, results=results)


def pinned_routing(pinned: Run) -> dict[int, RoutingPath] | None:
    """The pinned run's experts per prompt index (at each step and prompt token) that the golden's other runs
    follow (None: a dense model, or one whose engine records no routing)."""
    if not all(has_routing(r.arrays) for r in pinned.results):
        return None
    return {r.prompt_index: routing_path(r.arrays) for r in pinned.results}


def make_runs(config: RunConfig, progress=None, hook: Hook | None = None) -> CreatedRuns:
    """Run pinned, oracle, the envelope members and the function run (each distinct config once)."""
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    pinned = prepare(config)
    if hook:
        hook(pinned)
    runs = {"pinned": execute(pinned, progress=_tick(progress, "pinned", pinned))}
    seconds["pinned_s"] = time.perf_counter() - started
    tokens = {r.prompt_index: r.arrays["tokens"] for r in runs["pinned"].results}
    routing = pinned_routing(runs["pinned"])
    started = time.perf_counter()
    oracle = _prepared(oracle_config(pinned.config, pinned.header["model"]["parameters"]), pinned, hook)
    vocab = pinned.loaded.vocab_size
    own = min(PROBE_TOPK, vocab)
    sample = sample_ids(vocab, PROBE_SAMPLE)
    blank = {i: np.concatenate([np.zeros((len(t), own), np.int64), np.tile(sample, (len(t), 1))], axis=1)
             for i, t in tokens.items()}
    runs["oracle"] = _forced_probed(oracle, tokens, Probes(blank, own_topk=own), progress, "oracle", routing)
    del oracle  # float64 weights: free them before the envelope's models load (8B: 64 GB)
    seconds["oracle_s"] = time.perf_counter() - started
    probes = Probes({r.prompt_index: r.arrays["probe_ids"] for r in runs["oracle"].results})
    members = {"envelope:pinned": pinned.config, "envelope:reference": reference_config(pinned.config),
               "function": function_config(pinned.config)}
    done: dict[str, Run] = {}
    started = time.perf_counter()
    for role, member in members.items():
        key = member.compute_hash()
        if key not in done:
            prepared = pinned if key == pinned.config.compute_hash() else _prepared(member, pinned, hook)
            done[key] = _forced_probed(prepared, tokens, probes, progress, role, routing)
        runs[role] = done[key]
    seconds["envelope_s"] = time.perf_counter() - started
    return CreatedRuns(runs, seconds, {"routing": ROUTING_FOLLOWED} if routing is not None else {})


def _prepared(config: EffectiveConfig, like: Prepared, hook: Hook | None) -> Prepared:
    prepared = prepare(config, reuse=like)
    if hook:
        hook(prepared)
    return prepared


def check_writable_folder(directory: str | Path) -> None:
    """Fail before any model runs when the golden folder cannot take a new file."""
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{folder} is not a folder; pass --dir with a folder for goldens")
    blocked = unwritable_folder(folder)
    if blocked is not None:
        raise OutputError(f"cannot write goldens into {folder}: {blocked} is not writable; pass --dir with a writable folder")


def create_golden(name: str, config: RunConfig, directory: str | Path = DEFAULT_DIR, force: bool = False,
                  progress: Callable[[str, int], Any] | None = None, hook: Hook | None = None,
                  cuda_available: bool | None = None, make: Callable[..., CreatedRuns] | None = None) -> Golden | None:
    """Make every run of a golden and write `directory/NAME.db` atomically; returns the opened golden
    (None on torchrun ranks other than 0, which compute their share and write nothing).
    `make(request, progress, hook)` makes the runs (default `make_runs`; a server's: server_golden)."""
    import torch

    if distributed.world().distributed and config.tensor_parallel == 1:
        raise ConfigError("golden create is not split across torchrun ranks; run it in one process, or with "
                          "--tensor-parallel N under torchrun")
    path = golden_path(name, directory)
    if os.path.lexists(path) and not force:  # a link to nothing too: it was found only after every run
        what = "" if path.exists() else f" (a link to {os.readlink(path)}, which does not exist)"
        raise GoldenError(f"golden {path} exists{what}; pass --force to overwrite it")
    check_writable_folder(directory)
    request = pinned_request(config, torch.cuda.is_available() if cuda_available is None else cuda_available)
    created = (make or make_runs)(request, progress, hook)
    if not distributed.world().leader:  # tensor parallel under torchrun: every rank computed, rank 0 writes
        return None
    problem = created_problem(created)
    if problem:
        fix = ("check that the model's logits are finite under this config (--dtype float32, another model)"
               if "NaN" in problem else "check the model and the config, and report it if they are sound")
        raise GoldenError(f"golden {path} not written: {problem}, which no verify could use; {fix}")
    write_golden(path, created, request, replace=force)
    return open_golden(name, directory)


def write_golden(path: Path, created: CreatedRuns, request: RunConfig, replace: bool = True) -> None:
    """Write the runs and the golden table to a staging file, compact it, and move it into place: over what is
    there when `replace`, else only where nothing is (a link, atomic: of two creates of one name at once, the
    second is refused, not written over the first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    os.unlink(staging)
    try:
        store = Store(staging)
        stored: dict[int, str] = {}
        roles = {}
        for role, run in created.runs.items():
            if id(run) not in stored:
                stored[id(run)] = record(store, run.header, lambda: run, label=f"golden:{role}").run_id
            roles[role] = stored[id(run)]
        meta = {"format": GOLDEN_FORMAT, "name": path.stem, "created_at": store.get_run(roles["pinned"]).created_at,
                "roles": roles, "requested_config": dataclasses.asdict(request), "evalrun_version": __version__,
                "create_seconds": created.seconds,
                "probes": {"own_topk": PROBE_TOPK, "sample": PROBE_SAMPLE, "seed": PROBE_SEED}, **created.meta}
        with store.transaction() as conn:
            conn.execute("CREATE TABLE golden (key TEXT PRIMARY KEY, value TEXT)")
            conn.executemany("INSERT INTO golden VALUES (?, ?)", [(k, json.dumps(v, sort_keys=True)) for k, v in meta.items()])
        with store.transaction() as conn:
            conn.execute("INSERT INTO golden VALUES (?, ?)", ["content_digest", content_digest(conn)])
        store.compact()
        if replace:
            os.replace(staging, path)
        elif not _linked_into_place(staging, path):
            raise GoldenError(f"golden {path} was created meanwhile (by another golden create); pass --force "
                              "to overwrite it")
    finally:
        for leftover in (staging, staging + "-wal", staging + "-shm"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _linked_into_place(staging: str, path: Path) -> bool:
    """Put `staging` at `path` only where nothing is (a hard link, atomic); False when something is."""
    try:
        os.link(staging, path)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: checked again, then moved
        if path.exists():
            return False
        os.replace(staging, path)
    return True


def _tick(progress, role: str, prepared: Prepared):
    if progress is None:
        return None
    return progress(role, len(prepared.prompt_set.records))
