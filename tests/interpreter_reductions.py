"""Triton's interpreter given numpy's exact reduction for the xor reductions that tl.sort and tl.topk use.

The interpreter reduces with numpy where the combine function is one it knows (sum, min, max, argmin,
argmax) and otherwise one element at a time in Python, wrapping each in a Triton tensor. tl.topk's bitonic
network is built from xor_sum, which it does not know: the capture kernel's interpreted cases spent 68 % of
their 52 s there (py-spy). An integer xor is exact and associative, so numpy's reduction gives the same bits
in any order; the kernels under test are unchanged, only how the interpreter evaluates one of Triton's own
reductions. Installed in the child processes that run_under_triton_interpreter starts (tests only).
"""

from __future__ import annotations

import numpy as np


def install() -> bool:
    """Patch the interpreter's reduction for tl.standard._xor_combine; False where Triton has no such hook
    (another Triton version: the interpreter then runs as it is, slower, with the same results)."""
    import triton.language as tl
    from triton.runtime import interpreter

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    xor_combine = getattr(tl.standard, "_xor_combine", None)
    if reduce_ops is None or xor_combine is None or not hasattr(reduce_ops, "apply_impl"):
        return False
    general = reduce_ops.apply_impl
    if getattr(general, "__wrapped__", None) is not None:  # installed already
        return True

    def apply_impl(self, input):
        if self.combine_fn != xor_combine:
            return general(self, input)
        (tensor,) = input
        data = tensor.handle.data  # an integer array of any shape; axis None reduces it whole
        xored = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(xored, tensor.dtype)

    apply_impl.__wrapped__ = general  # the interpreter's own, which uninstall puts back
    reduce_ops.apply_impl = apply_impl
    return True


def uninstall() -> None:
    from triton.runtime import interpreter

    interpreter.ReduceOps.apply_impl = getattr(interpreter.ReduceOps.apply_impl, "__wrapped__",
                                               interpreter.ReduceOps.apply_impl)
