"""Renderings of a golden verdict: text table, JSON, Markdown (PR comment), JUnit XML."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from typing import Any

from .golden import PromptVerdict, Verdict
from .report import table

MARK = {"identical": "✅", "drift": "🟡", "changed": "❌", "incomparable": "⛔"}


def _flips_text(prompt: PromptVerdict, limit: int = 3) -> str:
    shown = [f"@{f.step} {f.golden_token!r}->{f.candidate_token!r} (margin {f.golden_margin:.3f}, oracle "
             f"{f.oracle_margin:.3f})" for f in prompt.flips[:limit]]
    more = len(prompt.flips) - limit
    return "; ".join(shown) + (f"; +{more} more" if more > 0 else "")


def _rows(verdict: Verdict) -> list[list[Any]]:
    return [[p.prompt_id, p.verdict, p.first_divergent_step if p.first_divergent_step >= 0 else "-",
             p.digest_mismatches, len(p.flips), f"{p.worst_ratio:.2f}" if p.worst_ratio else "-", _flips_text(p)]
            for p in verdict.prompts]


HEADERS = ["prompt", "verdict", "first divergent step", "digest diffs", "flips", "worst error ratio", "flips (golden -> candidate)"]


def text(verdict: Verdict) -> str:
    lines = [f"golden {verdict.golden}: {verdict.verdict.upper()} (exit {verdict.exit_code})"]
    lines += [f"  cause: {cause}" for cause in verdict.causes]
    lines.append(f"  reference re-run: {verdict.reference_rerun}")
    if verdict.prompts:
        lines.append(table(HEADERS, _rows(verdict)))
    return "\n".join(lines)


def as_json(verdict: Verdict) -> str:
    return json.dumps(verdict.as_dict(), indent=2, sort_keys=True, default=str, ensure_ascii=False)


def _md_cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", "\\n")


def markdown(verdict: Verdict) -> str:
    lines = [f"### {MARK[verdict.verdict]} evalrun golden `{verdict.golden}`: **{verdict.verdict}**", ""]
    lines += [f"- {_md_cell(cause)}" for cause in verdict.causes]
    lines += [f"- reference re-run: {verdict.reference_rerun}", ""]
    if verdict.prompts:
        lines.append("| " + " | ".join(HEADERS) + " |")
        lines.append("|" + "---|" * len(HEADERS))
        lines += ["| " + " | ".join(_md_cell(cell) for cell in row) + " |" for row in _rows(verdict)]
    return "\n".join(lines) + "\n"


def junit(verdict: Verdict, strict: bool) -> str:
    """One testcase per prompt; `changed` fails, `drift` fails only under --strict, `incomparable` errors."""
    suite = ElementTree.Element("testsuite", name=f"evalrun.golden.{verdict.golden}", tests=str(max(1, len(verdict.prompts))))
    failures = errors = 0
    cases = verdict.prompts or [PromptVerdict("(golden)", verdict.verdict, -1, 0, reason="; ".join(verdict.causes))]
    for prompt in cases:
        case = ElementTree.SubElement(suite, "testcase", classname=f"golden.{verdict.golden}", name=prompt.prompt_id)
        message = f"{prompt.verdict}: {prompt.reason or '; '.join(verdict.causes)}"
        if prompt.verdict == "incomparable":
            errors += 1
            ElementTree.SubElement(case, "error", message=message)
        elif prompt.verdict == "changed" or (strict and prompt.verdict == "drift"):
            failures += 1
            ElementTree.SubElement(case, "failure", message=message).text = _flips_text(prompt, 20)
        elif prompt.verdict == "drift":
            ElementTree.SubElement(case, "system-out").text = message + " " + _flips_text(prompt, 20)
    if verdict.verdict == "changed" and not failures:  # e.g. the reference re-run did not reproduce
        failures += 1
        case = ElementTree.SubElement(suite, "testcase", classname=f"golden.{verdict.golden}", name="(reference re-run)")
        ElementTree.SubElement(case, "failure", message="; ".join(verdict.causes))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True)


def render(verdict: Verdict, output_format: str) -> str:
    return {"text": text, "json": as_json, "markdown": markdown}[output_format](verdict)
