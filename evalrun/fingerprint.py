"""Environment fingerprint and numerics flags: what, beyond the config, can change the bits.

`apply_numerics_flags` sets the deterministic and TF32 flags the effective config asks for and
returns what it set, one by one (stored with the run). `environment` reads the machine, libraries,
numerics-relevant environment variables and the torch backend flags as the process had them before
evalrun changed any: flags that the config sets belong to the config, not to the environment.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import EffectiveConfig
from .engine import native_build
from .errors import ConfigError
from .hashing import hash_bytes, hash_value

# Environment variables that can change kernels, their selection, or their reduction order.
NUMERICS_ENV_VARS = (
    "CUBLAS_WORKSPACE_CONFIG", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "NVIDIA_TF32_OVERRIDE",
    "TORCH_CUDNN_V8_API_DISABLED", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCHINDUCTOR_MAX_AUTOTUNE",
    "TORCH_BLAS_PREFER_CUBLASLT", "TRITON_INTERPRET",
    "TORCHINDUCTOR_FREEZING", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
    "TORCHINDUCTOR_DETERMINISTIC", "TORCH_COMPILE_DEBUG", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS",
    "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA",
    "CXX", "TORCHINDUCTOR_CPP_MARCH",
)
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"
_SET_BY_EVALRUN: dict[str, str] = {}  # variables evalrun set itself, with the value (config, not environment)


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except Exception:  # noqa: BLE001 - an absent or broken optional library is simply not recorded
        return None
    return getattr(module, "__version__", None)


_BASELINE: dict[str, Any] = {}


def baseline_backend_flags() -> dict[str, Any]:
    """The process's backend flags before evalrun changed any: the environment's, not the config's."""
    if not _BASELINE:
        _BASELINE.update(backend_flags())
    return dict(_BASELINE)


def backend_flags() -> dict[str, Any]:
    """torch backend flags that select kernels or change reduction precision."""
    matmul = torch.backends.cuda.matmul
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": matmul.allow_tf32,
        "cuda_matmul_allow_fp16_reduced_precision": matmul.allow_fp16_reduced_precision_reduction,
        "cuda_matmul_allow_bf16_reduced_precision": matmul.allow_bf16_reduced_precision_reduction,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "num_threads": torch.get_num_threads(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpp_compiler() -> str | None:
    """The C++ compiler Inductor builds its CPU kernels with (the compiled modes on CPU) and evalrun its own
    (linear_kernel=gguf-gemv): the first line of its `--version`, or None where there is none (native_build)."""
    return native_build.compiler_version()


def _gpu(device: str) -> dict[str, Any]:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return {}
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    driver = None
    try:
        import subprocess

        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return {"gpu_name": props.name, "gpu_capability": f"{props.major}.{props.minor}",
            "gpu_count": torch.cuda.device_count(), "driver": driver}


# The package's own code that runs per step (forward, capture, mixing, modes): a change there can change bits.
# Fault injection lives beside it but never runs in a real run, so it is left out.
ENGINE_SOURCES = ("engine/*.py", "engine/*.cpp")
ENGINE_EXCLUDED = ("engine/faults.py",)


def engine_code_digest() -> str:
    """xxh3-128 over the engine's source files (name and bytes), so a golden made before an engine
    change is explained by the environment diff ("engine_code"), not taken for nondeterminism."""
    package = Path(__file__).resolve().parent
    files = sorted(path for pattern in ENGINE_SOURCES for path in package.glob(pattern)
                   if path.relative_to(package).as_posix() not in ENGINE_EXCLUDED)
    return hash_bytes(*[chunk for path in files for chunk in (path.relative_to(package).as_posix().encode(),
                                                             path.read_bytes())])


def environment(device: str) -> dict[str, Any]:
    """The environment fingerprint for a run on `device`."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "numpy": np.__version__,
        "cpu": _cpu_name(),
        "machine": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "libc": " ".join(platform.libc_ver()),
        "python_implementation": sys.implementation.name,
        "cpp_compiler": cpp_compiler(),
        "engine_code": engine_code_digest(),
        **_gpu(device),
        "env": {name: os.environ.get(name) for name in NUMERICS_ENV_VARS
                if os.environ.get(name) is not None and _SET_BY_EVALRUN.get(name) != os.environ[name]},
        "backend_flags": baseline_backend_flags(),
    }


def environment_hash(env: dict[str, Any]) -> str:
    return hash_value(env)


def inherited_environ() -> dict[str, str]:
    """This process's environment variables less those evalrun set for a config: what a child process
    running another config starts from, so that its environment fingerprint matches this process's."""
    return {name: value for name, value in os.environ.items() if _SET_BY_EVALRUN.get(name) != value}


def apply_numerics_flags(effective: EffectiveConfig) -> dict[str, Any]:
    """Set deterministic / TF32 flags from the effective config; return each flag as set.

    `CUBLAS_WORKSPACE_CONFIG` only takes effect if set before CUDA initialises: it is set here,
    which the runner calls before it touches the GPU.
    """
    baseline_backend_flags()
    deterministic, tf32 = effective.deterministic, effective.tf32
    applied: dict[str, Any] = {}
    if deterministic:
        if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACE
            _SET_BY_EVALRUN["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACE
        applied["CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
    torch.use_deterministic_algorithms(deterministic, warn_only=False)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    reduced = not deterministic
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    applied.update({"use_deterministic_algorithms": deterministic, "cudnn_deterministic": deterministic,
                    "cudnn_benchmark": False, "tf32": tf32, "reduced_precision_reductions": reduced})
    if effective.on_gpu and torch.version.hip is None:  # CUDA: set every run, from the config alone
        torch.backends.cuda.preferred_blas_library(effective.blas_library)
        applied["preferred_blas_library"] = effective.blas_library
    elif effective.on_gpu and effective.blas_library != "cublas":
        raise ConfigError(f"blas_library={effective.blas_library} chooses a CUDA library and this torch is built for "
                          "ROCm; use blas_library=cublas")
    try:
        import torch._inductor.config as inductor_config

        if hasattr(inductor_config, "deterministic"):
            inductor_config.deterministic = deterministic
            applied["inductor_deterministic"] = deterministic
    except ImportError:
        pass
    return applied
