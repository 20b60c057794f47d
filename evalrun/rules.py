"""The verdict's numeric rules: pure functions over probed logits. Arrays in, judgements out; no I/O.

Every run judged here was forced along the golden's pinned tokens and probed at the same ids per
step (the oracle's own top-64 plus a fixed sample of the vocabulary): arrays [N, K'] of logits at N
steps and K' ids. The oracle is the float64 run of the same model along the same tokens.

Why these statistics (DESIGN "Verdicts"; the measurements are in the README's calibration table):
- Error is the RMS over the probe ids of (run - oracle), per step. Sixty-four top ids plus a
  vocabulary sample make each step's figure steadier than the top-8 of the first version, and the
  oracle's exact values at every probed id make it an error, not a difference of two errors.
- A prompt is judged on its aggregate (the RMS over its steps) and the set on the RMS over prompts.
  The maximum over ~500 per-step ratios of an 8-value RMS was a false-alarm machine: another CPU
  instruction set reached 3.5 while per-prompt ratios stayed within 0.96-1.17. Single steps are
  judged only for large excursions (`step_multiplier`).
- The budget is relative to the worst known-good implementation (the envelope: the golden's pinned
  and reference configs, forced along the same tokens), not the luckiest: compiled bf16 sits closer
  to float64 than eager does, so a budget built from the compiled run alone failed eager.
- A prompt's envelope error is floored at the median over prompts, so one prompt where every
  known-good implementation happens to sit on the oracle does not shrink its budget to nothing; and
  an absolute floor of `floor_ulps` units of the run dtype's epsilon at the prompt's logit scale keeps
  a budget above what the dtype can resolve.
- A greedy flip (the candidate's own choice differs from the reference's) is drift when the oracle's
  own gap between the two tokens is within `flip_multiplier` x the envelope's error at that step: a
  flip at a near-tie is drift by construction; a flip across a clear oracle margin is not.
The multipliers come from `benchmarks/calibrate.py`: the largest ratio any drift case reached, with
headroom, and well below the smallest ratio of any change case at the stated detection limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

EPSILON = {"float64": 2.220446e-16, "float32": 1.192093e-07, "bfloat16": 7.8125e-03, "float16": 9.765625e-04}


@dataclass(frozen=True)
class Rule:
    """Thresholds of one check; every distance is observed / allowed, so <= 1 passes."""

    multiplier: float  # per prompt and per set: error <= multiplier x envelope error + floor
    step_multiplier: float  # per step: error <= step_multiplier x floored envelope step error + floor
    flip_multiplier: float  # a flip passes when the oracle's gap <= flip_multiplier x envelope step error + floor
    floor_ulps: float  # absolute floor: floor_ulps x epsilon(dtype) x the prompt's logit scale


# Calibrated on the corpus of benchmarks/calibrate.py (README "Calibration"); see the module docstring.
# Forced routing (verify, MoE): a routing flip passes as a near-tie when the router-probability gap it needs is
# <= this x the golden's own router error (its pinned run's largest margin movement against the float64 oracle,
# where both chose the same experts, before their first flip). Legitimate flips (bfloat16 -O0 goldens of random
# MoE checkpoints verified at -O1/-O2, benchmarks/moe_forced_routing.py) needed at most 1.21x that error on the
# CPU (19 flips; -O2 there gives -O1's bits) and 1.09x on the H200 (29 flips).
ROUTING_FLIP_MULTIPLIER = 2.0
ROUTING_FLIP_FLOOR = 1e-6  # added to that allowance: 8 float32 ulps at 1, the rounding of a router probability

EXECUTION_RULE = Rule(multiplier=3.0, step_multiplier=12.0, flip_multiplier=6.0, floor_ulps=1.0)
FUNCTION_RULE = Rule(multiplier=3.0, step_multiplier=12.0, flip_multiplier=6.0, floor_ulps=1.0)


# Where the oracle is no more precise than the runs it judges (float64 weights did not fit, so a float32
# oracle judges float32 runs), known-good errors against it can be exactly zero and cannot scale a
# budget; the budget is then this many epsilons of the run dtype at the logit scale. A lead, not
# calibrated: no such golden has been verified in another environment yet.
SAME_PRECISION_FLOOR_ULPS = 64.0


def rule_for(rule: Rule, dtype: str, oracle_dtype: str) -> Rule:
    """`rule` for runs of `dtype` judged against an oracle of `oracle_dtype`."""
    if EPSILON[oracle_dtype] >= EPSILON[dtype]:
        return dataclasses.replace(rule, floor_ulps=max(rule.floor_ulps, SAME_PRECISION_FLOOR_ULPS))
    return rule


def step_errors(values: np.ndarray, oracle: np.ndarray) -> np.ndarray:
    """values, oracle [N, K'] -> [N]: RMS over the probe ids of the difference, in float64."""
    delta = values.astype(np.float64) - oracle.astype(np.float64)
    return np.sqrt(np.mean(delta * delta, axis=-1))


def aggregate(errors: np.ndarray) -> float:
    """[N] per-step errors -> their RMS (0 for no steps)."""
    return float(np.sqrt(np.mean(errors * errors))) if errors.size else 0.0


def logit_scale(oracle: np.ndarray) -> float:
    """[N, K'] oracle values -> their RMS: the size of this prompt's logits."""
    return float(np.sqrt(np.mean(oracle.astype(np.float64) ** 2))) if oracle.size else 0.0


@dataclass
class Flip:
    """One step where the candidate's own choice differs from the reference's."""

    step: int
    reference_token: int
    candidate_token: int
    oracle_gap: float  # oracle logit of the reference token minus the candidate's (inf: not probed)
    allowed_gap: float
    passed: bool


@dataclass
class Judgement:
    """One prompt under one check."""

    candidate_error: float  # aggregate RMS error against the oracle
    envelope_error: float  # the worst known-good implementation's aggregate error (floored)
    ratio: float  # candidate_error / envelope_error
    distance: float  # the largest observed / allowed over the rules; <= 1 passes
    worst_step: int
    step_distance: float
    floor: float = 0.0  # the absolute floor added to every budget
    step_ratio: float = 0.0  # worst step's error / that step's floored envelope error (before any multiplier)
    flip_ratio: float = 0.0  # worst flip's oracle gap / that step's floored envelope error (0 without flips)
    flips: list[Flip] = field(default_factory=list)
    reason: str = ""  # one line naming the rule that failed; empty when it passed

    @property
    def passed(self) -> bool:
        return not self.reason


@dataclass(frozen=True)
class Evidence:
    """One prompt's arrays for a check. Envelope members are the known-good implementations."""

    candidate: np.ndarray  # [N, K'] candidate logits at the probe ids
    envelope: tuple[np.ndarray, ...]  # each [N, K']
    oracle: np.ndarray  # [N, K'] float64
    probe_ids: np.ndarray  # [N, K'] int64
    candidate_tokens: np.ndarray | None = None  # [N] the candidate's own choices
    reference_tokens: np.ndarray | None = None  # [N] the choices flips are counted against
    # ([N, T] ids, [N, T] float64 values): the oracle's own top ids beside the probes, for a flip to an id the probes
    # lack (a server golden probes what the server returned; llama.cpp's end-of-sequence prints as "" and is not)
    oracle_top: tuple[np.ndarray, np.ndarray] | None = None


def _gap(probe_ids: np.ndarray, oracle: np.ndarray, reference: int, candidate: int) -> float:
    """Oracle logit at `reference` minus at `candidate`; +inf when the candidate's token was not probed
    (outside the oracle's top ids: no near-tie), -inf when only the reference's was not."""
    where_c, where_r = np.flatnonzero(probe_ids == candidate), np.flatnonzero(probe_ids == reference)
    if where_c.size == 0:
        return float("inf")
    if where_r.size == 0:
        return float("-inf")
    return float(oracle[where_r[0]] - oracle[where_c[0]])


def judge_flips(evidence: Evidence, allowed: np.ndarray) -> list[Flip]:
    """Flips between candidate and reference choices, each judged against `allowed` [N] oracle gaps."""
    if evidence.candidate_tokens is None or evidence.reference_tokens is None:
        return []
    steps = min(len(evidence.candidate_tokens), len(evidence.reference_tokens), len(allowed))
    flips = []
    for step in np.flatnonzero(evidence.candidate_tokens[:steps] != evidence.reference_tokens[:steps]):
        reference, candidate = int(evidence.reference_tokens[step]), int(evidence.candidate_tokens[step])
        ids, values = evidence.probe_ids[step], evidence.oracle[step]
        if evidence.oracle_top is not None:
            ids = np.concatenate([ids, evidence.oracle_top[0][step]])
            values = np.concatenate([values, evidence.oracle_top[1][step]])
        gap = _gap(ids, values, reference, candidate)
        flips.append(Flip(int(step), reference, candidate, gap, float(allowed[step]), gap <= allowed[step]))
    return flips


def judge(evidence: Evidence, dtype: str, rule: Rule, typical_envelope_error: float = 0.0) -> Judgement:
    """Judge one prompt: aggregate, per-step excursions and flips against the envelope.

    `typical_envelope_error` (the median over the set's prompts) floors this prompt's envelope error,
    and every step's, as the median over this prompt's steps does.
    """
    floor = rule.floor_ulps * EPSILON[dtype] * logit_scale(evidence.oracle)
    candidate_steps = step_errors(evidence.candidate, evidence.oracle)  # [N]
    member_steps = [step_errors(member, evidence.oracle) for member in evidence.envelope]  # each [N]
    envelope_steps = np.max(member_steps, axis=0)  # [N]
    envelope_error = max(max(aggregate(steps) for steps in member_steps), typical_envelope_error)
    candidate_error = aggregate(candidate_steps)
    allowed = rule.multiplier * envelope_error + floor
    step_floor = max(float(np.median(envelope_steps)) if envelope_steps.size else 0.0, typical_envelope_error)
    floored_steps = np.maximum(envelope_steps, step_floor)  # [N]: no step's budget below the typical error
    step_allowed = rule.step_multiplier * floored_steps + floor  # [N]
    step_ratio = candidate_steps / np.maximum(step_allowed, np.finfo(np.float64).tiny)
    worst = int(np.argmax(step_ratio)) if step_ratio.size else -1
    flips = judge_flips(evidence, rule.flip_multiplier * floored_steps + floor)
    flip_distance = max((f.oracle_gap / max(f.allowed_gap, np.finfo(np.float64).tiny) for f in flips), default=0.0)
    distances = {"aggregate": candidate_error / max(allowed, np.finfo(np.float64).tiny),
                 "step": float(step_ratio[worst]) if worst >= 0 else 0.0, "flip": max(flip_distance, 0.0)}
    reason = _reason(distances, candidate_error, allowed, worst, candidate_steps, step_allowed, flips)
    ratio = candidate_error / envelope_error if envelope_error > 0 else (0.0 if candidate_error == 0 else float("inf"))
    tiny = np.finfo(np.float64).tiny
    step_ratio = float(np.max(candidate_steps / np.maximum(floored_steps, tiny))) if candidate_steps.size else 0.0
    flip_ratio = max((f.oracle_gap / max(floored_steps[f.step], tiny) for f in flips), default=0.0)
    return Judgement(candidate_error, envelope_error, ratio, max(distances.values()), worst, distances["step"],
                     floor, step_ratio, max(flip_ratio, 0.0), flips, reason)


def _reason(distances: dict[str, float], error: float, allowed: float, worst: int, steps: np.ndarray,
            step_allowed: np.ndarray, flips: list[Flip]) -> str:
    if distances["aggregate"] > 1:
        return f"error {error:.3g} exceeds the budget {allowed:.3g} ({distances['aggregate']:.2f}x)"
    if distances["step"] > 1:
        return (f"step {worst}: error {steps[worst]:.3g} exceeds the excursion budget {step_allowed[worst]:.3g} "
                f"({distances['step']:.2f}x)")
    bad = [f for f in flips if not f.passed]
    if bad:
        gap = "not among the oracle's top ids" if bad[0].oracle_gap == float("inf") else f"oracle gap {bad[0].oracle_gap:.3g}"
        return (f"step {bad[0].step}: greedy flip {bad[0].reference_token}->{bad[0].candidate_token} across a clear "
                f"margin ({gap}, allowed {bad[0].allowed_gap:.3g})")
    return ""


def judge_set(judgements: list[Judgement], rule: Rule) -> float:
    """Distance of the whole set: RMS over prompts of candidate errors against the same of the
    envelope's, x multiplier. <= 1 passes."""
    if not judgements:
        return 0.0
    rms = lambda values: float(np.sqrt(np.mean(np.square(values))))  # noqa: E731
    candidate = rms([j.candidate_error for j in judgements])
    allowed = rule.multiplier * rms([j.envelope_error for j in judgements]) + rms([j.floor for j in judgements])
    return candidate / allowed if allowed > 0 else (0.0 if candidate == 0 else float("inf"))


def typical(errors: list[float]) -> float:
    """The median of per-prompt envelope errors: the floor for any one prompt's envelope error."""
    return float(np.median(errors)) if errors else 0.0
