"""evalrun's pytest plugin: golden checks as tests (registered through the `pytest11` entry point).

    @pytest.mark.evalrun_golden("smollm2-cpu", opt_level=[0, 1, 2])
    def test_smollm2(evalrun_verdict):
        assert sum(p.verdict == "drift" for p in evalrun_verdict.prompts) <= 2  # optional, your own rule

The marker names a golden and any run options (the keys of `evalrun run`'s flags: opt_level, device,
dtype, batch_size, compilation_mode, ...); a list is one test per value, several lists their product.
The verdict is judged after the test body, like every evalrun verdict:
  identical  passes
  drift      passes with an `EvalrunDriftWarning` (fails with --evalrun-strict or strict=True)
  changed    fails, with the Markdown verdict as a report section
  incomparable, an unreadable golden or bad options: an error (reported like a verdict, no traceback)
The judgment wraps every kind of test (a unittest.TestCase's too), and a body that calls pytest.skip() or
pytest.xfail() after the check does not hide a failing verdict (skip with a skipif marker). Two markers at
one level (a function's, a class's with its bases', a module's pytestmark, those a hook added to the node:
what pytest reads) are a usage error; a test that pytest did not parametrize (unittest, a marker added
after collection) takes the marker's single config, or is refused.
Marker options besides run options: `golden_dir` (default: --evalrun-golden-dir, relative to the
rootdir), `create` (a preset, TOML file or dict of run options: how --evalrun-update makes the
golden), `strict`, `enforce=False` (leave the judgment to the test body).

A missing golden fails its tests with the command that creates it. Outside CI it is also created then
(its tests still fail: commit the golden and re-run, as pytest-regressions does); on CI it is never
created implicitly (`CI` set, or where `CI` has no value a CI system's own variable: CI_VARIABLES;
CI=false or CI=0 says it is not CI). `--evalrun-update` re-creates every golden the session's tests
use, once each, then verifies against it. What the session made is kept in its own temporary folder (shared by
xdist workers, with the lock), never beside the goldens, and not judged by file times.

One process loads a model once for all the configs it verifies (`verify_golden(reuse=...)`). Each
verification's candidate run is stored (`--evalrun-store`, default the usual store) labelled with the
test id, so `evalrun diff` works afterwards. With `--evalrun-gpu-per-worker`, each pytest-xdist worker
takes one GPU (`CUDA_VISIBLE_DEVICES` from `PYTEST_XDIST_WORKER`, when the machine has GPUs and the
variable is not set already); without it the plugin leaves the environment alone. JUnit XML gets `evalrun.*` properties per test (verdict, distance, causes, golden,
config); on GitHub Actions the controller appends every verdict's Markdown to `$GITHUB_STEP_SUMMARY`
and prints `::error`/`::warning` annotations; `--evalrun-comment FILE` writes the Markdown as a PR
comment body. Goldens in the used folders that no test of the session used are listed at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import shutil
import subprocess
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

MARKER = "evalrun_golden"
SPECIAL_KEYS = ("golden_dir", "create", "strict", "enforce")
SECTION = "evalrun"  # report section key: the verdict's Markdown travels with the report (xdist too)
# CI systems' own variables, for those that set no `CI` (or a runner that clears it): GitHub Actions, GitLab,
# Jenkins, Azure Pipelines, TeamCity, Buildkite, CircleCI, Travis, AppVeyor, Bitbucket Pipelines, AWS CodeBuild
CI_VARIABLES = ("GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "TF_BUILD", "TEAMCITY_VERSION", "BUILDKITE", "CIRCLECI",
                "TRAVIS", "APPVEYOR", "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ID")


class EvalrunDriftWarning(UserWarning):
    """A golden verified as drift: same model, different numerics (a pass)."""


# ---------------------------------------------------------------- options and markers

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("evalrun", "evalrun golden checks")
    group.addoption("--evalrun-update", action="store_true",
                    help="Re-create the goldens the selected tests use (once each), then verify against them.")
    group.addoption("--evalrun-golden-dir", default=None, metavar="DIR",
                    help="Folder of goldens, relative to the rootdir (default: golden, or ini evalrun_golden_dir).")
    group.addoption("--evalrun-store", default=None, metavar="PATH",
                    help="Store for the candidate runs (default: EVALRUN_STORE or the usual store).")
    group.addoption("--evalrun-strict", action="store_true", help="Drift fails too.")
    group.addoption("--evalrun-comment", default=None, metavar="FILE",
                    help="Write every verdict's Markdown here (a PR comment body).")
    group.addoption("--evalrun-gpu-per-worker", action="store_true",
                    help="Under pytest-xdist, worker gwN sees only GPU N mod count (CUDA_VISIBLE_DEVICES).")
    parser.addini("evalrun_golden_dir", "Folder of goldens, relative to the rootdir.", default="golden")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(name, **run_options): verify golden NAME under each combination "
                                       "of the run options (lists are parametrized); see evalrun.pytest_plugin")
    state = config.stash[STATE] = SessionState(config)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # the controller (or a run without xdist) owns the session's folder
        _check_comment_path(config.getoption("evalrun_comment"))
        state.marks = Path(tempfile.mkdtemp(prefix="evalrun-session-"))
    else:
        state.marks = Path(workerinput["evalrun_marks"]) if "evalrun_marks" in workerinput else Path(
            tempfile.mkdtemp(prefix="evalrun-session-"))
    config.pluginmanager.register(VerdictCollector(state), "evalrun-verdicts")
    if config.getoption("evalrun_gpu_per_worker"):
        _assign_gpu()


def _check_comment_path(comment: str | None) -> None:
    """--evalrun-comment FILE must be writable before any test runs, not found unwritable at the end."""
    if not comment:
        return
    folder = Path(comment).parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise pytest.UsageError(f"--evalrun-comment {comment}: {folder} is not a writable folder; create it or "
                                "pass another path")


def _assign_gpu() -> None:
    """Under xdist, worker gwN sees GPU N mod count; before anything initialises CUDA."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and "CUDA_VISIBLE_DEVICES" not in os.environ:
        device = gpu_for_worker(worker, gpu_count())
        if device is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = device


def gpu_count() -> int:
    """GPUs on this machine without initialising CUDA (nvidia-smi -L); EVALRUN_PYTEST_GPUS overrides."""
    if os.environ.get("EVALRUN_PYTEST_GPUS"):
        value = os.environ["EVALRUN_PYTEST_GPUS"].strip()
        return int(value) if value.isascii() and value.isdigit() else 0
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def gpu_for_worker(worker: str, count: int) -> str | None:
    """'gw3', 2 GPUs -> '1'; None without GPUs or for a worker id that is not gwN."""
    if count <= 0 or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    return str(int(worker[2:]) % count)


def configs_of(marker: pytest.Mark) -> list[dict[str, Any]]:
    """The marker's run options as one dict per test: lists (and tuples) multiply out, in order."""
    options = {k: v for k, v in marker.kwargs.items() if k not in SPECIAL_KEYS}
    empty = [k for k, v in options.items() if isinstance(v, (list, tuple)) and not v]
    if empty:
        raise pytest.UsageError(f"@pytest.mark.{MARKER}: run option {empty[0]!r} is an empty list; give at least one "
                                "value (an empty list would skip the golden check without a word)")
    keys = list(options)
    values = [v if isinstance(v, (list, tuple)) else [v] for v in options.values()]
    return [dict(zip(keys, combination)) for combination in itertools.product(*values)]


def config_id(options: dict[str, Any]) -> str:
    """A test id for one config: 'O2-dtype=bfloat16'; the marker's own golden config: 'golden'."""
    return "-".join(_opt_level_id(value) if key == "opt_level" else f"{key}={value}"
                    for key, value in options.items()) or "golden"


def _opt_level_id(value: Any) -> str:
    from .config import parse_opt_level
    from .errors import ConfigError

    try:
        return f"O{parse_opt_level(value)}"
    except ConfigError:  # shown as given; the check itself reports the bad value, as an error of its test
        return f"opt_level={value}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None or "evalrun_config" not in metafunc.fixturenames:
        return
    configs = configs_of(marker)
    if len(configs) > 1 or configs != [{}]:
        metafunc.parametrize("evalrun_config", configs, ids=[config_id(c) for c in configs], indirect=True)


# ---------------------------------------------------------------- one check

@dataclass
class GoldenCheck:
    """What one marked test verifies."""

    name: str
    directory: Path
    options: dict[str, Any]
    create: Any = None
    strict: bool = False
    enforce: bool = True

    @property
    def path(self) -> Path:
        return self.directory / f"{self.name}.db"

    def create_command(self) -> str:
        how = ""
        if isinstance(self.create, str):
            how = f" --config {self.create}"
        elif isinstance(self.create, dict):
            how = "".join(f" --set {k}={v}" for k, v in self.create.items())
        return f"evalrun golden create {self.name} --dir {self.directory}{how}"


def _closest_level_markers(item: pytest.Item) -> list[pytest.Mark]:
    """The markers of the nearest node (function, class, module) that has any: two there are ambiguous (the
    closest marker would check one golden and silently drop the other), while a nearer level overriding a
    farther one is pytest's closest-marker rule. A node's markers are the ones pytest itself reads for
    `get_closest_marker` (its `own_markers`): those a hook added to the node too, and a class's bases' (pytest
    reads a marked base's marker first, so a subclass's own marker beside it would be dropped)."""
    found = list(item.iter_markers_with_node(MARKER))  # nearest node first
    distinct: list[pytest.Mark] = []  # a subclass repeating its base's marker names one golden, not two
    for mark in (mark for node, mark in found if node is found[0][0]):
        if not any(mark.args == seen.args and mark.kwargs == seen.kwargs for seen in distinct):
            distinct.append(mark)
    return distinct


@dataclass
class SessionState:
    """Per process: loaded models to reuse, goldens already re-created, what was used and seen."""

    config: pytest.Config
    prepared: list[Any] = field(default_factory=list)  # runner.Prepared: each model this process loaded
    marks: Path | None = None  # the session's folder (shared by xdist workers): what was made, and the lock
    used: set[Path] = field(default_factory=set)
    folders: set[Path] = field(default_factory=set)
    reports: list[tuple[str, str, str, str]] = field(default_factory=list)  # nodeid, verdict, title, markdown

    def check_for(self, item: pytest.Item, options: dict[str, Any]) -> GoldenCheck:
        marker = item.get_closest_marker(MARKER)
        if not marker.args or not isinstance(marker.args[0], str):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER} needs the golden's name as its first "
                                    f"argument, e.g. @pytest.mark.{MARKER}('smollm2-cpu', opt_level=[0, 2])")
        # the closest marker is the one checked (a function's over its class's or module's, as pytest's own):
        # others on the function itself, or names past the first, were ignored silently (their goldens unchecked)
        own = _closest_level_markers(item)
        if len(own) > 1 or len(marker.args) > 1:
            names = [str(name) for mark in own or [marker] for name in mark.args]
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER} names {len(names)} goldens "
                                    f"({', '.join(names)}); a test checks one golden: write a test for each")
        folder = Path(marker.kwargs.get("golden_dir") or self.config.getoption("evalrun_golden_dir")
                      or self.config.getini("evalrun_golden_dir"))
        if not folder.is_absolute():
            folder = self.config.rootpath / folder
        for key in ("strict", "enforce"):
            if not isinstance(marker.kwargs.get(key, False), bool):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER}({key}=...) takes True or False, not "
                                        f"{marker.kwargs[key]!r}")
        return GoldenCheck(marker.args[0], folder, options, marker.kwargs.get("create"),
                           marker.kwargs.get("strict", False) or self.config.getoption("evalrun_strict"),
                           marker.kwargs.get("enforce", True))

    def verify(self, check: GoldenCheck, nodeid: str):
        """The verdict, the stored candidate run's id and the store; the model is loaded once per process
        for every config that shares it."""
        from .golden import open_golden
        from .runner import KeptCandidate, effective_config, prepare, shares_model
        from .store import default_store_path
        from .config import is_server_engine
        from .server_verify import verify_with_server
        from .verify import candidate_config, verify_golden

        golden = open_golden(check.name, check.directory)
        config = effective_config(candidate_config(golden, None, check.options, ()))
        server = is_server_engine(config.engine)  # a server computes the candidate (server_verify)
        loaded = None if server else next((p for p in self.prepared if shares_model(config, p)), None)
        if loaded is None and not server:
            loaded = prepare(config)
            self.prepared.append(loaded)
        store_path = self.config.getoption("evalrun_store") or default_store_path()
        kept = KeptCandidate(store_path, f"pytest:{nodeid}")
        verdict = (verify_with_server(golden, config, check.strict, observe=kept.observe) if server else
                   verify_golden(golden, config, check.strict, observe=kept.observe, reuse=loaded))
        return verdict, kept.run_id, str(store_path)

    def ensure_golden(self, check: GoldenCheck) -> str | None:
        """Create or re-create the golden as the session asks; a problem message to fail with, or None."""
        update = self.config.getoption("evalrun_update")
        with self._locked(check, fcntl.LOCK_SH):  # once no worker is making it: a golden linked into place before
            made, exists = self._made(check), check.path.exists()  # its mark read as there all along
        if made == "created" and not update:  # every test of a golden created this session fails alike
            return self._created_message(check)
        if exists and not update:
            return None
        ci = _ci_variable()
        if not exists and not update and ci:
            return (f"golden {check.path} does not exist, and goldens are never created implicitly when {ci} is set: "
                    f"create it with `{check.create_command()}` (or pytest --evalrun-update) and commit it")
        made = self._create_once(check)
        return None if update else self._created_message(check) if made == "created" else None

    @staticmethod
    def _created_message(check: GoldenCheck) -> str:
        return f"golden {check.path} did not exist: created it now ({check.create_command()}); commit it and re-run"

    def _mark(self, check: GoldenCheck) -> Path:
        return self.marks / (hashlib.sha256(str(check.path.resolve()).encode()).hexdigest()[:32] + ".made")

    def _made(self, check: GoldenCheck) -> str | None:
        """'created' or 'updated' when this session (any worker) made the golden, else None."""
        mark = self._mark(check)
        return mark.read_text() if mark.exists() else None

    @contextlib.contextmanager
    def _locked(self, check: GoldenCheck, how: int):
        """This golden's lock across xdist workers (one a golden: making one stalls no test of another). Not
        re-entrant: a process holding it that asks again waits for itself."""
        with open(self._mark(check).with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, how)
            yield

    def _create_once(self, check: GoldenCheck) -> str:
        """Make the golden once per session, whichever worker gets here first; 'created' (it did not exist)
        or 'updated'. The lock and the marks live in the session's own folder, not beside the goldens."""
        from .config import is_server_engine
        from .errors import GoldenError
        from .golden import create_golden
        from .server_golden import create_server_golden

        with self._locked(check, fcntl.LOCK_EX):  # xdist workers: one creates, the others find it made
            made = self._made(check)
            if made:
                return made
            try:
                check.directory.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise GoldenError(f"cannot make the golden folder {check.directory}: {error.strerror or error}; "
                                  "pass golden_dir= or --evalrun-golden-dir with a folder") from None
            made = "updated" if check.path.exists() else "created"
            config = _creation_config(check)
            create = create_server_golden if is_server_engine(config.engine) else create_golden
            create(check.name, config, check.directory, force=True)
            self._mark(check).write_text(made)
            return made


def _creation_config(check: GoldenCheck):
    from .config import build_config
    from .golden import open_golden

    if isinstance(check.create, str):
        return build_config(check.create)
    if isinstance(check.create, dict):
        return build_config(flags=check.create)
    if check.path.exists():  # --evalrun-update without `create`: the golden's own request, again
        return build_config(base=open_golden(check.name, check.directory).meta["requested_config"])
    return build_config()


def _truthy(value: str | None) -> bool:
    return (value or "").lower() not in ("", "0", "false", "no")


def _ci_variable() -> str | None:
    """The environment variable that says this is a CI run, or None. `CI` decides when it has a value (CI=false
    or CI=0 says it is not one); otherwise a CI system's own variable, for those that do not set CI."""
    if os.environ.get("CI"):
        return "CI" if _truthy(os.environ["CI"]) else None
    return next((name for name in CI_VARIABLES if _truthy(os.environ.get(name))), None)


# ---------------------------------------------------------------- fixtures and the judgment

@pytest.fixture
def evalrun_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    """This test's run options (one combination of the marker's lists)."""
    return getattr(request, "param", {})


@pytest.fixture(autouse=True)
def _evalrun_golden_check(request: pytest.FixtureRequest, evalrun_config: dict[str, Any]) -> None:
    """For a marked test: make the verdict before the body runs (errors here are errors, not failures)."""
    item = request.node
    if item.get_closest_marker(MARKER) is None:
        return
    from .errors import EvalrunError

    state: SessionState = request.config.stash[STATE]
    try:
        if "evalrun_config" not in getattr(getattr(item, "callspec", None), "params", {}):
            # not parametrized by pytest_generate_tests (a unittest.TestCase, a marker added after collection):
            # the marker's options still apply, never silently the golden's own config instead
            configs = configs_of(item.get_closest_marker(MARKER))
            if len(configs) > 1:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER} lists {len(configs)} configs, but this "
                                        "test is not parametrized by them (a unittest.TestCase, or a marker added "
                                        "after collection); give one value per option, or mark a test function")
            evalrun_config.update(configs[0])
        check = state.check_for(item, evalrun_config)
    except pytest.UsageError as error:  # a mistake in the marker: one line, like every evalrun error, no traceback
        pytest.fail(str(error), pytrace=False)
    state.folders.add(check.directory)
    state.used.add(check.path)
    item.stash[CHECK] = check
    try:
        problem = state.ensure_golden(check)
        if problem:
            item.stash[PROBLEM] = problem
            _record_error(item, check, problem)
            return
        verdict, run_id, store = state.verify(check, item.nodeid)
    except EvalrunError as error:  # bad options, an unreadable golden: an error, reported like a verdict
        _record_error(item, check, str(error))
        pytest.fail(f"golden {check.name} [{config_id(check.options)}]: {error}", pytrace=False)
    except Exception as error:  # evalrun's own failure: the traceback stays, and the summary says so too
        _record_error(item, check, f"evalrun failed: {type(error).__name__}: {error}", "error")
        raise
    item.stash[VERDICT] = verdict
    _record_properties(item, check, verdict, run_id, store, state._made(check))
    if verdict.verdict == "incomparable":
        pytest.fail(f"golden {check.name} [{config_id(check.options)}]: incomparable: {'; '.join(verdict.causes)}",
                    pytrace=False)


@pytest.fixture
def evalrun_verdict(request: pytest.FixtureRequest, _evalrun_golden_check):
    """The `evalrun.verify.Verdict` of this test's golden and config (None before it could be made)."""
    return request.node.stash.get(VERDICT, None)


def _record_properties(item: pytest.Item, check: GoldenCheck, verdict, run_id: str | None, store: str,
                       made: str | None = None) -> None:
    from . import verdict_report

    properties = [("evalrun.golden", check.name), ("evalrun.config", config_id(check.options)),
                  ("evalrun.verdict", verdict.verdict), ("evalrun.distance", f"{verdict.distance:.4g}"),
                  ("evalrun.closest", verdict.closest), ("evalrun.causes", "; ".join(verdict.causes)),
                  ("evalrun.run", run_id or ""), ("evalrun.store", store)]
    markdown = verdict_report.markdown(verdict)
    if made:  # --evalrun-update: verified against a golden this very model just made; say so wherever it is read
        properties.append(("evalrun.golden_made", made))
        markdown = (f"> ⚠️ golden `{check.name}` was {made} by this session (--evalrun-update): this verdict is "
                    "against the candidate model's own output and checks nothing about a model change\n\n" + markdown)
    item.user_properties.extend(properties)
    item.add_report_section("call", SECTION, markdown)


def _record_error(item: pytest.Item, check: GoldenCheck, message: str, verdict: str = "incomparable") -> None:
    """A golden that could not be checked (or is missing, or evalrun failed: verdict 'error') still reaches
    JUnit, the step summary and the PR comment."""
    from .golden import NAME_PATTERN
    from .report import markdown_cell

    item.user_properties.extend([("evalrun.golden", check.name), ("evalrun.config", config_id(check.options)),
                                 ("evalrun.verdict", verdict), ("evalrun.causes", message)])
    # a valid name is code as the verdict's heading has it (escapes show literally in a code span); any other, text
    name = f"`{check.name}`" if NAME_PATTERN.fullmatch(check.name) else markdown_cell(check.name)
    item.add_report_section("setup", SECTION, f"### ⛔ evalrun golden {name}: **{verdict}**"
                                              f"\n\n- {markdown_cell(message)}\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """The judgment, around the body of every kind of test (a unittest.TestCase's runs no pytest_pyfunc_call)."""
    problem = item.stash.get(PROBLEM, None)
    if problem:
        pytest.fail(problem, pytrace=False)
    result = yield  # a body's skip or xfail goes on to the report: pytest_runtest_makereport judges it
    failure = _verdict_failure(item)
    if failure:
        pytest.fail(failure, pytrace=False)
    verdict, check = item.stash.get(VERDICT, None), item.stash.get(CHECK, None)
    if verdict is not None and check is not None and check.enforce and verdict.verdict == "drift":
        warnings.warn(EvalrunDriftWarning(_verdict_line(check, verdict)), stacklevel=1)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A body that skipped or xfailed after the check does not hide a failing verdict, made before it ran: the
    report fails. Here, not around the call: a unittest.TestCase's skipTest() or pytest.skip() reaches no
    wrapper of the call (unittest keeps it, and pytest's report takes it from there). An xfail marker, which a
    reader sees on the test, still holds a changed verdict as expected."""
    report = yield
    if call.when == "call" and report.skipped and item.get_closest_marker("xfail") is None:
        failure = _verdict_failure(item)
        if failure:
            how = "xfailed" if hasattr(report, "wasxfail") else "skipped"
            report.outcome = "failed"
            report.longrepr = (f"{failure} (the test body {how} after the check; skip with a skipif marker, "
                               "which runs before it)")
            if hasattr(report, "wasxfail"):
                del report.wasxfail
    return report


def _verdict_line(check: GoldenCheck, verdict) -> str:
    detail = f"{verdict.causes[0] if verdict.causes else ''}; {verdict.closest} at {verdict.distance:.2f} of its budget"
    return f"golden {check.name} [{config_id(check.options)}]: {verdict.verdict}: {detail}"


def _verdict_failure(item: pytest.Item) -> str | None:
    """The failure message when the verdict fails the test (changed; drift when strict), else None."""
    verdict, check = item.stash.get(VERDICT, None), item.stash.get(CHECK, None)
    if verdict is None or check is None or not check.enforce:
        return None
    if verdict.verdict == "changed" or (check.strict and verdict.verdict == "drift"):
        return _verdict_line(check, verdict)
    return None


# ---------------------------------------------------------------- the session's end (controller)

class VerdictCollector:
    """Registered per session: sees every test report, the workers' too under xdist (in the controller)."""

    def __init__(self, state: SessionState):
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        properties = dict(report.user_properties)
        if "evalrun.verdict" not in properties or not (report.when == "call" or report.when == "setup" and report.failed):
            return
        markdown = next((content for name, content in report.sections if name.startswith(f"Captured {SECTION} ")), "")
        title = f"evalrun {properties['evalrun.golden']} [{properties['evalrun.config']}]"
        self.state.reports.append((report.nodeid, properties["evalrun.verdict"], title, markdown))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist does not know it
def pytest_configure_node(node) -> None:  # xdist controller: every worker shares the session's folder
    node.workerinput["evalrun_marks"] = str(node.config.stash[STATE].marks)


def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash.get(STATE, None)
    if state is None:
        return
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand what it used to the controller
        workeroutput["evalrun_used"] = sorted(str(p) for p in state.used)
        workeroutput["evalrun_folders"] = sorted(str(p) for p in state.folders)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None and state.marks is not None and getattr(config, "workerinput", None) is None:
        shutil.rmtree(state.marks, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    state = node.config.stash.get(STATE, None)
    output = getattr(node, "workeroutput", {}) or {}
    if state is not None:
        state.used.update(Path(p) for p in output.get("evalrun_used", []))
        state.folders.update(Path(p) for p in output.get("evalrun_folders", []))


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    from .ci_output import annotation, append_step_summary, on_github_actions

    state = config.stash.get(STATE, None)
    if state is None or getattr(config, "workerinput", None) is not None:
        return
    comment = config.getoption("evalrun_comment")
    if state.reports:
        from .report import markdown_cell

        counts = Counter(verdict for _, verdict, _, _ in state.reports)
        text = ("## evalrun: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) + "\n\n"
                + "\n".join(f"<sub>{markdown_cell(nodeid)}</sub>\n\n{body}" for nodeid, _, _, body in state.reports))
        append_step_summary(text)
    else:  # the comment still gets written: never leave an earlier session's comment behind
        text = "## evalrun: no golden was checked in this session\n"
    if comment:
        Path(comment).write_text(text, encoding="utf-8")
    for nodeid, verdict, title, _ in state.reports if on_github_actions() else ():
        line = annotation(verdict, title, f"{nodeid}: {verdict}")
        if line:
            terminalreporter.write_line(line)
    unused = unused_goldens(state.folders, state.used)
    if unused:
        terminalreporter.write_sep("-", "evalrun")
        terminalreporter.write_line(f"{len(unused)} golden(s) that no test of this session used: "
                                    + ", ".join(str(p) for p in unused) + " (delete them, or add a test)")


def unused_goldens(folders: set[Path], used: set[Path]) -> list[Path]:
    resolved = {p.resolve() for p in used}
    return sorted(path for folder in folders if folder.is_dir() for path in folder.glob("*.db")
                  if path.resolve() not in resolved)


STATE = pytest.StashKey[SessionState]()
CHECK = pytest.StashKey[GoldenCheck]()
VERDICT = pytest.StashKey[Any]()
PROBLEM = pytest.StashKey[str]()
