"""`evalrun bisect`: which knob, compiler pass, layer and step turn a GOOD config into a BAD one.

GOOD and BAD are SPECs (`parse_spec`): comma-separated items applied in order, the common run options
on top (as `golden verify` puts the user's options on a golden's requested config). Both are resolved
to effective configs; their difference over `config.NUMERICS_FACTORS`, in that order, is the knob
ladder (compilation mode before CUDA-graph mode before Inductor knobs before precision flags, as
torch's own bisector orders backends before subsystems). The predicate (`--until`) decides whether a
config is good: `bits` (every logits digest and token equal to GOOD's run), `verdict` (the golden's
verdict is not `changed`), `cmd:...` (a shell command: exit 0 good, 125 skip, else bad).

Stage 1, the knob ladder, is a search over data (`bisect_search`, pure, tested with fake predicates): BAD
judged first (GOOD and BAD agreeing under the predicate is no culprit: a predicate need not be monotone),
then a binary search over prefixes of the ladder (GOOD with the first n knobs of BAD) for the first bad one;
a prefix that is not a valid config (or that the predicate skips) is stepped over, so the culprit may be a
group of knobs that only change together. Then the culprit alone on GOOD: bad -> one culprit; good -> an
interaction, minimised by delta debugging (ddmin) over the earlier knobs. One culprit among K knobs takes at
most ceil(log2 K) + 3 runs, GOOD's and BAD's included. Every probe is an ordinary stored run
(`bisect_probe`), made in a fresh process unless asked otherwise, and reused when the store already holds it
(an interrupted bisect resumes). Stages 2-4 (`bisect_stages`) look inside the culprit: the compiler pass,
the layer and sub-block, the prompt and step.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .bisect_probe import Prober, ProbeOptions
from .bisect_search import Culprit, Knob, Predicate, knob_ladder, parse_predicate, run_bound, search_knobs
from .bisect_stages import analyse
from .config import (FIELD_TYPES, EffectiveConfig, RunConfig, apply_layer, build_config, load_config_source,
                     parse_opt_level, parse_set_option, preset_names)
from .errors import BisectError, ConfigError
from .golden import Hook
from .hashing import hash_value

STAGES = ("compiler", "layer")  # the optional stages (--skip); the knob ladder and the step always run
PROBE_TIMEOUT_S = 3600.0


# ---------------------------------------------------------------- SPECs and predicates

def split_spec(text: str) -> list[str]:
    """'O2,prefill_buckets=16,32,max_autotune=true' -> ['O2', 'prefill_buckets=16,32', 'max_autotune=true']:
    a bare number after a KEY=VALUE of a list key continues that list."""
    items: list[str] = []
    for piece in (part.strip() for part in text.split(",")):
        if not piece:
            continue
        previous_key = items[-1].split("=", 1)[0].strip().replace("-", "_") if items and "=" in items[-1] else ""
        if piece.strip("[]").isdigit() and FIELD_TYPES.get(previous_key, "").startswith("list"):
            items[-1] += "," + piece
        else:
            items.append(piece)
    if not items:
        raise BisectError(f"SPEC {text!r} is empty; give items such as O0, a preset, KEY=VALUE, run:ID or golden:NAME")
    return items


def spec_item(item: str, store_path: Path | None, golden_dir: Path) -> dict[str, Any]:
    """One SPEC item as requested-config values (see `parse_spec`)."""
    if item.startswith("run:"):
        from .store import Store, default_store_path

        store = Store(store_path or default_store_path(), readonly=True)
        try:
            values = EffectiveConfig.from_dict(store.get_run(item[4:]).config).as_dict()
        finally:
            store.close()
        values.pop("adjustments", None)
        return values
    if item.startswith("golden:"):
        from .golden import open_golden
        from .verify import candidate_config

        golden = open_golden(item[7:], golden_dir)
        candidate_config(golden, None, {}, ())  # validates the stored request
        return {k: v for k, v in golden.meta["requested_config"].items() if v is not None}
    if "=" in item:
        key, value = parse_set_option(item)
        build_config(sets=(item,))  # the value on its own: a choice, a range
        return {key: value}
    try:
        return {"opt_level": parse_opt_level(item)}
    except ConfigError:
        pass
    if item in preset_names() or item.endswith(".toml") or Path(item).is_file():
        return load_config_source(item)
    raise BisectError(f"SPEC item {item!r} is not an opt level (O0-O3), a preset ({', '.join(preset_names())}), a TOML "
                      "file, KEY=VALUE, run:ID or golden:NAME")


def parse_spec(text: str, store_path: Path | None = None, golden_dir: Path = Path("golden")) -> dict[str, Any]:
    """A SPEC's items merged in order into requested-config values: `O0`..`O3` sets opt_level; a preset
    name or TOML file its keys; `KEY=VALUE` one key; `run:ID` a stored run's effective config;
    `golden:NAME` the golden's requested config. Later items win."""
    values: dict[str, Any] = {}
    for item in split_spec(text):
        values = apply_layer(values, spec_item(item, store_path, golden_dir))
    return values


def spec_goldens(text: str) -> list[str]:
    return [item[7:] for item in split_spec(text) if item.startswith("golden:")]


# ---------------------------------------------------------------- one bisect, end to end

@dataclass
class BisectRequest:
    """The options of `evalrun bisect` (see the CLI). `hook(prepared)` is called on every model a probe or
    a stage prepares in this process (tests plant faults with it, together with `in_process=True`)."""

    good_spec: str
    bad_spec: str
    until: str = "bits"
    golden: str | None = None
    golden_dir: Path = Path("golden")
    config_source: str | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    sets: tuple[str, ...] = ()
    store_path: Path | None = None
    in_process: bool = False
    hook: Hook | None = None
    stages: tuple[str, ...] = STAGES
    probe_timeout: float = PROBE_TIMEOUT_S
    compare_compiler_bisector: bool = False  # also run CompilerBisector alone on BAD, for the run counts side by side
    progress: Callable[[str], None] | None = None


@dataclass
class BisectResult:
    """What a bisect found (`bisect_report` renders it): the knob ladder, every probe with its stored run,
    the culprit, and the stages run on it."""

    session: str
    good: str
    bad: str
    until: str
    store: str
    good_config: dict[str, Any]
    bad_config: dict[str, Any]
    knobs: list[Knob]
    probes: list[Any]  # bisect_probe.ProbeReport
    culprit: Culprit
    runs: int  # stage 1's runs (made or reused), GOOD's included
    bound: int  # ceil(log2 K) + 3: the most stage 1 takes for one culprit among K knobs
    culprit_run: str | None = None  # the stored run of GOOD with the culprit knobs (stages 2-4 examine it)
    culprit_config: dict[str, Any] | None = None
    compiler: Any = None  # bisect_stages.CompilerReport
    layer: Any = None  # bisect_stages.LayerReport
    step: Any = None  # bisect_stages.StepReport
    compiler_alone: Any = None  # bisect_stages.CompilerReport: CompilerBisector on BAD alone (when asked)
    seconds: float = 0.0

    @property
    def culprit_knobs(self) -> list[Knob]:
        return [self.knobs[i] for i in self.culprit.indices]

    @property
    def reused(self) -> int:
        return sum(1 for probe in self.probes if probe.reused)

    def as_dict(self) -> dict[str, Any]:
        data = {key: value for key, value in self.__dict__.items()
                if key not in ("knobs", "probes", "culprit", "compiler", "layer", "step", "compiler_alone")}
        data["knobs"] = [knob.as_dict() for knob in self.knobs]
        data["probes"] = [asdict(probe) for probe in self.probes]
        data["culprit"] = {"kind": self.culprit.kind, "knobs": [knob.as_dict() for knob in self.culprit_knobs],
                           "note": self.culprit.note}
        for stage in ("compiler", "layer", "step", "compiler_alone"):
            value = getattr(self, stage)
            data[stage] = asdict(value) if value is not None else None
        return data


def side_config(spec: str, request: BisectRequest) -> RunConfig:
    """One side's requested config: the SPEC's items, the common run options on top."""
    base = parse_spec(spec, request.store_path, request.golden_dir)
    return build_config(request.config_source, request.flags, request.sets, base=base)


def session_id(good: EffectiveConfig, bad: EffectiveConfig, predicate: Predicate, header: dict[str, Any]) -> str:
    """Same GOOD, BAD, predicate, model and prompts -> same session (its probes' labels carry it)."""
    return hash_value([good.factors(), bad.factors(), predicate.describe(), header["model"]["hash"],
                       header["prompt_set"]["hash"]])[:12]


def run_bisect(request: BisectRequest) -> BisectResult:
    """The whole bisect: resolve both sides, the knob ladder (stage 1), then the stages on the culprit."""
    from .runner import effective_config, prepare

    started = time.perf_counter()
    good = effective_config(side_config(request.good_spec, request))
    bad = effective_config(side_config(request.bad_spec, request))
    knobs = knob_ladder(good, bad)
    predicate = parse_predicate(request.until, request.golden, request.golden_dir,
                                spec_goldens(request.good_spec) + spec_goldens(request.bad_spec))
    if predicate.kind == "verdict":
        from .golden import open_golden

        open_golden(predicate.golden or "", predicate.golden_dir)  # a missing golden fails before any run
    good_prepared = prepare(good)
    if request.hook:
        request.hook(good_prepared)
    session = session_id(good, bad, predicate, good_prepared.header)
    options = ProbeOptions(request.in_process, request.hook, request.probe_timeout, request.progress)
    with tempfile.TemporaryDirectory(prefix="evalrun-bisect-") as scratch:
        prober = Prober(session, good, knobs, predicate, good_prepared, options, request.store_path, Path(scratch))
        try:
            prober.judge_good()
            if knobs:
                prober.judge_bad(frozenset(range(len(knobs))))  # the search's first probe (memoised)
            culprit = search_knobs(len(knobs), prober.judge) if knobs else Culprit(
                "none", [], "GOOD and BAD resolve to the same execution knobs")
            result = BisectResult(session, request.good_spec, request.bad_spec, predicate.describe(),
                                  str(prober.store.path), good.as_dict(), bad.as_dict(), knobs, prober.reports,
                                  culprit, prober.runs, run_bound(len(knobs)))
            if culprit.kind != "none":
                probe = prober.culprit_probe(culprit.indices)
                result.culprit_run, result.culprit_config = probe.report.run_id, probe.config.as_dict()
                result.step, result.layer, result.compiler = analyse(prober, probe, result.culprit_knobs,
                                                                     request.stages)
            if request.compare_compiler_bisector:
                from .bisect_stages import compiler_alone_stage

                say = request.progress or (lambda line: None)
                say("for comparison: CompilerBisector alone on BAD")
                result.compiler_alone = compiler_alone_stage(prober, bad, result.step.prompt_index if result.step else 0)
        finally:
            prober.store.close()
    result.seconds = time.perf_counter() - started
    return result
