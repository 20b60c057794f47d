"""The search of `evalrun bisect` as data: the predicate, the knob ladder, and stage 1 over it.

Pure: `search_knobs` takes a `test(knob indices) -> good|bad|skip` callable and returns the culprit,
so the search and its run bound are tested with fake predicates, no model involved (see `bisect` for
the whole procedure).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .config import INDUCTOR_KNOBS, NUMERICS_FACTORS, WORKLOAD_FACTORS, EffectiveConfig, validate
from .errors import BisectError

COMPILATION_KNOBS = ("compilation_mode", *INDUCTOR_KNOBS)


@dataclass(frozen=True)
class Predicate:
    """What makes a config good: `bits`, `verdict` (against `golden`) or `cmd` (a shell command)."""

    kind: str
    command: str = ""
    golden: str | None = None
    golden_dir: str = "golden"

    def describe(self) -> str:
        if self.kind == "cmd":
            return f"cmd: {self.command}"
        return f"verdict against golden {self.golden}" if self.kind == "verdict" else "bits"


def parse_until(until: str) -> tuple[str, str]:
    """`--until`'s kind (bits, verdict or cmd) and its command (cmd: only); BisectError for any other value.

    The command line checks this first: the options that depend on the kind (--golden, --probe-timeout) are
    judged against a value that names one."""
    text = until.strip()
    if text in ("bits", "verdict"):
        return text, ""
    if text.startswith("cmd:"):
        command = text[4:].strip()
        if len(command) >= 2 and command[0] == command[-1] and command[0] in "\"'":
            command = command[1:-1].strip()
        if not command:
            raise BisectError('--until cmd:"..." needs a command, e.g. --until \'cmd:pytest -x tests/test_model.py\'')
        return "cmd", command
    raise BisectError(f"--until {until!r} is not valid; use bits, verdict or cmd:\"COMMAND\"")


def parse_predicate(until: str, golden: str | None, golden_dir: Path, goldens_in_specs: list[str]) -> Predicate:
    """`--until bits|verdict|cmd:"..."`; verdict needs `--golden NAME` or a golden:NAME item in a SPEC."""
    kind, command = parse_until(until)
    if kind == "verdict":
        name = golden or (goldens_in_specs[0] if goldens_in_specs else None)
        if not name:
            raise BisectError("--until verdict needs a golden: pass --golden NAME or use a golden:NAME item in "
                              "--good or --bad")
        return Predicate("verdict", golden=name, golden_dir=str(golden_dir))
    return Predicate(kind, command=command, golden_dir=str(golden_dir))


# ---------------------------------------------------------------- the knob ladder

@dataclass(frozen=True)
class Knob:
    """One numerics factor whose value differs between GOOD and BAD (typed as EffectiveConfig holds it)."""

    name: str
    good: Any
    bad: Any

    def describe(self) -> str:
        return f"{self.name} {_plain(self.good)} -> {_plain(self.bad)}"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "good": _plain(self.good), "bad": _plain(self.bad)}

    @property
    def is_compilation(self) -> bool:
        return self.name in COMPILATION_KNOBS


def _plain(value: Any) -> Any:
    """A config value as JSON has it (enums by value, tuples as lists)."""
    if isinstance(value, enum.Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


def knob_ladder(good: EffectiveConfig, bad: EffectiveConfig) -> list[Knob]:
    """The numerics factors that differ, in NUMERICS_FACTORS order; BisectError when the workloads differ."""
    workload = [key for key in WORKLOAD_FACTORS if getattr(good, key) != getattr(bad, key)]
    if workload:
        pairs = ", ".join(f"{key} {getattr(good, key)} vs {getattr(bad, key)}" for key in workload)
        raise BisectError(f"GOOD and BAD differ in what they compute ({pairs}); bisect walks execution knobs only: "
                          "give both sides the same model, prompts and tokens")
    return [Knob(key, getattr(good, key), getattr(bad, key)) for key in NUMERICS_FACTORS
            if getattr(good, key) != getattr(bad, key)]


def apply_knobs(good: EffectiveConfig, knobs: list[Knob], cuda_available: bool,
                gpu_count: int | None = None) -> EffectiveConfig:
    """GOOD with these knobs set to BAD's values; ConfigError when that is not a valid config here."""
    config = good.replace(adjustments=(), **{knob.name: knob.bad for knob in knobs})
    validate(config, cuda_available, gpu_count)
    return config


# ---------------------------------------------------------------- the search (pure: outcomes in, culprit out)

Outcome = str  # "good" | "bad" | "skip" (a skipped probe or an invalid config)


@dataclass
class Culprit:
    """What stage 1 found: `knob` (one knob, or a group that only changes together), `interaction`
    (knobs each harmless alone), or `none` (GOOD and BAD do not differ under the predicate)."""

    kind: str
    indices: list[int]
    note: str = ""


def first_bad_prefix(count: int, test: Callable[[int], Outcome]) -> tuple[int, int]:
    """Binary search over prefix lengths: (lo, hi) with prefix lo good and prefix hi bad, hi == count
    assumed bad and not tested; lengths between them were skipped. ceil(log2 count) tests at most when
    none is skipped."""
    lo, hi, skipped = 0, count, set()
    while True:
        candidates = [n for n in range(lo + 1, hi) if n not in skipped]
        if not candidates:
            return lo, hi
        middle = (lo + hi) / 2
        length = min(candidates, key=lambda n: (abs(n - middle), n))
        outcome = test(length)
        if outcome == "good":
            lo = length
        elif outcome == "bad":
            hi = length
        else:
            skipped.add(length)


def ddmin(items: list[int], fails: Callable[[list[int]], bool]) -> list[int]:
    """Zeller's delta debugging: a 1-minimal subset of `items` (for which `fails` holds) that still fails."""
    granularity = 2
    while len(items) >= 2:
        chunks = [items[i * len(items) // granularity:(i + 1) * len(items) // granularity] for i in range(granularity)]
        chunks = [chunk for chunk in chunks if chunk]
        reduced = next((chunk for chunk in chunks if fails(chunk)), None)
        if reduced is not None:
            items, granularity = reduced, 2
            continue
        complements = [[i for i in items if i not in chunk] for chunk in chunks] if len(chunks) > 2 else []
        reduced = next((rest for rest in complements if fails(rest)), None)
        if reduced is not None:
            items, granularity = reduced, max(granularity - 1, 2)
            continue
        if granularity >= len(items):
            break
        granularity = min(len(items), 2 * granularity)
    return items


def search_knobs(count: int, test: Callable[[frozenset[int]], Outcome]) -> Culprit:
    """Stage 1 over knob indices 0..count-1; `test(indices)` judges GOOD with those knobs of BAD
    (memoise it: the search may ask for one set twice). GOOD itself is not tested here; BAD is, first: a
    predicate need not be monotone (batch_invariant=true undoes what batch_size=4 changes; a cmd: predicate is
    anything), so a knob that turns GOOD bad alone is no culprit when BAD, with every knob, is good."""
    everything = test(frozenset(range(count)))
    if everything == "skip":
        return Culprit("none", [], "the predicate could not judge BAD (it skipped it): nothing to bisect")
    if everything != "bad":
        return Culprit("none", [], "GOOD and BAD do not differ under the predicate")
    prefix = lambda n: test(frozenset(range(n)))  # noqa: E731
    lo, hi = first_bad_prefix(count, prefix)
    group = list(range(lo, hi))
    alone = test(frozenset(group))  # when lo == 0 this is prefix hi itself (BAD when hi == count)
    if alone == "bad":
        note = "" if len(group) == 1 else ("these knobs were judged together: the configs between them were "
                                           "skipped (not valid here, or their runs failed; the probes say which)")
        return Culprit("knob", group, note)
    minimal = ddmin(list(range(lo)), lambda subset: test(frozenset(subset) | frozenset(group)) == "bad")
    note = "each knob alone keeps GOOD good; together they turn it bad"
    if alone == "skip":
        note = ("the last knobs alone were skipped (not a valid config here, or the run failed; the probes say "
                "which), so they were judged together with earlier ones")
    return Culprit("interaction", sorted(minimal) + group, note)


def run_bound(count: int) -> int:
    """The most runs stage 1 takes for one culprit among `count` knobs: GOOD, BAD, the prefixes' binary search
    and the culprit's knobs alone."""
    return math.ceil(math.log2(count)) + 3 if count > 1 else 2
