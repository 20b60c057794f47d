"""Renderings of a golden verdict: text table, JSON, Markdown (PR comment), JUnit XML."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from typing import Any

from .report import markdown_cell, printable, table, to_json
from .verify import PromptVerdict, Verdict

MARK = {"identical": "✅", "drift": "🟡", "changed": "❌", "incomparable": "⛔"}
HEADERS = ["prompt", "verdict", "first divergent step", "digest diffs", "function (x budget)", "execution (x budget)",
           "flips (golden -> candidate, oracle gap)"]


def _flips_text(prompt: PromptVerdict, limit: int = 3) -> str:
    shown = [f"@{f.step} {f.golden_token!r}->{f.candidate_token!r} ({f.oracle_gap:.3g}"
             f"{'' if f.passed else ' > ' + format(f.allowed_gap, '.3g')})" for f in prompt.flips[:limit]]
    more = len(prompt.flips) - limit
    return "; ".join(shown) + (f"; +{more} more" if more > 0 else "")


def _check(report) -> str:
    return "-" if report is None else f"{report.distance:.2f}" + (" FAIL" if report.reason else "")


def _rows(verdict: Verdict) -> list[list[Any]]:
    return [[p.prompt_id, p.verdict, p.first_divergent_step if p.first_divergent_step >= 0 else "-",
             p.digest_mismatches, _check(p.function), _check(p.execution), _flips_text(p)] for p in verdict.prompts]


def _summary_lines(verdict: Verdict) -> list[str]:
    lines = [f"function check: {verdict.function_check}", f"execution check: {verdict.execution_check}"]
    lines += [f"prompt {p.prompt_id}: {p.routing.describe('golden', 'candidate')}" for p in verdict.prompts
              if p.routing is not None]
    if verdict.envelope:
        lines.append("envelope: " + "; ".join(verdict.envelope))
    if verdict.closest:
        lines.append(f"closest to the decision: {verdict.closest} at {verdict.distance:.2f} of its budget")
    if verdict.candidate_run:
        lines.append(f"candidate run {verdict.candidate_run['run_id']} kept in {verdict.candidate_run['store']} "
                     f"(evalrun diff {verdict.candidate_run['run_id'][:12]} golden:{verdict.golden})")
    return lines


def text(verdict: Verdict) -> str:
    lines = [f"golden {verdict.golden}: {verdict.verdict.upper()} (exit {verdict.exit_code})"]
    lines += [f"  cause: {printable(cause)}" for cause in verdict.causes]  # a golden's text adds no line
    lines += [f"  {line}" for line in _summary_lines(verdict)]
    if verdict.prompts:
        lines.append(table(HEADERS, _rows(verdict)))
    return "\n".join(lines)


def as_json(verdict: Verdict) -> str:
    return to_json(verdict.as_dict())


def markdown(verdict: Verdict) -> str:
    """A PR comment. Every value that came from a file (prompt ids, decoded tokens, causes) is escaped:
    no HTML, no Markdown structure, no line breaks can be injected through them."""
    lines = [f"### {MARK[verdict.verdict]} evalrun golden `{verdict.golden}`: **{verdict.verdict}**", ""]
    lines += [f"- {markdown_cell(cause)}" for cause in verdict.causes]
    lines += [f"- {markdown_cell(line)}" for line in _summary_lines(verdict)]
    lines.append("")
    if verdict.prompts:
        lines.append("| " + " | ".join(HEADERS) + " |")
        lines.append("|" + "---|" * len(HEADERS))
        lines += ["| " + " | ".join(markdown_cell(cell) for cell in row) + " |" for row in _rows(verdict)]
    return "\n".join(lines) + "\n"


def junit(verdict: Verdict, strict: bool) -> str:
    """One testcase per prompt; `changed` fails, `drift` fails only under --strict, `incomparable` errors.
    Suite properties carry the verdict, the causes and the distance to the budget."""
    suite = ElementTree.Element("testsuite", name=f"evalrun.golden.{verdict.golden}", tests=str(max(1, len(verdict.prompts))))
    properties = ElementTree.SubElement(suite, "properties")
    for name, value in (("verdict", verdict.verdict), ("distance", f"{verdict.distance:.4g}"),
                        ("closest", verdict.closest), ("causes", "; ".join(verdict.causes))):
        ElementTree.SubElement(properties, "property", name=f"evalrun.{name}", value=str(value))
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
    if verdict.verdict == "changed" and not failures:  # e.g. the whole set failed, or a gate
        failures += 1
        case = ElementTree.SubElement(suite, "testcase", classname=f"golden.{verdict.golden}", name="(the set)")
        ElementTree.SubElement(case, "failure", message="; ".join(verdict.causes))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True)


def render(verdict: Verdict, output_format: str) -> str:
    return {"text": text, "json": as_json, "markdown": markdown}[output_format](verdict)
