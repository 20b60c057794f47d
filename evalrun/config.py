"""Run configuration: the knobs, their modes, presets, aliases, validation and resolution.

Two types. `RunConfig` is what the user asked for: `None` means "not set". `EffectiveConfig` is the
frozen, fully resolved config a run executes and every fingerprint hashes. Resolution order (later
wins): preset -> TOML file -> command-line flags -> `--set KEY=VALUE` -> opt-level defaults for the
fields still unset (made compatible with what the user did set) -> device defaults.

The config hash covers only the declared factors (vLLM's `compute_hash` habit):
  NUMERICS_FACTORS  knobs that can change the bits of the logits (what `bisect` walks);
  WORKLOAD_FACTORS  what is computed: model, prompts, how many tokens, how they are chosen.
Everything else (opt level, warm-up count, strict-config, which logits to keep) changes how a run is
carried out or recorded, never its numbers: it is stored with the run but not hashed, so it never
shows up as a verdict's cause.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine.shapes import bucket_size
from .errors import ConfigError
from .hashing import hash_value

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


class CompilationMode(enum.StrEnum):
    """How the forward is compiled (vLLM's names in COMPILATION_ALIASES)."""

    NONE = "none"
    STOCK = "stock"
    TRACE_ONCE = "trace-once"
    PIECEWISE = "piecewise"

    def is_compiled(self) -> bool:
        return self is not CompilationMode.NONE


class CUDAGraphMode(enum.StrEnum):
    """Which steps are captured in CUDA graphs."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full-decode-only"
    FULL_AND_PIECEWISE = "full-and-piecewise"

    def has_full_cudagraphs(self) -> bool:
        """The whole decode step (forward + capture) is one CUDA graph."""
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)

    def has_piecewise_cudagraphs(self) -> bool:
        """A CUDA graph around each call of a compiled piece (prefill, and decode for PIECEWISE; engine/piece_graphs.py)."""
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)

    def captures_full_prefill(self) -> bool:
        return self is CUDAGraphMode.FULL

    def requires_piecewise_compilation(self) -> bool:
        return self.has_piecewise_cudagraphs()

    def needs_gpu(self) -> bool:
        return self is not CUDAGraphMode.NONE

    def without_piecewise(self) -> "CUDAGraphMode":
        """The closest mode that does not need piecewise compilation (vLLM's downgrade)."""
        return {CUDAGraphMode.PIECEWISE: CUDAGraphMode.NONE,
                CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.FULL}.get(self, self)


DTYPES = ("float32", "bfloat16", "float16", "float64")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
# Decode-speed levers (issue #16), each a numerics knob: other kernels, other bits. Never on by default.
BLAS_LIBRARIES = ("cublas", "cublaslt")  # torch.backends.cuda.preferred_blas_library on CUDA
LINEAR_KERNELS = ("aten", "triton-gemv", "triton-gemv-glu", "gguf-gemv")  # engine/linear.py: who computes a projection of 1-4 rows
ATTENTION_KERNELS = ("sdpa", "triton-split-kv")  # engine/attention_triton.py: who computes a decode step's attention
NORM_KERNELS = ("aten", "triton")  # engine/norm_triton.py: who computes an RMSNorm (Inductor's kernel when compiled)
DECODE_LEVER_DEFAULTS = {"blas_library": "cublas", "linear_kernel": "aten", "attention_kernel": "sdpa",
                         "norm_kernel": "aten"}
GEMV_MAX_ROWS = 4  # the GEMV's rows: decode at batch <= 4 (engine/linear.py)
TRITON_DTYPE_NAMES = ("bfloat16", "float16", "float32")  # the dtypes evalrun's Triton kernels compute (GEMV, split-KV)
# Steps of at most 9 digits (a prompt runs at most MAX_NEW_TOKENS_LIMIT): int() refuses text past 4300 digits.
KEEP_LOGITS_PATTERN = re.compile(r"none|all|([^,@\s]+(@\d{1,9}(-\d{1,9})?)?)(,[^,@\s]+(@\d{1,9}(-\d{1,9})?)?)*")
MAX_NEW_TOKENS_LIMIT = 8192  # past any context the shipped models have; larger asks are typos
MAX_BATCH_SIZE = 4096
MAX_TOP_K = 1024
MAX_BUCKET = 1 << 20

COMPILATION_ALIASES = {
    "eager": "none", "NONE": "none", "STOCK_TORCH_COMPILE": "stock", "DYNAMO_TRACE_ONCE": "trace-once",
    "VLLM_COMPILE": "piecewise", "0": "none", "1": "stock", "2": "trace-once", "3": "piecewise",
}
CUDAGRAPH_ALIASES = {mode.value.upper().replace("-", "_"): mode.value for mode in CUDAGraphMode}

# What each -O level fills in for fields the user left unset (vLLM's meaning of the levels).
OPT_LEVEL_DEFAULTS: dict[int, dict[str, Any]] = {
    0: {"compilation_mode": "none", "cudagraph_mode": "none"},
    1: {"compilation_mode": "piecewise", "cudagraph_mode": "piecewise"},
    2: {"compilation_mode": "piecewise", "cudagraph_mode": "full-and-piecewise"},
    3: {"compilation_mode": "piecewise", "cudagraph_mode": "full-and-piecewise", "max_autotune": True,
        "coordinate_descent_tuning": True},
}
# Inductor's own defaults, used when neither the user nor the opt level set a knob.
INDUCTOR_DEFAULTS = {"max_autotune": False, "coordinate_descent_tuning": False, "epilogue_fusion": True,
                     "emulate_precision_casts": False, "combo_kernels": False}
INDUCTOR_KNOBS = tuple(INDUCTOR_DEFAULTS)
OPT_LEVEL_KNOBS = ("compilation_mode", "cudagraph_mode", *INDUCTOR_KNOBS)  # what an -O level decides

# The hashed factors, in the order bisect walks them: compilation before CUDA graphs before Inductor
# knobs before precision flags before shapes (torch's bisector: backends before subsystems).
NUMERICS_FACTORS = ("engine", "device", "tensor_parallel", "dtype", "compilation_mode", "cudagraph_mode", *INDUCTOR_KNOBS, "attn_implementation",
                    "blas_library", "linear_kernel", "attention_kernel", "norm_kernel", "tf32", "deterministic", "batch_invariant", "batch_size", "prefill_buckets", "batch_buckets")
WORKLOAD_FACTORS = ("model", "prompts", "max_new_tokens", "top_k", "temperature", "seed", "served_model",
                    "server_config")
# Knobs added after runs and goldens were first stored: a stored config without one ran at this value.
OPTIONAL_STORED = {"batch_invariant": False, "engine": "evalrun", "tensor_parallel": 1, "served_model": "",
                   "server_config": "", "server_timeout": 60.0, "combo_kernels": INDUCTOR_DEFAULTS["combo_kernels"],
                   **DECODE_LEVER_DEFAULTS}
# Factors added after config hashes were first stored: left out of the hash at these values, so every
# hash stored before them (runs, goldens, bisect records) still names the same config.
HASHED_ONLY_WHEN_SET = {"engine": "evalrun", "tensor_parallel": 1, "served_model": "", "server_config": "",
                        "combo_kernels": INDUCTOR_DEFAULTS["combo_kernels"], **DECODE_LEVER_DEFAULTS}
# What computes the logits: evalrun's own engine (every execution mode), transformers' forward, or a
# running OpenAI-compatible server (`openai:URL`).
ENGINES = ("evalrun", "transformers")
OPENAI_ENGINE_PREFIX = "openai:"
MAX_TENSOR_PARALLEL = 64


@dataclass
class RunConfig:
    """Every knob of a run as requested. `None` means "not set": filled by opt level or device defaults."""

    model: str = "smollm2-135m"
    prompts: str = "default"
    engine: str = "evalrun"  # evalrun | transformers | openai:URL (ENGINES)
    tensor_parallel: int = 1  # ranks the projections are split across (torch.distributed)
    served_model: str = ""  # with engine openai:URL, the served model's name ('' = the server's only one)
    server_config: str = ""  # free-text notes on how the server runs (e.g. "-O3 cudagraph_mode=FULL"): hashed
    server_timeout: float = 60.0  # seconds one server request may take (not hashed)
    opt_level: int | None = None
    compilation_mode: str | None = None
    cudagraph_mode: str | None = None
    dtype: str | None = None
    device: str = "auto"
    attn_implementation: str = "sdpa"
    blas_library: str = "cublas"  # cublas | cublaslt: the library CUDA matrix products prefer (GPU only)
    linear_kernel: str = "aten"  # aten | triton-gemv | triton-gemv-glu (GPU) | gguf-gemv (CPU, GGUF): projections of 1-4 rows
    attention_kernel: str = "sdpa"  # sdpa | triton-split-kv (GPU): the attention of a decode step (one query token)
    norm_kernel: str = "aten"  # aten | triton (GPU): the RMSNorms, by torch (Inductor when compiled) or one Triton kernel
    batch_size: int = 1
    max_new_tokens: int = 32
    top_k: int = 8
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    deterministic: bool = False
    tf32: bool = False
    batch_invariant: bool = False  # each row computed as if alone: bits independent of the batch (engine/modes.py)
    max_autotune: bool | None = None
    coordinate_descent_tuning: bool | None = None
    epilogue_fusion: bool | None = None
    emulate_precision_casts: bool | None = None
    combo_kernels: bool | None = None  # Inductor launches a piece's independent kernels as one (issue #16)
    prefill_buckets: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024, 2048])
    batch_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    strict_config: bool = False
    keep_logits: str = "none"


FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(RunConfig)}
FIELD_NAMES = tuple(FIELD_TYPES)


@dataclass(frozen=True)
class EffectiveConfig:
    """The fully resolved config: every field set, modes as enums. What a run executes and records."""

    model: str
    prompts: str
    engine: str
    tensor_parallel: int
    served_model: str
    server_config: str
    server_timeout: float
    opt_level: int
    compilation_mode: CompilationMode
    cudagraph_mode: CUDAGraphMode
    dtype: str
    device: str
    attn_implementation: str
    blas_library: str
    linear_kernel: str
    attention_kernel: str
    norm_kernel: str
    batch_size: int
    max_new_tokens: int
    top_k: int
    temperature: float
    seed: int
    warmup: int
    deterministic: bool
    tf32: bool
    batch_invariant: bool
    max_autotune: bool
    coordinate_descent_tuning: bool
    epilogue_fusion: bool
    emulate_precision_casts: bool
    combo_kernels: bool
    prefill_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    strict_config: bool
    keep_logits: str
    adjustments: tuple[str, ...] = ()  # what resolution filled differently from the level's default, and why

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def is_static(self) -> bool:
        """Static shapes (prompts padded to buckets): anything but eager without graphs."""
        return (self.compilation_mode, self.cudagraph_mode) != (CompilationMode.NONE, CUDAGraphMode.NONE)

    def inductor_options(self) -> dict[str, bool]:
        return {key: getattr(self, key) for key in INDUCTOR_KNOBS}

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (enums as their names, tuples as lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def factors(self) -> dict[str, Any]:
        """The hashed factors, numerics then workload."""
        return {key: _plain(getattr(self, key)) for key in NUMERICS_FACTORS + WORKLOAD_FACTORS}

    def numerics(self) -> dict[str, Any]:
        return {key: _plain(getattr(self, key)) for key in NUMERICS_FACTORS}

    def compute_hash(self) -> str:
        factors = {key: value for key, value in self.factors().items()
                   if key not in HASHED_ONLY_WHEN_SET or value != HASHED_ONLY_WHEN_SET[key]}
        return hash_value(factors)

    def replace(self, **changes: Any) -> "EffectiveConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EffectiveConfig":
        """Rebuild from `as_dict()` output (a stored run, a golden): every value validated."""
        if not isinstance(data, dict):
            raise ConfigError("stored effective config is not an object")
        names = [f.name for f in dataclasses.fields(cls)]
        data = {**OPTIONAL_STORED, **data}
        missing = [name for name in names if name not in data and name != "adjustments"]
        if missing:
            raise ConfigError(f"stored effective config lacks {', '.join(missing)}")
        requested = RunConfig(**{k: _coerce(k, data[k]) for k in FIELD_NAMES})
        normalize(requested)
        if requested.opt_level is None or requested.compilation_mode is None or requested.cudagraph_mode is None \
                or requested.dtype is None or requested.device == "auto":
            raise ConfigError("stored effective config has unresolved fields")
        values = dataclasses.asdict(requested)
        values.update(compilation_mode=CompilationMode(values["compilation_mode"]),
                      cudagraph_mode=CUDAGraphMode(values["cudagraph_mode"]),
                      prefill_buckets=tuple(values["prefill_buckets"]), batch_buckets=tuple(values["batch_buckets"]),
                      adjustments=tuple(str(a) for a in data.get("adjustments") or ()))
        for key in INDUCTOR_KNOBS:
            if values[key] is None:
                raise ConfigError(f"stored effective config has {key} unset")
        return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


# ---------------------------------------------------------------- parsing and validation

def _choice(key: str, value: Any, choices: tuple[str, ...], aliases: dict[str, str] | None = None) -> str:
    text = str(value)
    if aliases and text in aliases:
        return aliases[text]
    if text in choices:
        return text
    accepted = list(choices) + sorted(aliases or {})
    raise ConfigError(f"{key}={text!r} is not valid; use one of: {', '.join(accepted)}")


def parse_opt_level(value: Any) -> int:
    """'-O2', 'O2', '2' or 2 -> 2; anything outside 0..3 is a ConfigError."""
    match = re.fullmatch(r"(?:-?O)?([0-3])", str(value).strip().upper())
    if match and not isinstance(value, bool):
        return int(match.group(1))
    raise ConfigError(f"opt level {value!r} is not valid; use -O0, -O1, -O2 or -O3")


def _coerce(key: str, value: Any) -> Any:
    """Coerce a raw value (from TOML, --set text or a stored config) to the type of field `key`."""
    kind = FIELD_TYPES[key]
    if key == "opt_level" and value is not None:
        return parse_opt_level(value)
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{key} cannot be empty; give a value")
    if kind.startswith("bool"):
        if isinstance(value, bool):
            return value
        lowered = str(value).lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r} is not a boolean; use true or false")
    if kind.startswith("int"):
        if isinstance(value, bool) or isinstance(value, (list, dict)):
            raise ConfigError(f"{key}={value!r} is not an integer")
        try:
            return int(value) if not isinstance(value, float) or value.is_integer() else _not_int(key, value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key}={value!r} is not an integer") from None
    if kind.startswith("float"):
        if isinstance(value, (bool, list, dict)):
            raise ConfigError(f"{key}={value!r} is not a number")
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key}={str(value)[:40]!r} is not a number in range") from None
        if number != number or number in (float("inf"), float("-inf")):
            raise ConfigError(f"{key}={value!r} is not a finite number")
        return number
    if kind.startswith("list"):
        items = value if isinstance(value, (list, tuple)) else [v for v in str(value).strip("[]").split(",") if v.strip()]
        if any(isinstance(item, (bool, float, list, dict)) for item in items):
            raise ConfigError(f"{key}={value!r} is not a list of integers, e.g. 16,32,64")
        try:
            return [int(item) for item in items]
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a list of integers, e.g. 16,32,64") from None
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{key}={value!r} is not a text value")
    return str(value)


def _not_int(key: str, value: Any) -> int:
    raise ConfigError(f"{key}={value!r} is not an integer")


def validate_key(key: str) -> None:
    if key not in FIELD_TYPES:
        raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(FIELD_NAMES)}")


def parse_set_option(text: str) -> tuple[str, Any]:
    """'batch_size=4' -> ('batch_size', 4). Dashes in keys are accepted for underscores."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r} needs the form KEY=VALUE, e.g. --set batch_size=4")
    key, raw = text.split("=", 1)
    key = key.strip().replace("-", "_")
    validate_key(key)
    return key, _coerce(key, raw.strip())


def preset_names() -> list[str]:
    return sorted(path.stem for path in CONFIGS_DIR.glob("*.toml"))


def load_config_source(name_or_path: str) -> dict[str, Any]:
    """Read a preset by name or a TOML file by path into a dict of validated keys."""
    path = Path(name_or_path)
    if not path.suffix and (CONFIGS_DIR / f"{name_or_path}.toml").exists():
        path = CONFIGS_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ConfigError(
            f"config {name_or_path!r} is neither a preset ({', '.join(preset_names())}) nor an existing TOML file"
        )
    try:
        if path.stat().st_size > 1 << 20:
            raise ConfigError(f"{path}: larger than 1 MiB; a config file holds a few keys")
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid TOML ({str(error).splitlines()[0]}); fix the file") from None
    except RecursionError:
        raise ConfigError(f"{path}: TOML nested too deeply; a config file holds flat keys") from None
    except ValueError:  # an integer of more than 4300 digits (Python's limit on converting text to int)
        raise ConfigError(f"{path}: a number too long to read (over 4300 digits); fix the file") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror}); check the path") from None
    data.pop("description", None)
    values, spelled = {}, {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in values:  # max-new-tokens and max_new_tokens: one key, which would win was not said
            raise ConfigError(f"{path}: {name} is given twice ({spelled[name]!r} and {key!r}); keep one")
        validate_key(name)
        values[name], spelled[name] = _coerce(name, value), key
    return values


def build_config(
    config_source: str | None = None, flags: dict[str, Any] | None = None, sets: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Merge base values, preset/file, explicit flags (None = not given) and --set items into a RunConfig.

    `base` is a requested config stored earlier (a golden's): the user's options go on top of it.
    """
    values = {key: _coerce(key, value) for key, value in (base or {}).items() if key in FIELD_TYPES}
    if config_source:
        values = apply_layer(values, load_config_source(config_source))
    given = {key: value for key, value in (flags or {}).items() if value is not None}
    for key in given:
        validate_key(key)
    command_line = {key: _coerce(key, value) for key, value in given.items()}
    command_line.update(parse_set_option(item) for item in sets)  # --set after the flags, one layer with them
    values = apply_layer(values, command_line)
    return normalize(RunConfig(**values))


def apply_layer(values: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """Requested values with a later layer on top (a golden's request, then a preset or file, then the
    command line: flags and --set items together). An -O level in the later layer takes back the knobs
    it governs from the earlier ones: `golden verify G -O2` on a golden requested as eager runs -O2, not
    eager labelled -O2. Knobs the same layer sets stay (`-O2 --compilation-mode stock`,
    `--compilation-mode stock --set opt_level=2`)."""
    merged = dict(values)
    if layer.get("opt_level") is not None:
        for key in OPT_LEVEL_KNOBS:
            if key not in layer:
                merged.pop(key, None)
    merged.update(layer)
    return merged


def normalize(config: RunConfig) -> RunConfig:
    """Validate every field's value on its own and map aliases to canonical names."""
    if config.opt_level is not None:
        config.opt_level = parse_opt_level(config.opt_level)
    if config.compilation_mode is not None:
        config.compilation_mode = _choice("compilation_mode", config.compilation_mode,
                                          tuple(m.value for m in CompilationMode), COMPILATION_ALIASES)
    if config.cudagraph_mode is not None:
        config.cudagraph_mode = _choice("cudagraph_mode", config.cudagraph_mode, tuple(m.value for m in CUDAGraphMode),
                                        CUDAGRAPH_ALIASES)
    if config.dtype is not None:
        config.dtype = _choice("dtype", config.dtype, DTYPES, DTYPE_ALIASES)
    config.attn_implementation = _choice("attn_implementation", config.attn_implementation, ATTENTION_IMPLEMENTATIONS)
    config.blas_library = _choice("blas_library", config.blas_library, BLAS_LIBRARIES)
    config.linear_kernel = _choice("linear_kernel", config.linear_kernel, LINEAR_KERNELS)
    config.attention_kernel = _choice("attention_kernel", config.attention_kernel, ATTENTION_KERNELS)
    config.norm_kernel = _choice("norm_kernel", config.norm_kernel, NORM_KERNELS)
    config.engine = parse_engine(config.engine)
    if not KEEP_LOGITS_PATTERN.fullmatch(str(config.keep_logits)):
        raise ConfigError(f"keep_logits={str(config.keep_logits)[:80]!r} is not valid; use none, all, or prompt ids with "
                          "optional steps, e.g. zh-deploy@0-15,code-fib")
    device = config.device
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ConfigError(f"device={device!r} is not valid; use auto, cpu, cuda or cuda:N")
    bounds = (("batch_size", 1, MAX_BATCH_SIZE), ("max_new_tokens", 1, MAX_NEW_TOKENS_LIMIT), ("top_k", 2, MAX_TOP_K),
              ("warmup", 0, 100), ("seed", 0, (1 << 63) - 1), ("tensor_parallel", 1, MAX_TENSOR_PARALLEL))
    for key, low, high in bounds:
        value = getattr(config, key)
        if not low <= value <= high:
            raise ConfigError(f"{key}={value} is out of range; use a value from {low} to {high}")
    if not 0 < config.server_timeout <= 3600:
        raise ConfigError(f"server_timeout={config.server_timeout} is out of range; use seconds from 0.1 to 3600")
    if len(config.server_config) > 1000 or len(config.served_model) > 300:
        raise ConfigError("server_config or served_model is too long; keep notes under 1,000 characters")
    if (config.served_model or config.server_config) and not config.engine.startswith(OPENAI_ENGINE_PREFIX):
        raise ConfigError("served_model and server_config describe a server; use them with --engine openai:URL")
    if not 0 <= config.temperature <= 100:
        raise ConfigError(f"temperature={config.temperature} is out of range; use 0 (greedy) or a positive number")
    for key in ("prefill_buckets", "batch_buckets"):
        buckets = getattr(config, key)
        if not buckets or any(not 1 <= b <= MAX_BUCKET for b in buckets) or len(buckets) > 64:
            raise ConfigError(f"{key}={buckets} is not valid; give 1 to 64 sizes from 1 to {MAX_BUCKET}, e.g. 16,32,64")
        setattr(config, key, sorted(set(buckets)))
    return config


def parse_engine(value: Any) -> str:
    """'evalrun', 'transformers' or 'openai:http://HOST:PORT/v1' (checked here for form only)."""
    text = str(value).strip()
    if text in ENGINES:
        return text
    if text.startswith(OPENAI_ENGINE_PREFIX):
        url = text[len(OPENAI_ENGINE_PREFIX):]
        if re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
            return OPENAI_ENGINE_PREFIX + url.rstrip("/")
        raise ConfigError(f"engine={text[:80]!r} has no usable URL; use openai:http://HOST:PORT/v1")
    raise ConfigError(f"engine={text[:80]!r} is not valid; use evalrun, transformers or openai:http://HOST:PORT/v1")


def is_server_engine(engine: str) -> bool:
    """Whether `engine` names an OpenAI-compatible server (evalrun/server_run.py runs those)."""
    return str(engine).startswith(OPENAI_ENGINE_PREFIX)


def keep_logits_items(keep_logits: str) -> list[tuple[str, str, int | None, int | None]]:
    """The ID[@A[-B]] items of a keep_logits spec other than none and all (see KEEP_LOGITS_PATTERN):
    (the item as written, its prompt id, first step, last step), the steps None where it names none."""
    items = []
    for item in keep_logits.split(","):
        name, _, span = item.partition("@")
        low, _, high = span.partition("-")
        items.append((item, name, int(low) if span else None, int(high or low) if span else None))
    return items


def keep_logits_steps(keep_logits: str, prompt_id: str, steps: int) -> list[int]:
    """Which steps of prompt `prompt_id` keep full logits under `keep_logits` (see KEEP_LOGITS_PATTERN)."""
    if keep_logits == "all":
        return list(range(steps))
    if keep_logits == "none":
        return []
    for _, name, low, high in keep_logits_items(keep_logits):
        if name == prompt_id:
            return list(range(steps)) if low is None else list(range(low, min(steps, high + 1)))
    return []


def inert_inductor_knobs(config: EffectiveConfig) -> list[str]:
    """Inductor's options set away from Inductor's defaults in a config that compiles nothing: hashed and
    recorded, they change no bit (`-O0 --set combo_kernels=true` ran eager under combo_kernels' name, its
    logits those of plain -O0). The run's fallbacks say so, and --strict-config refuses it."""
    if config.compilation_mode is not CompilationMode.NONE:
        return []
    changed = [f"{key}={str(getattr(config, key)).lower()}" for key in INDUCTOR_KNOBS
               if getattr(config, key) != INDUCTOR_DEFAULTS[key]]
    if not changed:
        return []
    return [f"{', '.join(changed)}: compilation_mode=none compiles nothing, so these Inductor options changed "
            "nothing; pick a compiled mode (-O2) or drop them"]


def keep_logits_problem(keep_logits: str, steps_by_id: dict[str, int], prompt_set: str) -> str | None:
    """Why `keep_logits` cannot keep what it names in a prompt set whose prompts run `steps_by_id` steps (in
    file order), or None. An unknown id or a range past a prompt's steps kept nothing, silently: a typo lost
    the logits asked for."""
    if keep_logits in ("none", "all"):
        return None
    ids = list(steps_by_id)
    named: set[str] = set()
    for item, name, low, high in keep_logits_items(keep_logits):
        if name not in steps_by_id:
            shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
            return (f"keep_logits names prompt {name!r}, which prompt set {prompt_set} lacks; use its ids "
                    f"({shown}) or all")
        if name in named:
            return f"keep_logits names prompt {name!r} twice; name each prompt once (ID or ID@A-B)"
        named.add(name)
        steps = steps_by_id[name]
        if low is not None and (high < low or high >= steps):
            return (f"keep_logits={item} asks steps {item.partition('@')[2]} of prompt {name!r}, which runs {steps} "
                    f"steps; ask steps within 0-{steps - 1} (A <= B)")
    return None


# ---------------------------------------------------------------- resolution

def resolve(config: RunConfig, cuda_available: bool) -> EffectiveConfig:
    """The effective config: every field filled, then validated for the device.

    Device `auto` becomes `cuda` when CUDA is there; the opt level defaults to 2 on GPU, 0 on CPU.
    A level fills only what the user left unset, and fills a value compatible with what the user did
    set (vLLM downgrades the same way); each such adjustment is recorded with its reason. On CPU a
    level never fills a CUDA graph mode (there are none here).
    """
    values = dataclasses.asdict(config)
    device = "cuda" if values["device"] == "auto" and cuda_available else values["device"]
    device = "cpu" if device == "auto" else device
    values["device"] = device
    on_gpu = device.startswith("cuda")
    level = values["opt_level"] if values["opt_level"] is not None else (2 if on_gpu else 0)
    values["opt_level"] = level
    adjustments = []
    defaults = dict(OPT_LEVEL_DEFAULTS[level])
    if not on_gpu:
        defaults["cudagraph_mode"] = "none"
    graphs_set, compilation_set = values["cudagraph_mode"] is not None, values["compilation_mode"] is not None
    if graphs_set and not compilation_set and CUDAGraphMode(values["cudagraph_mode"]).requires_piecewise_compilation():
        if defaults["compilation_mode"] != "piecewise":
            adjustments.append(f"compilation_mode: -O{level} fills {defaults['compilation_mode']}, but "
                               f"cudagraph_mode={values['cudagraph_mode']} needs piecewise; filled piecewise")
        defaults["compilation_mode"] = "piecewise"
    if compilation_set and not graphs_set and values["compilation_mode"] != "piecewise":
        wanted = CUDAGraphMode(defaults["cudagraph_mode"])
        if wanted.requires_piecewise_compilation():
            defaults["cudagraph_mode"] = wanted.without_piecewise().value
            adjustments.append(f"cudagraph_mode: -O{level} fills {wanted.value}, which needs piecewise compilation; "
                               f"with compilation_mode={values['compilation_mode']} filled {defaults['cudagraph_mode']}")
    if values["engine"] == "transformers":
        adjustments += _whole_forward_defaults(defaults, values, level)
    for key, value in defaults.items():
        if values[key] is None:
            values[key] = value
    for key, value in INDUCTOR_DEFAULTS.items():
        if values[key] is None:
            values[key] = value
    if values["dtype"] is None:
        values["dtype"] = "bfloat16" if on_gpu else "float32"
    values.update(compilation_mode=CompilationMode(values["compilation_mode"]),
                  cudagraph_mode=CUDAGraphMode(values["cudagraph_mode"]),
                  prefill_buckets=tuple(values["prefill_buckets"]), batch_buckets=tuple(values["batch_buckets"]),
                  adjustments=tuple(adjustments))
    effective = EffectiveConfig(**values)
    validate(effective, cuda_available)
    return effective


def _whole_forward_defaults(defaults: dict[str, Any], values: dict[str, Any], level: int) -> list[str]:
    """transformers' forward compiles whole, never piecewise: an -O level's piecewise defaults become
    trace-once (and its graph mode the closest without piecewise) for the fields the user left unset."""
    adjustments = []
    if values["compilation_mode"] is None and defaults["compilation_mode"] == "piecewise":
        defaults["compilation_mode"] = "trace-once"
        adjustments.append(f"compilation_mode: -O{level} fills piecewise, which --engine transformers cannot run "
                           "(it compiles the whole forward); filled trace-once")
    wanted = CUDAGraphMode(defaults["cudagraph_mode"])
    if values["cudagraph_mode"] is None and wanted.requires_piecewise_compilation():
        defaults["cudagraph_mode"] = wanted.without_piecewise().value
        adjustments.append(f"cudagraph_mode: -O{level} fills {wanted.value}, which needs piecewise compilation; "
                           f"with --engine transformers filled {defaults['cudagraph_mode']}")
    return adjustments


TRANSFORMERS_MODES_FIX = "--engine transformers compiles transformers' whole forward"


def _check_engine_modes(config: EffectiveConfig) -> None:
    """The execution modes an engine other than evalrun's can honour (engine.hf_engine)."""
    if config.engine != "transformers":
        return
    if config.compilation_mode is CompilationMode.PIECEWISE:
        raise ConfigError(f"compilation_mode=piecewise compiles evalrun's own forward piece by piece; "
                          f"{TRANSFORMERS_MODES_FIX}: use --compilation-mode none, stock or trace-once")
    if config.cudagraph_mode.has_full_cudagraphs() and not config.compilation_mode.is_compiled():
        raise ConfigError(f"cudagraph_mode={config.cudagraph_mode} under --engine transformers captures a static-cache "
                          "forward compiled by torch.compile; add --compilation-mode stock or trace-once")


def _check_decode_levers(config: EffectiveConfig) -> None:
    """The decode-speed knobs exist on CUDA only, and the Triton GEMV and split-KV attention in evalrun's own
    engine only (on the CPU under Triton's interpreter, TRITON_INTERPRET=1, for tests)."""
    if config.blas_library != "cublas" and not config.on_gpu:
        raise ConfigError(f"blas_library={config.blas_library} chooses a CUDA library; on CPU use blas_library=cublas "
                          "(or --device cuda)")
    if config.attention_kernel != "sdpa":
        _refuse_other_engine(config, "attention_kernel", "sdpa", "attention")
        # its tl.dot in bfloat16: the interpreter computes it wrongly
        _check_triton_knob(config, "attention_kernel", "sdpa", "attention", interpreted_wrongly=("bfloat16",))
    if config.norm_kernel != "aten":
        _refuse_other_engine(config, "norm_kernel", "aten", "norms")
        _check_triton_knob(config, "norm_kernel", "aten", "norms")
    if config.linear_kernel == "aten":
        return
    _refuse_other_engine(config, "linear_kernel", "aten", "projections")
    if config.batch_size > GEMV_MAX_ROWS and not config.batch_invariant:
        raise ConfigError(f"linear_kernel={config.linear_kernel} computes projections of 1-{GEMV_MAX_ROWS} rows; at "
                          f"batch_size {config.batch_size} it would compute none: use --batch-size {GEMV_MAX_ROWS} or "
                          "less, or linear_kernel=aten")
    padded = bucket_size(config.batch_size, config.batch_buckets)  # a static mode's rows (engine/shapes.py)
    if config.is_static and padded > GEMV_MAX_ROWS and not config.batch_invariant:
        raise ConfigError(f"linear_kernel={config.linear_kernel} computes projections of 1-{GEMV_MAX_ROWS} rows; "
                          f"batch_buckets pad batch_size {config.batch_size} to {padded} rows, where it would compute "
                          f"none: add a bucket of {config.batch_size} to {GEMV_MAX_ROWS} (--set batch_buckets=1,2,4), "
                          "or linear_kernel=aten")
    if config.linear_kernel == "gguf-gemv":
        _check_gguf_gemv(config)
        return
    _check_triton_knob(config, "linear_kernel", "aten", "projections")


def _refuse_other_engine(config: EffectiveConfig, knob: str, default: str, what: str) -> None:
    """A knob that replaces part of evalrun's own engine, asked of another engine."""
    if config.engine != "evalrun":
        raise ConfigError(f"{knob}={getattr(config, knob)} replaces evalrun's own {what}; use --engine evalrun, or "
                          f"{knob}={default}")


def _check_triton_knob(config: EffectiveConfig, knob: str, default: str, what: str,
                       interpreted_wrongly: tuple[str, ...] = ()) -> None:
    """A knob that runs a Triton kernel of evalrun's engine: a dtype it computes, on CUDA (on the CPU only under
    Triton's interpreter, TRITON_INTERPRET=1, eagerly and in a dtype the interpreter computes right: tests)."""
    value, fix = getattr(config, knob), f"{knob}={default}"
    if config.dtype not in TRITON_DTYPE_NAMES:
        raise ConfigError(f"{knob}={value} computes bfloat16, float16 and float32 {what}; with dtype {config.dtype} "
                          f"use {fix}")
    if config.on_gpu:
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise ConfigError(f"{knob}={value} on a GPU runs compiled, not under Triton's interpreter; unset "
                              "TRITON_INTERPRET")
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"{knob}={value} is a CUDA kernel; on CPU use {fix} (or --device cuda)")
    if config.dtype in interpreted_wrongly:
        raise ConfigError(f"{knob}={value} under Triton's interpreter (TRITON_INTERPRET=1, tests) multiplies "
                          f"{config.dtype} wrongly; use --dtype float32, or --device cuda")
    if config.is_static:
        raise ConfigError(f"{knob}={value} under Triton's interpreter (TRITON_INTERPRET=1, tests) runs eagerly only; "
                          "use -O0 or --device cuda")


def _check_gguf_gemv(config: EffectiveConfig) -> None:
    """The GGUF-block GEMV (engine/gguf_blocks.py): float32 on the CPU, one process, a GGUF model."""
    fix = "or linear_kernel=aten"
    if config.on_gpu:
        raise ConfigError(f"linear_kernel=gguf-gemv is a CPU kernel; on a GPU use linear_kernel=triton-gemv {fix}")
    if config.dtype != "float32":
        raise ConfigError("linear_kernel=gguf-gemv rebuilds a GGUF model's float32 weights exactly; use --dtype float32 "
                          f"{fix}")
    if config.tensor_parallel > 1:
        raise ConfigError(f"linear_kernel=gguf-gemv reads whole weights; use --tensor-parallel 1 {fix}")
    if not (config.model == "smollm2-135m" or config.model.endswith(".gguf")):
        raise ConfigError(f"linear_kernel=gguf-gemv reads the weights of a GGUF file; model {config.model[:80]!r} is "
                          f"not one: use smollm2-135m or a .gguf path, {fix}")


def validate(config: EffectiveConfig, cuda_available: bool, gpu_count: int | None = None) -> None:
    """The one check that a resolved config can exist here; ConfigError names the fix."""
    if config.on_gpu and not cuda_available:
        raise ConfigError(f"--device {config.device} was asked for but this machine has no CUDA GPU; use --device cpu")
    if config.on_gpu and gpu_count is not None and ":" in config.device and int(config.device[5:]) >= gpu_count:
        raise ConfigError(f"--device {config.device}: only {gpu_count} GPU(s) here; use cuda:0")
    if config.cudagraph_mode.needs_gpu() and not config.on_gpu:
        raise ConfigError(f"cudagraph_mode={config.cudagraph_mode} needs a GPU; on CPU use --cudagraph-mode none")
    if config.cudagraph_mode.requires_piecewise_compilation() and config.compilation_mode is not CompilationMode.PIECEWISE:
        raise ConfigError(f"cudagraph_mode={config.cudagraph_mode} wraps compiled pieces and needs --compilation-mode "
                          "piecewise; use it, or --cudagraph-mode full / full-decode-only / none")
    if config.engine not in ENGINES and not config.engine.startswith(OPENAI_ENGINE_PREFIX):
        raise ConfigError(f"engine={config.engine[:80]!r} is not valid; use --engine evalrun, --engine transformers "
                          "or --engine openai:http://HOST:PORT/v1")
    _check_engine_modes(config)
    if config.tensor_parallel != 1 and config.engine != "evalrun":
        raise ConfigError(f"tensor_parallel={config.tensor_parallel} splits evalrun's own engine only; use --engine "
                          "evalrun, or --tensor-parallel 1")
    if config.tensor_parallel != 1:
        from .distributed import check_world

        check_world(config.tensor_parallel)  # N ranks launched by torchrun, or one line naming the command
    _check_decode_levers(config)
    if config.dtype == "float16" and not config.on_gpu:
        raise ConfigError("dtype float16 is not supported on CPU here; use float32 or bfloat16")
