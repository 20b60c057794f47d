"""`evalrun bench --compare BASELINE.json --fail-on METRIC:PCT`: a performance regression fails like a
changed verdict (pytest-benchmark's `--benchmark-compare-fail` idea).

The baseline is an earlier `evalrun bench --json` output (its rows, or a previous comparison's `rows`).
Rows are matched by config name; each `--fail-on` rule names a metric and the largest change for the
worse it allows, in percent of the baseline: for tokens/s lower is worse, for times and memory higher
is worse. A config or metric missing on either side is reported, never a failure (a new config has no
baseline yet), unless no rule compared anything: that gate is refused (exit 2), not passed. Compare figures
from the same machine: the rule is a ratio, the machine is not in it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .json_input import RepeatedKey, object_without_repeated_keys

# A change exactly at the allowance passes: (now - before) / before in floating point lands a hair past it for some
# figures (7.3 -> 6.935 tokens/s is -5.000000000000003 %). A billionth of a percent is far below any figure's noise.
LIMIT_SLACK_PERCENT = 1e-9

HIGHER_IS_BETTER = {"tokens_per_s": True, "ttft_ms": False, "first_request_ms": False, "compile_s": False,
                    "peak_memory_gib": False, "p50_ms": False, "p95_ms": False, "p99_ms": False}


@dataclass(frozen=True)
class FailRule:
    metric: str
    percent: float | None  # the largest change for the worse that passes, in percent; None: report only


@dataclass
class MetricChange:
    config: str
    metric: str
    baseline: float | None
    current: float | None
    change_percent: float | None  # signed: positive = better, negative = worse
    limit_percent: float | None
    status: str  # ok | regressed | missing | reported | other workload
    differs: tuple[str, ...] = ()  # other workload: the workload keys that differ from the baseline row's


def parse_fail_on(text: str) -> FailRule:
    """'tokens_per_s:5%' -> FailRule('tokens_per_s', 5.0); ConfigError (exit 2) names the fix."""
    metric, _, percent = text.partition(":")
    if metric not in HIGHER_IS_BETTER:
        raise ConfigError(f"--fail-on {text!r}: unknown metric {metric!r}; use one of {', '.join(HIGHER_IS_BETTER)}, "
                          "e.g. --fail-on tokens_per_s:5%")
    try:
        value = float(percent.rstrip("%"))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"--fail-on {text!r}: the allowed change must be a percentage >= 0, e.g. {metric}:5%")
    return FailRule(metric, value)


def load_baseline(path: Path) -> dict[str, dict[str, Any]]:
    """Config name -> row of an earlier `bench --json`; ConfigError on anything else."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=object_without_repeated_keys)
    except RepeatedKey as repeated:
        raise ConfigError(f"--compare {path}: the key {str(repeated)[:40]!r} is given twice in one object (JSON "
                          "readers keep the last or the first); keep one, or pass the output of `evalrun bench --json`"
                          ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"--compare {path}: cannot read a bench baseline ({error}); pass the output of "
                          "`evalrun bench --json`") from None
    except ValueError:  # an integer of more than 4300 digits (Python's limit on converting text to int)
        raise ConfigError(f"--compare {path}: a number too long to read (over 4300 digits); pass the output of "
                          "`evalrun bench --json`") from None
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("config"), str) for r in rows):
        raise ConfigError(f"--compare {path}: not a bench baseline (a list of rows with a 'config' each); pass the "
                          "output of `evalrun bench --json`")
    baseline: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["config"] in baseline:
            raise ConfigError(f"--compare {path}: config {row['config'][:60]!r} appears twice; a baseline has one row "
                              "per config")
        for metric in HIGHER_IS_BETTER:
            value = row.get(metric)
            least = 0 if metric != "tokens_per_s" else math.ulp(0)  # an eager run compiles in 0 s; no speed is 0
            if value is not None and not (_finite_number(value) and value >= least):
                raise ConfigError(f"--compare {path}: config {row['config'][:60]!r} has {metric} = {str(value)[:40]}; "
                                  "a measured figure is a number from 0 to 1e308 (tokens/s above 0), or absent")
        baseline[row["config"]] = row
    return baseline


def _finite_number(value: Any) -> bool:
    """A JSON number (not a boolean) that is finite as a float: an integer past 1e308 is not (math.isfinite
    raises OverflowError on it)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _figure(row: dict[str, Any] | None, metric: str) -> float | None:
    value = (row or {}).get(metric)
    usable = _finite_number(value) and value > 0
    return float(value) if usable else None  # 0 (an eager run's compile time): no ratio to judge, reported


def compare(rows: list[dict[str, Any]], baseline: dict[str, dict[str, Any]], rules: list[FailRule]) -> list[MetricChange]:
    """Every rule on every config measured now (in the order measured); no rules: every metric, reported."""
    rules = rules or [FailRule(metric, None) for metric in HIGHER_IS_BETTER]
    changes = []
    shared = (_shared_workload(baseline.values()), _shared_workload(rows))
    for row in rows:
        differs = _workload_differs(baseline.get(row["config"]), row, *shared)
        for rule in rules:
            before, now = _figure(baseline.get(row["config"]), rule.metric), _figure(row, rule.metric)
            if differs:
                changes.append(MetricChange(row["config"], rule.metric, before, now, None, rule.percent,
                                            "other workload", differs))
                continue
            if before is None or now is None:
                changes.append(MetricChange(row["config"], rule.metric, before, now, None, rule.percent, "missing"))
                continue
            change = (now - before) / abs(before) * 100 * (1 if HIGHER_IS_BETTER[rule.metric] else -1)
            status = ("reported" if rule.percent is None
                      else "regressed" if change < -rule.percent - LIMIT_SLACK_PERCENT else "ok")
            changes.append(MetricChange(row["config"], rule.metric, before, now, change, rule.percent, status))
    return changes


def _workload_differs(before: dict[str, Any] | None, now: dict[str, Any], their_bench: dict[str, Any] | None = None,
                      our_bench: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The workload keys (bench.workload) in which a row and its baseline row differ. A row without one (transformers'
    baseline rows) is judged by its bench's shared workload (`_shared_workload`, batch size aside: those rows run
    batch 1): a baseline of another model compared its transformers rows, a false regression or a hidden one. None
    where no workload is known (a baseline from before rows carried it)."""
    if before is None:
        return ()
    theirs, ours = before.get("workload"), now.get("workload")
    inferred = not isinstance(theirs, dict) or not isinstance(ours, dict)
    theirs = theirs if isinstance(theirs, dict) else their_bench
    ours = ours if isinstance(ours, dict) else our_bench
    if not isinstance(theirs, dict) or not isinstance(ours, dict):
        return ()
    return tuple(key for key in ours if theirs.get(key) != ours[key] and not (inferred and key == "batch_size"))


def _shared_workload(rows: Any) -> dict[str, Any] | None:
    """The workload every row of a bench that carries one shares, batch size aside; None where none does or they
    differ (a row of a served model beside local ones)."""
    workloads = [{key: value for key, value in row["workload"].items() if key != "batch_size"}
                 for row in rows if isinstance(row.get("workload"), dict)]
    return workloads[0] if workloads and all(w == workloads[0] for w in workloads) else None


def other_workloads(changes: list[MetricChange]) -> list[MetricChange]:
    return [c for c in changes if c.status == "other workload"]


def compared_nothing(changes: list[MetricChange], rules: list[FailRule]) -> bool:
    """Whether --fail-on rules were given and not one of them met a figure on both sides: a gate that passes
    because the baseline names other configs (or none) is no gate. One missing config stays a report."""
    return bool(rules) and not any(change.status in ("ok", "regressed") for change in changes)


def regressions(changes: list[MetricChange]) -> list[MetricChange]:
    return [c for c in changes if c.status == "regressed"]


def as_dicts(changes: list[MetricChange]) -> list[dict[str, Any]]:
    return [asdict(c) for c in changes]


def table(changes: list[MetricChange]) -> tuple[list[str], list[list[Any]]]:
    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    headers = ["config", "metric", "baseline", "now", "change (+ better)", "allowed", "status"]
    rows = [[c.config, c.metric, show(c.baseline), show(c.current),
             "-" if c.change_percent is None else f"{c.change_percent:+.1f}%",
             "any" if c.limit_percent is None else f"-{c.limit_percent:g}%", c.status]
            for c in changes]
    return headers, rows
