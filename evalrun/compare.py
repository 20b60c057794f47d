"""Pure numeric comparison and classification: arrays in, numbers and verdicts out. No I/O.

Shapes: N decode steps, K top-k entries, V vocabulary.

The drift rule follows PyTorch's accuracy check (torch._dynamo.utils.same): a candidate passes
when its RMS error against a higher-precision oracle is at most `multiplier` times the reference's
RMS error against that oracle, plus a small floor. Per step, the reference's error is floored at its
typical level (the median over all steps), so that one step where the reference happens to sit very
close to the oracle does not shrink the budget to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# m in the drift rule, by the dtype of the runs compared (PyTorch uses 2 for fp32 and 3 below it).
DRIFT_MULTIPLIER = {"float32": 2.0, "bfloat16": 3.0, "float16": 3.0, "float64": 2.0}
# The floor added to the budget: tol / 10 with PyTorch's usual tolerances per dtype.
DRIFT_FLOOR = {"float32": 1e-5, "bfloat16": 1e-3, "float16": 1e-3, "float64": 1e-8}
VERDICT_ORDER = ("identical", "drift", "changed", "incomparable")


def worst_verdict(verdicts: list[str]) -> str:
    return max(verdicts, key=VERDICT_ORDER.index) if verdicts else "identical"


def rms_error(values: np.ndarray, oracle: np.ndarray) -> np.ndarray:
    """values, oracle [N, K] -> [N]: RMS difference per step (computed in float64)."""
    delta = values.astype(np.float64) - oracle.astype(np.float64)
    return np.sqrt(np.mean(delta * delta, axis=-1))


@dataclass
class DriftCheck:
    """Per-step errors against the oracle and the budget they must stay within."""

    candidate_error: np.ndarray  # [N]
    reference_error: np.ndarray  # [N]
    budget: np.ndarray  # [N]
    ratio: np.ndarray  # [N] candidate error / floored reference error

    @property
    def within_budget(self) -> bool:
        return bool(np.all(self.candidate_error <= self.budget))

    @property
    def worst_ratio(self) -> float:
        return float(self.ratio.max()) if self.ratio.size else 0.0

    @property
    def worst_step(self) -> int:
        return int(self.ratio.argmax()) if self.ratio.size else -1

    def fails(self) -> str | None:
        """A one-line message when the budget is exceeded, else None."""
        if self.within_budget:
            return None
        step = int(np.argmax(self.candidate_error - self.budget))
        return (f"step {step}: error {self.candidate_error[step]:.3g} exceeds budget {self.budget[step]:.3g} "
                f"(reference error {self.reference_error[step]:.3g})")


def drift_check(candidate: np.ndarray, reference: np.ndarray, oracle: np.ndarray, dtype: str,
                noise_scale: float | None = None) -> DriftCheck:
    """candidate, reference, oracle [N, K] values on the same ids -> DriftCheck.

    `noise_scale` is the reference's typical error (median over steps, over all prompts when given);
    each step's reference error is floored at it.
    """
    candidate_error, reference_error = rms_error(candidate, oracle), rms_error(reference, oracle)
    scale = float(np.median(reference_error)) if noise_scale is None else noise_scale
    floored = np.maximum(reference_error, scale)
    budget = DRIFT_MULTIPLIER[dtype] * floored + DRIFT_FLOOR[dtype]
    ratio = candidate_error / np.maximum(floored, np.finfo(np.float64).tiny)
    return DriftCheck(candidate_error, reference_error, budget, ratio)


def first_divergence(a: np.ndarray, b: np.ndarray) -> int:
    """[N] and [M] token arrays -> first step where they differ (length difference counts), or -1."""
    shared = min(len(a), len(b))
    unequal = np.flatnonzero(a[:shared] != b[:shared])
    if unequal.size:
        return int(unequal[0])
    return shared if len(a) != len(b) else -1


def digest_mismatch_steps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """digests [N, 2] and [M, 2] -> steps (over the shared length) whose digests differ."""
    shared = min(len(a), len(b))
    return np.flatnonzero(np.any(a[:shared] != b[:shared], axis=-1))


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {'a.b.c': leaf}."""
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def dict_diff(a: dict[str, Any], b: dict[str, Any], ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """Keys whose values differ between two nested dicts: [(dotted key, a value, b value)], sorted."""
    flat_a, flat_b = flatten(a), flatten(b)
    keys = sorted(set(flat_a) | set(flat_b))
    return [(key, flat_a.get(key), flat_b.get(key)) for key in keys
            if flat_a.get(key) != flat_b.get(key) and not any(key.startswith(prefix) for prefix in ignore)]


def environment_causes(diff: list[tuple[str, Any, Any]], golden: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """One cause line per entry of `diff` (dict_diff of the two environments). A field missing on one side is
    named for what its absence means: an environment variable that was unset, or a field that record predates
    (added to the fingerprint later), rather than a bare None that reads like a recorded value."""
    recorded = (flatten(golden), flatten(candidate))

    def shown(side: int, key: str, value: Any) -> str:
        if key in recorded[side]:
            return str(value)
        return "(unset)" if key.startswith("env.") else "(not recorded)"

    return [f"environment: {key} {shown(0, key, a)} -> {shown(1, key, b)}" for key, a, b in diff]


# ---------------------------------------------------------------- element-level and sketch figures

def ordered_bits(bits: np.ndarray) -> np.ndarray:
    """Raw float bit patterns (signed ints of the float's width) -> int64 keys in value order.

    IEEE floats are sign-magnitude: a negative pattern x maps to -(x + 2^(w-1)), a positive one to
    itself, so neighbouring floats get neighbouring keys and -0.0 and +0.0 both map to 0.
    """
    wide = bits.astype(np.int64)
    offset = np.int64(np.iinfo(bits.dtype).min)  # -2^(w-1)
    return np.where(wide < 0, -(wide - offset), wide)


def ulp_distance(bits_a: np.ndarray, bits_b: np.ndarray) -> np.ndarray:
    """Same-shape raw bit arrays of one float dtype -> |distance in ULPs| per element (int64)."""
    return np.abs(ordered_bits(bits_a) - ordered_bits(bits_b))


def sketch_series(ids_a: np.ndarray, values_a: np.ndarray, ids_b: np.ndarray, values_b: np.ndarray,
                  dtype: str) -> dict[str, np.ndarray]:
    """Compare two top-k sketches step by step, over a's ids. Inputs [..., K]; every output [...].

    max_abs_delta  max |a - b| over the ids both hold (0 when none)
    ulp_max        max ULP distance in the run dtype over those ids; ulp_median their median
    kl             KL(a || b) of the softmax over a's ids (an id b lacks gets b's minimum value)
    topk_overlap   share of a's ids that b also holds
    Vectorised over any leading dimensions, so many prompts can be compared in one call.
    """
    matches = ids_a[..., :, None] == ids_b[..., None, :]  # [..., K, K]
    found = matches.any(-1)  # [..., K]
    picked = np.where(matches, values_b[..., None, :], 0).sum(-1).astype(values_a.dtype)  # b at a's ids
    other = np.where(found, picked, values_a)
    delta = np.abs(values_a.astype(np.float64) - other.astype(np.float64))
    ulps = sketch_ulps(values_a, other, dtype)  # 0 where b lacks the id
    missing = np.where(found, other, values_b.min(-1, keepdims=True)).astype(np.float64)
    log_p, log_q = _log_softmax(values_a.astype(np.float64)), _log_softmax(missing)
    return {"max_abs_delta": delta.max(-1), "ulp_max": ulps.max(-1).astype(np.float64),
            "ulp_median": _masked_median(ulps, found), "kl": np.sum(np.exp(log_p) * (log_p - log_q), axis=-1),
            "topk_overlap": found.mean(-1)}


def _masked_median(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Median over the last axis of the entries where `mask` holds; 0 where none does. [..., K] -> [...]."""
    ordered = np.sort(np.where(mask, values.astype(np.float64), np.inf), axis=-1)
    count = mask.sum(-1)
    low = np.clip((count - 1) // 2, 0, None)[..., None]
    high = np.clip(count // 2, 0, values.shape[-1] - 1)[..., None]
    median = (np.take_along_axis(ordered, low, -1) + np.take_along_axis(ordered, high, -1))[..., 0] / 2
    return np.where(count > 0, median, 0.0)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def sketch_ulps(values_a: np.ndarray, values_b: np.ndarray, dtype: str) -> np.ndarray:
    """[N, K] fp32 sketch values -> [N, K] ULP distance in the run's dtype (values are exact in fp32)."""
    if dtype == "bfloat16":
        bits_a = (values_a.astype(np.float32).view(np.int32) >> 16).astype(np.int16)
        bits_b = (values_b.astype(np.float32).view(np.int32) >> 16).astype(np.int16)
    elif dtype == "float16":
        bits_a, bits_b = values_a.astype(np.float16).view(np.int16), values_b.astype(np.float16).view(np.int16)
    else:
        bits_a, bits_b = values_a.astype(np.float32).view(np.int32), values_b.astype(np.float32).view(np.int32)
    return ulp_distance(bits_a, bits_b)


def bits_to_float(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Raw bit patterns of a float dtype (as stored for kept logits) -> float64 values, exactly."""
    if dtype == "bfloat16":
        return (bits.astype(np.int32) << 16).view(np.float32).astype(np.float64)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float64)
    return bits.view(np.float32 if bits.dtype == np.int32 else np.float64).astype(np.float64)
