"""Verdicts where reviewers look, on GitHub Actions: the job's step summary and workflow annotations.

GitHub sets `GITHUB_STEP_SUMMARY` to a file whose Markdown is shown on the run's page, and reads
`::error title=T::message` / `::warning ...` lines on a step's stdout as annotations. Outside Actions
(neither variable set) nothing is written. The messages come from files (prompt ids, causes): they are
escaped so that no line break or `::` sequence can start another workflow command.
"""

from __future__ import annotations

import os
from pathlib import Path

ANNOTATION_LEVEL = {"changed": "error", "incomparable": "error", "error": "error", "drift": "warning"}


def on_github_actions() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def step_summary_path() -> Path | None:
    value = os.environ.get("GITHUB_STEP_SUMMARY")
    return Path(value) if value else None


def append_step_summary(markdown: str) -> bool:
    """Append to the step summary (several commands and workers may each append); False when not on Actions."""
    path = step_summary_path()
    if path is None:
        return False
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(markdown.rstrip("\n") + "\n\n")
    return True


def _escape(text: str, for_property: bool = False) -> str:
    """GitHub's workflow-command escaping: %, CR and LF always; ':' and ',' in properties."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if for_property else text


def annotation(verdict: str, title: str, message: str) -> str | None:
    """The workflow command for a verdict (`::error` for changed, incomparable and error, evalrun's own failure;
    `::warning` for drift), or None when the verdict needs none."""
    level = ANNOTATION_LEVEL.get(verdict)
    if level is None:
        return None
    return f"::{level} title={_escape(title, True)}::{_escape(message)}"
