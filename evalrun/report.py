"""Text and JSON renderings of runs, fingerprints and store listings (no computation here)."""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from .store import PromptResult, RunRecord


def to_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


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
    return "" if value is None else str(value)


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
    return (f"model={config['model']} device={config['device']} dtype={config['dtype']} -O{config['opt_level']} "
            f"compilation={config['compilation_mode']} cudagraphs={config['cudagraph_mode']} "
            f"batch={config['batch_size']} deterministic={str(config['deterministic']).lower()}")


def timings_text(timings: dict[str, Any]) -> str:
    latency = timings["step_latency"]
    memory = timings["peak_memory"]
    return (f"load {timings['load_s']:.2f}s  compile {timings['compile_s']:.2f}s  warm-up {timings['warmup_s']:.2f}s  "
            f"TTFT p50 {timings['ttft_ms']['p50']:.1f} ms  step p50/p95/p99 {latency['p50_ms']:.2f}/"
            f"{latency['p95_ms']:.2f}/{latency['p99_ms']:.2f} ms  {timings['tokens_per_s']:.1f} tok/s  "
            f"peak {human_bytes(memory['bytes'])} ({memory['kind']})")


def results_table(results: list[PromptResult]) -> str:
    rows = []
    for r in results:
        margins = r.arrays.get("margins")
        rows.append([r.prompt_id, r.input_tokens, r.new_tokens, r.eos_step if r.eos_step >= 0 else "-",
                     f"{float(margins.min()):.3f}" if margins is not None and margins.size else "",
                     r.logits_digest[:12], snippet(r.output_text)])
    return table(["prompt", "in", "new", "eos", "min margin", "logits digest", "output"], rows)


def run_text(run_id: str | None, header: dict[str, Any], results: list[PromptResult], timings: dict[str, Any],
             evidence: dict[str, Any]) -> str:
    lines = [config_line(header["config"]), results_table(results), timings_text(timings)]
    if evidence.get("fallbacks"):
        lines.append("FALLBACKS: " + "; ".join(evidence["fallbacks"]))
    if run_id:
        lines.append(f"run {run_id}")
    return "\n".join(lines)


def run_json(run_id: str | None, header: dict[str, Any], results: list[PromptResult], timings: dict[str, Any],
             evidence: dict[str, Any], tokens_digest: str, logits_digest: str) -> dict[str, Any]:
    return {
        "run_id": run_id, "config": header["config"], "config_hash": header["config_hash"],
        "environment_hash": header["environment_hash"], "model": header["model"], "prompt_set": header["prompt_set"],
        "timings": timings, "evidence": evidence, "tokens_digest": tokens_digest, "logits_digest": logits_digest,
        "results": [{"prompt_id": r.prompt_id, "input_tokens": r.input_tokens, "new_tokens": r.new_tokens,
                     "eos_step": r.eos_step, "tokens": r.arrays["tokens"].tolist(), "text": r.output_text,
                     "tokens_digest": r.tokens_digest, "logits_digest": r.logits_digest} for r in results],
    }


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
    lines = [f"run {record.id}  {record.status}  created {record.created_at}  finished {record.finished_at or '-'}"]
    if record.config:
        lines.append(config_line(record.config))
    lines.append(f"hashes: config {record.config_hash[:12]}  environment {record.environment_hash[:12]}  "
                 f"model {record.model_hash[:12]}  prompts {record.prompts_hash[:12]}")
    if record.error:
        lines.append(f"error: {record.error}")
    if results:
        lines.append(results_table(results))
    if record.json.get("timings"):
        lines.append(timings_text(record.json["timings"]))
    return "\n".join(lines)
