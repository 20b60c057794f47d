"""Renderings of a `RunDiff`: text, JSON, Markdown, and a per-step error plot (matplotlib, optional)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from .diff import PromptDiff, RunDiff
from .errors import EvalrunError
from .report import markdown_cell, markdown_code, printable, table, to_json


def _value(value: Any, width: int = 60) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 1] + "…"


def _key_rows(diff: RunDiff) -> list[list[str]]:
    rows = []
    for section in ("config", "environment", "model", "prompt_set"):
        rows += [[section, key, _value(a), _value(b)] for key, a, b in getattr(diff, section)]
    return rows


def _summary(prompt: PromptDiff) -> dict[str, Any]:
    series = prompt.series
    return {"digest_equal_steps": f"{sum(series.digest_equal)}/{prompt.steps}",
            "max_abs_delta": max(series.max_abs_delta, default=0.0), "ulp_max": max(series.ulp_max, default=0.0),
            "ulp_median": float(np.median(series.ulp_median)) if series.ulp_median else 0.0,
            "kl_max": max(series.kl, default=0.0), "overlap_min": min(series.topk_overlap, default=1.0)}


PROMPT_HEADERS = ["prompt", "tokens", "first divergent step", "digest-equal steps", "max |delta|", "ULP max",
                  "ULP median", "KL max", "top-k overlap min"]


def _prompt_rows(diff: RunDiff) -> list[list[Any]]:
    rows = []
    for prompt in diff.prompts:
        s = _summary(prompt)
        rows.append([prompt.prompt_id, _tokens_cell(prompt),
                     prompt.first_divergent_step if prompt.first_divergent_step >= 0 else "-", s["digest_equal_steps"],
                     f"{s['max_abs_delta']:.3g}", f"{s['ulp_max']:.0f}", f"{s['ulp_median']:.1f}", f"{s['kl_max']:.2g}",
                     f"{s['overlap_min']:.2f}"])
    return rows


def _tokens_cell(prompt: PromptDiff) -> str:
    """identical, differ, or (one run shorter, e.g. another max_new_tokens) equal over the shared steps."""
    if prompt.tokens_identical:
        return "identical"
    if prompt.first_divergent_step == prompt.steps:
        return f"same {prompt.steps}, one run longer"
    return "differ"


def _divergence_lines(diff: RunDiff, prompt: PromptDiff) -> list[str]:
    """Where one prompt's tokens part; every value from a run (ids, names, decoded text) through `printable`."""
    a, b = printable(diff.a), printable(diff.b)
    lines = [printable(f"{prompt.prompt_id}: tokens part at step {prompt.first_divergent_step}"),
             printable(f"  {a}: {prompt.context_a!r}  (margin {prompt.margin_a:.4f})"),
             printable(f"  {b}: {prompt.context_b!r}  (margin {prompt.margin_b:.4f})")]
    rows = [[rank + 1, f"{x['id']} {x['token']!r}", f"{x['value']:.4f}", f"{y['id']} {y['token']!r}", f"{y['value']:.4f}"]
            for rank, (x, y) in enumerate(zip(prompt.top_a, prompt.top_b))]
    lines.append("  " + table(["#", f"{a} token", "value", f"{b} token", "value"], rows).replace("\n", "\n  "))
    return lines


def _logits_lines(prompt: PromptDiff) -> list[str]:
    figures = prompt.logits
    histogram = ", ".join(f"{k}: {v}" for k, v in figures["ulp_histogram"].items() if v) or "n/a (two dtypes)"
    return [printable(f"{prompt.prompt_id}: full logits over {len(figures['steps'])} steps, {figures['elements']:,} "
                      f"elements: {figures['bit_identical_share']:.2%} bit-identical; max |delta| "
                      f"{figures['max_abs_delta']:.4g} at step {figures['max_at_step']}, token id "
                      f"{figures['max_at_token_id']}; ULPs {histogram}")]


def text(diff: RunDiff) -> str:
    """The terminal rendering: every value from a run (ids, names, prompt ids, decoded text) goes through
    `printable` (a table's cells do in `table`), so no stored text can add a line or a control character."""
    a, b = printable(diff.a), printable(diff.b)
    lines = [f"diff {a} vs {b}"]
    key_rows = _key_rows(diff)
    lines.append(table(["section", "key", a, b], key_rows) if key_rows else "same config, environment, model and prompt set")
    if diff.note:
        lines.append(printable(f"note: {diff.note}"))
    if diff.not_comparable:
        lines.append(printable(f"not comparable (in one run only, or different input tokens): "
                               f"{', '.join(diff.not_comparable)}"))
    if diff.prompts:
        lines.append(table(PROMPT_HEADERS, _prompt_rows(diff)))
    for prompt in diff.prompts:
        if not prompt.tokens_identical and prompt.top_a:
            lines += _divergence_lines(diff, prompt)
        if prompt.logits:
            lines += _logits_lines(prompt)
        lines += _routing_lines(diff, prompt)
    return "\n".join(lines)


def _routing_lines(diff: RunDiff, prompt: PromptDiff) -> list[str]:
    """MoE models: where the prompt's tokens, then the steps' tokens, were routed to other experts."""
    return [printable(f"{prompt.prompt_id}: {where.describe(diff.a, diff.b)}")
            for where in (prompt.prompt_routing, prompt.routing) if where is not None]


def as_json(diff: RunDiff) -> str:
    data = dataclasses.asdict(diff)
    for section in ("config", "environment", "model", "prompt_set"):
        data[section] = [{"key": k, "a": a, "b": b} for k, a, b in getattr(diff, section)]
    for prompt, entry in zip(diff.prompts, data["prompts"]):
        entry["summary"] = _summary(prompt)
    return to_json(data)


_md = markdown_cell


def markdown(diff: RunDiff) -> str:
    """A PR comment; every value from a run (ids, tokens, prompt ids) is escaped (`report.markdown_cell`)."""
    lines = [f"### evalrun diff {_md(diff.a)} vs {_md(diff.b)}", ""]
    key_rows = _key_rows(diff)
    if key_rows:
        lines += [f"| section | key | {_md(diff.a)} | {_md(diff.b)} |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in key_rows]
        lines.append("")
    if diff.note:
        lines += [f"> {_md(diff.note)}", ""]
    if diff.not_comparable:  # as the text says it: a comment that compared nothing must say so
        lines += [f"**not comparable** (in one run only, or different input tokens): "
                  f"{_md(', '.join(diff.not_comparable))}", ""]
    if diff.prompts:  # headers escaped too: "max |delta|" split its cell and GitHub rendered no table
        lines += ["| " + " | ".join(_md(h) for h in PROMPT_HEADERS) + " |", "|" + "---|" * len(PROMPT_HEADERS)]
        lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in _prompt_rows(diff)]
    for prompt in diff.prompts:
        if not prompt.tokens_identical and prompt.top_a:
            lines += ["", *markdown_code(_divergence_lines(diff, prompt))]
        if prompt.logits:
            lines += ["", *[f"- {_md(line)}" for line in _logits_lines(prompt)]]
        for line in _routing_lines(diff, prompt):
            lines += ["", f"- {_md(line)}"]
    return "\n".join(lines) + "\n"


def render(diff: RunDiff, output_format: str) -> str:
    return {"text": text, "json": as_json, "markdown": markdown}[output_format](diff)


def plot(diff: RunDiff, path: Path) -> None:
    """Per-step max |delta| over shared top-k ids, one line per prompt (symlog scale: zero stays zero)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EvalrunError("--plot needs matplotlib; install it with pip install 'evalrun[plot]'") from None
    figure, axis = plt.subplots(figsize=(9, 4.5))
    positive = [v for p in diff.prompts for v in p.series.max_abs_delta if v > 0]
    for prompt in diff.prompts:
        values = np.asarray(prompt.series.max_abs_delta)
        axis.plot(range(len(values)), values, label=prompt.prompt_id, linewidth=1)
        if prompt.first_divergent_step >= 0:
            axis.axvline(prompt.first_divergent_step, linestyle=":", linewidth=0.8, color=axis.lines[-1].get_color())
    # symlog: exact zeros (bit-identical steps) stay visible at 0 beside errors spanning decades
    axis.set_yscale("symlog", linthresh=min(positive) if positive else 1e-8)
    axis.set_xlabel("decode step")
    axis.set_ylabel("max |delta| over shared top-k")
    axis.set_title(f"{diff.a} vs {diff.b}")
    if len(diff.prompts) <= 20:
        axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
