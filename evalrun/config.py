"""Run configuration: fields, presets, aliases, validation and resolution.

Resolution order (later wins): preset -> TOML file -> command-line flags -> `--set KEY=VALUE`
-> opt-level defaults for fields still unset -> device defaults. The result, `EffectiveConfig`,
is what fingerprints hash; never the raw flags.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"

COMPILATION_MODES = ("none", "stock", "trace-once", "piecewise")
CUDAGRAPH_MODES = ("none", "piecewise", "full", "full-decode-only", "full-and-piecewise")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
KEEP_LOGITS_PATTERN = re.compile(r"none|all|([^,@\s]+(@\d+(-\d+)?)?)(,[^,@\s]+(@\d+(-\d+)?)?)*")

COMPILATION_ALIASES = {
    "eager": "none",
    "NONE": "none",
    "STOCK_TORCH_COMPILE": "stock",
    "DYNAMO_TRACE_ONCE": "trace-once",
    "VLLM_COMPILE": "piecewise",
    "0": "none",
    "1": "stock",
    "2": "trace-once",
    "3": "piecewise",
}
CUDAGRAPH_ALIASES = {name.upper().replace("-", "_"): name for name in CUDAGRAPH_MODES}

# What each -O level fills in for fields the user left unset (vLLM's meaning of the levels).
OPT_LEVEL_DEFAULTS: dict[int, dict[str, Any]] = {
    0: {"compilation_mode": "none", "cudagraph_mode": "none"},
    1: {"compilation_mode": "piecewise", "cudagraph_mode": "piecewise"},
    2: {"compilation_mode": "piecewise", "cudagraph_mode": "full-and-piecewise"},
    3: {
        "compilation_mode": "piecewise",
        "cudagraph_mode": "full-and-piecewise",
        "max_autotune": True,
        "coordinate_descent_tuning": True,
    },
}
# Inductor's own defaults, used when neither the user nor the opt level set a knob.
INDUCTOR_DEFAULTS = {
    "max_autotune": False,
    "coordinate_descent_tuning": False,
    "epilogue_fusion": True,
    "emulate_precision_casts": False,
}


@dataclass
class RunConfig:
    """Every knob of a run. `None` means "not set": filled by opt level or device defaults."""

    model: str = "smollm2-135m"
    prompts: str = "default"
    opt_level: int | None = None
    compilation_mode: str | None = None
    cudagraph_mode: str | None = None
    dtype: str | None = None
    device: str = "auto"
    attn_implementation: str = "sdpa"
    batch_size: int = 1
    max_new_tokens: int = 32
    top_k: int = 8
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    deterministic: bool = False
    tf32: bool = False
    max_autotune: bool | None = None
    coordinate_descent_tuning: bool | None = None
    epilogue_fusion: bool | None = None
    emulate_precision_casts: bool | None = None
    prefill_buckets: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024, 2048])
    batch_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    strict_config: bool = False
    keep_logits: str = "none"


FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(RunConfig)}
FIELD_NAMES = tuple(FIELD_TYPES)


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
    if match:
        return int(match.group(1))
    raise ConfigError(f"opt level {value!r} is not valid; use -O0, -O1, -O2 or -O3")


def _coerce(key: str, value: Any) -> Any:
    """Coerce a raw value (from TOML or --set text) to the type of field `key`."""
    kind = FIELD_TYPES[key]
    if value is None:
        return None
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
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not an integer") from None
    if kind.startswith("float"):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a number") from None
    if kind.startswith("list"):
        items = value if isinstance(value, list) else [v for v in str(value).strip("[]").split(",") if v.strip()]
        try:
            return [int(item) for item in items]
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a list of integers, e.g. 16,32,64") from None
    return str(value)


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
    if not path.exists():
        raise ConfigError(
            f"config {name_or_path!r} is neither a preset ({', '.join(preset_names())}) nor an existing TOML file"
        )
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid TOML ({error}); fix the file") from None
    data.pop("description", None)
    values = {}
    for key, value in data.items():
        key = key.replace("-", "_")
        validate_key(key)
        values[key] = _coerce(key, value)
    return values


def build_config(
    config_source: str | None = None, flags: dict[str, Any] | None = None, sets: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Merge base values, preset/file, explicit flags (None = not given) and --set items into a RunConfig.

    `base` is a requested config stored earlier (a golden's): the user's options go on top of it.
    """
    values: dict[str, Any] = {key: value for key, value in (base or {}).items() if key in FIELD_TYPES}
    if config_source:
        values.update(load_config_source(config_source))
    for key, value in (flags or {}).items():
        if value is not None:
            validate_key(key)
            values[key] = _coerce(key, value)
    for item in sets:
        key, value = parse_set_option(item)
        values[key] = value
    config = RunConfig(**values)
    return normalize(config)


def normalize(config: RunConfig) -> RunConfig:
    """Validate every field and map aliases to canonical names."""
    if config.opt_level is not None:
        config.opt_level = parse_opt_level(config.opt_level)
    if config.compilation_mode is not None:
        config.compilation_mode = _choice("compilation_mode", config.compilation_mode, COMPILATION_MODES, COMPILATION_ALIASES)
    if config.cudagraph_mode is not None:
        config.cudagraph_mode = _choice("cudagraph_mode", config.cudagraph_mode, CUDAGRAPH_MODES, CUDAGRAPH_ALIASES)
    if config.dtype is not None:
        config.dtype = _choice("dtype", config.dtype, DTYPES, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"})
    config.attn_implementation = _choice("attn_implementation", config.attn_implementation, ATTENTION_IMPLEMENTATIONS)
    if not KEEP_LOGITS_PATTERN.fullmatch(str(config.keep_logits)):
        raise ConfigError(f"keep_logits={config.keep_logits!r} is not valid; use none, all, or prompt ids with "
                          "optional steps, e.g. zh-deploy@0-15,code-fib")
    device = config.device
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ConfigError(f"device={device!r} is not valid; use auto, cpu, cuda or cuda:N")
    for key, low in (("batch_size", 1), ("max_new_tokens", 1), ("top_k", 2), ("warmup", 0)):
        if getattr(config, key) < low:
            raise ConfigError(f"{key}={getattr(config, key)} is too small; use a value >= {low}")
    if config.temperature < 0:
        raise ConfigError(f"temperature={config.temperature} is negative; use 0 (greedy) or a positive number")
    return config


def keep_logits_steps(keep_logits: str, prompt_id: str, steps: int) -> list[int]:
    """Which steps of prompt `prompt_id` keep full logits under `keep_logits` (see KEEP_LOGITS_PATTERN)."""
    if keep_logits == "all":
        return list(range(steps))
    if keep_logits == "none":
        return []
    for item in keep_logits.split(","):
        name, _, span = item.partition("@")
        if name != prompt_id:
            continue
        if not span:
            return list(range(steps))
        low, _, high = span.partition("-")
        return list(range(int(low), min(steps, int(high or low) + 1)))
    return []


def resolve(config: RunConfig, cuda_available: bool) -> dict[str, Any]:
    """The effective config: every field filled, as a plain dict (what fingerprints hash).

    Device `auto` becomes `cuda` when CUDA is there; opt level defaults to 2 on GPU, 0 on CPU;
    on CPU the opt level never fills a CUDA graph mode (there are none), an explicit one is kept
    so that the engine can refuse it with a clear message.
    """
    resolved = dataclasses.asdict(config)
    device = resolved["device"]
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    resolved["device"] = device
    on_gpu = device.startswith("cuda")
    if resolved["opt_level"] is None:
        resolved["opt_level"] = 2 if on_gpu else 0
    for key, value in OPT_LEVEL_DEFAULTS[resolved["opt_level"]].items():
        if resolved[key] is None:
            resolved[key] = value if (on_gpu or key != "cudagraph_mode") else "none"
    for key, value in INDUCTOR_DEFAULTS.items():
        if resolved[key] is None:
            resolved[key] = value
    if resolved["dtype"] is None:
        resolved["dtype"] = "bfloat16" if on_gpu else "float32"
    return resolved
