"""`evalrun invariance` rendered: a text table, a Markdown comment (JSON is `InvarianceReport.as_dict`)."""

from __future__ import annotations

from .invariance import InvarianceReport, PromptInvariance
from .report import config_line, markdown_cell, table


def _yes(value: bool | None, unmeasured: str) -> str:
    return f"not measured ({unmeasured})" if value is None else "yes" if value else "no"


def _config(report: InvarianceReport) -> str:
    return f"{config_line(report.config)} batch_invariant={report.config.get('batch_invariant')}"


def summary_line(report: InvarianceReport) -> str:
    return (f"batch-invariant: {_yes(report.batch_invariant, 'no batch size but 1')}; "
            f"run-to-run deterministic: {_yes(report.run_to_run_deterministic, 'one repeat')}")


def _step(step: int) -> str:
    return "-" if step < 0 else str(step)


def _margin(prompt: PromptInvariance) -> str:
    return "-" if prompt.margin_at_divergence is None else f"{prompt.margin_at_divergence:.4g}"


def _row(prompt: PromptInvariance) -> list[str]:
    return [prompt.prompt_id, str(prompt.unique_token_sequences), str(prompt.unique_logits_digests),
            _step(prompt.first_divergent_step), _step(prompt.token_divergent_step), _margin(prompt),
            ", ".join(prompt.differs_in) or "-"]


HEADERS = ("prompt", "token seqs", "logits digests", "first diff step", "token flip step", "margin there", "differs in")


def _scope(report: InvarianceReport) -> str:
    cells = len({run["cell"] for run in report.runs})
    return (f"batch sizes {','.join(map(str, report.batch_sizes))}, positions {','.join(report.positions)}, "
            f"{report.repeats} repeat(s): {cells} cells, {len(report.runs)} runs, {report.seconds:.1f} s")


def invariance_text(report: InvarianceReport) -> str:
    lines = [summary_line(report), _config(report), _scope(report), "",
             table(HEADERS, [_row(p) for p in report.prompts]), "",
             "reference: each prompt alone, first repeat; margin: the reference's top1-top2 at the token flip "
             "(else at the first differing logits step)", "",
             table(("cell", "repeat", "run", "tokens/s"),
                   [[r["cell"], r["repeat"], (r["run_id"] or "-")[:12], f"{r['tokens_per_s']:.1f}"] for r in report.runs])]
    return "\n".join(lines)


def invariance_markdown(report: InvarianceReport) -> str:
    """A PR comment; prompt ids came from a file and are escaped."""
    lines = [f"### evalrun invariance: {summary_line(report)}", "", f"`{_config(report)}`", "",
             _scope(report), "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(markdown_cell(cell) for cell in _row(p)) + " |" for p in report.prompts]
    lines += ["", "Reference: each prompt alone, first repeat. Margin: the reference's top1-top2 logit gap at the "
              "token flip (else at the first differing logits step); a small margin means a near-tie."]
    return "\n".join(lines)
