"""Pairwise bit-diff investigation of two runs: what differs, where tokens part, by how much.

A run is named by id (or unique prefix) in a store, or `golden:NAME` (the golden's pinned run).
The numbers come from `compare`; this module matches prompts, picks the divergence, and shapes
the result (`RunDiff`), which `diff_report` renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .compare import bits_to_float, dict_diff, digest_mismatch_steps, first_divergence, sketch_series, ulp_distance
from .errors import StoreError
from .routing import PromptRoutingDiff, RoutingFlip, prompt_routing_diff, result_flip
from .store import PromptResult, RunRecord, Store, results_problem

CONTEXT_TOKENS = 6  # decoded tokens shown each side of the first divergence
TOP_SHOWN = 5
ULP_BUCKETS = (0, 1, 2, 4, 8, 16, 64, 256, 1024)  # histogram lower edges; the last bucket is open


@dataclass
class RunRef:
    name: str
    record: RunRecord
    results: list[PromptResult]


def load_run(ref: str, store: Store | None, golden_dir: str | Path = "golden") -> RunRef:
    """`golden:NAME` or a run id/prefix in `store`; StoreError (exit 2) when missing or not complete."""
    if ref.startswith("golden:"):
        from .golden import open_golden

        golden = open_golden(ref.split(":", 1)[1], golden_dir)
        return RunRef(ref, golden.pinned, golden.results("pinned"))
    if store is None:
        raise StoreError(f"run {ref!r}: no store to look in; pass --store PATH")
    record = store.get_run(ref)
    if record.status != "complete":
        raise StoreError(f"run {record.id[:12]} is {record.status}, not complete; diff complete runs only")
    results = store.load_results(record.id)
    problem = run_problem(record, results)
    if problem:
        raise StoreError(f"run {record.id[:12]} in {store.path} is damaged: {problem}; `evalrun store check` says more")
    return RunRef(record.id[:12], record, results)


def run_problem(record: RunRecord, results: list[PromptResult]) -> str:
    """What keeps a stored run from being compared ('' when nothing): its provenance and its arrays."""
    from .config import DTYPES

    model, prompt_set = record.json.get("model"), record.json.get("prompt_set")
    if record.config.get("dtype") not in DTYPES:
        return "its config names no known dtype"
    if not isinstance(model, dict) or not isinstance(prompt_set, dict) or not isinstance(prompt_set.get("hash"), str):
        return "its model or prompt-set record is missing"
    if not results:
        return "it has no results"
    return results_problem(results)


def diff_refs(ref_a: str, ref_b: str, store_path: Path, golden_dir: str | Path = "golden",
              prompt_ids: tuple[str, ...] = (), decoder_for=None) -> "RunDiff":
    """`evalrun diff A B`: load both runs (a store is opened only when a side needs one) and compare.
    `decoder_for(record)` returns a token decoder for the runs' model, or None."""
    needs_store = not (ref_a.startswith("golden:") and ref_b.startswith("golden:"))
    store = Store(store_path, readonly=True) if needs_store else None
    a, b = load_run(ref_a, store, golden_dir), load_run(ref_b, store, golden_dir)
    return diff_runs(a, b, prompt_ids, decode=decoder_for(a.record) if decoder_for else None)


@dataclass
class StepSeries:
    """Per-step figures over the shared steps of one prompt (lists, for JSON)."""

    digest_equal: list[bool]
    max_abs_delta: list[float]
    ulp_max: list[float]
    ulp_median: list[float]
    kl: list[float]
    topk_overlap: list[float]


@dataclass
class PromptDiff:
    prompt_id: str
    tokens_identical: bool
    first_divergent_step: int
    digest_mismatches: int
    steps: int
    context_a: str = ""
    context_b: str = ""
    top_a: list[dict[str, Any]] = field(default_factory=list)
    top_b: list[dict[str, Any]] = field(default_factory=list)
    margin_a: float | None = None
    margin_b: float | None = None
    series: StepSeries | None = None
    logits: dict[str, Any] | None = None  # element-level figures when both runs kept full logits
    routing: RoutingFlip | None = None  # MoE models: the first routing flip, up to the token divergence
    prompt_routing: PromptRoutingDiff | None = None  # MoE models: the prompt's tokens routed to other experts


@dataclass
class RunDiff:
    a: str
    b: str
    config: list[tuple[str, Any, Any]]
    environment: list[tuple[str, Any, Any]]
    model: list[tuple[str, Any, Any]]
    prompt_set: list[tuple[str, Any, Any]]
    prompts: list[PromptDiff]
    not_comparable: list[str]  # prompt ids present in one run only, or with different input tokens
    note: str = ""


def _top(result: PromptResult, step: int, decode) -> list[dict[str, Any]]:
    ids, values = result.arrays["topk_ids"][step], result.arrays["topk_values"][step]
    return [{"id": int(i), "token": decode([int(i)]), "value": float(v)} for i, v in zip(ids[:TOP_SHOWN], values[:TOP_SHOWN])]


def _context(tokens: np.ndarray, step: int, decode) -> str:
    before = decode(tokens[max(0, step - CONTEXT_TOKENS):step].tolist())
    after = decode(tokens[step:step + CONTEXT_TOKENS].tolist())
    return f"{before}⟦{after}"


SERIES_KEYS = ("max_abs_delta", "ulp_max", "ulp_median", "kl", "topk_overlap")


def step_series_many(pairs: list[tuple[PromptResult, PromptResult]], dtype: str) -> list[StepSeries]:
    """Per-step figures of many prompt pairs: pairs with the same shared step count go through
    `sketch_series` as one stacked array [P, N, K], which is what keeps a 1,000-prompt diff fast."""
    series: list[StepSeries | None] = [None] * len(pairs)
    groups: dict[tuple[int, int, int], list[int]] = {}
    for index, (a, b) in enumerate(pairs):  # one stack per (shared steps, top-k widths): arrays of one shape
        key = (min(len(a.arrays["tokens"]), len(b.arrays["tokens"])), a.arrays["topk_ids"].shape[1],
               b.arrays["topk_ids"].shape[1])
        groups.setdefault(key, []).append(index)
    for (steps, _, _), members in groups.items():
        stack = lambda side, name: np.stack([pairs[i][side].arrays[name][:steps] for i in members])  # noqa: E731
        figures = sketch_series(stack(0, "topk_ids"), stack(0, "topk_values"), stack(1, "topk_ids"),
                                stack(1, "topk_values"), dtype)
        equal = np.all(stack(0, "digests") == stack(1, "digests"), axis=-1)  # [P, N]
        for row, index in enumerate(members):
            series[index] = StepSeries(equal[row].tolist(), *(figures[key][row].tolist() for key in SERIES_KEYS))
    return series


def logits_figures(bits_a: np.ndarray, bits_b: np.ndarray, dtype: str, dtype_b: str | None = None) -> dict[str, Any] | None:
    """Full logits as raw bits [N, V] each -> share bit-identical, ULP histogram, max |delta| and where.

    Runs of two dtypes compare values (the ULP histogram is left empty: ULPs of which dtype?); runs
    with different vocabularies compare nothing (None)."""
    dtype_b = dtype_b or dtype
    n = min(len(bits_a), len(bits_b))
    bits_a, bits_b = bits_a[:n], bits_b[:n]
    if bits_a.shape != bits_b.shape:
        return None
    values_a, values_b = bits_to_float(bits_a, dtype), bits_to_float(bits_b, dtype_b)
    ulps = ulp_distance(bits_a, bits_b) if dtype == dtype_b else None
    delta = np.abs(values_a - values_b)
    step, token = np.unravel_index(int(np.argmax(delta)), delta.shape) if delta.size else (0, 0)
    edges = list(ULP_BUCKETS) + [np.iinfo(np.int64).max]
    histogram = {} if ulps is None else {
        (f"{low}" if high - low == 1 else f"{low}-{high - 1}" if high < edges[-1] else f">={low}"):
        int(np.count_nonzero((ulps >= low) & (ulps < high))) for low, high in zip(edges, edges[1:])}
    return {"elements": int(delta.size), "bit_identical_share": float(np.mean(delta == 0)) if delta.size else 1.0,
            "ulp_histogram": histogram, "max_abs_delta": float(delta.max()) if delta.size else 0.0,
            "max_at_step": int(step), "max_at_token_id": int(token)}


def diff_prompt(a: PromptResult, b: PromptResult, dtype: str, decode, series: StepSeries,
                dtype_b: str | None = None) -> PromptDiff:
    tokens_a, tokens_b = a.arrays["tokens"], b.arrays["tokens"]
    divergence = first_divergence(tokens_a, tokens_b)
    result = PromptDiff(a.prompt_id, divergence < 0, divergence,
                        int(digest_mismatch_steps(a.arrays["digests"], b.arrays["digests"]).size),
                        min(len(tokens_a), len(tokens_b)), series=series)
    if 0 <= divergence < result.steps:
        result.context_a, result.context_b = _context(tokens_a, divergence, decode), _context(tokens_b, divergence, decode)
        result.top_a, result.top_b = _top(a, divergence, decode), _top(b, divergence, decode)
        result.margin_a = float(a.arrays["margins"][divergence])
        result.margin_b = float(b.arrays["margins"][divergence])
    # routing is compared where both runs had the same input: up to and including the first divergent step
    result.routing = result_flip(a.arrays, b.arrays, divergence + 1 if divergence >= 0 else result.steps)
    result.prompt_routing = prompt_routing_diff(a.arrays, b.arrays)
    if "logits" in a.arrays and "logits" in b.arrays:
        steps, in_a, in_b = np.intersect1d(a.arrays["logits_steps"], b.arrays["logits_steps"], return_indices=True)
        if steps.size:
            result.logits = logits_figures(a.arrays["logits"][in_a], b.arrays["logits"][in_b], dtype, dtype_b)
            if result.logits is not None:
                result.logits["max_at_step"] = int(steps[result.logits["max_at_step"]])
                result.logits["steps"] = steps.tolist()
    return result


def _cache_hits(evidence: dict) -> tuple[int, int, Any]:
    """(graphs taken from the cache, graphs compiled at all, the cache folder) of one run's evidence."""
    cache = evidence.get("compile_cache") or {}
    counts = [int(cache.get(key) or 0) for key in ("hits", "misses", "bypasses")]
    return counts[0], sum(counts), cache.get("folder")


def _cache_note(name_a: str, name_b: str, evidence_a: dict, evidence_b: dict, prompts: list[PromptDiff]) -> str:
    """Where the bits differ and one run took compiled graphs from a cache the other did not take them from: a cache
    replays what the process that wrote it compiled (Inductor's keys miss some of what the fingerprint names beside
    them, compile_cache.py), so it is named as a candidate cause."""
    (hits_a, graphs_a, folder_a), (hits_b, graphs_b, folder_b) = _cache_hits(evidence_a), _cache_hits(evidence_b)
    # both compiled: beside a run that compiled nothing (eager), the other's mode explains its bits, not its cache
    if not any(p.digest_mismatches for p in prompts) or not (hits_a or hits_b) or not (graphs_a and graphs_b) or \
            (hits_a and hits_b and folder_a == folder_b):
        return ""
    said = [f"{name} took {hits} compiled graphs from {folder}" if hits else f"{name} took none from a cache"
            for name, hits, folder in ((name_a, hits_a, folder_a), (name_b, hits_b, folder_b))]
    return (f"compile cache: {', '.join(said)}; a cached graph is what the process that wrote it compiled: run "
            "again with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 to compile afresh")


def diff_runs(a: RunRef, b: RunRef, prompt_ids: tuple[str, ...] = (), decode=None) -> RunDiff:
    """Compare two runs; `prompt_ids` restricts the per-prompt part; `decode(ids) -> text`."""
    decode = decode or (lambda ids: " ".join(str(i) for i in ids))
    ja, jb = a.record.json, b.record.json
    model_a = {k: ja["model"].get(k) for k in ("ref", "weights", "config", "tokenizer")}
    model_b = {k: jb["model"].get(k) for k in ("ref", "weights", "config", "tokenizer")}
    by_id_b = {r.prompt_id: r for r in b.results}
    pairs, not_comparable = [], []
    for result in a.results:
        if prompt_ids and result.prompt_id not in prompt_ids:
            continue
        other = by_id_b.get(result.prompt_id)
        if other is None or not np.array_equal(result.arrays["input_ids"], other.arrays["input_ids"]):
            not_comparable.append(result.prompt_id)
            continue
        pairs.append((result, other))
    dtype, dtype_b = a.record.config["dtype"], b.record.config["dtype"]
    prompts = [diff_prompt(x, y, dtype, decode, series, dtype_b)
               for (x, y), series in zip(pairs, step_series_many(pairs, dtype))]
    ids_a = {r.prompt_id for r in a.results}
    not_comparable += [r.prompt_id for r in b.results if r.prompt_id not in ids_a
                       and (not prompt_ids or r.prompt_id in prompt_ids)]
    note = ""
    if ja["prompt_set"]["hash"] != jb["prompt_set"]["hash"]:
        note = (f"prompt sets differ ({ja['prompt_set']['name']} vs {jb['prompt_set']['name']}): only prompts with the "
                "same id and input tokens are compared")
    cache = _cache_note(a.name, b.name, ja.get("evidence") or {}, jb.get("evidence") or {}, prompts)
    note = "; ".join(part for part in (note, cache) if part)
    if prompt_ids and not prompts and not not_comparable:
        raise StoreError(f"no prompt named {', '.join(prompt_ids)} in run {a.name}; see `evalrun store show {a.name}`")
    return RunDiff(a.name, b.name, dict_diff(ja["config"], jb["config"]), dict_diff(ja["environment"], jb["environment"]),
                   dict_diff(model_a, model_b), dict_diff(ja["prompt_set"], jb["prompt_set"], ("path",)),
                   prompts, not_comparable, note)
