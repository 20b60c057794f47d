"""The probes of `evalrun bisect`: one config each, an ordinary stored run, judged by the predicate.

A probe runs in a fresh process (`python -m evalrun.bisect_probe`: the request as JSON on stdin, the
result as JSON on stdout), so no compiled code, Dynamo cache or backend flag of one config reaches the
next; `in_process=True` runs it here instead (tests, where a hook plants faults). Before running, the
store is searched for a complete run that a bisect made with the same config, environment, model and
prompt-set hashes: it is reused, so an interrupted bisect resumes where it stopped. Under `--until
verdict` the probe is `golden verify`, and its stored run is the verification's candidate run, labelled
with the verdict (that is how a resumed bisect knows it).

Labels: `bisect:SESSION probe N` (+ ` verdict=V golden=NAME@PINNED` under --until verdict).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .bisect_search import Knob, Outcome, Predicate, apply_knobs
from .child import run_json_child
from .config import FIELD_NAMES, EffectiveConfig
from .errors import BisectError, ConfigError, EvalrunError
from .fingerprint import environment, environment_hash, inherited_environ
from .runner import Prepared
from .store import Store, default_store_path

LABEL_PREFIX = "bisect:"
VERDICT_LABEL = re.compile(r" verdict=(identical|drift|changed|incomparable) golden=(\S+)$")
SKIP_EXIT = 125  # git bisect run's "cannot test this one"


@dataclass
class ProbeReport:
    """One probe as reported: the knobs of BAD it puts on GOOD, what the predicate said, its stored run."""

    index: int
    knobs: list[str]
    outcome: str  # good | bad | skip (the predicate or the run could not judge it) | invalid (not a config here)
    run_id: str | None = None
    reused: bool = False
    config_hash: str = ""
    note: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class ProbeOptions:
    """How probes run: in this process or a fresh one each, the hook (in-process only), the time limit,
    and a callback that hears one line per probe."""

    in_process: bool = False
    hook: Callable[[Prepared], None] | None = None
    timeout: float = 3600.0
    progress: Callable[[str], None] | None = None


@dataclass
class Probe:
    report: ProbeReport
    config: EffectiveConfig | None
    details: dict[str, Any]  # the probe process's answer (verdict details under --until verdict)


def write_toml(config: EffectiveConfig, path: Path) -> Path:
    """The config as a TOML file `evalrun run --config` reads back to the same effective config."""
    lines = []
    for key, value in config.as_dict().items():
        if key not in FIELD_NAMES:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value, ensure_ascii=False)
        else:
            text = json.dumps(value)
        lines.append(f"{key} = {text}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class Prober:
    """Makes, reuses and judges the probes of one bisect session (memoised by knob set)."""

    def __init__(self, session: str, good: EffectiveConfig, knobs: list[Knob], predicate: Predicate,
                 good_prepared: Prepared, options: ProbeOptions, store_path: Path | None, scratch: Path):
        import torch

        self.session, self.good, self.knobs, self.predicate = session, good, knobs, predicate
        self.good_prepared, self.options, self.scratch = good_prepared, options, scratch
        self.store = Store(store_path or default_store_path())
        self.cuda = torch.cuda.is_available()
        self.gpu_count = torch.cuda.device_count() if self.cuda else None
        self.probes: dict[frozenset[int], Probe] = {}
        self.reports: list[ProbeReport] = []
        header = good_prepared.header
        self.prompts_hash = header["prompt_set"]["hash"]
        self.model_hashes = {(good.device, good.dtype, good.attn_implementation): header["model"]["hash"]}
        self.environment_hashes: dict[str, str] = {}
        self.golden_tag = self._golden_tag() if predicate.kind == "verdict" else ""
        self.good_record = None

    def _golden_tag(self) -> str:
        from .golden import open_golden

        golden = open_golden(self.predicate.golden or "", self.predicate.golden_dir)
        return f"{golden.name}@{golden.run_id('pinned')[:12]}"

    @property
    def runs(self) -> int:
        """Probes that took a run (made or reused); invalid configs take none."""
        return sum(1 for report in self.reports if report.outcome != "invalid")

    # ------------------------------------------------------------ judging

    def judge_good(self) -> None:
        """Probe GOOD; BisectError when GOOD itself does not pass the predicate."""
        probe = self.probe(frozenset())
        if probe.report.outcome != "good":
            raise BisectError(f"GOOD itself does not pass the predicate ({self.predicate.describe()}: "
                              f"{probe.report.outcome}, {probe.report.note or 'no detail'}); choose a GOOD that passes")
        self.good_record = self.store.get_run(probe.report.run_id)

    def judge_bad(self, everything: frozenset[int]) -> None:
        """BisectError when BAD (GOOD with every knob) could not be judged: its run failed or timed out, it is not a
        config here, or the predicate skipped it. Nothing was bisected, so that is no answer ("no culprit", exit 0,
        said GOOD and BAD agree); the probes made so far stay stored."""
        report = self.probe(everything).report
        if report.outcome in ("skip", "invalid"):
            timed_out = "timed out" in (report.note or "")
            raise BisectError(f"BAD could not be judged ({self.predicate.describe()}: {report.outcome}, "
                              f"{report.note or 'no detail'}); " + ("raise --probe-timeout" if timed_out else
                              "choose a BAD that runs here and that the predicate judges"))

    def judge(self, indices: frozenset[int]) -> Outcome:
        outcome = self.probe(indices).report.outcome
        return "skip" if outcome == "invalid" else outcome

    def culprit_probe(self, indices: list[int]) -> Probe:
        return self.probe(frozenset(indices))

    def probe(self, indices: frozenset[int]) -> Probe:
        if indices not in self.probes:
            self.probes[indices] = self._make(indices)
        return self.probes[indices]

    def _make(self, indices: frozenset[int]) -> Probe:
        chosen = [self.knobs[i] for i in sorted(indices)]
        report = ProbeReport(len(self.reports), [knob.name for knob in chosen], "invalid")
        self.reports.append(report)
        started = time.perf_counter()
        try:
            config = apply_knobs(self.good, chosen, self.cuda, self.gpu_count)
        except ConfigError as error:
            report.note = str(error)
            self._say(report)
            return Probe(report, None, {})
        report.config_hash = config.compute_hash()
        found = self._reusable(config)
        if found:
            report.run_id, details, report.reused = found[0], found[1], True
        else:
            details = self._run(config, f"{LABEL_PREFIX}{self.session} probe {report.index}")
            report.run_id = details.get("run_id")
        if details.get("error"):
            report.outcome, report.note = "skip", f"its run failed: {details['error']}"
        else:
            report.outcome, report.note = self._decide(config, report.run_id, details)
        report.seconds = time.perf_counter() - started
        self._say(report)
        return Probe(report, config, details)

    def _decide(self, config: EffectiveConfig, run_id: str | None, details: dict[str, Any]) -> tuple[str, str]:
        kind = self.predicate.kind
        if kind == "verdict":
            verdict = details.get("verdict", "")
            note = f"verdict {verdict}" + (f": {details['cause']}" if details.get("cause") else "")
            return {"changed": "bad", "incomparable": "skip"}.get(verdict, "good"), note
        if kind == "cmd":
            return self._command(config, run_id)
        if self.good_record is None:  # this is GOOD: the reference of `bits`
            return "good", "the reference"
        record = self.store.get_run(run_id or "")
        same = (record.logits_digest, record.tokens_digest) == (self.good_record.logits_digest,
                                                                self.good_record.tokens_digest)
        return ("good", "every logits digest and token equal to GOOD's") if same else \
            ("bad", "logits digests differ from GOOD's")

    def _command(self, config: EffectiveConfig, run_id: str | None) -> tuple[str, str]:
        """Run the user's command on a probe: EVALRUN_BISECT_CONFIG (its config as TOML), EVALRUN_BISECT_RUN
        (its run id) and EVALRUN_BISECT_STORE in the environment; exit 0 good, 125 skip, else bad."""
        path = write_toml(config, self.scratch / f"probe-{config.compute_hash()[:12]}.toml")
        env = dict(inherited_environ(), EVALRUN_BISECT_CONFIG=str(path), EVALRUN_BISECT_RUN=run_id or "",
                   EVALRUN_BISECT_STORE=str(self.store.path))
        try:
            process = subprocess.run(self.predicate.command, shell=True, env=env, capture_output=True, text=True,
                                     timeout=self.options.timeout)
        except subprocess.TimeoutExpired:
            return "skip", f"the command timed out after {self.options.timeout:.0f} s"
        code = process.returncode
        return ("good" if code == 0 else "skip" if code == SKIP_EXIT else "bad"), f"command exit {code}"

    # ------------------------------------------------------------ running and reusing

    def _expected_header(self, config: EffectiveConfig) -> dict[str, Any] | None:
        """The hashes a run of `config` here would carry (None when its model hash is not known yet)."""
        model_hash = self.model_hashes.get((config.device, config.dtype, config.attn_implementation))
        if model_hash is None:
            return None
        if config.device not in self.environment_hashes:
            self.environment_hashes[config.device] = environment_hash(environment(config.device))
        return {"config_hash": config.compute_hash(), "environment_hash": self.environment_hashes[config.device],
                "model": {"hash": model_hash}, "prompt_set": {"hash": self.prompts_hash}}

    def _reusable(self, config: EffectiveConfig) -> tuple[str, dict[str, Any]] | None:
        """A complete run of this config that a bisect stored before (with its verdict, under --until verdict)."""
        header = self._expected_header(config)
        if header is None:
            return None
        for record in self.store.find_complete_runs(header, LABEL_PREFIX):
            if self.predicate.kind != "verdict":
                return record.id, {}
            match = VERDICT_LABEL.search(record.label or "")
            if match and match.group(2) == self.golden_tag:
                return record.id, {"verdict": match.group(1)}
        return None

    def _run(self, config: EffectiveConfig, label: str) -> dict[str, Any]:
        request = {"config": config.as_dict(), "store": str(self.store.path), "label": label,
                   "until": self.predicate.kind, "golden": self.predicate.golden,
                   "golden_dir": self.predicate.golden_dir}
        if self.options.in_process:
            try:
                details = probe_here(request, self.options.hook, reuse=self.good_prepared)
            except EvalrunError as error:
                return {"error": str(error).splitlines()[0] if str(error) else type(error).__name__}
        else:
            details = self._child(request)
        if details.get("run_id"):
            record = self.store.get_run(details["run_id"])
            if record.config_hash != config.compute_hash():
                raise BisectError(f"probe run {record.id[:12]} ran another config than asked (hash "
                                  f"{record.config_hash[:12]} vs {config.compute_hash()[:12]}); report this")
            self.model_hashes.setdefault((config.device, config.dtype, config.attn_implementation), record.model_hash)
        return details

    def _child(self, request: dict[str, Any]) -> dict[str, Any]:
        """One probe in a fresh process; its failure is the probe's (a skip), not the bisect's."""
        result, error = run_json_child(["evalrun.bisect_probe"], self.options.timeout, stdin=json.dumps(request))
        return {"error": error} if result is None else result

    def _say(self, report: ProbeReport) -> None:
        if self.options.progress:
            knobs = ", ".join(report.knobs) or "GOOD"
            run = f", run {report.run_id[:12]}" + (" reused" if report.reused else "") if report.run_id else ""
            self.options.progress(f"probe {report.index} [{knobs}]: {report.outcome}{run}")


# ---------------------------------------------------------------- one probe, in whichever process runs it

def probe_here(request: dict[str, Any], hook=None, reuse: Prepared | None = None) -> dict[str, Any]:
    """Make one probe's run in this process and store it; under verdict, verify and store the candidate run.
    Returns {"run_id"} (+ "verdict", "cause", "failure" under verdict)."""
    from .runner import execute, prepare, record

    config = EffectiveConfig.from_dict(request["config"])
    store = Store(request["store"])
    try:
        if request["until"] == "verdict":
            return _verify_probe(config, store, request, hook)
        prepared = prepare(config, reuse=reuse)
        if hook:
            hook(prepared)
        return {"run_id": record(store, prepared.header, lambda: execute(prepared), request["label"]).run_id}
    finally:
        store.close()


def _verify_probe(config: EffectiveConfig, store: Store, request: dict[str, Any], hook) -> dict[str, Any]:
    from .golden import open_golden
    from .runner import record
    from .verify import verify_golden

    golden = open_golden(request["golden"], request["golden_dir"])
    runs: dict[str, Any] = {}
    verdict = verify_golden(golden, config, hook=hook, observe=lambda phase, run: runs.setdefault(phase, run))
    label = f"{request['label']} verdict={verdict.verdict} golden={golden.name}@{golden.run_id('pinned')[:12]}"
    run_id = None
    if "candidate" in runs:
        candidate = runs["candidate"]
        run_id = record(store, candidate.header, lambda: candidate, label).run_id
    return {"run_id": run_id, "verdict": verdict.verdict, "cause": verdict.causes[0] if verdict.causes else "",
            "failure": verdict_failure(verdict)}


def verdict_failure(verdict) -> dict[str, Any] | None:
    """The first prompt whose verdict is changed: its id, the reason and its first flip (if any)."""
    prompt = next((p for p in verdict.prompts if p.verdict == "changed"), None)
    if prompt is None:
        return None
    flip = next((f for f in prompt.flips if not f.passed), prompt.flips[0] if prompt.flips else None)
    return {"prompt_id": prompt.prompt_id, "reason": prompt.reason,
            "flip": None if flip is None else {"step": flip.step, "golden_token": flip.golden_token,
                                               "candidate_token": flip.candidate_token,
                                               "golden_margin": flip.golden_margin, "oracle_gap": flip.oracle_gap}}


def main() -> None:
    """`python -m evalrun.bisect_probe`: a probe request (JSON) on stdin, its result (JSON) on stdout."""
    try:
        print(json.dumps(probe_here(json.loads(sys.stdin.read()))))
    except EvalrunError as error:
        print(f"evalrun: error: {(str(error).splitlines() or [type(error).__name__])[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
