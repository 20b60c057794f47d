"""Build one of the engine's C++ sources into a shared library, once per machine, and load it with ctypes.

The library is built by the C++ compiler the environment fingerprint names (fingerprint.cpp_compiler: $CXX, else
g++) for the instruction set ATen runs with (`ATEN_CPU_CAPABILITY`, as Inductor's kernels are), with OpenMP and
without FMA contraction (a source's summation order is then the bits, whatever the instruction set). It lands in
evalrun's compile-cache folder (compile_cache.cache_folder: one per torch, CPU instruction set, compiler and engine
code) under a name that hashes the source, the compiler and the flags, written whole or not at all, so parallel
processes and later runs share it. Nothing here is reachable from a config: the sources are the engine's own
files (fingerprint.ENGINE_SOURCES puts them in the engine-code digest).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..errors import ConfigError

# ATen's CPU capability -> the compiler flags of that instruction set (x86); any other builds portable code
ISA_FLAGS = {"AVX512": ("-mavx512f", "-mavx512bw", "-mf16c"), "AVX2": ("-mavx2", "-mf16c")}
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
_LOADED: dict[tuple[str, str], ctypes.CDLL] = {}
_BUILD_SECONDS = [0.0]  # spent building in this process (a run's compile_s counts it: modes.py)


def build_seconds() -> float:
    return _BUILD_SECONDS[0]


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def load(source: str, isa: str | None = None, declare: Callable[[ctypes.CDLL], ctypes.CDLL] = lambda lib: lib
         ) -> ctypes.CDLL:
    """The library built from engine/`source` for `isa` (ATen's capability name; default: the one ATen runs with),
    passed once through `declare` (which sets its functions' ctypes signatures). ConfigError (exit 2) naming
    linear_kernel=aten when the compiler is missing or fails."""
    isa = isa or capability()
    key = (source, isa)
    if key not in _LOADED:
        _LOADED[key] = declare(ctypes.CDLL(str(_built(Path(__file__).with_name(source), isa))))
    return _LOADED[key]


def _built(path: Path, isa: str) -> Path:
    from ..compile_cache import cache_folder
    from ..fingerprint import cpp_compiler
    from ..hashing import hash_bytes

    command = [compiler(), *BASE_FLAGS, *ISA_FLAGS.get(isa, ())]
    digest = hash_bytes(path.read_bytes(), shlex.join(command).encode(), str(cpp_compiler()).encode())[:16]
    target = cache_folder() / "native" / f"{path.stem}-{isa.lower()}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(handle)
    try:
        done = subprocess.run([*command, str(path), "-o", partial], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as error:
        os.unlink(partial)
        raise ConfigError(f"{path.name} could not be built with {command[0]} ({error}); install g++ (or set CXX) "
                          "or use linear_kernel=aten") from None
    if done.returncode != 0:
        os.unlink(partial)
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ConfigError(f"{path.name} could not be built with {command[0]}: {last}; use linear_kernel=aten")
    os.replace(partial, target)
    _BUILD_SECONDS[0] += time.perf_counter() - started
    return target
