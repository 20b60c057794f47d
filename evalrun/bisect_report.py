"""Renderings of a `BisectResult`: text, JSON, Markdown (a PR comment), and a per-layer error plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .bisect import BisectResult
from .errors import EvalrunError
from .report import markdown_cell, markdown_code, table, to_json

PROBE_HEADERS = ["probe", "knobs of BAD on GOOD", "outcome", "run", "note"]


def _knobs_text(names: list[str], limit: int = 4) -> str:
    if not names:
        return "(GOOD)"
    return ", ".join(names[:limit]) + (f" +{len(names) - limit} more" if len(names) > limit else "")


def _probe_rows(result: BisectResult) -> list[list[Any]]:
    return [[probe.index, _knobs_text(probe.knobs), probe.outcome,
             (probe.run_id[:12] + (" (reused)" if probe.reused else "")) if probe.run_id else "-", probe.note[:90]]
            for probe in result.probes]


def headline(result: BisectResult) -> str:
    """One line: what was found."""
    culprit = result.culprit
    if culprit.kind == "none":
        return f"no culprit: {culprit.note}"
    knobs = ", ".join(knob.describe() for knob in result.culprit_knobs)
    if culprit.kind == "interaction":
        return f"culprit: an interaction of {len(result.culprit_knobs)} knobs: {knobs} ({culprit.note})"
    return f"culprit: {knobs}" + (f" ({culprit.note})" if culprit.note else "")


def _stage_one(result: BisectResult) -> list[str]:
    reused = f", {result.reused} reused from the store" if result.reused else ""
    ladder = "; ".join(knob.describe() for knob in result.knobs) or "none"
    return [f"stage 1, knob ladder: {len(result.knobs)} knob(s) differ: {ladder}",
            f"  {result.runs} run(s){reused}; bound for one culprit: "
            f"{'ceil(log2 K) + 3 = ' if len(result.knobs) > 1 else ''}{result.bound}",
            f"  {headline(result)}"]


def _stage_two(result: BisectResult) -> list[str]:
    report = result.compiler
    if report is None:
        return ["stage 2, inside the compiler: skipped"]
    lines = [f"stage 2, inside the compiler: {report.status}: {report.summary}"]
    if report.calls:
        lines.append(f"  {report.calls} call(s) in this process (not stored); reference: {report.reference}")
    lines += [f"  note: {note}" for note in report.notes]
    return lines


def _stage_three(result: BisectResult) -> list[str]:
    report = result.layer
    if report is None:
        return ["stage 3, layer: skipped"]
    if not report.points:  # the stage could not run; its summary says why
        return [f"stage 3, layer: {report.summary}"]
    lines = [f"stage 3, layer: {report.summary}",
             f"  one forward over prompt {report.prompt_id!r} + GOOD's tokens ({report.tokens} tokens) for each of "
             f"GOOD, the culprit and the reference, in this process (not stored); rule: {report.rule}",
             "  observed: " + "; ".join(f"{who}: {how}" for who, how in report.observed.items())]
    return lines + [f"  note: {note}" for note in report.notes]


def _stage_four(result: BisectResult) -> list[str]:
    step = result.step
    if step is None:
        return ["stage 4, prompt and step: the culprit's run and GOOD's agree bit for bit on every prompt"]
    tokens = f"tokens at step {step.token_step}" if step.token_step >= 0 else "tokens equal throughout"
    logits = f"logits first differ at step {step.step}" if step.step >= 0 else "logits equal"
    lines = [f"stage 4, prompt and step: prompt {step.prompt_id!r} ({step.prompts_differing} prompt(s) differ), "
             f"{logits}, {tokens}",
             f"  at step {step.shown_step}: GOOD {step.good_token!r} (margin {step.good_margin:.4g}) vs culprit "
             f"{step.bad_token!r} (margin {step.bad_margin:.4g}); {step.compared}"]
    if step.verdict_reason:
        gap = f"; oracle gap {step.oracle_gap:.4g}" if step.oracle_gap is not None else ""
        lines.append(f"  verdict: {step.verdict_reason}{gap}")
    return lines


def _later_stages(result: BisectResult) -> list[str]:
    if result.culprit.kind == "none":
        return ["stages 2-4: not run (no culprit to look into)"] + _comparison(result)
    return _stage_two(result) + _stage_three(result) + _stage_four(result) + _comparison(result)


def _comparison(result: BisectResult) -> list[str]:
    """--compare-compiler-bisector: what torch's bisector alone, on BAD as a whole, took and said."""
    alone = result.compiler_alone
    if alone is None:
        return []
    ours = result.runs + (result.compiler.calls if result.compiler is not None else 0)
    return [f"for comparison, CompilerBisector alone on BAD: {alone.calls} call(s): {alone.status}: {alone.summary}",
            f"  evalrun: {ours} ({result.runs} stored run(s) in stage 1 + "
            f"{result.compiler.calls if result.compiler is not None else 0} CompilerBisector call(s) in stage 2)"]


def _layer_rows(result: BisectResult) -> list[list[Any]]:
    report = result.layer
    return [[p.name, f"{p.good_error:.3g}", f"{p.bad_error:.3g}", f"{p.allowed:.3g}",
             "OUT" if p.bad_error > p.allowed else "in", "yes" if p.bits_equal else "no"] for p in report.points]


LAYER_HEADERS = ["sub-block", "GOOD err", "culprit err", "allowed", "envelope", "bits equal"]


def text(result: BisectResult) -> str:
    lines = [f"evalrun bisect {result.good} -> {result.bad}, until {result.until} (session {result.session}, "
             f"store {result.store}, {result.seconds:.1f} s)"]
    lines += _stage_one(result)
    lines.append(table(PROBE_HEADERS, _probe_rows(result)))
    lines += _later_stages(result)
    if result.layer is not None and result.layer.points:
        lines.append(table(LAYER_HEADERS, _layer_rows(result)))
    if result.culprit_run and result.probes and result.probes[0].run_id:
        lines.append(f"see: evalrun diff {result.probes[0].run_id[:12]} {result.culprit_run[:12]} "
                     f"--store {result.store}")
    return "\n".join(lines)


def as_json(result: BisectResult) -> str:
    return to_json(result.as_dict())


def markdown(result: BisectResult) -> str:
    """A PR comment; every value that came from the user or a file is escaped (`report.markdown_cell`)."""
    md = markdown_cell
    lines = [f"### evalrun bisect: {md(headline(result))}", "",
             f"GOOD {md(result.good)} → BAD {md(result.bad)}, until {md(result.until)}", ""]
    for line in _stage_one(result)[:2] + _later_stages(result):
        lines.append(f"- {md(line.strip())}")
    lines += ["", "| " + " | ".join(PROBE_HEADERS) + " |", "|" + "---|" * len(PROBE_HEADERS)]
    lines += ["| " + " | ".join(md(cell) for cell in row) + " |" for row in _probe_rows(result)]
    if result.layer is not None and result.layer.points:
        lines += ["", "| " + " | ".join(LAYER_HEADERS) + " |", "|" + "---|" * len(LAYER_HEADERS)]
        lines += ["| " + " | ".join(md(cell) for cell in row) + " |" for row in _layer_rows(result)]
    if result.compiler is not None and result.compiler.log:
        lines += ["", "<details><summary>CompilerBisector log</summary>", "", *markdown_code(result.compiler.log),
                  "", "</details>"]
    return "\n".join(lines) + "\n"


def render(result: BisectResult, output_format: str) -> str:
    return {"text": text, "json": as_json, "markdown": markdown}[output_format](result)


def plot(result: BisectResult, path: Path) -> None:
    """Per sub-block relative error against float64: GOOD, the culprit, and the envelope (log scale)."""
    if result.layer is None:
        raise EvalrunError("--plot needs stage 3 (the layer stage), which did not run; drop --skip layer")
    if not result.layer.points:
        raise EvalrunError(f"--plot needs stage 3 (the layer stage), which did not run ({result.layer.summary}); "
                           "drop --plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EvalrunError("--plot needs matplotlib; install it with pip install 'evalrun[plot]'") from None
    points = result.layer.points
    tiny = min([v for p in points for v in (p.good_error, p.bad_error) if v > 0], default=1e-12) / 10
    figure, axis = plt.subplots(figsize=(max(6.0, 0.35 * len(points)), 4.5))
    x = range(len(points))
    axis.plot(x, [max(p.good_error, tiny) for p in points], marker="o", label="GOOD vs float64")
    axis.plot(x, [max(p.bad_error, tiny) for p in points], marker="x", label="culprit vs float64")
    axis.plot(x, [p.allowed for p in points], linestyle=":", color="grey", label="envelope")
    if result.layer.first_out is not None:
        axis.axvline(points.index(result.layer.first_out), color="red", linewidth=0.8)
    axis.set_yscale("log")
    axis.set_xticks(list(x), [p.name.replace("layer ", "L") for p in points], rotation=90, fontsize=7)
    axis.set_ylabel("relative RMS error against float64")
    axis.set_title(f"bisect {result.good} -> {result.bad}: {result.layer.prompt_id}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
