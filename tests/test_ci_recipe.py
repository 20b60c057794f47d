"""The GitHub Actions recipe (examples/github-actions/evalrun.yml), run here: its `evalrun:` steps of the CPU
job, verbatim, in a workspace like the runner's, with a fake GITHUB_STEP_SUMMARY (a random:tiny golden
stands in for the committed SmolLM2 one, under the same name)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "github-actions" / "evalrun.yml"


def _steps(job: dict) -> list[dict]:
    return [step for step in job["steps"] if str(step.get("name", "")).startswith("evalrun:")]


def test_the_recipe_is_a_workflow_with_a_cpu_and_a_gpu_job():
    workflow = yaml.safe_load(RECIPE.read_text())
    assert set(workflow["jobs"]) == {"cpu", "gpu"} and workflow["jobs"]["gpu"]["runs-on"] == ["self-hosted", "gpu"]
    for job in workflow["jobs"].values():
        assert _steps(job) and any(step.get("uses", "").startswith("actions/upload-artifact") for step in job["steps"])
    assert "--fail-on tokens_per_s:5%" in _steps(workflow["jobs"]["gpu"])[1]["run"]


def test_the_cpu_jobs_evalrun_steps_verify_and_report_where_reviewers_look(cli, tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / ".venv").symlink_to(Path(sys.prefix))  # the project's own environment, as `make setup` makes it
    shutil.copytree(ROOT / "golden_checks", workspace / "golden_checks")
    code, _, err = cli("golden", "create", "smollm2-cpu", "--model", "random:tiny", "--prompts", "smoke",
                       "--max-new-tokens", "4", "--dir", str(workspace / "golden"), "--quiet")
    assert code == 0, err
    job = yaml.safe_load(RECIPE.read_text())["jobs"]["cpu"]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST", "CI", "GITHUB"))}
    env.update({key: str(value).replace("${{ github.workspace }}", str(workspace)) for key, value in job["env"].items()})
    env.update(GITHUB_ACTIONS="true", GITHUB_STEP_SUMMARY=str(tmp_path / "summary.md"))
    outputs = []
    for step in _steps(job):
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=workspace, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (step["name"], done.stdout[-3000:], done.stderr[-3000:])
        outputs.append(done.stdout)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("## evalrun: 1 identical") and "evalrun golden `smollm2-cpu`: **identical**" in summary
    assert (workspace / "evalrun-out" / "comment.md").read_text().strip() == summary.strip()  # the PR comment body
    cases = ElementTree.parse(workspace / "evalrun-out" / "junit.xml").getroot().iter("testcase")
    properties = {p.get("name"): p.get("value") for case in cases for p in case.iter("property")}
    assert properties["evalrun.verdict"] == "identical" and properties["evalrun.golden"] == "smollm2-cpu"
    runs = json.loads((workspace / "evalrun-out" / "runs.json").read_text())
    assert [run["label"] for run in runs] == ["pytest:golden_checks/test_committed_goldens.py::test_smollm2_cpu_golden"]
    assert "::" not in outputs[0]  # identical: no annotation
