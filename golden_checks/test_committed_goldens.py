"""The committed goldens, checked by evalrun's pytest plugin (`.ci/run` runs this under every CPU
instruction set; the GitHub Actions recipe in examples/ runs it on every PR).

Identical passes, drift passes with a warning, changed fails, incomparable is an error; the verdict's
Markdown goes to $GITHUB_STEP_SUMMARY on Actions and to --evalrun-comment FILE.
"""

import pytest


@pytest.mark.evalrun_golden("smollm2-cpu")
def test_smollm2_cpu_golden(evalrun_verdict):
    assert evalrun_verdict.prompts, "the golden's prompts were verified one by one"
