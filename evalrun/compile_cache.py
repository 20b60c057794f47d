"""Inductor's compile caches under evalrun's cache folder, and what a run took from them.

Inductor keeps compiled FX graphs and max-autotune's kernel choices on disk (`TORCHINDUCTOR_CACHE_DIR`,
by default a per-user folder under /tmp that a reboot or a fresh CI runner loses), Triton its kernel
binaries (`TRITON_CACHE_DIR`). evalrun points both at `EVALRUN_CACHE/compile/torch-V-triton-W-cpu-C-cxx-X-engine-E/`
unless the user set them (Inductor's own default folder, which it writes into the environment on first use,
does not count as set), so a second `golden verify -O3` skips compiling and autotuning, and CI can
cache one folder (examples/github-actions/evalrun.yml caches EVALRUN_CACHE).

Can a cache change numerics unnoticed? Inductor's own keys cover the graph, the Inductor config and
the torch/triton/device versions, but not everything: not the CPU instruction set, and for a graph calling
one of evalrun's Triton ops, the op and its kernels' source but not the Python that picks their blocks. So the
folder is also keyed by the instruction set and by evalrun's engine code (cache_folder), and then a hit gives
the code a cold compile of the same graph would give, except where a cold compile is itself not deterministic:
max-autotune picks kernels by timing, and a warm run replays the choice the cold one made. Each run therefore records, as evidence, the cache
folder and how many graphs were cache hits, misses and bypasses (`compile_cache`); `evalrun diff` names it
where two runs' bits differ and one took graphs from a cache the other did not, and
`TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` (an environment factor of the fingerprint) compiles everything afresh.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .errors import ConfigError

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def cache_folder() -> Path:
    """EVALRUN_CACHE/compile/torch-<version>-triton-<version>-cpu-<capability>-cxx-<compiler>-engine-<code>: one folder
    per compiler build, CPU instruction set, C++ compiler version and engine code. Inductor's keys miss the
    instruction set ATen runs with (ATEN_CPU_CAPABILITY): C++ code compiled for one and loaded under another crashed
    the process (a bfloat16 MoE at -O1, compiled under AVX-512, then run with ATEN_CPU_CAPABILITY=avx2: segmentation
    fault; tests/test_modes.py).
    They miss evalrun's own Triton ops too: a graph calling one is keyed by the op's name and its kernels' source,
    not by the Python that launches them: blocks chosen there (linear.GLU_BLOCKS) changed, and a graph compiled
    before was replayed with the old blocks' bits (the H200, stop 25: decode_breakdown.py, Inductor's own folder)."""
    import torch

    from .fingerprint import cpp_compiler, engine_code_digest
    from .hashing import hash_value
    from .models import cache_root

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    capability = torch.backends.cpu.get_cpu_capability()
    # The C++ compiler's version too: Inductor keys a CPU kernel's binary by its source and command line ("g++ ..."),
    # not by which g++ that is, so a compiler upgraded under the same name replayed the old compiler's binaries while
    # the run's fingerprint (cpp_compiler) named the new one.
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", f"torch-{torch.__version__}-triton-{triton_version}-cpu-{capability}"
                  f"-cxx-{hash_value(cpp_compiler())[:8]}-engine-{engine_code_digest()[:12]}")
    return cache_root() / "compile" / name


def inductor_default_folder() -> str:
    """The folder Inductor falls back to, and writes into TORCHINDUCTOR_CACHE_DIR the first time it reads the
    variable unset (torch._inductor.runtime.cache_dir_utils.cache_dir)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def chosen_by_user(variable: str) -> bool:
    """Whether a cache variable names a folder somebody chose. Inductor's own defaults do not count: anything
    compiled earlier in the process (a library user's torch.compile, a test) has written them into the
    environment (TORCHINDUCTOR_CACHE_DIR on first use; TRITON_CACHE_DIR as <that folder>/triton/<device> when
    Inductor builds a Triton kernel), and that folder is shared by every CPU instruction set (cache_folder)."""
    value = os.environ.get(variable)
    if not value:
        return False
    default = inductor_default_folder()
    if variable == "TORCHINDUCTOR_CACHE_DIR":
        return os.path.abspath(value) != default
    parent, device = os.path.split(os.path.abspath(value))
    return not (variable == "TRITON_CACHE_DIR" and device.isdigit() and parent == os.path.join(default, "triton"))


def use_evalrun_cache() -> dict[str, str]:
    """Point Inductor's and Triton's caches into evalrun's cache folder where the user has not chosen one;
    returns the folders in effect. Before anything compiles: Inductor reads the variable each time it opens
    its cache, so what compiles after this call reads and writes evalrun's folder."""
    for variable in CACHE_VARIABLES:  # before Inductor's import, which makes the folder its variable names
        value = os.environ.get(variable)
        if value and os.path.exists(value) and not os.path.isdir(value):
            raise ConfigError(f"{variable}={value[:200]} names a file, not a folder; point it at a folder or unset it")
    folder = cache_folder()
    defaults = {"TORCHINDUCTOR_CACHE_DIR": folder / "inductor", "TRITON_CACHE_DIR": folder / "triton"}
    for variable, path in defaults.items():
        if not chosen_by_user(variable):
            path.mkdir(parents=True, exist_ok=True)
            os.environ[variable] = str(path)
    return {variable: os.environ[variable] for variable in CACHE_VARIABLES}


def cache_counters() -> dict[str, int]:
    """Inductor's FX-graph cache counters so far in this process."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hits": int(inductor["fxgraph_cache_hit"]), "misses": int(inductor["fxgraph_cache_miss"]),
            "bypasses": int(inductor["fxgraph_cache_bypass"])}


def cache_evidence(before: dict[str, int], folders: dict[str, str]) -> dict[str, Any]:
    """What one run took from the cache: graphs hit, missed (compiled and written) and bypassed."""
    after = cache_counters()
    return {"folder": folders.get("TORCHINDUCTOR_CACHE_DIR"), **{k: after[k] - before[k] for k in after},
            "disabled": os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1"}
