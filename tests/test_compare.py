"""compare.py: pure comparisons over arrays, small exact cases."""

import numpy as np
import pytest

from evalrun.compare import (bits_to_float, dict_diff, digest_mismatch_steps, first_divergence, flatten,
                             ordered_bits, ulp_distance, worst_verdict)


@pytest.mark.parametrize("a,b,expected", [([1, 2, 3], [1, 2, 3], -1), ([1, 2, 3], [1, 5, 3], 1),
                                          ([1, 2], [1, 2, 3], 2), ([], [], -1), ([4], [5], 0)])
def test_first_divergence(a, b, expected):
    assert first_divergence(np.array(a), np.array(b)) == expected


def test_digest_mismatch_steps_over_the_shared_length():
    a = np.array([[1, 1], [2, 2], [3, 3]])
    b = np.array([[1, 1], [2, 9], [3, 3], [4, 4]])
    assert digest_mismatch_steps(a, b).tolist() == [1]


def test_flatten_and_dict_diff_with_ignored_prefixes():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}}) == {"a.b": 1, "a.c.d": 2}
    diff = dict_diff({"x": 1, "y": {"z": 2, "n": 3}}, {"x": 1, "y": {"z": 5}, "w": 0}, ignore=("y.n",))
    assert diff == [("w", None, 0), ("y.z", 2, 5)]


def test_worst_verdict_orders_the_verdicts():
    assert worst_verdict(["identical", "drift"]) == "drift"
    assert worst_verdict(["drift", "changed", "identical"]) == "changed"
    assert worst_verdict([]) == "identical"


def test_ulps_count_neighbouring_floats_across_zero():
    values = np.array([0.0, -0.0, np.nextafter(np.float32(0), np.float32(1)), -np.nextafter(np.float32(0), np.float32(1))],
                      dtype=np.float32)
    keys = ordered_bits(values.view(np.int32))
    assert keys.tolist() == [0, 0, 1, -1]
    one = np.array([1.0], dtype=np.float32)
    assert ulp_distance(one.view(np.int32), np.nextafter(one, np.float32(2)).view(np.int32)).tolist() == [1]


@pytest.mark.parametrize("dtype,numpy_type", [("float32", np.float32), ("float16", np.float16)])
def test_bits_to_float_is_exact(dtype, numpy_type):
    values = np.array([1.5, -2.25, 65504 if dtype == "float16" else 3.4e38], dtype=numpy_type)
    bits = values.view(np.int16 if dtype == "float16" else np.int32)
    assert bits_to_float(bits, dtype).tolist() == values.astype(np.float64).tolist()


def test_bits_to_float_bfloat16():
    import torch

    values = torch.tensor([1.5, -2.25, 3.0e38], dtype=torch.bfloat16)
    bits = values.view(torch.int16).numpy()
    assert bits_to_float(bits, "bfloat16").tolist() == values.double().tolist()


def test_environment_causes_name_what_a_missing_field_means():
    """A variable the golden ran without is unset; a field its record predates is not recorded: neither is a
    bare None, which would read like a recorded value (no compiler, no library)."""
    from evalrun.compare import environment_causes

    def environment_causes_of(a, b):
        return environment_causes(dict_diff(a, b), a, b)

    golden = {"torch": "2.13.0", "triton": None, "env": {}}
    candidate = {"torch": "2.13.0", "triton": "3.6.0", "cpp_compiler": "g++ 12.2.0", "env": {"CXX": "g++"}}
    assert environment_causes_of(golden, candidate) == [
        "environment: cpp_compiler (not recorded) -> g++ 12.2.0",
        "environment: env.CXX (unset) -> g++",
        "environment: triton None -> 3.6.0",  # recorded as absent: the library was not installed
    ]
    assert environment_causes_of(candidate, golden)[0] == "environment: cpp_compiler g++ 12.2.0 -> (not recorded)"
    assert environment_causes_of(golden, golden) == []
