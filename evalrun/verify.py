"""Verify a candidate config against a golden: gates, runs, the two checks, one verdict.

1. Gates. Model identity differs -> changed, naming weights, config or tokenizer (one that reads the
   golden's tokens as other text). Tokens chosen another way (greedy against sampled, another temperature
   or sampling seed) -> incomparable. Prompt records differ -> incomparable. More new tokens than the
   golden holds -> incomparable; fewer -> the prefix is verified, and the causes say so.
2. The candidate runs free, probed at the golden's ids. Every digest and token equal -> identical,
   with no other run (the cheap path).
3. Forced decoding: the batches holding a prompt whose tokens left the golden's path run again, fed
   the golden's tokens (the other prompts' free runs already followed it). MoE models under evalrun's
   engine: forced routing too (`Context.routing`: every run here, whatever its dtype, when every run of the
   golden followed its pinned run's routing, a golden that says `routing: pinned`; in an older golden only a
   candidate in the golden's dtype that is not the function config). A prompt whose experts left the
   golden's anywhere (or came in another order) runs again along the golden's tokens and routing, so that a
   routing flip at a tie is judged by itself, not by the logits of the other path it opens. A flip is drift
   when it is a near-tie (routing.py: the router-probability gap it needs is within the router error
   against the oracle of the golden's pinned run and of the envelope of the candidate's dtype, x
   rules.ROUTING_FLIP_MULTIPLIER); a flip that is no near-tie fails the execution check.
4. Function check (is it the same model?): the candidate environment runs the golden's function
   config (float32, eager, deterministic, TF32 off) forced and probed. In the golden's own
   environment it must reproduce the golden's function run bit for bit; elsewhere its error against
   the float64 oracle must stay within `rules.FUNCTION_RULE` of the golden's. It runs at the candidate's
   batch size: a bug in the batched path (padding, masks, a row-dependent op) is then judged in float32,
   where it is thousands of budgets out; judged only by the execution check of a bfloat16 candidate, a 1%
   error of every batched row's logits was within 3x the envelope (drift). When the candidate's own config
   is that config, its run is reused.
5. Execution check (does this config compute that model faithfully?): the candidate's own forced
   numbers against the envelope of known-good implementations of its dtype recorded in the golden
   (pinned, reference, function). When the golden has none of that dtype, the reference config in
   that dtype runs here, in the candidate's environment, and the report says so.
Verdict: changed when a check fails (the cause says which and by how much), else drift; the distance
to the decision (observed / allowed, <= 1 passes) is reported for every prompt and for the set.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .compare import dict_diff, digest_mismatch_steps, environment_causes, first_divergence, worst_verdict
from .config import DECODE_LEVER_DEFAULTS, EffectiveConfig, RunConfig, build_config
from .errors import ConfigError, GoldenError
from .golden import ENVELOPE_ROLES, Golden, Hook, reference_config, roles_verify_reads, routing_layout
from .hashing import hash_value
from .routing import (PROMPT_ARRAY, RoutingFlip, RoutingPath, has_routing, left_path, result_flip, result_movement,
                      result_router_error, routing_path)
from .rules import (EXECUTION_RULE, FUNCTION_RULE, ROUTING_FLIP_FLOOR, ROUTING_FLIP_MULTIPLIER, Evidence, Judgement,
                    aggregate, judge, judge_set, rule_for, step_errors, typical)
from .runner import Prepared, Probes, Run, execute, prepare, steps_for
from .store import PromptResult

FUNCTION_CHECK_MODES = ("auto", "statistical")


@dataclass
class FlipReport:
    step: int
    golden_token: str
    candidate_token: str
    golden_margin: float  # the pinned run's own top1 - top2 at that step
    oracle_gap: float  # oracle logit of the golden's token minus the candidate's
    allowed_gap: float
    passed: bool


@dataclass
class CheckReport:
    """One check on one prompt, as reported."""

    candidate_error: float
    envelope_error: float
    ratio: float  # candidate_error / envelope_error
    distance: float  # observed / allowed over the rules; <= 1 passes
    worst_step: int
    step_ratio: float = 0.0  # worst step against its envelope error, before the multiplier
    flip_ratio: float = 0.0  # worst flip's oracle gap against the envelope error there
    reason: str = ""

    @classmethod
    def of(cls, judgement: Judgement) -> "CheckReport":
        return cls(judgement.candidate_error, judgement.envelope_error, judgement.ratio, judgement.distance,
                   judgement.worst_step, judgement.step_ratio, judgement.flip_ratio, judgement.reason)


@dataclass
class PromptVerdict:
    prompt_id: str
    verdict: str
    first_divergent_step: int  # tokens of the free candidate run vs golden; -1 when equal
    digest_mismatches: int  # steps whose logits digest differs
    function: CheckReport | None = None
    execution: CheckReport | None = None
    flips: list[FlipReport] = field(default_factory=list)
    distance: float = 0.0  # the largest of the checks' distances
    reason: str = ""
    routing: RoutingFlip | None = None  # MoE models: first routing flip, golden vs candidate along the golden's tokens


@dataclass
class Verdict:
    golden: str
    verdict: str
    exit_code: int
    causes: list[str]
    prompts: list[PromptVerdict]
    config_diff: list[tuple[str, Any, Any]]
    environment_diff: list[tuple[str, Any, Any]]
    model_diff: list[str]
    function_check: str  # how the function check ran and came out, one line
    execution_check: str
    distance: float  # the largest distance anywhere (per prompt or per set); <= 1 passes
    closest: str  # where that distance is, in words
    envelope: list[str]
    steps_verified: int | None
    candidate_config: dict[str, Any]
    timings: dict[str, float]
    candidate_run: dict[str, str] | None = None  # {"run_id", "store"} where `--store` kept the candidate run

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config_diff"] = [{"key": k, "golden": a, "candidate": b} for k, a, b in self.config_diff]
        data["environment_diff"] = [{"key": k, "golden": a, "candidate": b} for k, a, b in self.environment_diff]
        return data


def exit_code_for(verdict: str, strict: bool) -> int:
    return {"identical": 0, "drift": 1 if strict else 0, "changed": 1, "incomparable": 2}[verdict]


def candidate_config(golden: Golden, config_source: str | None, flags: dict[str, Any],
                     sets: tuple[str, ...]) -> RunConfig:
    """The golden's requested config with the user's explicit options on top."""
    try:
        build_config(base=golden.meta["requested_config"])
    except ConfigError as error:
        raise GoldenError(f"golden {golden.path}: its requested config is damaged ({error}); "
                          f"re-create it with `evalrun golden create {golden.name} --force`") from None
    return build_config(config_source, flags, sets, base=golden.meta["requested_config"])


# ---------------------------------------------------------------- the verification, step by step

@dataclass
class Context:
    """What the steps of one verification share."""

    golden: Golden
    candidate: Prepared
    golden_results: list[PromptResult]  # pinned, cut to the verified steps
    oracle: list[PromptResult]
    steps: dict[int, int]  # prompt index -> verified steps
    strict: bool
    progress: Callable[[str, int], Any] | None
    hook: Hook | None
    observe: Callable[[str, Run], None] | None
    causes: list[str]
    config_diff: list
    env_diff: list
    timings: dict[str, float]
    started: float

    def tick(self, phase: str, prepared: Prepared):
        return self.progress(phase, len(prepared.prompt_set.records)) if self.progress else None

    def ran(self, phase: str, run: Run) -> Run:
        """Hand each run this verification makes to the observer (calibration keeps their logits)."""
        if self.observe:
            self.observe(phase, run)
        return run

    def oracle_by_index(self, index: int) -> PromptResult:
        return next(r for r in self.oracle if r.prompt_index == index)

    def tokens(self) -> dict[int, np.ndarray]:
        return {r.prompt_index: r.arrays["tokens"] for r in self.golden_results}

    def routing(self, config: EffectiveConfig | None = None) -> dict[int, RoutingPath] | None:
        """The golden's experts per prompt index (at its steps and prompt tokens), when the forced runs of `config`
        (default: the candidate's) follow them: an MoE golden (with its oracle's routing, which calibrates the flips)
        and evalrun's engine. When every run of the golden followed its pinned routing (`Golden.routing_followed`),
        every such run here does too, whatever its dtype: the candidate's, the function config's, the reference
        run here, so that each is compared with an oracle and envelope along the same experts. An older golden's
        runs routed freely: only the candidate in the golden's dtype (its envelope members share the pinned path
        there), never the function config (its run must reproduce the golden's function run, routed freely)."""
        config = config or self.candidate.config
        if not all(has_routing(r.arrays) for r in self.golden_results + self.oracle) or config.engine != "evalrun":
            return None
        if not self.golden.routing_followed and (config.dtype != self.golden.config("pinned").dtype or
                                                 config.compute_hash() == _function_config(self).compute_hash()):
            return None
        return {r.prompt_index: routing_path(r.arrays) for r in self.golden_results}

    def probes(self) -> Probes:
        return Probes({r.prompt_index: r.arrays["probe_ids"] for r in self.oracle})

    def verdict(self, verdict: str, prompts: list[PromptVerdict], function_check: str, execution_check: str,
                distance: float = 0.0, closest: str = "", envelope: list[str] | None = None,
                model_diff: list[str] | None = None) -> Verdict:
        self.timings["total_s"] = time.perf_counter() - self.started
        return Verdict(self.golden.name, verdict, exit_code_for(verdict, self.strict), self.causes, prompts,
                       self.config_diff, self.env_diff, model_diff or [], function_check, execution_check, distance,
                       closest, envelope or [], max(self.steps.values()) if self.steps else None,
                       self.candidate.config.as_dict(), self.timings)


def _cut(result: PromptResult, steps: int) -> PromptResult:
    """A result limited to its first `steps` steps (the prefix a shorter candidate verifies)."""
    per_step = ("tokens", "digests", "topk_ids", "topk_values", "margins", "probe_ids", "probe_values",
                "probe_logsumexp", "routing_experts", "routing_margins")
    arrays = {name: (array[:steps] if name in per_step else array) for name, array in result.arrays.items()}
    return dataclasses.replace(result, arrays=arrays, new_tokens=min(result.new_tokens, steps))


def _gate(golden: Golden, candidate: Prepared, golden_results: list[PromptResult]) -> tuple[str, str, list[str]] | None:
    """(verdict, cause, model parts) when the candidate cannot be verified as a run of the golden's model.

    Weights or model config differ -> changed. A tokenizer that differs but encodes every prompt to the
    same ids and reads the golden's tokens as the golden's text is not a gate (outputs are compared by token
    id; `tokenizer_note` names what differs): the same GGUF file converted by two transformers versions gave
    two end-of-sequence ids. Prompts that encode differently -> incomparable; tokens read as other text ->
    changed (`decoding_difference`)."""
    pinned = golden.pinned
    model_diff = [part for part in ("weights", "config")
                  if candidate.header["model"][part] != pinned.json["model"].get(part)]
    if model_diff:
        return "changed", "; ".join(f"model identity: {part} differ" for part in model_diff), model_diff
    sampling = _sampling_gate(golden.config("pinned"), candidate.config)
    if sampling:
        return "incomparable", sampling, []
    records = [r.record for r in golden_results]
    if hash_value(records) != hash_value([r.as_dict() for r in candidate.prompt_set.records]):
        return ("incomparable", f"prompt set differs from the golden's ({pinned.json['prompt_set']['name']}): "
                "verify with the golden's prompts or create a new golden", [])
    for result, ids in zip(golden_results, candidate.prompt_set.token_ids):
        if not np.array_equal(result.arrays.get("input_ids", np.array([])), np.asarray(ids, dtype=np.int64)):
            return ("incomparable", f"prompt {result.prompt_id!r} encodes to other token ids than in the golden: "
                    f"the tokenizer differs ({tokenizer_note(golden, candidate) or 'its hash'}); verify where the "
                    "golden's tokenizer is, or re-create the golden", ["tokenizer"])
    _check_id_ranges(golden, golden_results, candidate.loaded.vocab_size,
                     getattr(candidate.loaded.model.config, "num_experts", None))
    differing = _decoding_fields_differing(golden, candidate)
    other_text = decoding_difference(golden_results, candidate.loaded.tokenizer) if differing else None
    if other_text:
        return ("changed", f"model identity: the tokenizer's {', '.join(differing)} differ and {other_text}; verify "
                "with the golden's tokenizer, or re-create the golden if the change is meant", ["tokenizer"])
    _check_routing_layout(golden, golden_results, candidate)
    for result in golden_results:
        wanted = steps_for(candidate.prompt_set, result.prompt_index, candidate.config)
        if wanted > len(result.arrays["tokens"]):
            return ("incomparable", f"prompt {result.prompt_id!r}: the golden holds {len(result.arrays['tokens'])} new "
                    f"tokens, the candidate asks {wanted}; verify with --max-new-tokens {len(result.arrays['tokens'])} "
                    "or fewer, or re-create the golden", [])
    return None


DECODING_FIELDS = ("vocab_size", "vocab", "added_tokens", "decoder", "model_rules")  # what turns ids into text


def decoding_difference(golden_results: list[PromptResult], tokenizer: Any) -> str | None:
    """How the candidate's tokenizer reads the golden's tokens as other text than the golden stored, else None.

    Outputs are compared by token id, so a tokenizer whose vocabulary or decoder changed (' Paris' and ' London'
    swapped, a decoder rule) with every prompt still encoding to the golden's ids verified identical: the same ids
    now read as other words. Each prompt's tokens are decoded as the run decoded them (runner.to_results: up to the
    golden's end-of-sequence step, special tokens kept; a server golden's ids whole, its eos_step their count) and
    must give the golden's text. Other text is `changed` where a recorded field that turns ids into text differs
    (DECODING_FIELDS, `_gate`); with those fields the golden's, it is a library that decodes otherwise (a
    transformers release changed its clean-up of spaces once), named in the causes. The end-of-sequence id is not
    judged here: the same GGUF file converted by two transformers versions gave two (`tokenizer_note`)."""
    for result in golden_results:
        tokens = result.arrays["tokens"]
        end = result.eos_step if result.eos_step >= 0 else len(tokens)
        text = tokenizer.decode(tokens[:end].tolist(), skip_special_tokens=False)
        if text != result.output_text:
            start = next((i for i, (a, b) in enumerate(zip(text, result.output_text)) if a != b),
                         min(len(text), len(result.output_text)))
            around = slice(max(0, start - 12), start + 24)
            return (f"it reads the golden's tokens for prompt {result.prompt_id!r} as other text "
                    f"({result.output_text[around]!r} -> {text[around]!r})")
    return None


def _sampling(config) -> str:
    return "greedily (temperature=0)" if not config.temperature else \
        f"by sampling (temperature={config.temperature:g}, seed={config.seed})"


def _sampling_gate(golden, candidate) -> str | None:
    """Why the candidate's tokens cannot be compared with the golden's, when they are chosen another way: greedy
    against sampled, or sampled at another temperature or seed (the seed matters only where tokens are sampled).
    A greedy golden verified at temperature=1.0 was called `changed`, blaming the execution config for tokens
    that chance chose; these are another workload, not a verdict on the numbers."""
    way = lambda config: (config.temperature, config.seed if config.temperature else None)  # noqa: E731
    if way(golden) == way(candidate):
        return None
    keep = ["temperature=0"] if not golden.temperature else [f"temperature={golden.temperature:g}",
                                                             f"seed={golden.seed}"]
    return (f"the golden chose its tokens {_sampling(golden)} and the candidate chooses them {_sampling(candidate)}; "
            f"verify with the golden's ({' '.join('--set ' + part for part in keep)}), or create a golden "
            "that samples the same way")


def _check_id_ranges(golden: Golden, golden_results: list[PromptResult], vocab: int, experts: int | None) -> None:
    """The golden's ids feed the candidate's engine: tokens and probe ids must be vocabulary ids, the pinned run's
    experts (forced routing) the model's experts. (Their dtypes, signs and shapes: store.result_problem.)"""
    bounds = {"tokens": (vocab, "vocabulary ids"), "probe_ids": (vocab, "vocabulary ids")}
    if experts is not None:
        bounds["routing_experts"] = bounds[PROMPT_ARRAY] = (experts, "experts")
    for role, results in (("pinned", golden_results), ("oracle", golden.results("oracle"))):
        for result in results:
            for name, (bound, unit) in bounds.items():
                ids = result.arrays.get(name)
                if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= bound):
                    raise GoldenError(f"golden {golden.path}: the {role} run's {name} for prompt {result.prompt_id!r} "
                                      f"fall outside the model's {bound} {unit}; re-create it with "
                                      f"`evalrun golden create {golden.name} --force`")


def _check_routing_layout(golden: Golden, golden_results: list[PromptResult], candidate: Prepared) -> None:
    """The golden's experts feed forced routing (the candidate's runs, the function run, the reference here): each
    step's must have this model's routing shape [MoE layers, k]. (Their values: _check_id_ranges; the oracle's
    shape is the pinned run's: golden.results_problem.)"""
    from .engine.moe import model_routing_layout

    if not any(has_routing(r.arrays) for r in golden_results):
        return
    layout = model_routing_layout(candidate.loaded.model)
    for result in golden_results:
        shape = routing_layout(result)  # None where a prompt has no routing
        if shape != layout:
            raise GoldenError(f"golden {golden.path}: prompt {result.prompt_id!r} has routing of shape {shape}, this "
                              f"model's {layout}; re-create it with `evalrun golden create {golden.name} --force`")


def _tokenizer_fields(header: dict[str, Any]) -> dict[str, Any]:
    fields = header.get("tokenizer_fields")
    return fields if isinstance(fields, dict) else {}


def _differing_tokenizer_fields(golden: Golden, candidate: Prepared) -> dict[str, tuple[Any, Any]]:
    """field -> (the golden's value, the candidate's) for the tokenizer fields both recorded that differ. Fields an
    older golden did not record (the pipeline's steps, stop 48) are not compared."""
    ours, theirs = _tokenizer_fields(candidate.header["model"]), _tokenizer_fields(golden.pinned.json["model"])
    return {key: (theirs[key], ours[key]) for key in sorted(set(ours) & set(theirs)) if ours[key] != theirs[key]}


def _decoding_fields_differing(golden: Golden, candidate: Prepared) -> list[str]:
    """The differing tokenizer fields that turn ids into text (DECODING_FIELDS): where one does, other text from
    the golden's tokens is `changed` (`_gate`); where none does, it is named in the causes (`begin`)."""
    return [key for key in _differing_tokenizer_fields(golden, candidate) if key in DECODING_FIELDS]


def _one_line(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str, ensure_ascii=True)  # a golden's text adds no line


def tokenizer_note(golden: Golden, candidate: Prepared) -> str:
    """Which tokenizer fields differ between golden and candidate ('' when the tokenizers are the same)."""
    fields = [f"{key} {_one_line(theirs)} -> {_one_line(ours)}"
              for key, (theirs, ours) in _differing_tokenizer_fields(golden, candidate).items()]
    if fields:
        return ", ".join(fields)
    return "its hash" if candidate.header["model"]["tokenizer"] != golden.pinned.json["model"].get("tokenizer") else ""


def generation_note(golden: Golden, candidate: Prepared) -> str:
    """Which settings of the model's generation_config.json differ ('' when alike, or when the golden is older
    than the record). Compared as JSON, as the golden holds them."""
    theirs, ours = golden.pinned.json["model"].get("generation_config"), candidate.header["model"].get("generation_config")
    if not isinstance(theirs, dict) or not isinstance(ours, dict):
        return ""
    theirs, ours = json.loads(_one_line(theirs)), json.loads(_one_line(ours))
    return ", ".join(f"{_one_line(key)} {_one_line(theirs.get(key))} -> {_one_line(ours.get(key))}"
                     for key in sorted(set(theirs) | set(ours)) if theirs.get(key) != ours.get(key))


def verify_golden(golden: Golden, config: RunConfig, strict: bool = False,
                  progress: Callable[[str, int], Any] | None = None, hook: Hook | None = None,
                  function_check: str = "auto", observe: Callable[[str, Run], None] | None = None,
                  reuse: Prepared | None = None) -> Verdict:
    """The verdict of `config` against `golden` (see the module docstring for the steps).

    `hook` is called on every run this verification prepares (tests and calibration plant faults
    with it); `function_check="statistical"` judges the function check by its numbers even in the
    golden's own environment, where "auto" demands bit-for-bit reproduction; `observe(phase, run)`
    sees every run made (phases: candidate, forced, function, envelope); `reuse` shares an already
    loaded model (several configs verified in one process load the weights once).
    """
    context = begin(golden, config, strict, progress, hook, function_check, observe, reuse)
    if isinstance(context, Verdict):
        return context
    return judge_runs(context, compute_runs(context), function_check)


def begin(golden: Golden, config: RunConfig, strict: bool = False, progress: Callable[[str, int], Any] | None = None,
          hook: Hook | None = None, function_check: str = "auto", observe: Callable[[str, Run], None] | None = None,
          reuse: Prepared | None = None) -> "Context | Verdict":
    """Prepare the candidate and pass the gates: the verification's context, or the verdict a gate gave."""
    if function_check not in FUNCTION_CHECK_MODES:
        raise ValueError(f"function_check must be one of {FUNCTION_CHECK_MODES}")
    started = time.perf_counter()
    golden_results = golden.results("pinned")
    for role in roles_verify_reads(golden.meta):  # damage found now, before the model loads, whatever the candidate
        golden.results(role)
    candidate = prepare(config, reuse)
    if hook:
        hook(candidate)
    pinned = golden.config("pinned")
    config_diff = dict_diff(pinned.factors(), candidate.config.factors())
    golden_env, candidate_env = golden.pinned.json["environment"], candidate.header["environment"]
    env_diff = dict_diff(golden_env, candidate_env)
    causes = [f"config: {k} {a} -> {b}" for k, a, b in config_diff]
    causes += environment_causes(env_diff, golden_env, candidate_env)
    gated = _gate(golden, candidate, golden_results)
    # other text with every field that turns ids into text the golden's is no gate (_gate decoded the rest)
    other_text = decoding_difference(golden_results, candidate.loaded.tokenizer) \
        if gated is None and not _decoding_fields_differing(golden, candidate) else None
    note = tokenizer_note(golden, candidate)
    if note and gated is None:
        read_alike = "" if other_text else " and its tokens read as the golden's text"  # else the next cause says
        causes.append(f"tokenizer differs ({note}); every prompt encodes to the golden's token ids{read_alike}, so "
                      "outputs are compared by token id")
    if other_text:
        causes.append(f"tokenizer: {other_text}, with the golden's vocabulary and decoder: this transformers or "
                      "tokenizers version decodes them otherwise; outputs are compared by token id")
    generation = generation_note(golden, candidate)
    if generation and gated is None:
        causes.append(f"generation config differs ({generation}): evalrun chooses tokens by its own config "
                      f"({_sampling(candidate.config)}); generate() or a server reading the model's folder would not")
    steps = {r.prompt_index: steps_for(candidate.prompt_set, r.prompt_index, candidate.config) for r in golden_results
             if r.prompt_index < len(candidate.prompt_set.records)}  # a gated shorter prompt set lacks some
    context = Context(golden, candidate, [_cut(r, steps.get(r.prompt_index, 0)) for r in golden_results], [], steps, strict,
                      progress, hook, observe, causes, config_diff, env_diff, {}, started)
    if gated is not None:
        verdict, cause, model_diff = gated
        context.causes = [cause] + causes
        return context.verdict(verdict, [], "skipped: " + verdict, "skipped: " + verdict, model_diff=model_diff)
    if any(steps[r.prompt_index] < len(r.arrays["tokens"]) for r in golden_results):
        causes.append(f"verified the first {max(steps.values())} of {max(len(r.arrays['tokens']) for r in golden_results)} "
                      "new tokens per prompt (the candidate asks fewer)")
    context.oracle = [_cut(r, steps[r.prompt_index]) for r in golden.results("oracle")]
    return context


@dataclass
class VerifyRuns:
    """The model runs a verification makes, per prompt index; what a shard computes for its prompts
    (sharding.py joins the shards' by union). `function` is None when the function config is the
    candidate's own (its forced results serve); `envelope` is None when the golden holds the envelope."""

    free: dict[int, PromptResult]
    forced: dict[int, PromptResult]  # free results, with the diverged prompts' forced re-runs in their place
    function: dict[int, PromptResult] | None = None
    envelope: dict[int, PromptResult] | None = None


def compute_runs(context: Context, only: set[int] | None = None,
                 checks_needed: Callable[[bool], bool] = lambda identical: not identical) -> VerifyRuns:
    """Run the candidate free, then (when `checks_needed(every prompt here identical)`: by default when
    one is not) the forced re-runs, the function config and, where the golden has no envelope of the
    candidate's dtype, the reference here; each over the batches holding a prompt of `only` (all when
    None). A shard's `checks_needed` asks the other shards too (sharding.py)."""
    candidate = context.candidate
    free = context.ran("candidate", execute(candidate, probes=context.probes(), only=only,
                                            progress=context.tick("candidate", candidate)))
    context.timings["candidate_s"] = free.timings["generate_s"]
    runs = VerifyRuns(free.by_index(), free.by_index())
    mine = [r for r in context.golden_results if r.prompt_index in runs.free]
    prompts = _free_verdicts(mine, [runs.free[r.prompt_index] for r in mine])
    if not checks_needed(all(p.verdict == "identical" for p in prompts)):
        return runs
    runs.forced = _forced_results(context, free, prompts, mine)
    if _function_config(context).compute_hash() != candidate.config.compute_hash():
        started = time.perf_counter()
        runs.function = _run_forced(context, _function_config(context), "function", only)
        context.timings["function_s"] = time.perf_counter() - started
    if not _envelope_roles(context):
        started = time.perf_counter()
        runs.envelope = _run_forced(context, reference_config(candidate.config), "envelope", only)
        context.timings["envelope_s"] = time.perf_counter() - started
    return runs


def judge_runs(context: Context, runs: VerifyRuns, function_check: str = "auto") -> Verdict:
    """The verdict from the runs of every prompt (`compute_runs`, or the shards' joined)."""
    results = [runs.free[r.prompt_index] for r in context.golden_results]
    prompts = _free_verdicts(context.golden_results, results)
    if all(p.verdict == "identical" for p in prompts):
        context.causes = context.causes or ["every token and logits digest equal"]
        return context.verdict("identical", prompts, "skipped: identical", "skipped: identical")
    if not context.config_diff and not context.env_diff:
        context.causes.append("nondeterminism: same config and environment, different bits")
    composition = batch_composition_cause(context.config_diff, context.env_diff, context.golden_results, results)
    if composition:
        context.causes.append(composition)
    envelope_names, members = _envelope(context, runs.envelope)
    _routing_flips(context, runs.forced, prompts, members)
    function_line, function_reports, function_set = _function_check(context, runs.forced, runs.function,
                                                                     function_check)
    execution = _execution_check(context, runs.forced, members, prompts)
    return _decide(context, prompts, function_line, function_reports, function_set, envelope_names, execution)


def batch_composition_cause(config_diff: list[tuple[str, Any, Any]], env_diff: list[tuple[str, Any, Any]],
                            golden_results: list[PromptResult], results: list[PromptResult]) -> str | None:
    """The cause line when the only difference between golden and candidate is the batch each prompt ran
    in (batch_size, nothing else in config or environment), naming how many prompts changed batch."""
    if env_diff or [key for key, _, _ in config_diff] != ["batch_size"]:
        return None
    (_, before, after), = config_diff
    golden_batches, batches = _companions(golden_results), _companions(results)
    moved = sum(golden_batches[r.prompt_index] != batches.get(r.prompt_index) for r in golden_results)
    return (f"batch composition: the only difference is the batch each prompt ran in (batch_size {before} -> "
            f"{after}; {moved} of {len(golden_results)} prompts in another batch or row); this engine's bits depend "
            "on the batch: `evalrun invariance` measures it, --set batch_invariant=true removes it")


def _companions(results: list[PromptResult]) -> dict[int, tuple]:
    """prompt index -> (its row, the prompt indices of its batch)."""
    members: dict[int, list[int]] = {}
    for result in results:
        members.setdefault(result.batch_index, []).append(result.prompt_index)
    return {r.prompt_index: (r.batch_row, tuple(members[r.batch_index])) for r in results}


def _free_verdicts(golden_results: list[PromptResult], results: list[PromptResult]) -> list[PromptVerdict]:
    """Per prompt: identical when every digest and token matches, else provisionally drift."""
    verdicts = []
    for g, c in zip(golden_results, results):
        mismatches = digest_mismatch_steps(g.arrays["digests"], c.arrays["digests"])
        same = mismatches.size == 0 and np.array_equal(g.arrays["tokens"], c.arrays["tokens"])
        verdicts.append(PromptVerdict(g.prompt_id, "identical" if same else "drift",
                                      first_divergence(g.arrays["tokens"], c.arrays["tokens"]), int(mismatches.size)))
    return verdicts


def _forced_results(context: Context, free: Run, prompts: list[PromptVerdict],
                    golden_results: list[PromptResult]) -> dict[int, PromptResult]:
    """Every prompt's numbers along the golden's tokens: free results where the tokens stayed on the
    path, a forced re-run of the batches where they did not (`prompts` are `golden_results`' verdicts)."""
    results = free.by_index()
    routing = context.routing()
    diverged = {r.prompt_index for r, p in zip(golden_results, prompts)
                if p.first_divergent_step >= 0 or (routing is not None and p.verdict != "identical" and
                                                   left_path(routing[r.prompt_index], results[r.prompt_index].arrays))}
    if diverged:
        started = time.perf_counter()
        rerun = context.ran("forced", execute(context.candidate, forced=context.tokens(), probes=context.probes(),
                                              progress=context.tick("forced", context.candidate), only=diverged,
                                              timed=False, routing=routing))
        results.update(rerun.by_index())
        context.timings["forced_s"] = time.perf_counter() - started
    return results


def _routing_flips(context: Context, forced: dict[int, PromptResult], prompts: list[PromptVerdict],
                   members: list[dict[int, PromptResult]]) -> None:
    """MoE models: each prompt's first routing flip (golden vs the candidate along the golden's tokens, so
    every step has the same input), and one cause naming the first flip and whether it was a near-tie. Under
    forced routing every flip is judged against the router error of the golden and of the envelope of the
    candidate's dtype (`_routing_allowance`), and each prompt reports its decisive flip."""
    moved = _routing_allowance(context, members) if context.routing() is not None else None
    unseen = 0  # prompts the golden routed whose candidate captured no routing
    for golden_run, prompt in zip(context.golden_results, prompts):
        if prompt.verdict != "identical":
            candidate = forced[golden_run.prompt_index].arrays
            unseen += has_routing(golden_run.arrays) and not has_routing(candidate)
            flip = result_flip(golden_run.arrays, candidate, context.steps[golden_run.prompt_index], moved)
            oracle = context.oracle_by_index(golden_run.prompt_index).arrays
            prompt.routing = flip.with_oracle(oracle) if flip is not None else None
    if unseen:  # e.g. --engine transformers: it captures no routing, so it can neither follow the golden's nor show it
        context.causes.append(f"routing: not compared in {unseen} of {len(prompts)} prompts: engine "
                              f"{context.candidate.config.engine} captures no expert choices, so the verdict rests on "
                              "the logits alone (evalrun's engine follows the golden's routing and judges its flips)")
    flipped = [p for p in prompts if p.routing is not None]
    if not flipped:
        return
    ties = sum(p.routing.near_tie for p in flipped)
    if moved is None:
        shown, which = min(flipped, key=lambda p: (p.routing.step, p.routing.layer)), "first"
    else:  # forced: each prompt's decisive flip; the one furthest from a near-tie
        shown, which = max(flipped, key=lambda p: p.routing.distance), "the furthest from a tie"
    context.causes.append(f"routing: experts chosen differently in {len(flipped)} of {len(prompts)} prompts "
                          f"({ties} at near-ties); {which} in prompt {shown.prompt_id!r}: "
                          f"{shown.routing.describe('golden', 'candidate')}")
    if moved is not None and ties < len(flipped) and not context.golden.routing_followed:
        context.causes.append("routing: this golden's oracle routed freely (made before evalrun measured the router "
                              "error along the pinned routing), so its allowance saw only the entries before their "
                              "first flip; re-create it with `evalrun golden create "
                              f"{context.golden.name} --force` for the allowance along the whole path")


def _routing_allowance(context: Context, members: list[dict[int, PromptResult]]) -> float:
    """The router-probability gap a flip under forced routing may need and still be a near-tie: the router error
    against the float64 oracle of the golden's pinned run and of the known-good implementations of the
    candidate's dtype (`members`, the execution check's envelope) x rules.ROUTING_FLIP_MULTIPLIER. A flip of the
    candidate against the pinned run needs about both runs' errors, so both dtypes count: a bfloat16 candidate
    of a float32 golden is allowed bfloat16's error. The golden and known-good implementations set it, not the
    candidate: a candidate whose router reports wild margins cannot widen it. (Where the golden has no
    implementation of the candidate's dtype, the reference config runs here, as the execution check's envelope;
    a candidate that is that config is then its own envelope in both checks.) Plus rules.ROUTING_FLIP_FLOOR, so
    that a golden whose pinned run is its oracle's bit for bit (float64) still allows rounding.

    The error, the largest over prompts: where the oracle and the members followed the pinned routing,
    `router_error` at every (step, layer) entry; in an older golden, whose runs routed freely, the pinned run's
    margin movement before its first flip against the oracle only (after it the two see different inputs). A
    model with many MoE layers and experts flips against its oracle within its first few entries, so that older
    measure saw too little of the router's error (with 128 experts, top-8 and 24 layers: 2 to 4 entries of 384,
    and false `changed` on 4 of 9 random checkpoints at -O1 on the CPU, 12 of 20 verifications on the H200)."""
    if context.golden.routing_followed:
        errors = [result_router_error(run[g.prompt_index].arrays, context.oracle_by_index(g.prompt_index).arrays,
                                      context.steps[g.prompt_index])
                  for run in [{r.prompt_index: r for r in context.golden_results}, *members]
                  for g in context.golden_results]
    else:
        errors = [result_movement(g.arrays, context.oracle_by_index(g.prompt_index).arrays,
                                  context.steps[g.prompt_index], until_flip=True) for g in context.golden_results]
    return ROUTING_FLIP_MULTIPLIER * max(errors) + ROUTING_FLIP_FLOOR


def _run_forced(context: Context, config: EffectiveConfig, phase: str,
                only: set[int] | None = None) -> dict[int, PromptResult]:
    prepared = prepare(config, reuse=context.candidate)
    if context.hook:
        context.hook(prepared)
    return context.ran(phase, execute(prepared, forced=context.tokens(), probes=context.probes(), only=only,
                                      progress=context.tick(phase, prepared), timed=False,
                                      routing=context.routing(config))).by_index()


def _function_config(context: Context) -> EffectiveConfig:
    """The golden's function config, on the candidate's device, workload and batch size (module docstring, 4),
    with the decode levers at their defaults (golden.reference_config; goldens made before it kept them)."""
    golden_function = context.golden.config("function")
    # An older MoE golden's function run routed freely: at another batch size its float32 router could tip a tie
    # that no allowance here covers, so it keeps the golden's batch size (and its bit-for-bit check).
    older_moe = not context.golden.routing_followed and all(has_routing(r.arrays) for r in context.golden_results)
    taken = ("model", "prompts", "max_new_tokens") + (() if older_moe else ("batch_size",))
    workload = {key: getattr(context.candidate.config, key) for key in taken}
    return golden_function.replace(device=context.candidate.config.device, **DECODE_LEVER_DEFAULTS, **workload)


def _function_check(context: Context, forced: dict[int, PromptResult], function: dict[int, PromptResult] | None,
                    mode: str):
    """Returns (one-line summary, per-prompt reports, set distance). `function`: the function config's
    forced results, None when that config is the candidate's (then `forced` serve)."""
    config = _function_config(context)
    results = forced if function is None else function
    golden_function = {r.prompt_index: _cut(r, context.steps[r.prompt_index]) for r in context.golden.results("function")}
    same_environment = not context.env_diff and config.compute_hash() == context.golden.config("function").compute_hash()
    reproduced = {i: np.array_equal(golden_function[i].arrays["digests"], results[i].arrays["digests"])
                  for i in golden_function}
    reports, judgements = {}, []
    typical_error = typical([_error(golden_function[i], context.oracle_by_index(i)) for i in golden_function])
    rule = rule_for(FUNCTION_RULE, "float32", context.golden.config("oracle").dtype)
    for index, golden_run in golden_function.items():
        oracle = context.oracle_by_index(index)
        evidence = Evidence(results[index].arrays["probe_values"], (golden_run.arrays["probe_values"],),
                            oracle.arrays["probe_values"], oracle.arrays["probe_ids"],
                            results[index].arrays["tokens"], golden_run.arrays["tokens"])
        judgement = judge(evidence, "float32", rule, typical_error)
        judgements.append(judgement)
        reports[index] = CheckReport.of(judgement)
    set_distance = judge_set(judgements, rule)
    if same_environment and mode == "auto":
        if all(reproduced.values()):
            return "reproduced the golden's float32 reference bit for bit (same environment)", reports, 0.0
        context.causes.append("function check: the float32 reference no longer reproduces the golden's bit for "
                              "bit in the same environment: the model or its code changed")
        for index, report in reports.items():
            report.reason = "" if reproduced[index] else "float32 reference not reproduced bit for bit"
        return "NOT reproduced bit for bit in the golden's own environment", reports, float("inf")
    worst = max(list(reports.values()), key=lambda r: r.distance)
    oracle = ("the float64 oracle" if rule is FUNCTION_RULE else f"the float32 oracle (float64 did not fit: "
              f"budget {rule.floor_ulps:g} float32 ulps at the logit scale)")
    line = (f"float32 eager in this environment vs the golden's, against {oracle}: worst prompt at "
            f"{worst.distance:.2f} of the budget, the set at {set_distance:.2f}")
    return line, reports, set_distance


def _error(result: PromptResult, oracle: PromptResult) -> float:
    return aggregate(step_errors(result.arrays["probe_values"], oracle.arrays["probe_values"]))


def _envelope_roles(context: Context) -> list[str]:
    """The golden's roles that are known-good implementations of the candidate's dtype (one per run)."""
    roles, seen = [], set()
    for role in (*ENVELOPE_ROLES, "function"):
        run_id = context.golden.run_id(role)
        if run_id not in seen and context.golden.config(role).dtype == context.candidate.config.dtype:
            seen.add(run_id)
            roles.append(role)
    return roles


def _envelope(context: Context, here: dict[int, PromptResult] | None
              ) -> tuple[list[str], list[dict[int, PromptResult]]]:
    """The known-good implementations of the candidate's dtype: the golden's, else `here`, the reference
    config run in this environment (`compute_runs`)."""
    names, members = [], []
    for role in _envelope_roles(context):
        names.append(f"{role} ({_describe(context.golden.config(role))})")
        members.append({r.prompt_index: _cut(r, context.steps[r.prompt_index]) for r in context.golden.results(role)})
    if not members:
        assert here is not None, "no envelope in the golden and none run here"
        config = reference_config(context.candidate.config)
        members.append(here)
        names.append(f"reference run here ({_describe(config)}): the golden has no "
                     f"{context.candidate.config.dtype} implementation")
    return names, members


def _describe(config: EffectiveConfig) -> str:
    levers = "".join(f" {key}={getattr(config, key)}" for key, default in DECODE_LEVER_DEFAULTS.items()
                     if getattr(config, key) != default)
    return (f"{config.dtype} -O{config.opt_level} {config.compilation_mode}/{config.cudagraph_mode}{levers} "
            f"batch {config.batch_size} on {config.device}")


def _execution_check(context: Context, forced: dict[int, PromptResult], members: list[dict[int, PromptResult]],
                     prompts: list[PromptVerdict]) -> tuple[dict[int, Judgement], float]:
    judgements: dict[int, Judgement] = {}
    per_prompt_envelope = {}
    for golden_run in context.golden_results:
        index, oracle = golden_run.prompt_index, context.oracle_by_index(golden_run.prompt_index)
        per_prompt_envelope[index] = max(_error(member[index], oracle) for member in members)
    typical_error = typical(list(per_prompt_envelope.values()))
    dtype = context.candidate.config.dtype
    rule = rule_for(EXECUTION_RULE, dtype, context.golden.config("oracle").dtype)
    for golden_run, prompt in zip(context.golden_results, prompts):
        index = golden_run.prompt_index
        if prompt.verdict == "identical":
            continue
        oracle = context.oracle_by_index(index)
        evidence = Evidence(forced[index].arrays["probe_values"],
                            tuple(member[index].arrays["probe_values"] for member in members),
                            oracle.arrays["probe_values"], oracle.arrays["probe_ids"], forced[index].arrays["tokens"],
                            golden_run.arrays["tokens"])
        judgements[index] = judge(evidence, dtype, rule, typical_error)
    return judgements, judge_set(list(judgements.values()), rule)


def _decide(context: Context, prompts: list[PromptVerdict], function_line: str, function_reports: dict[int, CheckReport], function_set: float, envelope: list[str],
            execution: tuple[dict[int, Judgement], float]) -> Verdict:
    judgements, execution_set = execution
    tokenizer = context.candidate.loaded.tokenizer
    closest = [(function_set, "the whole set, function check"), (execution_set, "the whole set, execution check")]
    function_failed, execution_failed = [], []
    for golden_run, prompt in zip(context.golden_results, prompts):
        index = golden_run.prompt_index
        prompt.function = function_reports.get(index)
        judgement = judgements.get(index)
        if judgement is not None:
            prompt.execution = CheckReport.of(judgement)
            prompt.flips = [FlipReport(f.step, tokenizer.decode([f.reference_token]), tokenizer.decode([f.candidate_token]),
                                       float(golden_run.arrays["margins"][f.step]), f.oracle_gap, f.allowed_gap, f.passed)
                            for f in judgement.flips]
        checks = [c for c in (prompt.function, prompt.execution) if c is not None]
        prompt.distance = max((c.distance for c in checks), default=0.0)
        routing = prompt.routing.distance if prompt.routing is not None and prompt.routing.forced else None
        if routing is not None:
            prompt.distance = max(prompt.distance, routing)
            closest.append((routing, f"prompt {prompt.prompt_id}, routing flip"))
        if prompt.function is not None and prompt.function.reason:
            prompt.verdict, prompt.reason = "changed", "function check: " + prompt.function.reason
            function_failed.append(prompt.prompt_id)
        elif prompt.execution is not None and prompt.execution.reason:
            prompt.verdict, prompt.reason = "changed", "execution check: " + prompt.execution.reason
            execution_failed.append(prompt.prompt_id)
        elif prompt.routing is not None and prompt.routing.forced and not prompt.routing.near_tie:
            prompt.verdict = "changed"
            prompt.reason = "execution check: " + prompt.routing.describe("golden", "candidate")
            execution_failed.append(prompt.prompt_id)
        elif prompt.verdict != "identical":
            prompt.reason = f"within the budgets (at {prompt.distance:.2f} of the closest)"
        closest += [(c.distance, f"prompt {prompt.prompt_id}, {name} check") for c, name in
                    ((prompt.function, "function"), (prompt.execution, "execution")) if c is not None]
    if function_set > 1 and not function_failed and np.isfinite(function_set):
        function_failed.append("(the set)")
    if execution_set > 1 and not execution_failed:
        execution_failed.append("(the set)")
    if function_failed and np.isfinite(function_set):
        context.causes.append(f"function check failed on {', '.join(function_failed[:5])}: the model computes a "
                              "different function (weights, code, a library op or a config field changed)")
    if execution_failed and not function_failed:
        context.causes.append(f"execution check failed on {', '.join(execution_failed[:5])}: the model is unchanged "
                              "(function check passed), but this execution config computes it wrongly; "
                              "`evalrun bisect` finds the knob")
    distance, where = max(closest, key=lambda item: item[0])
    failed = bool(function_failed or execution_failed or not np.isfinite(function_set))
    execution_line = (f"candidate vs the envelope, against the float64 oracle: set at {execution_set:.2f} of the budget"
                      if judgements else "skipped: every prompt identical")
    overall = "changed" if failed else worst_verdict([p.verdict for p in prompts])
    return context.verdict(overall, prompts, function_line, execution_line, distance, where, envelope)
