"""evalrun: reproducibility and evaluation harness for LLM inference.

Library first: `evalrun.runner.execute_run` does a run, `evalrun.store.Store` keeps it,
`evalrun.golden` and `evalrun.diff` compare runs. `evalrun.cli` is a thin click front end.
"""

__version__ = "0.1.0"
