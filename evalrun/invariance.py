"""`evalrun invariance`: does a prompt's output depend on the batch it ran in, or on the run?

Each prompt runs alone (batch 1) and inside batches of other prompts at chosen positions (first,
middle, last row), `repeats` times each. A cell is (batch size, position); each cell and repeat is
one ordinary stored run, in which every prompt is placed at that position among companions (the
prompts after it in file order, cyclically); only the placed row's result is recorded, so each run
holds every prompt once and `evalrun diff` works between any two of them.

Per prompt: unique token sequences and logits digests over every run, the first step whose logits
digest differs from the reference (alone, first repeat), the first step whose token differs, and the
reference's top1-top2 margin there (a flip at a near-tie reads as such), and the cells that differ.
Summary: batch-invariant when no cell adds a variant the alone cell does not have; run-to-run
deterministic when every cell's repeats agree bit for bit. What was not measured is said so (null in JSON):
determinism with one repeat, batch invariance with no batch size but 1; asking for neither is refused.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .compare import digest_mismatch_steps, first_divergence
from .config import MAX_BATCH_SIZE, RunConfig
from .errors import ConfigError
from .prompts import read_records, resolve_path
from .runner import Placement, Prepared, Run, effective_config, execute, open_when_good, prepare, record
from .store import PromptResult, Store

POSITIONS = ("first", "middle", "last")
MAX_REPEATS = 100
MAX_ROWS = 20_000  # batch rows one invariance decodes in all: ~10x the default set at 1,4,16 x 3 positions x 2
Progress = Callable[[str, int], Callable[[int], None]]  # (phase, total) -> update(count)


@dataclass(frozen=True)
class Cell:
    """Where a prompt runs: alone (batch 1), or in a batch of `batch_size` at row `position`."""

    batch_size: int
    position: str

    @property
    def name(self) -> str:
        return "alone" if self.batch_size == 1 else f"b{self.batch_size}/{self.position}"

    def row(self) -> int:
        return {"first": 0, "middle": self.batch_size // 2, "last": self.batch_size - 1}.get(self.position, 0)

    def named_by_row(self) -> Cell:
        """The same row under its own name: a batch of 2 has no middle row, the row `middle` picks is the last."""
        if self.position == "middle" and self.row() == self.batch_size - 1:
            return Cell(self.batch_size, "last")
        return self


@dataclass
class PromptInvariance:
    prompt_id: str
    unique_token_sequences: int
    unique_logits_digests: int
    first_divergent_step: int  # first step whose logits digest differs from the reference's, or -1
    token_divergent_step: int  # first step whose token differs from the reference's, or -1
    margin_at_divergence: float | None  # the reference's top1-top2 there (the token flip, else the logits step)
    differs_in: list[str] = field(default_factory=list)  # cells with a run that differs from the reference


@dataclass
class InvarianceReport:
    config: dict[str, Any]
    batch_sizes: list[int]
    positions: list[str]
    repeats: int
    runs: list[dict[str, Any]]  # per run: cell, batch_size, position, repeat, run_id, tokens_per_s
    prompts: list[PromptInvariance]
    batch_invariant: bool | None  # None: not measured (no batch size but 1)
    run_to_run_deterministic: bool | None  # None: not measured (one repeat)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_batch_sizes(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (sorted, unique, 1 always included: the reference is the prompt alone)."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not all(item.isascii() and item.isdigit() for item in items):  # int() would take '1_000' and other digits
        raise ConfigError(f"--batch-sizes {str(text)[:60]!r} is not a list of integers; use e.g. 1,4,16")
    # int() refuses text past 4300 digits (zeros too): leading zeros dropped, a longer item is out of range unread
    digits = [item.lstrip("0") or "0" for item in items]
    sizes = {int(item) if len(item) <= len(str(MAX_BATCH_SIZE)) else MAX_BATCH_SIZE + 1 for item in digits}
    if not sizes or any(not 1 <= size <= MAX_BATCH_SIZE for size in sizes):
        raise ConfigError(f"--batch-sizes {str(text)[:60]!r}: give sizes from 1 to {MAX_BATCH_SIZE}, e.g. 1,4,16")
    return sorted(sizes | {1})


def parse_positions(text: str) -> list[str]:
    """'first,last' -> ['first', 'last'] (in POSITIONS order)."""
    names = {item.strip() for item in str(text).split(",") if item.strip()}
    unknown = sorted(names - set(POSITIONS))
    if not names or unknown:
        raise ConfigError(f"--positions {text!r}: use some of {', '.join(POSITIONS)}, e.g. first,middle,last")
    return [name for name in POSITIONS if name in names]


def check_request(config: RunConfig, batch_sizes: list[int], positions: list[str], repeats: int) -> RunConfig:
    """What an invariance asks for, refused before any store is opened or model loads: repeats out of range, batch
    size 1 alone run once (it compares nothing: it said invariant and deterministic, yes), more batch rows than
    MAX_ROWS. Returns the effective config of the alone cell (batch size 1: a preset's or --set's batch size is
    what --batch-sizes replaces, and no run used it)."""
    if not 1 <= repeats <= MAX_REPEATS:
        raise ConfigError(f"--repeats {repeats}: use 1 to {MAX_REPEATS}")
    if set(batch_sizes) <= {1} and repeats == 1:
        raise ConfigError("invariance: batch size 1 alone, run once, compares nothing; add a batch size "
                          "(--batch-sizes 1,4,16) or repeats (--repeats 2)")
    effective = effective_config(config).replace(batch_size=1)
    cells = cells_for(batch_sizes, positions)
    prompt_count = len(read_records(resolve_path(effective.prompts)))
    rows_computed = repeats * prompt_count * sum(cell.batch_size for cell in cells)
    if rows_computed > MAX_ROWS:
        raise ConfigError(f"invariance: {repeats} repeat(s) x {prompt_count} prompts x {len(cells)} cells would "
                          f"decode {rows_computed:,} batch rows (limit {MAX_ROWS:,}); use fewer or smaller "
                          "--batch-sizes, --positions or --repeats")
    return effective


def cells_for(batch_sizes: list[int], positions: list[str]) -> list[Cell]:
    """Alone first (the reference), then every batch size > 1 at every position, each row once, in row order and
    named by its row (a batch of 2 has no middle row: `middle` picks the last, the cell `b2/last`)."""
    cells = [Cell(1, "alone")]
    for size in (size for size in batch_sizes if size > 1):
        cells += sorted({Cell(size, position).named_by_row() for position in positions}, key=Cell.row)
    return cells


def placement(prompt_count: int, cell: Cell) -> Placement:
    """One batch per prompt: the prompt at the cell's row, its companions the prompts after it in file
    order (cyclically, repeating when the set is smaller than the batch)."""
    batches, rows = [], []
    for target in range(prompt_count):
        others = [(target + 1 + k) % prompt_count for k in range(prompt_count - 1)] or [target]
        companions = [others[k % len(others)] for k in range(cell.batch_size - 1)]
        row = cell.row()
        batches.append(companions[:row] + [target] + companions[row:])
        rows.append(row)
    return Placement(batches, rows)


def measure_invariance(config: RunConfig, batch_sizes: list[int], positions: list[str], repeats: int,
                       store: Store | Callable[[], Store] | None, progress: Progress | None = None) -> InvarianceReport:
    """Run every cell `repeats` times (each an ordinary stored run) and analyse the results. `store` may be a
    function that opens it once the model and prompts are good (runner.open_when_good)."""
    started = time.perf_counter()
    effective = check_request(config, batch_sizes, positions, repeats)
    cells = cells_for(batch_sizes, positions)
    base = prepare(effective)
    prepared_cells = [(cell, _prepared_for(base, cell.batch_size)) for cell in cells]  # every config good first
    store = open_when_good(store)
    runs: list[tuple[Cell, int, Run]] = []
    for cell, prepared in prepared_cells:
        layout = placement(len(prepared.prompt_set.records), cell)
        for repeat in range(repeats):
            update = progress(f"{cell.name} #{repeat + 1}", len(layout.batches)) if progress else None
            run = record(store, prepared.header, lambda: execute(prepared, progress=update, timed=False,
                                                                 placement=layout),
                         label=f"invariance {cell.name} repeat {repeat + 1}")
            runs.append((cell, repeat, run))
    prompts = analyse([(cell.name, run.results) for cell, _, run in runs])
    deterministic = _deterministic([(cell.name, run.results) for cell, _, run in runs]) if repeats > 1 else None
    invariant = None if len(cells) == 1 else (
        _no_new_variants(runs) if deterministic is False else all(not p.differs_in for p in prompts))
    rows = [{"cell": cell.name, "batch_size": cell.batch_size, "position": cell.position, "repeat": repeat + 1,
             "run_id": run.run_id, "tokens_per_s": run.timings["tokens_per_s"]} for cell, repeat, run in runs]
    return InvarianceReport(base.config.as_dict(), batch_sizes, positions, repeats, rows, prompts, invariant,
                            deterministic, time.perf_counter() - started)


def _prepared_for(base: Prepared, batch_size: int) -> Prepared:
    """The base run at another batch size: its own header (batch_size is a numerics factor), the same
    loaded model, prompts and execution mode (compiled code is reused across cells)."""
    prepared = prepare(base.config.replace(batch_size=batch_size), reuse=base)
    prepared.mode = base.execution_mode()
    return prepared


def analyse(runs: list[tuple[str, list[PromptResult]]]) -> list[PromptInvariance]:
    """Per prompt, over runs [(cell name, results in prompt order)], the first being the reference."""
    reference = runs[0][1]
    report = []
    for index, ref in enumerate(reference):
        results = [(name, results[index]) for name, results in runs]
        logits_steps, token_steps, differs = [], [], []
        for name, result in results:
            mismatches = digest_mismatch_steps(ref.arrays["digests"], result.arrays["digests"])
            flip = first_divergence(ref.arrays["tokens"], result.arrays["tokens"])
            if mismatches.size or flip >= 0:
                differs.append(name)
            logits_steps += [int(mismatches[0])] if mismatches.size else []
            token_steps += [flip] if flip >= 0 else []
        first_logits, first_token = min(logits_steps, default=-1), min(token_steps, default=-1)
        at = first_token if first_token >= 0 else first_logits
        margins = ref.arrays["margins"]
        margin = float(margins[at]) if 0 <= at < len(margins) else None
        report.append(PromptInvariance(
            ref.prompt_id, len({r.tokens_digest for _, r in results}), len({r.logits_digest for _, r in results}),
            first_logits, first_token, margin, sorted(set(differs), key=[name for name, _ in runs].index)))
    return report


def _deterministic(runs: list[tuple[str, list[PromptResult]]]) -> bool:
    """Every cell's repeats agree, prompt by prompt, in every token and logits digest."""
    seen: dict[str, list[PromptResult]] = {}
    for name, results in runs:
        first = seen.setdefault(name, results)
        if any((a.tokens_digest, a.logits_digest) != (b.tokens_digest, b.logits_digest)
               for a, b in zip(first, results)):
            return False
    return True


def _no_new_variants(runs: list[tuple[Cell, int, Run]]) -> bool:
    """Run to run nondeterministic: batch-invariant still when no batched run shows a variant (of tokens
    and logits) that the prompt's alone runs do not also show."""
    alone: dict[int, set] = {}
    for cell, _, run in runs:
        for result in run.results:
            variant = (result.tokens_digest, result.logits_digest)
            if cell.batch_size == 1:
                alone.setdefault(result.prompt_index, set()).add(variant)
            elif variant not in alone.get(result.prompt_index, set()):
                return False
    return True
