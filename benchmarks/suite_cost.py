"""Where `make test`'s time goes: the C++ builds Inductor runs and the Python processes the tests start (issue #16).

    python benchmarks/suite_cost.py                        # the whole suite, as `make test` runs it, cold caches
    python benchmarks/suite_cost.py tests/test_modes.py --json
    python benchmarks/suite_cost.py --top 40 -- -k routing

The suite is bound by the CPU (two xdist workers keep both cores of the 2-core machine busy; a third slows it
down), so its time is the CPU its tests spend: Inductor's C++ builds (one g++ per CPU kernel, plus the
instruction-set probes and the precompiled header of every fresh Inductor folder), the Python of the compiles
(Dynamo, lowering), the models' runs, and the imports of every process a test starts. This runs pytest once, as
`make test` does, with two spies on the way: a `g++` first on PATH that logs every build (its output, seconds,
and the test that caused it) before running the real one, and a `sitecustomize` that logs each Python
process's own CPU seconds when it exits. Then, per test: builds, g++ seconds, processes started and their CPU.
A build whose output is made twice is a compile that a cache should have saved (reported as duplicates).

Caches are fresh (a new EVALRUN_CACHE and Inductor default folder in a temporary folder) unless --warm: a fresh
clone on CI compiles everything once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COMPILER_SPY = """#!/usr/bin/env bash
started=$(date +%s.%N)
{compiler} "$@"
code=$?
output=""; previous=""
for argument in "$@"; do [ "$previous" = "-o" ] && output="$argument"; previous="$argument"; done
printf '%s\\t%s\\t%s\\t%s\\t%s\\n' "$started" "$(date +%s.%N)" "$code" "$output" "${{PYTEST_CURRENT_TEST:-}}" >> {log}
exit $code
"""

PROCESS_SPY = """import atexit, json, os, resource, sys

def _spy_on_exit():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {{"argv": sys.argv[:3], "cpu_s": usage.ru_utime + usage.ru_stime,
              "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}}
    with open({log!r}, "a") as log:
        log.write(json.dumps(record) + "\\n")

atexit.register(_spy_on_exit)
"""


@dataclass(frozen=True)
class Build:
    seconds: float
    output: str  # the file g++ wrote ("" for a probe like `g++ --version`)
    test: str  # the pytest node id, "" outside a test


def test_id(current_test: str) -> str:
    """PYTEST_CURRENT_TEST ("tests/x.py::name[param] (call)") without its phase."""
    return current_test.rsplit(" (", 1)[0] if current_test.endswith(")") else current_test


def parse_builds(lines: list[str]) -> list[Build]:
    """The compiler spy's lines: started, ended, exit code, output, test, separated by tabs."""
    builds = []
    for line in lines:
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 5:
            continue
        started, ended, _, output, test = fields
        builds.append(Build(float(ended) - float(started), output, test_id(test)))
    return builds


def build_kind(output: str) -> str:
    """A shared library (a kernel, a graph's wrapper or an instruction-set probe: Inductor names them alike), a
    precompiled header, or a preprocessing pass."""
    return {".so": "libraries", ".gch": "precompiled_headers", ".i": "preprocessed"}.get(Path(output).suffix, "other")


def summarize(builds: list[Build], processes: list[dict], top: int) -> dict:
    """Totals and the `top` tests by g++ seconds plus the CPU of the processes they started."""
    made = Counter(build.output for build in builds if build.output)
    per_test: dict[str, dict] = defaultdict(lambda: {"builds": 0, "gxx_s": 0.0, "processes": 0, "process_cpu_s": 0.0})
    for build in builds:
        row = per_test[build.test or "(outside a test)"]
        row["builds"] += bool(build.output)  # a probe like `g++ --version` writes nothing: its seconds only
        row["gxx_s"] += build.seconds
    started = [p for p in processes if p["test"]]  # by a test; the rest are pytest itself and its xdist workers
    for process in started:
        row = per_test[test_id(process["test"])]
        row["processes"] += 1
        row["process_cpu_s"] += process["cpu_s"]
    ranked = sorted(per_test.items(), key=lambda item: -(item[1]["gxx_s"] + item[1]["process_cpu_s"]))
    written = [build for build in builds if build.output]
    return {
        "builds": len(written),
        "gxx_s": round(sum(build.seconds for build in builds), 1),
        "by_kind": dict(Counter(build_kind(build.output) for build in written)),
        "duplicate_builds": sum(count - 1 for count in made.values()),
        "processes_started_by_tests": len(started),
        "their_cpu_s": round(sum(p["cpu_s"] for p in started), 1),
        "pytest_and_workers_cpu_s": round(sum(p["cpu_s"] for p in processes if not p["test"]), 1),
        "tests": [{"test": name, **{k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}}
                  for name, row in ranked[:top]],
    }


def install_spies(folder: Path) -> dict[str, str]:
    """Write the compiler spy (folder/bin/g++) and the process spy (folder/site/sitecustomize.py), both logging
    into `folder`, and return the environment that puts them first: PATH, CXX (Inductor's compiler), PYTHONPATH."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise SystemExit("suite_cost: no C++ compiler (g++) on PATH; install one (Inductor needs it on CPU)")
    (folder / "bin").mkdir(parents=True)
    spy = folder / "bin" / "g++"
    spy.write_text(COMPILER_SPY.format(compiler=compiler, log=folder / "builds.tsv"))
    spy.chmod(0o755)
    (folder / "site").mkdir()
    (folder / "site" / "sitecustomize.py").write_text(PROCESS_SPY.format(log=str(folder / "processes.jsonl")))
    return {"PATH": f"{folder / 'bin'}:{os.environ['PATH']}", "CXX": "g++",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(folder / "site"), os.environ.get("PYTHONPATH")]))}


def read_spies(folder: Path) -> tuple[list[Build], list[dict]]:
    builds, processes = folder / "builds.tsv", folder / "processes.jsonl"
    return (parse_builds(builds.read_text().splitlines()) if builds.exists() else [],
            [json.loads(line) for line in processes.read_text().splitlines()] if processes.exists() else [])


def run_suite(pytest_args: list[str], warm: bool) -> tuple[dict, list[Build], list[dict]]:
    spies = Path(tempfile.mkdtemp(prefix="suite-cost-"))
    env = {**os.environ, **install_spies(spies)}
    if not warm:
        env["EVALRUN_CACHE"] = str(spies / "evalrun-cache")
        env["TMPDIR"] = str(spies / "tmp")  # Inductor's default folder (/tmp/torchinductor_<user>) fresh too
        (spies / "tmp").mkdir()
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "worksteal", "-q", "-p", "no:cacheprovider",
               *pytest_args]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, stdout=sys.stderr)  # this report alone on stdout
    wall = time.perf_counter() - started
    builds, processes = read_spies(spies)
    shutil.rmtree(spies, ignore_errors=True)
    return {"command": " ".join(command[1:]), "exit_code": done.returncode, "wall_s": round(wall, 1),
            "warm": warm}, builds, processes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (default: the whole suite)")
    parser.add_argument("--warm", action="store_true", help="keep EVALRUN_CACHE and Inductor's default folder")
    parser.add_argument("--top", type=int, default=25, help="tests listed, by g++ plus child-process seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run, builds, processes = run_suite(args.pytest_args, args.warm)
    report = {**run, **summarize(builds, processes, args.top)}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"pytest exit {report['exit_code']}, {report['wall_s']} s ({'warm' if args.warm else 'cold'} caches)")
        kinds = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in report["by_kind"].items())
        print(f"g++: {report['builds']} builds ({kinds}; {report['duplicate_builds']} duplicates), {report['gxx_s']} s")
        print(f"processes started by tests: {report['processes_started_by_tests']}, {report['their_cpu_s']} CPU s; "
              f"pytest and its workers: {report['pytest_and_workers_cpu_s']} CPU s (their own, without children)")
        print(f"\n{'builds':>6} {'g++ s':>7} {'procs':>5} {'proc CPU s':>10}  test")
        for row in report["tests"]:
            print(f"{row['builds']:>6} {row['gxx_s']:>7} {row['processes']:>5} {row['process_cpu_s']:>10}  {row['test']}")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
