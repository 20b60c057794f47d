"""Goldens: one self-contained SQLite file per golden, and the verdict of a candidate against it.

A golden file is a store (same schema as `store/evalrun.db`) holding three runs,
  pinned     the config the golden was created with
  reference  the reference config: O0, eager, deterministic, same dtype (the pinned run when equal)
  oracle     the same prompts forced along the pinned tokens in float64 (float32 when float64 would
             not fit), probed on the pinned run's top-k ids
plus a `golden` table (name, roles, requested config, oracle dtype) and a digest of its own
content, so an edited or damaged file is refused.

Verify: identity gates (model -> changed; prompts -> incomparable) -> candidate run -> identical if
every digest matches -> else forced decoding along the golden's tokens, error against the oracle
within the drift budget (`compare.drift_check`) -> and, in the golden's environment, a re-run of
the reference config that must reproduce the golden's reference bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import __version__
from .compare import (DRIFT_MULTIPLIER, dict_diff, digest_mismatch_steps, drift_check, first_divergence,
                      rms_error, worst_verdict)
from .config import RunConfig, build_config
from .errors import GoldenError, StoreError
from .hashing import hash_bytes, hash_value
from .runner import Forcing, Prepared, generate_all, prepare, run_digests
from .store import PromptResult, Store

DEFAULT_DIR = Path("golden")
ORACLE_FP64_MAX_PARAMETERS = 2_000_000_000  # 16 GB of fp64 weights; above it the oracle runs in fp32
# Differences that do not make two environments different for the reference re-run.
ENVIRONMENT_IGNORE = ("backend_flags.num_threads",)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def golden_path(name: str, directory: str | Path = DEFAULT_DIR) -> Path:
    if not NAME_PATTERN.fullmatch(name):
        raise GoldenError(f"golden name {name!r} is not valid; use letters, digits, '.', '_' and '-'")
    return Path(directory) / f"{name}.db"


def reference_config(config: RunConfig) -> RunConfig:
    """The reference config: O0, eager, no CUDA graphs, deterministic, no TF32; all else unchanged."""
    return dataclasses.replace(config, opt_level=0, compilation_mode="none", cudagraph_mode="none",
                               deterministic=True, tf32=False, max_autotune=None, coordinate_descent_tuning=None)


def oracle_dtype(parameters: int) -> str:
    return "float64" if parameters <= ORACLE_FP64_MAX_PARAMETERS else "float32"


# ---------------------------------------------------------------- content digest

def content_digest(conn: sqlite3.Connection) -> str:
    """Digest of every row of every table in a canonical order, the stored digest itself excluded."""
    chunks: list[bytes] = []
    tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                             "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    for table in tables:  # names come from an untrusted file: always quoted as identifiers
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({_quoted(table)})")]
        chunks.append(f"{table}:{','.join(columns)}".encode())
        order = ", ".join(_quoted(column) for column in columns)
        for row in conn.execute(f"SELECT * FROM {_quoted(table)} ORDER BY {order}"):
            if table == "golden" and row[0] == "content_digest":
                continue
            chunks.append(b"".join(_cell_bytes(value) for value in row))
    return hash_bytes(*chunks)


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

    def run_id(self, role: str) -> str:
        return self.meta["roles"][role]

    def results(self, role: str) -> list[PromptResult]:
        return self.store.load_results(self.run_id(role))

    @property
    def pinned(self):
        return self.store.get_run(self.run_id("pinned"))

    def summary(self) -> dict[str, Any]:
        pinned = self.pinned
        return {"name": self.name, "path": str(self.path), "created_at": self.meta["created_at"],
                "model": pinned.json["model"]["ref"], "prompts": pinned.json["prompt_set"]["name"],
                "device": pinned.config["device"], "dtype": pinned.config["dtype"],
                "opt_level": pinned.config["opt_level"], "oracle_dtype": self.meta["oracle_dtype"],
                "bytes": self.path.stat().st_size, "evalrun": self.meta["evalrun_version"]}


def open_golden(name: str, directory: str | Path = DEFAULT_DIR) -> Golden:
    """Open and validate a golden; GoldenError (exit 2) names the file and the fix on any problem."""
    path = golden_path(name, directory)
    if not path.exists():
        raise GoldenError(f"golden {path} does not exist; create it with `evalrun golden create {name}` "
                          "and commit it")
    fix = f"restore it from git or recreate it with `evalrun golden create {name} --force`"
    try:
        store = Store(path, readonly=True)
        integrity = store.db.execute("PRAGMA integrity_check").fetchone()[0]
        if integrity != "ok":
            raise GoldenError(f"golden {path} is damaged ({integrity}); {fix}")
        rows = dict(store.db.execute("SELECT key, value FROM golden").fetchall())
        stored = rows.pop("content_digest", None)
        if stored != content_digest(store.db.conn):
            raise GoldenError(f"golden {path} was edited or damaged (content digest mismatch); {fix}")
        meta = {key: json.loads(value) for key, value in rows.items()}
    except (sqlite3.Error, StoreError, json.JSONDecodeError, KeyError) as error:
        raise GoldenError(f"golden {path} is damaged or not a golden ({str(error).splitlines()[0]}); {fix}") from None
    return Golden(name, path, store, meta)


def list_goldens(directory: str | Path = DEFAULT_DIR) -> list[dict[str, Any]]:
    entries = []
    for path in sorted(Path(directory).glob("*.db")):
        try:
            entries.append(open_golden(path.stem, directory).summary())
        except GoldenError as error:
            entries.append({"name": path.stem, "path": str(path), "error": str(error)})
    return entries


# ---------------------------------------------------------------- create

def _store_run(store: Store, prepared: Prepared, results: list[PromptResult], timings: dict, evidence: dict,
               plan: list, label: str) -> str:
    run_id = store.begin_run(prepared.header, label)
    tokens_digest, logits_digest = run_digests(results)
    store.finish_run(run_id, results, {"timings": timings, "evidence": evidence, "batches": plan},
                     tokens_digest, logits_digest)
    return run_id


def create_golden(name: str, config: RunConfig, directory: str | Path = DEFAULT_DIR, force: bool = False,
                  progress: Callable[[str, int], Any] | None = None) -> Golden:
    """Run pinned, reference and oracle; write them into `directory/NAME.db` atomically."""
    path = golden_path(name, directory)
    if path.exists() and not force:
        raise GoldenError(f"golden {path} exists; pass --force to overwrite it")
    pinned = prepare(config)
    runs = {"pinned": (pinned, *generate_all(pinned, _tick(progress, "pinned", pinned)))}
    reference = prepare(reference_config(config), reuse=pinned)
    if reference.header["config_hash"] != pinned.header["config_hash"]:
        runs["reference"] = (reference, *generate_all(reference, _tick(progress, "reference", reference)))
    pinned_results = runs["pinned"][1]
    o_dtype = oracle_dtype(pinned.header["model"]["parameters"])
    oracle = prepare(reference_config(config), dtype_override=o_dtype, reuse=pinned)
    forcing = Forcing({r.prompt_index: r.arrays["tokens"] for r in pinned_results},
                      {r.prompt_index: r.arrays["topk_ids"] for r in pinned_results})
    runs["oracle"] = (oracle, *generate_all(oracle, _tick(progress, "oracle", oracle), forcing))

    Path(directory).mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(handle)
    os.unlink(staging)
    try:
        store = Store(staging)
        roles = {role: _store_run(store, *run, label=f"golden:{role}") for role, run in runs.items()}
        roles.setdefault("reference", roles["pinned"])
        meta = {"name": name, "created_at": store.get_run(roles["pinned"]).created_at, "roles": roles,
                "requested_config": dataclasses.asdict(config), "oracle_dtype": o_dtype,
                "evalrun_version": __version__}
        with store.transaction() as conn:
            conn.execute("CREATE TABLE golden (key TEXT PRIMARY KEY, value TEXT)")
            conn.executemany("INSERT INTO golden VALUES (?, ?)", [(k, json.dumps(v, sort_keys=True)) for k, v in meta.items()])
        with store.transaction() as conn:
            conn.execute("INSERT INTO golden VALUES (?, ?)", ["content_digest", content_digest(conn)])
        store.compact()
        os.replace(staging, path)
    finally:
        for leftover in (staging, staging + "-wal", staging + "-shm"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return open_golden(name, directory)


def _tick(progress, role: str, prepared: Prepared):
    if progress is None:
        return None
    return progress(role, len(prepared.prompt_set.records))


# ---------------------------------------------------------------- verify

@dataclass
class Flip:
    step: int
    golden_token: str
    candidate_token: str
    golden_margin: float
    oracle_margin: float


@dataclass
class PromptVerdict:
    prompt_id: str
    verdict: str
    first_divergent_step: int  # tokens of the free candidate run vs golden; -1 when equal
    digest_mismatches: int  # steps whose logits digest differs
    flips: list[Flip] = field(default_factory=list)  # forced decoding: steps where the candidate's choice differs
    worst_ratio: float = 0.0  # max over steps of candidate error / golden error against the oracle
    worst_step: int = -1
    candidate_rms: float = 0.0
    golden_rms: float = 0.0
    reason: str = ""


@dataclass
class Verdict:
    golden: str
    verdict: str
    exit_code: int
    causes: list[str]
    prompts: list[PromptVerdict]
    config_diff: list[tuple[str, Any, Any]]
    environment_diff: list[tuple[str, Any, Any]]
    model_diff: list[str]
    reference_rerun: str  # "reproduced", "not reproduced", "skipped: ..."
    candidate_config: dict[str, Any]
    timings: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config_diff"] = [{"key": k, "golden": a, "candidate": b} for k, a, b in self.config_diff]
        data["environment_diff"] = [{"key": k, "golden": a, "candidate": b} for k, a, b in self.environment_diff]
        return data


def exit_code_for(verdict: str, strict: bool) -> int:
    return {"identical": 0, "drift": 1 if strict else 0, "changed": 1, "incomparable": 2}[verdict]


def candidate_config(golden: Golden, config_source: str | None, flags: dict[str, Any], sets: tuple[str, ...]) -> RunConfig:
    """The golden's requested config with the user's explicit options on top."""
    requested = dict(golden.meta["requested_config"])
    return build_config(config_source, flags, sets, base=requested)


def _incomparable(golden: Golden, cause: str, candidate: dict[str, Any]) -> Verdict:
    return Verdict(golden.name, "incomparable", 2, [cause], [], [], [], [], "skipped: incomparable", candidate, {})


def _decode(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([int(token)])


def _flips(tokenizer, golden_r: PromptResult, forced_r: PromptResult, oracle_r: PromptResult) -> list[Flip]:
    golden_tokens, chosen = golden_r.arrays["tokens"], forced_r.arrays["tokens"]
    steps = np.flatnonzero(golden_tokens[: len(chosen)] != chosen[: len(golden_tokens)])
    return [Flip(int(s), _decode(tokenizer, golden_tokens[s]), _decode(tokenizer, chosen[s]),
                 float(golden_r.arrays["margins"][s]), float(oracle_r.arrays["margins"][s])) for s in steps]


def _identity_gate(golden: Golden, golden_results: list[PromptResult], candidate: Prepared, config_diff: list,
                   env_diff: list, causes: list[str]) -> Verdict | None:
    """Model identity differs -> changed (naming the parts); prompt records differ -> incomparable."""
    pinned, effective = golden.pinned, candidate.effective
    model_diff = [part for part in ("weights", "config", "tokenizer")
                  if candidate.header["model"][part] != pinned.json["model"][part]]
    if model_diff:
        return Verdict(golden.name, "changed", 1, [f"model identity: {part} differ" for part in model_diff] + causes,
                       [], config_diff, env_diff, model_diff, "skipped: model changed", effective, {})
    golden_records = [r.record for r in golden_results]
    if hash_value(golden_records) != hash_value([r.as_dict() for r in candidate.prompt_set.records]):
        return _incomparable(golden, f"prompt set differs from the golden's ({pinned.json['prompt_set']['name']}): "
                             "verify with the golden's prompts or create a new golden", effective)
    return None


def _free_run_verdicts(golden_results: list[PromptResult], results: list[PromptResult]) -> list[PromptVerdict]:
    """Per prompt: identical when every digest and token matches, else provisionally drift."""
    verdicts = []
    for g, c in zip(golden_results, results):
        mismatches = digest_mismatch_steps(g.arrays["digests"], c.arrays["digests"])
        same = mismatches.size == 0 and np.array_equal(g.arrays["tokens"], c.arrays["tokens"])
        verdicts.append(PromptVerdict(g.prompt_id, "identical" if same else "drift",
                                      first_divergence(g.arrays["tokens"], c.arrays["tokens"]), int(mismatches.size)))
    return verdicts


def verify_golden(golden: Golden, config: RunConfig, strict: bool = False,
                  progress: Callable[[str, int], Any] | None = None) -> Verdict:
    """The verdict of `config` against `golden` (see the module docstring for the steps)."""
    started = time.perf_counter()
    candidate = prepare(config)
    effective, pinned = candidate.effective, golden.pinned
    config_diff = dict_diff(pinned.config, effective)
    env_diff = dict_diff(pinned.json["environment"], candidate.header["environment"], ENVIRONMENT_IGNORE)
    causes = [f"config: {k} {a} -> {b}" for k, a, b in config_diff]
    causes += [f"environment: {k} {a} -> {b}" for k, a, b in env_diff]
    golden_results = golden.results("pinned")
    gated = _identity_gate(golden, golden_results, candidate, config_diff, env_diff, causes)
    if gated is not None:
        return gated
    results, run_timings, _, _ = generate_all(candidate, _tick(progress, "candidate", candidate))
    timings = {"candidate_s": run_timings["generate_s"]}
    verdicts = _free_run_verdicts(golden_results, results)
    if all(v.verdict == "identical" for v in verdicts):
        timings["total_s"] = time.perf_counter() - started
        return Verdict(golden.name, "identical", 0, causes or ["every token and logits digest equal"], verdicts,
                       config_diff, env_diff, [], "skipped: identical", effective, timings)
    if not config_diff and not env_diff:
        causes.append("nondeterminism: same config and environment, different bits")
    started_forced = time.perf_counter()
    forced = generate_all(candidate, _tick(progress, "forced", candidate),
                          Forcing({r.prompt_index: r.arrays["tokens"] for r in golden_results},
                                  {r.prompt_index: r.arrays["topk_ids"] for r in golden_results}))[0]
    timings["forced_s"] = time.perf_counter() - started_forced
    _judge_drift(golden, candidate, golden_results, forced, verdicts)
    rerun = _reference_rerun(golden, candidate, env_diff, progress, timings)
    if rerun == "not reproduced":
        causes.append("reference config no longer reproduces the golden's reference in the same environment: "
                      "the model or its code changed")
    overall = worst_verdict([v.verdict for v in verdicts] + (["changed"] if rerun == "not reproduced" else []))
    if overall == "changed" and rerun != "not reproduced":
        causes.append("error against the oracle left the drift budget")
    timings["total_s"] = time.perf_counter() - started
    return Verdict(golden.name, overall, exit_code_for(overall, strict), causes, verdicts, config_diff, env_diff, [],
                   rerun, effective, timings)


def _judge_drift(golden: Golden, candidate: Prepared, golden_results: list[PromptResult],
                 forced: list[PromptResult], verdicts: list[PromptVerdict]) -> None:
    """Fill each non-identical prompt's verdict from forced decoding against the oracle."""
    oracle_results = golden.results("oracle")
    dtype = golden.pinned.config["dtype"]
    golden_errors = np.concatenate([rms_error(g.arrays["topk_values"], o.arrays["probe_values"])
                                    for g, o in zip(golden_results, oracle_results)])
    noise = float(np.median(golden_errors))
    tokenizer = candidate.loaded.tokenizer
    for verdict, g, f, o in zip(verdicts, golden_results, forced, oracle_results):
        if verdict.verdict == "identical":
            continue
        check = drift_check(f.arrays["probe_values"], g.arrays["topk_values"], o.arrays["probe_values"], dtype, noise)
        verdict.flips = _flips(tokenizer, g, f, o)
        verdict.worst_ratio, verdict.worst_step = check.worst_ratio, check.worst_step
        verdict.candidate_rms = float(np.sqrt(np.mean(check.candidate_error ** 2)))
        verdict.golden_rms = float(np.sqrt(np.mean(check.reference_error ** 2)))
        failure = check.fails()
        verdict.verdict = "drift" if failure is None else "changed"
        verdict.reason = failure or f"within {DRIFT_MULTIPLIER[dtype]:g}x the golden's error against the oracle"


def _reference_rerun(golden: Golden, candidate: Prepared, env_diff: list, progress,
                     timings: dict[str, float]) -> str:
    """Re-run the golden's reference config when the environment is the golden's; compare bit for bit."""
    if env_diff:
        return "skipped: environment differs from the golden's"
    started = time.perf_counter()
    requested = build_config(base=golden.meta["requested_config"])
    reference = prepare(reference_config(requested), reuse=candidate)
    results = generate_all(reference, _tick(progress, "reference", reference))[0]
    timings["reference_s"] = time.perf_counter() - started
    expected = golden.results("reference")
    same = all(np.array_equal(a.arrays["digests"], b.arrays["digests"]) for a, b in zip(expected, results))
    return "reproduced" if same else "not reproduced"
