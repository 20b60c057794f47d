"""Build one of the engine's C++ sources into a shared library, once per cache folder, and load it with ctypes.

The library is built by the C++ compiler Inductor uses and the environment fingerprint names ($CXX, else g++;
clang++ on macOS) for the instruction set ATen runs with (`ATEN_CPU_CAPABILITY`, as Inductor's kernels are), with
OpenMP where the compiler has it and without FMA contraction (a source's summation order is then its bits, whatever
the instruction set).
It lands in Inductor's cache folder (a run's is evalrun's compile cache, compile_cache.py: one per torch, CPU
instruction set, compiler and engine code) under a name that hashes the source, the compiler's version and the
command, written whole or not at all, so parallel processes and later runs share it. Beside it lies the digest of its
bytes: a library damaged after its build (a truncated copy of a cache, a disk error) is built again, not loaded (a
truncated one crashed the process in dlopen). Nothing here is reachable from a config: the sources are the engine's
own files (fingerprint.ENGINE_SOURCES puts them in the engine-code digest).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from ..errors import ConfigError

# ATen's CPU capability -> the compiler flags of that instruction set (x86); any other builds portable code
ISA_FLAGS = {"AVX512": ("-mavx512f", "-mavx512bw", "-mf16c"), "AVX2": ("-mavx2", "-mf16c")}
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
OPENMP_FLAGS = ("-fopenmp",)
_LOADED: dict[tuple[str, str], ctypes.CDLL] = {}
_BUILD_SECONDS = [0.0]  # spent building in this process (a run's compile_s counts it: modes.py)


def build_seconds() -> float:
    return _BUILD_SECONDS[0]


def compiler() -> str:
    """Inductor's default C++ compiler: $CXX, else g++ (clang++ on macOS)."""
    return os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")


def compiler_version() -> str | None:
    """The first line of the compiler's `--version`, or None where there is none."""
    return _version_of(compiler())


@functools.lru_cache(maxsize=8)
def _version_of(command: str) -> str | None:
    try:
        done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


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
    """The library of `path` for `isa`, built unless a build of the same source, command and compiler is there. With
    OpenMP where the compiler has it, else without (Apple's clang refuses -fopenmp): each output is one thread's, so
    the bits are the same; only the speed is one core's."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    with_openmp = [compiler(), *BASE_FLAGS, *OPENMP_FLAGS, *ISA_FLAGS.get(isa, ())]
    source, version = path.read_bytes(), str(compiler_version()).encode()
    failures = []
    for command in (with_openmp, [flag for flag in with_openmp if flag not in OPENMP_FLAGS]):
        digest = hashlib.sha256(b"\0".join([source, shlex.join(command).encode(), version])).hexdigest()[:16]
        target = Path(cache_dir()) / "evalrun-native" / f"{path.stem}-{isa.lower()}-{digest}.so"
        if _intact(target):
            return target
        failure = _build(path, command, target)
        if failure is None:
            return target
        failures.append(failure)
    raise ConfigError(f"{path.name} could not be built with {with_openmp[0]}: {failures[0]}; install g++ (or set "
                      "CXX) or use linear_kernel=aten")


def _intact(library: Path) -> bool:
    """Whether `library` holds the bytes its build wrote: their digest is the one written beside it."""
    try:  # bytes, not text: a digest damaged into bytes that are not UTF-8 is a mismatch too, not an error
        return _digest(library).encode() == _digest_file(library).read_bytes().strip()
    except OSError:  # either missing (not built yet, or built before digests were written) or unreadable: build it
        return False


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _unwritable(path: Path, target: Path, why: str) -> ConfigError:
    """The one line for a cache folder the library cannot be written into, saying why it had to be built there."""
    found = (f"the {target.name} there does not match its digest (damaged, or built by an older evalrun); "
             if os.path.isfile(target) else "")  # not Path.is_file: a folder that cannot be searched raises there
    return ConfigError(f"{path.name} cannot be built into {target.parent} ({why}): {found}point "
                       "TORCHINDUCTOR_CACHE_DIR (or EVALRUN_CACHE) at a writable folder")


def _remove(path: Path) -> None:
    """Remove a file this process may have written; on a read-only file system even a missing one fails."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _build(path: Path, command: list[str], target: Path) -> str | None:
    """Build `path` into `target` by `command`, whole or not at all: None, or why it failed."""
    started = time.perf_counter()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _unwritable(path, target, error.strerror or str(error)) from None
    # A name of this process's own, not a file made for it (mkstemp's is 0600: the linker kept that mode, 0711, and
    # a cache shared by a group or restored by another user could not load the library): the linker creates it
    # with the mode the umask gives any build output.
    partial = target.with_name(f"{target.stem}.{os.getpid()}-{secrets.token_hex(8)}.partial")
    try:
        done = subprocess.run([*command, str(path), "-o", str(partial)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as error:
        _remove(partial)
        return str(error)
    if done.returncode != 0:
        _remove(partial)
        if not os.access(target.parent, os.W_OK):
            raise _unwritable(path, target, "not writable")
        return (done.stderr.strip().splitlines() or ["no message"])[-1]
    # the digest first: a process stopped between the two leaves a digest no library matches, built again then
    digest = partial.with_name(partial.name + ".sha256")
    try:
        digest.write_text(_digest(partial) + "\n")
        os.replace(digest, _digest_file(target))
        os.replace(partial, target)
    except OSError as error:  # the folder, not the compiler: building without OpenMP would fail the same way
        _remove(partial)
        _remove(digest)
        raise _unwritable(path, target, error.strerror or str(error)) from None
    _BUILD_SECONDS[0] += time.perf_counter() - started
    return None
