"""One evalrun module in a fresh process, for work whose configs must not leak into each other
(bench rows, bisect probes): its JSON result from stdout, or one line saying why there is none."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from .fingerprint import inherited_environ


def run_json_child(arguments: list[str], timeout: float, stdin: str | None = None,
                   timeout_hint: str = "") -> tuple[dict[str, Any] | None, str | None]:
    """`python -m ARGUMENTS` -> (parsed stdout, None), or (None, the reason in one line): a timeout, the
    child's last stderr line, or output that is not JSON. The child starts from this process's own
    environment less what evalrun set for a config here."""
    try:
        process = subprocess.run([sys.executable, "-m", *arguments], input=stdin, capture_output=True, text=True,
                                 timeout=timeout, env=inherited_environ())
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s{timeout_hint}"
    if process.returncode != 0:
        lines = process.stderr.strip().splitlines()
        return None, lines[-1][:300] if lines else f"exit {process.returncode}"
    try:
        return json.loads(process.stdout), None
    except json.JSONDecodeError:
        return None, "the child process printed no JSON result"
