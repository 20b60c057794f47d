"""The field's two usual verdict rules, re-implemented from their published definitions, so the
calibration corpus can show case by case where evalrun is stricter or looser than each.

- vLLM's `check_logprobs_close` (tests/models/utils.py): walk two greedy outputs; at the first step
  where the tokens differ, each side's token must be among the other side's top-N logprobs (the
  tests use N = 5), and the comparison stops there. Equal token sequences always pass.
- PyTorch's `torch._dynamo.utils.same` with an fp64 reference: pass when allclose(ref, res, tol, tol);
  else when RMSE(fp64_ref, res) <= multiplier x RMSE(fp64_ref, ref) + tol / 10, multiplier 3 for
  float16/bfloat16 results and 2 otherwise (tensors of 1,000 elements or more), tol = 1e-4 by default.
  Applied per prompt on whole logit tensors [N, V]; with `exact_dtype=False` semantics (ref is cast
  to res's dtype) so a dtype change can be judged at all.

Pure functions over arrays; no I/O.
"""

from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


def vllm_logprobs_close(tokens_a: np.ndarray, top_ids_a: np.ndarray, tokens_b: np.ndarray, top_ids_b: np.ndarray,
                        top_n: int = 5) -> tuple[bool, int]:
    """tokens [N], top ids [N, K] of two free runs -> (passes, first mismatching step or -1)."""
    steps = min(len(tokens_a), len(tokens_b))
    mismatches = np.flatnonzero(tokens_a[:steps] != tokens_b[:steps])
    if mismatches.size == 0:
        return True, -1
    step = int(mismatches[0])
    passes = bool(tokens_a[step] in top_ids_b[step, :top_n] and tokens_b[step] in top_ids_a[step, :top_n])
    return passes, step


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.sqrt(torch.mean(torch.square(a.double() - b.double()))))


def torch_same(ref: np.ndarray, res: np.ndarray, fp64_ref: np.ndarray, res_dtype: str, tol: float = 1e-4) -> bool:
    """Whole logits [N, V] as float arrays (values exact in float64), `res_dtype` the candidate's dtype."""
    kind = TORCH_DTYPES[res_dtype]
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float64)).to(kind)  # exact_dtype=False: ref as res
    res_t = torch.from_numpy(np.ascontiguousarray(res, dtype=np.float64)).to(kind)
    if torch.allclose(ref_t.double(), res_t.double(), atol=tol, rtol=tol):
        return True
    fp64 = torch.from_numpy(np.ascontiguousarray(fp64_ref, dtype=np.float64))
    multiplier = 3.0 if kind in (torch.float16, torch.bfloat16) or fp64.numel() < 1000 else 2.0
    return rmse(fp64, res_t) <= multiplier * rmse(fp64, ref_t) + tol / 10.0
