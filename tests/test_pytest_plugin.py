"""The pytest plugin, tested with pytest's own pytester: real pytest runs (in subprocesses) of test files
that use the marker against real goldens of random:tiny.

pytester restores sys.modules when its test ends, so a module first imported in this process after its
snapshot is dropped again, and a later re-import of a torch module that registers operators fails in
whatever test comes next on this worker. Hence `pytester` comes last in every signature here (the
goldens are made before its snapshot) and nothing of evalrun runs in-process after it."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from evalrun.ci_output import annotation
from evalrun.pytest_plugin import CI_VARIABLES, _ci_variable, config_id, configs_of, gpu_for_worker

pytest_plugins = ["pytester"]

TINY = {"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 6}
COUNT_LOADS = '''
import json, os
import evalrun.runner as runner

_real, _loads = runner.load_model, []


def _counting(*args, **kwargs):
    _loads.append(args[0])
    return _real(*args, **kwargs)


runner.load_model = _counting


def pytest_sessionfinish(session):
    name = "loads-" + os.environ.get("PYTEST_XDIST_WORKER", "main") + ".json"
    with open(os.path.join(os.environ["RESULTS"], name), "w") as handle:
        json.dump(_loads, handle)
'''


@pytest.fixture
def golden_dir(golden_factory, tmp_path) -> Path:
    """A private copy of a random:tiny golden `g` (6 tokens, smoke prompts)."""
    directory = tmp_path / "goldens"
    shutil.copytree(golden_factory(), directory)
    return directory


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict[str, Path]:
    paths = {"store": tmp_path / "store.db", "summary": tmp_path / "summary.md", "results": tmp_path / "results"}
    paths["results"].mkdir()
    monkeypatch.setenv("EVALRUN_STORE", str(paths["store"]))
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(paths["summary"]))
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("RESULTS", str(paths["results"]))
    for variable in ("CI", "CUDA_VISIBLE_DEVICES", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(variable, raising=False)
    return paths


def _run(pytester, *args):
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", *args)


def test_configs_multiply_out_and_name_the_tests():
    marker = pytest.mark.evalrun_golden("g", opt_level=[0, 2], dtype=("float32", "bfloat16"), golden_dir="x",
                                        create="debug").mark
    configs = configs_of(marker)
    assert configs[0] == {"opt_level": 0, "dtype": "float32"} and len(configs) == 4
    assert [config_id(c) for c in configs[:2]] == ["O0-dtype=float32", "O0-dtype=bfloat16"]
    assert configs_of(pytest.mark.evalrun_golden("g").mark) == [{}]


@pytest.mark.parametrize("worker,count,expected", [("gw0", 2, "0"), ("gw3", 2, "1"), ("gw5", 8, "5"),
                                                   ("gw1", 0, None), ("master", 2, None)])
def test_one_gpu_per_xdist_worker(worker, count, expected):
    assert gpu_for_worker(worker, count) == expected


def test_annotations_cannot_start_another_workflow_command():
    assert annotation("drift", "evalrun g [O2]", "x: drift") == "::warning title=evalrun g [O2]::x: drift"
    assert annotation("changed", "a,b:c", "line\n::error::forged") == "::error title=a%2Cb%3Ac::line%0A::error::forged"
    assert annotation("identical", "t", "m") is None


def test_parametrized_configs_junit_step_summary_store_and_one_model_load(golden_dir, env, pytester):
    pytester.makeconftest(COUNT_LOADS)
    pytester.makepyfile(f'''
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r}, batch_size=[1, 3])
        def test_g(evalrun_verdict, evalrun_config):
            assert evalrun_verdict.verdict in ("identical", "drift")
            assert evalrun_verdict.candidate_config["batch_size"] == evalrun_config["batch_size"]
    ''')
    result = _run(pytester, "--junitxml=report.xml", "-rw")
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(["*EvalrunDriftWarning: golden g ?batch_size=3?: drift*",
                                 "::warning title=evalrun g ?batch_size=3?::*test_g?batch_size=3?: drift"])
    assert "::error" not in result.stdout.str()
    properties = {}
    for case in ElementTree.parse(pytester.path / "report.xml").getroot().iter("testcase"):
        properties[case.get("name")] = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert properties["test_g[batch_size=1]"]["evalrun.verdict"] == "identical"
    drift = properties["test_g[batch_size=3]"]
    assert drift["evalrun.verdict"] == "drift" and 0 < float(drift["evalrun.distance"]) < 1
    assert "config: batch_size 1 -> 3" in drift["evalrun.causes"] and drift["evalrun.golden"] == "g"
    summary = env["summary"].read_text()
    assert summary.startswith("## evalrun: 1 drift, 1 identical")
    assert summary.count("evalrun golden `g`") == 2 and "| prompt |" in summary
    assert json.loads((env["results"] / "loads-main.json").read_text()) == ["random:tiny"]  # one load, two configs
    with sqlite3.connect(env["store"]) as db:
        labels = [row[0] for row in db.execute("SELECT label FROM runs ORDER BY label")]
    assert labels == ["pytest:test_parametrized_configs_junit_step_summary_store_and_one_model_load.py::"
                      f"test_g[batch_size={n}]" for n in (1, 3)]
    done = subprocess.run([sys.executable, "-m", "evalrun", "diff", drift["evalrun.run"],
                           properties["test_g[batch_size=1]"]["evalrun.run"], "--store", str(env["store"]), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {"key": "batch_size", "a": 3, "b": 1} in json.loads(done.stdout)["config"]


FAULTY_MODEL = '''
    import evalrun.runner as runner
    import evalrun.verify as verify
    from evalrun.engine.faults import Fault, fault_hook

    _real, _hook = runner.prepare, fault_hook(Fault("scale", 0.25))


    def _faulty(*args, **kwargs):  # the model computes another function: every run this process verifies
        prepared = _real(*args, **kwargs)
        _hook(prepared)
        return prepared


    verify.prepare = _faulty
'''


def test_changed_fails_with_the_markdown_verdict_and_strict_fails_drift(golden_dir, env, pytester):
    pytester.makeconftest(FAULTY_MODEL)
    pytester.makepyfile(f'''
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        def test_g():
            pass
    ''')
    result = _run(pytester, f"--evalrun-comment={env['results'] / 'comment.md'}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*golden g ?golden?: changed*", "*Captured evalrun call*",
                                 "*evalrun golden `g`: **changed***", "::error title=evalrun g ?golden?::*changed"])
    assert "changed" in (env["results"] / "comment.md").read_text()
    pytester.makeconftest("")
    pytester.makepyfile(f'''
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r}, batch_size=3)
        def test_g():
            pass
    ''')
    _run(pytester).assert_outcomes(passed=1, warnings=1)
    strict = _run(pytester, "--evalrun-strict")
    strict.assert_outcomes(failed=1)
    strict.stdout.fnmatch_lines(["*golden g ?batch_size=3?: drift*"])


def test_missing_golden_under_ci_is_never_created_and_update_creates_it(env, tmp_path, monkeypatch, pytester):
    folder = tmp_path / "new-goldens"
    pytester.makepyfile(f'''
        import pytest

        @pytest.mark.evalrun_golden("h", golden_dir={str(folder)!r}, create={TINY!r}, batch_size=[1, 2])
        def test_h(evalrun_verdict):
            assert evalrun_verdict.verdict in ("identical", "drift")
    ''')
    monkeypatch.setenv("CI", "true")
    result = _run(pytester)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*never created implicitly when CI is set*evalrun golden create h --dir*"
                                 "--set model=random:tiny*"])
    assert not (folder / "h.db").exists()
    monkeypatch.delenv("CI")
    monkeypatch.delenv("GITHUB_ACTIONS")  # a CI system's own variable says CI too (test_ci_is_known_by_...)
    first = _run(pytester)  # locally: created, and every test of it fails once (commit it, re-run)
    first.assert_outcomes(failed=2)
    first.stdout.fnmatch_lines(["*did not exist: created it now*commit it and re-run*"])
    made = (folder / "h.db").stat().st_mtime_ns
    _run(pytester).assert_outcomes(passed=2, warnings=1)
    assert (folder / "h.db").stat().st_mtime_ns == made
    os.utime(folder / "h.db", (2e9, 2e9))  # a timestamp from the future (a copy, clock skew) must not fool it
    _run(pytester, "--evalrun-update").assert_outcomes(passed=2, warnings=1)
    assert (folder / "h.db").stat().st_mtime_ns != int(2e9 * 1e9)
    assert sorted(p.name for p in folder.iterdir()) == ["h.db"]  # no lock or mark left beside the goldens


@pytest.mark.parametrize("variables,expected", [
    ({}, None), ({"CI": "true"}, "CI"), ({"CI": "1"}, "CI"),
    ({"JENKINS_URL": "https://jenkins.example/"}, "JENKINS_URL"), ({"TF_BUILD": "True"}, "TF_BUILD"),
    ({"TEAMCITY_VERSION": "2024.1"}, "TEAMCITY_VERSION"), ({"BUILDKITE": "true"}, "BUILDKITE"),
    ({"GITLAB_CI": "true"}, "GITLAB_CI"), ({"GITHUB_ACTIONS": "true"}, "GITHUB_ACTIONS"),
    ({"CI": "", "GITLAB_CI": "true"}, "GITLAB_CI"), ({"GITHUB_ACTIONS": "false"}, None),
    # CI with a value decides, as before: CI=false or CI=0 says this is not CI, whatever else is set
    ({"CI": "false", "JENKINS_URL": "https://jenkins.example/"}, None), ({"CI": "0", "GITHUB_ACTIONS": "true"}, None),
    ({"CI": "no"}, None),
])
def test_ci_is_known_by_the_ci_systems_own_variables_too(variables, expected, monkeypatch):
    """Only CI was read: on Jenkins, Azure Pipelines, TeamCity, ... without it a missing golden was created."""
    for name in ("CI", *CI_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert _ci_variable() == expected


def test_xdist_workers_take_one_gpu_each_and_unused_goldens_are_listed(golden_dir, env, monkeypatch, pytester):
    monkeypatch.setenv("EVALRUN_PYTEST_GPUS", "2")
    shutil.copy(golden_dir / "g.db", golden_dir / "stale.db")
    pytester.makeconftest(COUNT_LOADS)
    pytester.makepyfile(f'''
        import json, os
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r}, batch_size=[1, 2, 3, 4])
        def test_g(evalrun_verdict, evalrun_config):
            worker = os.environ["PYTEST_XDIST_WORKER"]
            path = os.path.join(os.environ["RESULTS"], "gpu-" + worker + "-" + str(evalrun_config["batch_size"]))
            with open(path, "w") as handle:
                handle.write(os.environ["CUDA_VISIBLE_DEVICES"])
    ''')
    result = _run(pytester, "-n", "2", "--junitxml=report.xml", "--evalrun-gpu-per-worker")
    result.assert_outcomes(passed=4, warnings=3)
    seen = {p.name.split("-")[1]: p.read_text() for p in env["results"].glob("gpu-*")}
    assert seen and all(gpu == str(int(worker[2:]) % 2) for worker, gpu in seen.items())
    result.stdout.fnmatch_lines([f"*1 golden(s) that no test of this session used: {golden_dir / 'stale.db'}*"])
    summary = env["summary"].read_text()
    assert summary.startswith("## evalrun: 3 drift, 1 identical") and summary.count("evalrun golden `g`") == 4
    loads = [json.loads(p.read_text()) for p in env["results"].glob("loads-gw*.json")]
    assert all(len(worker_loads) <= 1 for worker_loads in loads) and sum(map(len, loads)) == len(seen)


def test_the_plugin_loads_without_xdist(pytester):
    """Its xdist hooks are optional: a project without pytest-xdist still runs (here: xdist blocked)."""
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=1)


def test_goldens_that_cannot_be_checked_are_errors_that_reach_the_summary_and_comment(golden_dir, env, pytester):
    (golden_dir / "broken-1.db").write_bytes(b"not a golden")
    pytester.makepyfile(f'''
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r}, max_new_tokens=8)
        def test_longer_than_the_golden():
            pass

        @pytest.mark.evalrun_golden("broken-1", golden_dir={str(golden_dir)!r})
        def test_damaged():
            pass
    ''')
    comment = env["results"] / "comment.md"
    result = _run(pytester, f"--evalrun-comment={comment}")
    result.assert_outcomes(errors=2)
    assert "Traceback" not in result.stdout.str()
    result.stdout.fnmatch_lines(["::error title=evalrun g ?max_new_tokens=8?::*incomparable",
                                 "::error title=evalrun broken-1 ?golden?::*incomparable"])
    assert env["summary"].read_text().startswith("## evalrun: 2 incomparable")
    assert comment.read_text().count("**incomparable**") == 2
    assert "### ⛔ evalrun golden `broken-1`: **incomparable**" in comment.read_text()  # code, not escaped text


@pytest.mark.parametrize("marker,needle", [('"g", strict="no"', "strict=...) takes True or False"),
                                           ('"g", batch_size=[]', "'batch_size' is an empty list"),
                                           # the second golden was never checked, and the test passed
                                           ('"g", "other"', "names 2 goldens (g, other)"),
                                           ('"other")\n        @pytest.mark.evalrun_golden("g"', "names 2 goldens")])
def test_marker_mistakes_are_usage_errors(golden_dir, env, marker, needle, pytester):
    pytester.makepyfile(f'''
        import pytest

        @pytest.mark.evalrun_golden({marker}, golden_dir={str(golden_dir)!r})
        def test_g():
            pass
    ''')
    result = _run(pytester)
    assert needle in result.stdout.str() + result.stderr.str() and result.ret != 0


def test_an_unwritable_comment_path_is_refused_before_any_test_and_a_stale_comment_replaced(env, pytester):
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = _run(pytester, f"--evalrun-comment={env['results'] / 'missing' / 'c.md'}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "is not a writable folder" in result.stderr.str()
    stale = env["results"] / "c.md"
    stale.write_text("## evalrun: 1 identical (an old session)")
    _run(pytester, f"--evalrun-comment={stale}").assert_outcomes(passed=1)
    assert stale.read_text().startswith("## evalrun: no golden was checked")


def test_a_changed_model_fails_a_unittest_case_and_a_body_that_skips(golden_dir, env, pytester):
    """The judgment ran in pytest_pyfunc_call, which a unittest.TestCase's test never reaches, and a body's
    pytest.skip() came out as a skip: both were green with a changed model (and '::error ... changed')."""
    pytester.makeconftest(FAULTY_MODEL)
    pytester.makepyfile(f'''
        import unittest
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        class TestCase(unittest.TestCase):
            def test_g(self):
                pass

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        class TestSkipping(unittest.TestCase):
            def test_skip_test(self):
                self.skipTest("not on this platform")

            def test_pytest_skip(self):
                pytest.skip("not on this platform")

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        def test_skips(evalrun_verdict):
            pytest.skip("not on this platform")

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        def test_xfails(evalrun_verdict):
            pytest.xfail("known")

        @pytest.mark.xfail(reason="changed until the golden is re-created", strict=True)
        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        def test_marked_xfail():
            pass
    ''')
    result = _run(pytester)
    result.assert_outcomes(failed=5, xfailed=1)
    result.stdout.fnmatch_lines(["*golden g ?golden?: changed*test body skipped after the check*"])
    result.stdout.fnmatch_lines(["*golden g ?golden?: changed*test body xfailed after the check*"])


def test_options_apply_where_not_parametrized_and_two_goldens_on_a_class_or_module_are_refused(golden_dir, env,
                                                                                                pytester):
    """A unittest case (no pytest_generate_tests) and a marker added after collection were verified in the
    golden's own config, their options silently dropped; two markers on a class or in a module's pytestmark
    checked one golden and dropped the other."""
    pytester.makeconftest(f'''
        import pytest

        def pytest_collection_modifyitems(items):
            for item in items:
                if item.name == "test_late":
                    item.add_marker(pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r}, batch_size=[1, 3]))
    ''')
    pytester.makepyfile(test_options=f'''
        import unittest
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r}, batch_size=3)
        class TestCase(unittest.TestCase):
            def test_g(self):
                pass

        def test_late():
            pass

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        @pytest.mark.evalrun_golden("other", golden_dir={str(golden_dir)!r})
        class TestTwo:
            def test_two(self):
                pass
    ''', test_module=f'''
        import pytest

        pytestmark = [pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r}),
                      pytest.mark.evalrun_golden("other", golden_dir={str(golden_dir)!r})]

        def test_module():
            pass
    ''')
    result = _run(pytester, "--junitxml=report.xml")
    result.assert_outcomes(passed=1, warnings=1, errors=3)
    for line in ("*test_late*lists 2 configs, but this test is not parametrized*",
                 "*test_two*names 2 goldens (other, g)*", "*test_module*names 2 goldens (g, other)*"):
        result.stdout.fnmatch_lines([line])
    assert "Traceback" not in result.stdout.str() and "def _evalrun_golden_check" not in result.stdout.str()
    case = next(c for c in ElementTree.parse(pytester.path / "report.xml").getroot().iter("testcase")
                if c.get("name") == "test_g")
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert properties["evalrun.config"] == "batch_size=3" and properties["evalrun.verdict"] == "drift"
    assert not (golden_dir / "other.db").exists()


def test_a_marker_a_hook_adds_to_a_class_or_a_marked_base_class_is_a_second_golden_of_the_class(golden_dir, env,
                                                                                                  pytester):
    """The two-golden check read a class's own pytestmark attribute, and pytest reads the class node's markers:
    a marker a hook added to the class node, or a marked base class beside the subclass's marker, made one golden
    checked (the one pytest reads first) and the other silently dropped."""
    pytester.makeconftest(f'''
        import pytest

        def pytest_collection_modifyitems(items):
            for item in items:
                if item.name == "test_hooked":
                    item.parent.add_marker(pytest.mark.evalrun_golden("other", golden_dir={str(golden_dir)!r}))
    ''')
    pytester.makepyfile(test_classes=f'''
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        class TestHooked:
            def test_hooked(self):
                pass

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        class TestBase:
            pass

        @pytest.mark.evalrun_golden("other", golden_dir={str(golden_dir)!r})
        class TestSub(TestBase):
            def test_sub(self):
                pass

            @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
            def test_own(self):  # the function's own marker is the closest: one golden
                pass

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        class TestRepeated(TestBase):  # its base's marker again: one golden
            def test_repeated(self):
                pass
    ''')
    result = _run(pytester)
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines_random(["*test_hooked*names 2 goldens (g, other)*",
                                        "*test_sub*names 2 goldens (g, other)*"])
    assert not (golden_dir / "other.db").exists()


def test_a_missing_golden_evalruns_crash_and_an_update_are_said_in_the_comment(golden_dir, env, monkeypatch, pytester):
    """The comment said 'no golden was checked in this session' for a failing job (a missing golden, evalrun's
    own crash), and '✅ identical' for a golden --evalrun-update had just re-made from the candidate."""
    pytester.makeconftest('''
        import evalrun.verify as verify

        _real = verify.verify_golden


        def _crash(golden, *args, **kwargs):
            if golden.name == "g":
                raise RuntimeError("boom")
            return _real(golden, *args, **kwargs)


        verify.verify_golden = _crash
    ''')
    pytester.makepyfile(f'''
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(golden_dir)!r})
        def test_crash():
            pass

        @pytest.mark.evalrun_golden("missing", golden_dir={str(golden_dir)!r})
        def test_missing():
            pass
    ''')
    comment = env["results"] / "comment.md"
    monkeypatch.setenv("CI", "true")
    result = _run(pytester, f"--evalrun-comment={comment}")
    result.assert_outcomes(failed=1, errors=1)
    assert comment.read_text().startswith("## evalrun: 1 error, 1 incomparable")
    result.stdout.fnmatch_lines(["::error title=evalrun g ?golden?::*error"])
    pytester.makeconftest("")
    shutil.copy(golden_dir / "g.db", golden_dir / "u.db")
    pytester.makepyfile(f'''
        import pytest

        @pytest.mark.evalrun_golden("u", golden_dir={str(golden_dir)!r})
        def test_u():
            pass
    ''')
    _run(pytester, "--evalrun-update", "-k", "test_u", f"--evalrun-comment={comment}", "--junitxml=report.xml")
    assert "was updated by this session (--evalrun-update)" in comment.read_text()
    assert 'name="evalrun.golden_made" value="updated"' in (pytester.path / "report.xml").read_text()
