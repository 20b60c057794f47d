"""Text and JSON renderings of runs, fingerprints and store listings (no computation here)."""

from __future__ import annotations

import html
import json
import math
import re
from typing import Any, Iterable, Sequence

from .config import DECODE_LEVER_DEFAULTS, INDUCTOR_DEFAULTS
from .store import PromptResult, RunRecord


def _finite(value: Any) -> Any:
    """NaN and infinities become null: the output is strict JSON that any parser reads."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(value: Any) -> str:
    """Strict JSON (no NaN/Infinity), sorted keys, UTF-8 text kept readable; text that is not valid
    Unicode (a lone surrogate read from a damaged file) is written as JSON escapes instead."""
    text = json.dumps(_finite(value), indent=2, sort_keys=True, default=str, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(_finite(value), indent=2, sort_keys=True, default=str, ensure_ascii=True, allow_nan=False)
    return text


_MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~$])")  # $: GitHub's inline math


# A zero-width space after "@" and "#": GitHub links "@name" (a ping) and "#1" (a backlink on issue 1) in text,
# the entity decoded (what Renovate's PR bodies do); the reader sees the same text.
_GITHUB_REFERENCE = re.compile(r"([@#])")


def markdown_cell(value: Any) -> str:
    """Text that came from a file, safe inside a Markdown table cell or list item of a PR comment, rendered
    as the text itself: line breaks and control characters shown as escapes, then `&`, `<` and `>` as HTML
    entities (no comment, no tag; quotes stay text), then every Markdown special backslash-escaped ($ too:
    GitHub reads $...$ as math; no entity holds one), then "@" and "#" followed by a zero-width space entity
    (no ping, no issue link)."""
    text = _MARKDOWN_SPECIALS.sub(r"\\\1", html.escape(printable(value), quote=False))
    return _GITHUB_REFERENCE.sub(r"\1&#8203;", text)


def markdown_code(lines: list[str]) -> list[str]:
    """A fenced code block whose fence is longer than any backtick run inside (nothing escapes it)."""
    body = [printable(line) for line in lines]
    longest = max((len(run) for line in body for run in re.findall(r"`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, *body, fence]


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain left-aligned text table."""
    rows = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(value.ljust(w) for value, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else printable(value)


def printable(value: Any) -> str:
    """Text that came from a file, one terminal line that shows what it holds: line breaks, control and
    bidirectional-override characters as escapes (a prompt id cannot start a `::error::` workflow command
    on a line of its own, or reorder what a reader sees)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(value))


def snippet(text: str, width: int = 40) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def config_line(config: dict[str, Any]) -> str:
    """The stored config's main knobs, and the engine, combo kernels and decode levers where they are not the
    defaults: one printable line, whatever a stored config holds."""
    keys = ("model", "device", "dtype", "opt_level", "compilation_mode", "cudagraph_mode", "batch_size", "deterministic")
    levers = {"engine": "evalrun", "combo_kernels": INDUCTOR_DEFAULTS["combo_kernels"], **DECODE_LEVER_DEFAULTS}
    return printable(" ".join([f"{key}={config.get(key)}" for key in keys]
                              + [f"{key}={config[key]}" for key, default in levers.items()
                                 if config.get(key, default) != default]))


def timings_text(timings: dict[str, Any]) -> str:
    """One line of timings; a stored record without them (damaged, or from a failed run) says so."""
    try:
        latency, memory = timings["step_latency"], timings["peak_memory"]
        return printable(f"load {timings['load_s']:.2f}s  compile {timings['compile_s']:.2f}s  warm-up "
                         f"{timings['warmup_s']:.2f}s  TTFT p50 {timings['ttft_ms']['p50']:.1f} ms  step p50/p95/p99 "
                         f"{latency['p50_ms']:.2f}/{latency['p95_ms']:.2f}/{latency['p99_ms']:.2f} ms  "
                         f"{timings['tokens_per_s']:.1f} tok/s  peak {human_bytes(memory['bytes'])} ({memory['kind']})")
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: an integer past 1e308 as a float
        return "timings: not readable in this record"


def results_table(results: list[PromptResult]) -> str:
    rows = []
    for r in results:
        margins = r.arrays.get("margins")
        eos = r.eos_step if isinstance(r.eos_step, int) and r.eos_step >= 0 else "-"
        rows.append([r.prompt_id, r.input_tokens, r.new_tokens, eos,
                     f"{float(margins.min()):.3f}" if margins is not None and margins.size else "",
                     str(r.logits_digest)[:12], snippet(str(r.output_text))])
    return table(["prompt", "in", "new", "eos", "min margin", "logits digest", "output"], rows)


def run_text(run) -> str:
    """A run (runner.Run) as the `evalrun run` summary."""
    lines = [config_line(run.header["config"]), results_table(run.results), timings_text(run.timings)]
    if run.evidence.get("config_adjustments"):
        lines.append("ADJUSTED: " + "; ".join(run.evidence["config_adjustments"]))
    if run.evidence.get("fallbacks"):
        lines.append("FALLBACKS: " + "; ".join(run.evidence["fallbacks"]))
    if run.run_id:
        lines.append(f"run {run.run_id}")
    return "\n".join(lines)


def run_json(run) -> dict[str, Any]:
    header = run.header
    return {
        "run_id": run.run_id, "config": header["config"], "config_hash": header["config_hash"],
        "environment_hash": header["environment_hash"], "model": header["model"], "prompt_set": header["prompt_set"],
        "timings": run.timings, "evidence": run.evidence, "tokens_digest": run.tokens_digest,
        "logits_digest": run.logits_digest,
        "results": [{"prompt_id": r.prompt_id, "input_tokens": r.input_tokens, "new_tokens": r.new_tokens,
                     "eos_step": r.eos_step, "tokens": r.arrays["tokens"].tolist(), "text": r.output_text,
                     "tokens_digest": r.tokens_digest, "logits_digest": r.logits_digest} for r in run.results],
    }


def run_record_json(record: RunRecord, results: list[PromptResult]) -> dict[str, Any]:
    return {**record.summary(), **record.json, "error": record.error,
            "results": [{"prompt_id": r.prompt_id, "text": r.output_text,
                         "tokens": r.arrays["tokens"].tolist() if "tokens" in r.arrays else None,
                         "logits_digest": r.logits_digest} for r in results]}


def store_check_text(outcome: dict[str, Any]) -> str:
    """One printable line per problem (they quote run ids and values read from the store)."""
    lines = [f"{outcome['path']}: {'ok' if outcome['ok'] else 'PROBLEMS'}  schema {outcome['schema_version']}  "
             f"runs {outcome['runs']}"]
    lines += [f"  {problem}" for problem in outcome["problems"]]
    lines += [f"  note: run {run_id[:12]} was interrupted (stopped, or its process is gone); never complete"
              for run_id in outcome["interrupted"]]
    return "\n".join(printable(line) for line in lines)


def golden_created_text(summary: dict[str, Any]) -> str:
    seconds = summary.get("create_seconds") or {}
    phases = sorted(seconds, key=lambda p: (["pinned_s", "oracle_s", "envelope_s"] + [p]).index(p))  # run order
    made = "; made in " + " + ".join(f"{p.removesuffix('_s')} {seconds[p]:.1f} s" for p in phases) if seconds else ""
    return (f"golden {summary['path']}: {summary['model']} {summary['dtype']} on {summary['device']}, prompts "
            f"{summary['prompts']}, oracle {summary['oracle_dtype']}, {summary['bytes']:,} bytes{made}")


def goldens_table(entries: list[dict[str, Any]]) -> str:
    rows = [[e["name"], e.get("model", ""), e.get("prompts", ""), e.get("device", ""), e.get("dtype", ""),
             e.get("oracle_dtype", ""), f"{e['bytes']:,}" if "bytes" in e else "", e.get("error", "")] for e in entries]
    return table(["golden", "model", "prompts", "device", "dtype", "oracle", "bytes", "problem"], rows)


def golden_json(golden, results: list[PromptResult]) -> dict[str, Any]:
    return {**golden.summary(), "meta": golden.meta, **golden.pinned.json,
            "results": [{"prompt_id": r.prompt_id, "text": r.output_text, "tokens": r.arrays["tokens"].tolist()}
                        for r in results]}


def golden_text(golden, results: list[PromptResult]) -> str:
    summary = golden.summary()
    routing = ", every run along the pinned routing" if summary["routing"] else ""
    return "\n".join([printable(f"golden {golden.name} ({summary['path']}, {summary['bytes']:,} bytes), format "
                                f"{summary['format']}, oracle {summary['oracle_dtype']}{routing}, created "
                                f"{summary['created_at']} by evalrun {summary['evalrun']}"),
                      run_record_text(golden.pinned, results)])


BENCH_COLUMNS = [("config", "config"), ("batch", "batch_size"), ("compile s", "compile_s"),
                 ("peak GiB", "peak_memory_gib"), ("TTFT ms", "ttft_ms"), ("first req ms", "first_request_ms"),
                 ("tok/s", "tokens_per_s"),
                 ("p50 ms", "p50_ms"), ("p95 ms", "p95_ms"), ("p99 ms", "p99_ms"),
                 ("identical to first", "identical_to_first"), ("launches/step", "kernel_launches_per_decode_step")]


def bench_table(rows: list[dict[str, Any]]) -> str:
    """The bench's rows; with --repeats, beside tokens/s, its spread over the runs ((max - min) / median). Bits are
    compared with the first row's, or, where it failed at once, with the row named in the column's header."""
    columns = list(BENCH_COLUMNS)
    reference = next((row["identical_to"] for row in rows if "identical_to" in row), None)
    if rows and reference not in (None, rows[0]["config"]):  # the first row failed before its bits were known
        header = f"identical to {printable(reference)}"
        columns[columns.index(("identical to first", "identical_to_first"))] = (header, "identical_to_first")
    if any("repeats" in row for row in rows):
        columns.insert(columns.index(("tok/s", "tokens_per_s")) + 1, ("tok/s spread %", "tokens_per_s_spread_percent"))
    headers = [header for header, _ in columns] + ["fallbacks / error"]
    return table(headers, [[row.get(key) for _, key in columns]
                           + ["; ".join(row.get("fallbacks") or []) or row.get("error") or ""] for row in rows])


def fingerprint_text(header: dict[str, Any]) -> str:
    config, env, model = header["config"], header["environment"], header["model"]
    lines = [f"config       {header['config_hash']}"]
    lines += [f"  {key} = {value}" for key, value in sorted(config.items())]
    lines.append(f"environment  {header['environment_hash']}")
    lines += [f"  {key} = {value}" for key, value in sorted(env.items())]
    lines.append(f"model        {model['hash']}  ({model['ref']}, {model['parameters']:,} parameters)")
    lines += [f"  {part} = {model[part]}" for part in ("weights", "config", "tokenizer")]
    prompt_set = header["prompt_set"]
    lines.append(f"prompt set   {prompt_set['hash']}  ({prompt_set['name']}, {prompt_set['count']} prompts)")
    return "\n".join(lines)


def runs_table(runs: list[RunRecord]) -> str:
    rows = [[r.id[:12], r.created_at[:19], r.status, r.summary()["model"], r.summary()["prompts"],
             r.summary()["device"], r.summary()["dtype"], r.summary()["opt_level"], r.label or ""] for r in runs]
    return table(["run", "created", "status", "model", "prompts", "device", "dtype", "-O", "label"], rows)


def run_record_text(record: RunRecord, results: list[PromptResult]) -> str:
    """A stored run (`store show`, `golden show`): every value read from the file printed with `printable`, so
    none can add a line (a forged `::error::` workflow command) or a control character."""
    lines = [printable(f"run {record.id}  {record.status}  created {record.created_at}  finished "
                       f"{record.finished_at or '-'}")]
    if record.config:
        lines.append(config_line(record.config))
    lines.append(printable("hashes: " + "  ".join(f"{name} {str(value)[:12]}" for name, value in (
        ("config", record.config_hash), ("environment", record.environment_hash), ("model", record.model_hash),
        ("prompts", record.prompts_hash)))))
    if record.error:
        lines.append(printable(f"error: {record.error}"))
    if results:
        lines.append(results_table(results))
    if record.json.get("timings"):
        lines.append(timings_text(record.json["timings"]))
    return "\n".join(lines)
