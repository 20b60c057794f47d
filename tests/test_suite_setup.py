"""The suite's own setup (conftest.py): each pytest-xdist worker runs on its share of the cores."""

import os

import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import share_cores_between_workers

THREAD_VARIABLES = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")


@pytest.fixture
def unset_thread_settings(monkeypatch):
    """The thread variables unset, and this worker's torch threads, variables and Inductor compile threads as they
    were after the test (share_cores_between_workers changes all three)."""
    threads = torch.get_num_threads()
    for variable in THREAD_VARIABLES:
        monkeypatch.setenv(variable, "0")  # recorded (delenv of an unset variable is not), so the end restores it
        monkeypatch.delenv(variable)
    try:
        with inductor_config.patch(compile_threads=99):  # restored at its end (pytest's monkeypatch cannot)
            yield
    finally:
        torch.set_num_threads(threads)


def test_each_worker_of_several_gets_its_share_of_the_cores(unset_thread_settings):
    share = share_cores_between_workers("2")
    assert share == max(1, len(os.sched_getaffinity(0)) // 2)
    assert torch.get_num_threads() == share and os.environ["OMP_NUM_THREADS"] == str(share)  # inherited
    assert inductor_config.compile_threads == share
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == str(share)


def test_one_worker_or_a_thread_count_the_caller_set_is_left_alone(unset_thread_settings, monkeypatch):
    assert share_cores_between_workers(None) is None and share_cores_between_workers("1") is None
    assert not any(variable in os.environ for variable in THREAD_VARIABLES)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert share_cores_between_workers("2") is None and os.environ["OMP_NUM_THREADS"] == "3"
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ


def test_a_compile_thread_count_the_caller_set_is_kept(unset_thread_settings, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "5")
    assert share_cores_between_workers("2") is not None
    assert inductor_config.compile_threads == 5 and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "5"


def test_this_worker_runs_with_the_thread_count_its_children_inherit():
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
        pytest.skip("not a pytest-xdist worker of several (make test runs two)")
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:  # unset where the caller set OMP_NUM_THREADS
        assert inductor_config.compile_threads == int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


def test_the_suite_and_the_processes_it_starts_skip_inductors_instruction_set_probes(tmp_path):
    """conftest's TORCHINDUCTOR_VEC_ISA_OK=1 reaches Inductor here and in a child process started with the modes
    tests' environment (which drops Inductor's other variables)."""
    import subprocess
    import sys

    from test_modes import child_environment

    assert inductor_config.cpp.vec_isa_ok is True
    read = "import torch._inductor.config as c; print(c.cpp.vec_isa_ok)"
    for env in (os.environ, child_environment(tmp_path)):
        done = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_suite_cost_spies_count_each_tests_builds_and_processes(tmp_path):
    """benchmarks/suite_cost.py's spies, for real: its g++ builds a file twice and one other under two tests, a
    Python child exits; the summary charges each test its builds, g++ seconds and process, and counts the
    second build of the same file as a duplicate. A probe (`g++ --version`, as Inductor's checks run) costs its
    test seconds, not a build: a test's builds add up to the total."""
    import importlib.util
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "suite_cost.py"
    spec = importlib.util.spec_from_file_location("suite_cost", path)
    suite_cost = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("suite_cost", suite_cost)  # its dataclass looks its module up there
    spec.loader.exec_module(suite_cost)
    env = {**os.environ, **suite_cost.install_spies(tmp_path / "spies")}
    source = tmp_path / "k.cpp"
    source.write_text('extern "C" int kernel() { return 2; }\n')
    for output, test in [("k.so", "tests/a.py::one (call)"), ("k.so", "tests/a.py::two[x] (setup)"),
                         ("j.so", "tests/a.py::two[x] (call)")]:
        build = ["g++", "-shared", "-fPIC", str(source), "-o", str(tmp_path / output)]
        subprocess.run(build, env={**env, "PYTEST_CURRENT_TEST": test}, check=True)
    subprocess.run(["g++", "--version"], env={**env, "PYTEST_CURRENT_TEST": "tests/a.py::one (call)"}, check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "-c", "sum(range(10**6))"], check=True,
                   env={**env, "PYTEST_CURRENT_TEST": "tests/a.py::one (call)"})
    builds, processes = suite_cost.read_spies(tmp_path / "spies")
    assert [(Path(b.output).name if b.output else "", b.test) for b in builds] == [
        ("k.so", "tests/a.py::one"), ("k.so", "tests/a.py::two[x]"), ("j.so", "tests/a.py::two[x]"),
        ("", "tests/a.py::one")]
    assert all(b.seconds > 0 for b in builds) and (tmp_path / "j.so").exists()
    report = suite_cost.summarize(builds, processes, top=5)
    assert report["builds"] == 3 and report["duplicate_builds"] == 1 and report["by_kind"] == {"libraries": 3}
    rows = {row["test"]: row for row in report["tests"]}
    assert rows["tests/a.py::two[x]"]["builds"] == 2 and rows["tests/a.py::one"]["builds"] == 1
    assert sum(row["builds"] for row in report["tests"]) == report["builds"]
    assert rows["tests/a.py::one"]["processes"] == 1 and rows["tests/a.py::one"]["process_cpu_s"] >= 0
    assert report["processes_started_by_tests"] == 1 and "tests/a.py::two[x]" not in [
        p["test"] for p in processes]
