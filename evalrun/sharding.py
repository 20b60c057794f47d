"""Work split across ranks or jobs: which prompts a shard runs, and how shard results travel and join.

A shard runs whole batches of the run's plan (`distributed.shard_batches`), so every prompt keeps the
batch companions, padding and bits it has in the unsharded run. Two launches:
  torchrun, tensor_parallel 1  rank r of W is shard r/W; every rank sends its results to rank 0 as a
                               SQLite store file (bytes on a gloo group), rank 0 stores one run
                               holding every prompt: the run an unsharded process would have stored
  --shard I/N                  one job of N (CI matrix, Slurm array): it stores a run of its prompts,
                               marked with its shard; `evalrun store merge` joins the jobs' stores
Under tensor parallelism every rank computes every prompt (the ranks split the model instead) and
rank 0 alone writes.
"""

from __future__ import annotations

import copy
import json
import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import distributed, runner
from .distributed import Shard
from .compare import dict_diff
from .config import NUMERICS_FACTORS, WORKLOAD_FACTORS
from .errors import ConfigError, StoreError
from .golden import Golden
from .hashing import hash_value
from .runner import Prepared, Run, NullBar, plan_batches, record
from .store import PromptResult, Store, result_problem
from .verify import Verdict, VerifyRuns, _envelope_roles, _function_config, begin, compute_runs, judge_runs


def active_shard(tensor_parallel: int, requested: Shard | None) -> Shard:
    """The shard this process runs: its rank under a data-parallel torchrun world, else --shard, else all."""
    here = distributed.world()
    distributed.check_world(tensor_parallel, requested)
    if here.distributed and tensor_parallel == 1:
        return Shard(here.rank, here.size)
    return requested or Shard()


def shard_prompts(prepared: Prepared, shard: Shard) -> set[int] | None:
    """Prompt indices of the batches `shard` runs (None: all of them)."""
    if shard.whole:
        return None
    plan = plan_batches(prepared.prompt_set, prepared.config)
    return {index for number in distributed.shard_batches(len(plan), shard) for index in plan[number]}


def shard_header(header: dict[str, Any], shard: Shard, prompts: set[int] | None) -> dict[str, Any]:
    """A run header naming the part of the prompt set the run holds (not hashed: the prompt set's hash
    stays the whole set's, so a shard's results compare with any run of that set)."""
    if shard.whole or prompts is None:
        return header
    marked = copy.deepcopy(header)
    marked["prompt_set"]["shard"] = {**shard.as_dict(), "prompts": len(prompts)}
    return marked


# ---------------------------------------------------------------- results as bytes between ranks

def runs_to_bytes(runs: list[tuple[str, dict[str, Any], Run]]) -> bytes:
    """(label, header, run) triples as the bytes of a SQLite store file (validated again where read)."""
    with tempfile.TemporaryDirectory(prefix="evalrun-shard-") as folder:
        path = Path(folder) / "shard.db"
        store = Store(path)
        for label, header, run in runs:
            run_id = store.begin_run(header, label)
            store.finish_run(run_id, run.results, {"timings": run.timings, "evidence": run.evidence,
                                                   "batches": run.plan}, run.tokens_digest, run.logits_digest)
        store.compact()
        return path.read_bytes()


HASHED_FACTORS = frozenset(NUMERICS_FACTORS + WORKLOAD_FACTORS)
IDENTITY_HASHES = (("config_hash", "config_hash"), ("environment_hash", "environment_hash"),
                   ("model_hash", "model"), ("prompts_hash", "prompt_set"))  # the row's column, the header's key


def _header_hash(header: dict[str, Any], key: str) -> str:
    return header[key] if key.endswith("_hash") else header[key]["hash"]


def _differing_hashes(stored, header: dict[str, Any]) -> list[str]:
    """The row's identity hash columns (IDENTITY_HASHES, in order) whose value is not the run header's."""
    return [column for column, key in IDENTITY_HASHES if getattr(stored, column) != _header_hash(header, key)]


def _check_rank(stored, header: dict[str, Any], rank: int) -> None:
    """A rank's results join rank 0's only when it ran rank 0's config, environment, model and prompt set: else
    the one run stored would hold another model's (or machine's) results under rank 0's identity."""
    differing = _differing_hashes(stored, header)
    if not differing:
        return
    column = differing[0]
    key = dict(IDENTITY_HASHES)[column]
    what = column.removesuffix("_hash").replace("prompts", "prompt set")
    shown = _first_difference(stored, header, key.removesuffix("_hash"), rank) or \
        f"{str(getattr(stored, column))[:12]} against {str(_header_hash(header, key))[:12]}"
    raise ConfigError(f"torchrun rank {rank} ran another {what} than rank 0 ({shown}): its results cannot join "
                      "rank 0's; give every rank the same model files, prompts, options, software and machine "
                      "settings")


def _first_difference(stored, header: dict[str, Any], part: str, rank: int) -> str | None:
    """The first key of a rank's config or environment record that is not rank 0's, for the one line."""
    if part not in ("config", "environment"):
        return None
    ours, theirs = header.get(part) or {}, stored.json.get(part) or {}
    if part == "config":  # the hashed factors only (warmup, keep_logits, ... are recorded, not hashed)
        ours, theirs = ({k: v for k, v in side.items() if k in HASHED_FACTORS} for side in (ours, theirs))
    diff = dict_diff(ours, theirs)
    if not diff:
        return None
    name, at_rank0, at_rank = diff[0]
    more = f", and {len(diff) - 1} more" if len(diff) > 1 else ""
    return f"{part} {name}: rank 0 {str(at_rank0)[:60]}, rank {rank} {str(at_rank)[:60]}{more}"


def runs_from_bytes(data: bytes, header: dict[str, Any] | None = None, rank: int = 0) -> dict[str, Run]:
    """label -> Run, from `runs_to_bytes` output (another rank's: read as any store, validated; each run's hashes
    checked against `header`, rank 0's, when given)."""
    with tempfile.TemporaryDirectory(prefix="evalrun-shard-") as folder:
        path = Path(folder) / "shard.db"
        path.write_bytes(data)
        store = Store(path, readonly=True)
        runs = {}
        for stored in store.list_runs():
            if header is not None:
                _check_rank(stored, header, rank)
            runs[stored.label or ""] = Run({}, store.load_results(stored.id), stored.json.get("timings") or {},
                                           stored.json.get("evidence") or {}, stored.json.get("batches") or [])
        store.close()
        return runs


def join_results(parts: list[list[PromptResult]]) -> list[PromptResult]:
    """Every shard's results as one list in prompt order (a prompt in two shards is an invariant broken)."""
    by_index: dict[int, PromptResult] = {}
    for results in parts:
        for result in results:
            assert result.prompt_index not in by_index, f"prompt {result.prompt_id} ran in two shards"
            by_index[result.prompt_index] = result
    return [by_index[index] for index in sorted(by_index)]


def join_runs(header: dict[str, Any], runs: list[Run]) -> Run:
    """The ranks' runs as the one run of the whole prompt set: results and batches joined; timings are
    rank 0's with the ranks' own listed and throughput over the slowest rank's generation time."""
    first = runs[0]
    timings = dict(first.timings)
    generated = sum(run.timings.get("tokens_generated", 0) for run in runs)
    slowest = max(run.timings.get("generate_s", 0.0) for run in runs)
    timings.update(tokens_generated=generated, generate_s=slowest,
                   tokens_per_s=generated / slowest if slowest > 0 else 0.0, ranks=[run.timings for run in runs])
    evidence = dict(first.evidence, ranks=len(runs))
    plan = sorted((entry for run in runs for entry in run.plan), key=lambda entry: entry["batch"])
    return Run(header, join_results([run.results for run in runs]), timings, evidence, plan)


def empty_run(header: dict[str, Any]) -> Run:
    """The run of a shard with no batch (more shards than batches)."""
    return Run(header, [], {"tokens_generated": 0, "generate_s": 0.0, "tokens_per_s": 0.0}, {}, [])


def gather_runs(label: str, header: dict[str, Any], mine: Run) -> list[Run] | None:
    """Every rank's `mine` on rank 0, in rank order (None elsewhere)."""
    if not distributed.world().distributed:
        return [mine]
    gathered = distributed.gather_bytes(runs_to_bytes([(label, header, mine)]))
    return None if gathered is None else [runs_from_bytes(data, header, rank)[label]
                                          for rank, data in enumerate(gathered)]


# ---------------------------------------------------------------- evalrun run, sharded

def execute_sharded_run(config, store: Store | Callable[[], Store] | None, label: str | None = None,
                        progress_factory: Callable[[int], Any] | None = None, shard: Shard | None = None) -> Run:
    """`evalrun run` on this process's shard: under torchrun rank 0 stores the joined run (the others
    return theirs, unstored); with --shard the job stores its part, marked as such. `store` may be a function
    that opens it, called once the model, prompts and config are known to be good (runner.open_when_good)."""
    prepared = runner.prepare(config)  # through the module: tests replace its functions
    prepared.execution_mode()  # before anything is stored: an engine that refuses its config stores nothing
    store = runner.open_when_good(store)
    here, current = distributed.world(), active_shard(prepared.config.tensor_parallel, shard)
    only = shard_prompts(prepared, current)
    joined_by_ranks = here.distributed and prepared.config.tensor_parallel == 1
    header = prepared.header if joined_by_ranks else shard_header(prepared.header, current, only)

    def produce() -> Run:
        total = len(only) if only is not None else len(prepared.prompt_set.records)
        bar = progress_factory(total) if progress_factory and here.leader else None
        with (bar if bar is not None else NullBar()) as active:
            mine = runner.execute(prepared, progress=active.update, only=only) if only != set() else empty_run(header)
        if here.distributed and not joined_by_ranks:  # tensor parallel: each rank's peak memory on rank 0
            peaks = distributed.gather_bytes(json.dumps(mine.timings.get("peak_memory")).encode())
            if peaks is not None:
                mine.timings["ranks_peak_memory"] = [json.loads(peak) for peak in peaks]
        if not joined_by_ranks:
            return mine
        runs = gather_runs("shard", header, mine)
        return join_runs(header, runs) if runs is not None else mine

    return record(store if here.leader else None, header, produce, label)


# ---------------------------------------------------------------- evalrun golden verify, sharded

VERIFY_PHASES = ("free", "forced", "function", "envelope")


@dataclass
class ShardStored:
    """What a `--shard I/N` verify job did: its phase runs stored for the joining verify."""

    golden: str
    shard: str
    prompts: int
    store: str
    run_ids: dict[str, str]
    next_steps: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _phase_runs(runs: VerifyRuns) -> dict[str, dict[int, PromptResult]]:
    return {phase: getattr(runs, phase) for phase in VERIFY_PHASES if getattr(runs, phase) is not None}


def _as_run(header: dict[str, Any], results: dict[int, PromptResult]) -> Run:
    ordered = [results[index] for index in sorted(results)]
    return Run(header, ordered, {}, {}, [])


def _join_verify_runs(parts: list[dict[str, Run]]) -> VerifyRuns:
    """The shards' phase runs as one VerifyRuns over every prompt (a phase no shard ran stays None)."""
    joined: dict[str, dict[int, PromptResult] | None] = {}
    for phase in VERIFY_PHASES:
        found = [part[phase].results for part in parts if phase in part]
        joined[phase] = {r.prompt_index: r for r in join_results(found)} if found else None
    return VerifyRuns(joined["free"] or {}, joined["forced"] or {}, joined["function"], joined["envelope"])


# Which runs a verification makes, and how: shards stored under another scheme are not this verification's
# (2: against a golden whose runs followed its pinned routing, every run follows it, whatever its dtype; 3: the
# function check runs at the candidate's batch size, so whether a shard stores a function run changed).
SHARD_SCHEME = 3


def _shard_key(golden: Golden, header: dict[str, Any]) -> str:
    """Names one verification's shards: the golden (its pinned run), the candidate config and environment, and
    the scheme of runs (an older evalrun's shards are missing shards here, not mixed in)."""
    return hash_value([golden.run_id("pinned"), header["config_hash"], header["environment_hash"],
                       SHARD_SCHEME])[:16]


def verify_label(golden: Golden, header: dict[str, Any], phase: str) -> str:
    return f"verify:{golden.name}:{_shard_key(golden, header)}:{phase}"


def verify_sharded(golden: Golden, config, strict: bool = False, progress=None, shard: Shard | None = None,
                   store: Store | None = None, from_shards: bool = False,
                   observe=None) -> "Verdict | ShardStored | None":
    """`evalrun golden verify` split across shards. Under torchrun (tensor_parallel 1) each rank runs its
    batches and rank 0 judges every prompt (the others return None); with --shard I/N the job stores its
    phase runs; with `from_shards` the verdict is judged from the shards a store holds (after `store
    merge`), running no model. Ranks run the function check's configs when a prompt of any rank differs;
    a --shard job always runs them (it cannot know whether the other jobs' prompts stayed identical; when
    all did, the verdict ignores them)."""
    here = distributed.world()
    context = begin(golden, config, strict, progress, observe=observe)  # observe: whole verifies only (cli)
    if here.distributed:  # ranks whose gates disagree would wait for each other in unmatched collectives
        gated = isinstance(context, Verdict)
        if distributed.any_rank(gated) and distributed.any_rank(not gated):
            line = f"{context.verdict}: {(context.causes or ['-'])[0]}" if gated else ""
            lines = distributed.gather_bytes(line.encode())  # every rank's on rank 0, which prints the line
            named = "; ".join(f"rank {rank} {text.decode()[:160]}" for rank, text in enumerate(lines or []) if text)
            raise ConfigError(f"the torchrun ranks disagree whether golden {golden.name} gates this candidate "
                              f"({named or 'on another rank'}; the others not): they load another model, tokenizer "
                              "or prompt set; give every rank the same files")
    if isinstance(context, Verdict):  # a gate: the same verdict on every shard
        return context if here.leader else None
    current = active_shard(context.candidate.config.tensor_parallel, shard)
    if from_shards:
        return judge_runs(context, _stored_shards(golden, context, store))
    if current.whole:  # one process, or tensor-parallel ranks (each computes every prompt; rank 0 reports)
        verdict = judge_runs(context, compute_runs(context))
        return verdict if here.leader else None
    only = shard_prompts(context.candidate, current)
    # torchrun ranks agree whether any prompt anywhere differs; a --shard job cannot ask, so it always checks
    needed = (lambda identical: distributed.any_rank(not identical)) if here.distributed else (lambda _: True)
    runs = compute_runs(context, only, needed) if only else _no_prompts(needed)
    if here.distributed:
        mine = {phase: _as_run(context.candidate.header, results) for phase, results in _phase_runs(runs).items()}
        gathered = distributed.gather_bytes(runs_to_bytes([(phase, context.candidate.header, run)
                                                           for phase, run in mine.items()]))
        return None if gathered is None else judge_runs(context, _join_verify_runs([
            runs_from_bytes(data, context.candidate.header, rank) for rank, data in enumerate(gathered)]))
    return _store_shard(golden, context, runs, current, store)


def _no_prompts(checks_needed) -> VerifyRuns:
    """A shard without a batch (more shards than batches) still takes part in the ranks' agreement."""
    checks_needed(True)
    return VerifyRuns({}, {})


def _store_shard(golden: Golden, context, runs: VerifyRuns, shard: Shard, store: Store | None) -> ShardStored:
    assert store is not None, "a --shard verify stores its runs"
    ids = {}
    for phase, results in _phase_runs(runs).items():
        header = shard_header(context.candidate.header, shard, set(results))
        run = _as_run(header, results)
        ids[phase] = record(store, header, lambda run=run: run, verify_label(golden, context.candidate.header, phase)
                            ).run_id
    return ShardStored(golden.name, shard.label(), len(runs.free), str(store.path), ids,
                       f"when all {shard.count} shards are stored: evalrun store merge ALL.db SHARD.db ...; "
                       f"evalrun golden verify {golden.name} --store ALL.db --from-shards (same options)")


def _check_shard_row(store: Store, stored, header: dict[str, Any]) -> None:
    """A run labelled as this verification's shard must say so in its row: the label's key names the config and
    environment hashes, which the row records (a relabelled run of another config is refused, not judged). Its
    model must be the one here: the config names the model by its path, and a job whose files at that path held
    another checkpoint (weights, config or tokenizer) computed another model under the same label."""
    differing = _differing_hashes(stored, header)
    labelled = [column for column in differing if column != "model_hash"]  # what the label's key names
    if labelled:
        raise StoreError(f"{store.path}: run {stored.id[:12]} is labelled {stored.label!r} but its {labelled[0]} is "
                         "another verification's (an edited label?); `evalrun store show` it, and merge the "
                         "shards' own stores into a new ALL.db")
    if differing:
        raise StoreError(f"{store.path}: run {stored.id[:12]} ({stored.label!r}) was computed by another model "
                         f"than the one here ({stored.model_hash[:12]} against {header['model']['hash'][:12]}: the "
                         f"files at {header['model'].get('ref')} differ); give every shard job and this join the same "
                         "model files")


# Arrays a run holds or not by keep_logits, which is no hashed factor (two jobs of one shard may differ in it); each
# step's logits digest covers them
KEPT_LOGITS = ("logits", "logits_steps")


def _same_result(a: PromptResult, b: PromptResult) -> bool:
    """Two stored results of one prompt are the same result: digests and every array equal (kept logits aside)."""
    names = set(a.arrays) - set(KEPT_LOGITS)
    return (a.tokens_digest, a.logits_digest) == (b.tokens_digest, b.logits_digest) and \
        names == set(b.arrays) - set(KEPT_LOGITS) and \
        all(a.arrays[name].dtype == b.arrays[name].dtype and
            np.array_equal(a.arrays[name], b.arrays[name], equal_nan=a.arrays[name].dtype.kind == "f")
            for name in names)


def _stored_shards(golden: Golden, context, store: Store | None) -> VerifyRuns:
    """The phase runs the store holds for this verification, checked complete. A prompt stored by several runs (a
    shard re-run, shards of two counts) must hold the same result in each: two that differ are refused."""
    assert store is not None, "--from-shards reads a store"
    header = context.candidate.header
    newest: dict[str, dict[int, PromptResult]] = {}
    source: dict[tuple[str, int], str] = {}  # (phase, prompt index) -> the run its result came from
    for phase in VERIFY_PHASES:
        label = verify_label(golden, header, phase)
        for stored in store.list_runs():  # newest first
            if stored.label == label and stored.status == "complete":
                _check_shard_row(store, stored, header)
                for result in store.load_results(stored.id):  # each array's bytes checked against its digest
                    problem = result_problem(result)  # then what a verdict reads: shapes, integer ids
                    if problem:
                        raise StoreError(f"{store.path}: run {stored.id[:12]} is damaged (it {problem}); "
                                         "`evalrun store check` lists what is wrong")
                    seen = newest.setdefault(phase, {}).get(result.prompt_index)
                    if seen is None:
                        newest[phase][result.prompt_index] = result
                        source[(phase, result.prompt_index)] = stored.id
                    elif not _same_result(seen, result):  # two jobs' runs of one prompt disagree: mixed data
                        raise StoreError(
                            f"{store.path}: runs {source[(phase, result.prompt_index)][:12]} and {stored.id[:12]} both "
                            f"hold golden {golden.name}'s {phase} run of prompt {result.prompt_id!r} for this config "
                            "and environment, with other bits (a changed model, or two jobs of one shard of a config "
                            "that is not deterministic); merge the stores of one job per shard into a new ALL.db")
    wanted = {r.prompt_index for r in context.golden_results}
    needed = ["free", "forced"]
    needed += ["function"] if _function_config(context).compute_hash() != context.candidate.config.compute_hash() else []
    needed += [] if _envelope_roles(context) else ["envelope"]
    for phase in needed:
        missing = wanted - set(newest.get(phase, {}))
        if missing:
            raise StoreError(f"{store.path} holds {len(wanted) - len(missing)} of {len(wanted)} prompts of golden "
                             f"{golden.name}'s {phase} runs for this config and environment; run the missing "
                             "`golden verify --shard I/N` jobs with the same options and merge their stores")
    used = {phase: newest.get(phase) if phase in needed else None for phase in ("function", "envelope")}
    return VerifyRuns(newest["free"], newest["forced"], used["function"], used["envelope"])
