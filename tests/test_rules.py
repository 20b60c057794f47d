"""The verdict's numeric rules (rules.py) and the field's rules (field_rules.py): small exact cases."""

import numpy as np
import pytest

from evalrun.field_rules import torch_same, vllm_logprobs_close
from evalrun.rules import (EPSILON, Evidence, Rule, aggregate, judge, judge_set, logit_scale, step_errors,
                           typical)

RULE = Rule(multiplier=3.0, step_multiplier=10.0, flip_multiplier=4.0, floor_ulps=0.0)
IDS = np.tile(np.arange(4), (3, 1))  # [N=3, K'=4]
ORACLE = np.tile(np.array([4.0, 3.0, 1.0, 0.0]), (3, 1))


def _evidence(candidate_offset, envelope_offset=0.1, candidate_tokens=None, reference_tokens=None):
    return Evidence(ORACLE + candidate_offset, (ORACLE + envelope_offset,), ORACLE, IDS,
                    None if candidate_tokens is None else np.array(candidate_tokens),
                    None if reference_tokens is None else np.array(reference_tokens))


def test_step_errors_and_aggregate():
    values = ORACLE + np.array([[0.0, 0.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0], [0.0] * 4])
    assert step_errors(values, ORACLE).tolist() == [1.0, 1.0, 0.0]
    assert aggregate(np.array([3.0, 4.0])) == pytest.approx(np.sqrt(12.5))
    assert aggregate(np.array([])) == 0.0


def test_within_the_envelope_passes_with_its_distance():
    judgement = judge(_evidence(0.25), "float32", RULE)  # 2.5x the envelope's error, budget 3x
    assert judgement.passed and judgement.ratio == pytest.approx(2.5)
    assert judgement.distance == pytest.approx(2.5 / 3)


def test_past_the_envelope_fails_naming_the_budget():
    judgement = judge(_evidence(0.35), "float32", RULE)
    assert not judgement.passed and "exceeds the budget" in judgement.reason
    assert judgement.distance == pytest.approx(3.5 / 3)


def test_the_worst_known_good_implementation_sets_the_budget():
    evidence = Evidence(ORACLE + 0.5, (ORACLE + 0.01, ORACLE + 0.2), ORACLE, IDS)
    assert judge(evidence, "float32", RULE).passed  # 0.5 <= 3 x 0.2, though 50x the lucky member


def test_a_lucky_prompt_is_floored_at_the_typical_envelope_error():
    lucky = Evidence(ORACLE + 0.05, (ORACLE + 0.001,), ORACLE, IDS)
    assert not judge(lucky, "float32", RULE).passed
    assert judge(lucky, "float32", RULE, typical_envelope_error=0.1).passed


def test_a_single_large_excursion_fails_the_step_rule():
    candidate = ORACLE + 0.01
    candidate[1] += 2.0  # one step far out; the aggregate would hide it among many steps
    evidence = Evidence(np.repeat(candidate, [1, 1, 1], axis=0), (ORACLE + 0.1,), ORACLE, IDS)
    judgement = judge(evidence, "float32", Rule(100.0, 10.0, 4.0, 0.0))
    assert not judgement.passed and judgement.worst_step == 1 and "excursion" in judgement.reason


def test_a_flip_at_a_near_tie_is_drift_and_across_a_clear_margin_is_not():
    near = np.tile(np.array([4.0, 3.95, 1.0, 0.0]), (3, 1))
    evidence = Evidence(near + 0.05, (near + 0.05,), near, IDS, np.array([0, 1, 0]), np.array([0, 0, 0]))
    judgement = judge(evidence, "float32", RULE)
    assert judgement.passed and len(judgement.flips) == 1 and judgement.flips[0].oracle_gap == pytest.approx(0.05)
    clear = judge(_evidence(0.05, 0.05, [0, 1, 0], [0, 0, 0]), "float32", RULE)  # oracle gap 1.0 vs allowed 0.2
    assert not clear.passed and "greedy flip" in clear.reason


def test_a_flip_to_a_token_outside_the_probes_is_never_a_near_tie():
    judgement = judge(_evidence(0.0, 0.1, [9, 0, 0], [0, 0, 0]), "float32", RULE)
    assert not judgement.passed and judgement.flips[0].oracle_gap == float("inf")


def test_the_floor_is_epsilon_at_the_logit_scale():
    exact = Evidence(ORACLE, (ORACLE,), ORACLE, IDS)
    judgement = judge(exact, "bfloat16", Rule(3.0, 10.0, 4.0, floor_ulps=1.0))
    assert judgement.floor == pytest.approx(EPSILON["bfloat16"] * logit_scale(ORACLE))
    assert judgement.passed and judgement.distance == 0.0


def test_set_distance_and_typical():
    judgements = [judge(_evidence(offset), "float32", RULE) for offset in (0.1, 0.2, 0.3)]
    assert judge_set(judgements, RULE) == pytest.approx(np.sqrt(np.mean([0.01, 0.04, 0.09])) / 0.3)
    assert typical([3.0, 1.0, 2.0]) == 2.0 and typical([]) == 0.0


# ---------------------------------------------------------------- the field's rules

def test_vllm_rule_passes_equal_tokens_and_checks_only_the_first_mismatch():
    tokens = np.array([1, 2, 3])
    top = np.array([[1, 5, 6, 7, 8], [2, 9, 10, 11, 12], [3, 4, 0, 0, 0]])
    assert vllm_logprobs_close(tokens, top, tokens, top) == (True, -1)
    other, other_top = np.array([1, 9, 30]), np.array([[1, 5, 6, 7, 8], [9, 2, 0, 0, 0], [30, 0, 0, 0, 0]])
    assert vllm_logprobs_close(tokens, top, other, other_top) == (True, 1)  # later steps are never looked at
    far_top = np.array([[1, 5, 6, 7, 8], [9, 40, 41, 42, 43], [0] * 5])
    assert vllm_logprobs_close(tokens, top, other, far_top) == (False, 1)


def test_torch_same_follows_its_published_rule():
    oracle = np.linspace(-5, 5, 2000).reshape(2, 1000)
    ref = oracle + 1e-3
    assert torch_same(ref, ref + 1e-6, oracle, "float32")  # allclose at tol 1e-4
    assert torch_same(ref, oracle + 1.9e-3, oracle, "float32")  # rmse 1.9e-3 <= 2 x 1e-3 + 1e-5
    assert not torch_same(ref, oracle + 2.2e-3, oracle, "float32")


def test_an_oracle_no_more_precise_than_the_run_raises_the_floor():
    from evalrun.rules import SAME_PRECISION_FLOOR_ULPS, rule_for

    assert rule_for(RULE, "bfloat16", "float64") is RULE and rule_for(RULE, "float32", "float64") is RULE
    assert rule_for(RULE, "float32", "float32").floor_ulps == SAME_PRECISION_FLOOR_ULPS
    assert rule_for(RULE, "bfloat16", "float32") is RULE
