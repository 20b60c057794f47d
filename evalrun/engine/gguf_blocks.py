"""Decode projections that read a GGUF model's weights in their stored blocks (`linear_kernel=gguf-gemv`, issue #16).

A GGUF model is stored quantized (SmolLM2-135M: Q4_1 projections, a Q8_0 embedding and head) and loads as
float32 weights dequantized from those blocks. At batch 1 on a CPU a decode step is bound by reading the
weights: 540 MB of float32 against 96 MB of blocks. This kernel reads the blocks, rebuilds each weight in
registers with gguf's own float32 formula (Q8_0 q*d, Q4_0 d*(q-8), Q4_1 d*q+m: every product exact, so the
weights are bit for bit the loaded ones) and multiplies in float32. Only the order of the sums differs from
`F.linear`: other bits, so a knob in the config hash, never on by default.

`attach` maps the file's tensors onto evalrun's stacked projections (q/k rows un-permuted as transformers
does for Llama, q/k/v and gate/up stacked) and checks that the blocks give exactly the model's weights;
any projection that does not is refused (ConfigError, exit 2), never computed from other weights. The
formulas are pure torch functions per format, traced into the compiled pieces of -O1 and up; eagerly (-O0)
engine/gguf_gemv.cpp computes them, with the same bits as Inductor's AVX-512 loop over these functions (which
ran here before) on every instruction set, at 1.9x its speed on AVX-512 and 4.4x under
ATEN_CPU_CAPABILITY=avx2 on that machine
(benchmarks/gguf_gemv_speed.py). A prefill of more than GEMV_MAX_ROWS tokens, like every other projection of a
model, stays on `F.linear`.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from . import native_build

BLOCK = 32  # elements per block in Q4_0, Q4_1 and Q8_0
# format -> (bytes per block, [(field, byte offset, numpy dtype, count)]): gguf's block layouts
LAYOUTS = {
    "Q8_0": (34, (("d", 0, np.float16, 1), ("qs", 2, np.int8, 32))),
    "Q4_0": (18, (("d", 0, np.float16, 1), ("qs", 2, np.uint8, 16))),
    "Q4_1": (20, (("d", 0, np.float16, 1), ("m", 2, np.float16, 1), ("qs", 4, np.uint8, 16))),
}
# evalrun's stacked projection -> the file's tensors stacked in its rows (Llama's names in gguf)
STACKS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
          "down": ("ffn_down",)}


@dataclass(frozen=True)
class Blocks:
    """A weight [N, K] as gguf blocks: qs [N, K/32, 32] int8 (Q8_0) or [N, K/32, 16] uint8 nibbles (Q4_x, the low
    nibble of byte j is element j, the high one element j+16); d, m [N, K/32] float16 (m: Q4_1 only)."""

    format: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    def __post_init__(self):  # what engine/gguf_gemv.cpp reads them as (raw pointers): anything else is garbage
        wanted = (torch.int8 if self.format == "Q8_0" else torch.uint8, torch.float16,
                  torch.float16 if self.format == "Q4_1" else None)
        got = (self.qs.dtype, self.d.dtype, None if self.m is None else self.m.dtype)
        if self.format not in LAYOUTS or got != wanted or any(
                t is not None and t.device.type != "cpu" for t in (self.qs, self.d, self.m)):
            raise ValueError(f"{self.format} blocks are CPU qs, d, m of {wanted}, not {got}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * BLOCK

    def rows(self, index: torch.Tensor) -> "Blocks":
        return Blocks(self.format, self.qs[index], self.d[index], None if self.m is None else self.m[index])


@dataclass(frozen=True)
class BlockWeight:
    """A projection's weight both ways: `dense` [N, K] (the model's own tensor, for prefill) and its `blocks`."""

    dense: torch.Tensor
    blocks: Blocks

    @property
    def shape(self) -> torch.Size:
        return self.dense.shape


def stack(parts: list[Blocks]) -> Blocks:
    first = parts[0]
    if any(p.format != first.format or p.shape[1] != first.shape[1] for p in parts):
        raise ConfigError("linear_kernel=gguf-gemv: a stacked projection mixes GGUF formats "
                          f"({', '.join(p.format for p in parts)}); use linear_kernel=aten")
    m = None if first.m is None else torch.cat([p.m for p in parts])
    return Blocks(first.format, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)


def read_blocks(reader) -> dict[str, Blocks]:
    """The tensors of a gguf.GGUFReader in a format of LAYOUTS, by gguf name, copied out of the memory map."""
    found = {}
    for tensor in reader.tensors:
        fmt = tensor.tensor_type.name
        if fmt not in LAYOUTS:
            continue
        size, fields = LAYOUTS[fmt]
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1  # gguf lists the shape innermost first
        raw = np.ascontiguousarray(tensor.data).reshape(rows, -1, size)  # [N, K/32, bytes]
        parts = {}
        for field, offset, dtype, count in fields:
            width = np.dtype(dtype).itemsize * count
            values = np.ascontiguousarray(raw[:, :, offset:offset + width]).view(dtype)  # [N, K/32, count]
            parts[field] = torch.from_numpy(values[:, :, 0] if count == 1 else values)
        found[tensor.name] = Blocks(fmt, parts["qs"], parts["d"], parts.get("m"))
    return found


def q8_values(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0: qs [N, B, 32] int8, d [N, B] float16 -> the weights [N, B, 32] float32, q * d (gguf.quants)."""
    return qs.to(torch.float32) * d.to(torch.float32)[:, :, None]


def q4_values(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (m None) and Q4_1: qs [N, B, 16] uint8 nibbles, d, m [N, B] float16 -> the weights of elements 0-15
    and 16-31 of each block, [N, B, 16] float32 each: d * (q - 8), or d * q + m (gguf.quants). Kept as two
    halves: the kernel that multiplies them without joining them runs 2.5x faster (Inductor's C++ loop)."""
    scale = d.to(torch.float32)[:, :, None]
    if m is None:
        return tuple(scale * (q.to(torch.float32) - 8) for q in (qs & 15, qs >> 4))
    offset = m.to(torch.float32)[:, :, None]
    return tuple(scale * q.to(torch.float32) + offset for q in (qs & 15, qs >> 4))


def dequantize(blocks: Blocks) -> torch.Tensor:
    """[N, K] float32: the values a loaded model's weight holds, by the formulas the kernels use."""
    if blocks.format == "Q8_0":
        return q8_values(blocks.qs, blocks.d).reshape(blocks.shape)
    return torch.cat(q4_values(blocks.qs, blocks.d, blocks.m), dim=-1).reshape(blocks.shape)


def gemv_q8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [R, K] float32 @ the Q8_0 weight [N, K]^T -> [R, N]."""
    return (q8_values(qs, d) * x.view(x.shape[0], 1, -1, BLOCK)).sum(dim=(-1, -2))


def gemv_q4(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] float32 @ the Q4_0 or Q4_1 weight [N, K]^T -> [R, N]."""
    low, high = q4_values(qs, d, m)  # [N, B, 16] each
    halves = x.view(x.shape[0], 1, -1, 2, BLOCK // 2)  # [R, 1, B, 2, 16]
    return (low * halves[:, :, :, 0] + high * halves[:, :, :, 1]).sum(dim=(-1, -2))


def gemv_q4_0(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """gemv_q4 without m: what make_fx traces takes tensors only, all of them."""
    return gemv_q4(x, qs, d)


_KERNELS = {"Q8_0": gemv_q8, "Q4_0": gemv_q4_0, "Q4_1": gemv_q4}
_NATIVE = "gguf_gemv.cpp"  # the eager kernel: the same bits as Inductor's loop over these formulas with AVX-512


def gemv(x: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """x [R, K] float32 (1 <= R <= 4, contiguous) @ the blocks' weight [N, K]^T -> [R, N]. Inside a compiled piece
    (-O1 and up) the torch formulas above are traced into the piece; eagerly, engine/gguf_gemv.cpp computes it
    (built once per cache folder: native_build), whose order of sums is fixed on every instruction set: the bits
    Inductor's AVX-512 loop gives for those formulas, on AVX2 and portable builds too, at 1.9x its speed on AVX-512
    (one SmolLM2 decode step's projections: benchmarks/gguf_gemv_speed.py)."""
    if torch.compiler.is_compiling():
        return _KERNELS[blocks.format](x, blocks.qs, blocks.d, *(() if blocks.m is None else (blocks.m,)))
    return native_gemv(x, blocks)


def native_gemv(x: torch.Tensor, blocks: Blocks, isa: str | None = None) -> torch.Tensor:
    """gemv by engine/gguf_gemv.cpp built for `isa` (ATen's capability name; default: the one ATen runs with)."""
    if not all(t is None or t.is_contiguous() for t in (x, blocks.qs, blocks.d, blocks.m)):
        raise ValueError("gguf_gemv reads contiguous tensors")
    # The C code reads float32 with x's K as the blocks' row length: anything else is garbage or reads past them
    # (the blocks' own dtypes are checked once, by Blocks)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != blocks.shape[1] or x.device.type != "cpu":
        raise ValueError(f"gguf_gemv multiplies float32 CPU x [R, {blocks.shape[1]}]; got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    library = native_build.load(_NATIVE, isa, _declare)
    rows, cols = x.shape
    out = torch.empty(rows, blocks.shape[0], dtype=torch.float32)  # [R, N]
    pointers = (x.data_ptr(), blocks.qs.data_ptr(), blocks.d.data_ptr())
    threads = torch.get_num_threads()
    if blocks.format == "Q8_0":
        failed = library.gguf_gemv_q8(*pointers, out.data_ptr(), rows, blocks.shape[0], cols, threads)
    else:
        m = None if blocks.m is None else blocks.m.data_ptr()
        failed = library.gguf_gemv_q4(*pointers, m, out.data_ptr(), rows, blocks.shape[0], cols, threads)
    if failed:
        raise ValueError(f"gguf_gemv computes 1-4 rows, not {rows}")
    return out


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.gguf_gemv_q4.argtypes = [pointer] * 5 + [size] * 3 + [ctypes.c_int]
    library.gguf_gemv_q8.argtypes = [pointer] * 4 + [size] * 3 + [ctypes.c_int]
    library.gguf_gemv_q4.restype = library.gguf_gemv_q8.restype = ctypes.c_int
    return library


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a Llama q or k weight read from GGUF (llama.cpp stores each head's
    rotary halves interleaved): index [rows] into the file's rows."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def open_gguf(path: Path):
    """A gguf.GGUFReader of the file at `path` that reads its header through a plain array: the reader slices its
    memory map once per value, and a slice of a np.memmap pays that subclass's bookkeeping. SmolLM2's header (a
    49,152-token vocabulary) took 2.8-3.3 s so and takes 0.85 s; the bytes are the same memory map's."""
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = np.asarray(mapped)  # a view of the same pages, as a base ndarray

    return PlainArrayReader(path)


def attach(transformer, path: Path):
    """A shallow copy of `transformer` whose projections and head are BlockWeights over the GGUF file at `path`.
    ConfigError (exit 2) unless every one of them is stored in a format of LAYOUTS and gives exactly the
    model's weight."""
    reader = open_gguf(path)
    architecture = reader.fields["general.architecture"]
    arch = bytes(architecture.parts[architecture.data[0]]).decode()
    if arch != "llama":
        raise ConfigError(f"linear_kernel=gguf-gemv reads Llama-architecture GGUF files; {path.name} is {arch!r}: "
                          "use linear_kernel=aten")
    found = read_blocks(reader)
    orders = {"attn_q": transformer.heads, "attn_k": transformer.kv_heads}

    def blocks_of(gguf_names: list[str]) -> Blocks:
        parts = []
        for name in gguf_names:
            if name not in found:
                raise ConfigError(f"linear_kernel=gguf-gemv: {path.name} stores {name} in a format this kernel does "
                                  f"not read (it reads {', '.join(LAYOUTS)}); use linear_kernel=aten")
            blocks = found[name]
            short = name.split(".")[-2]
            if short in orders:
                blocks = blocks.rows(_unpermute_rows(blocks.shape[0], orders[short]))
            parts.append(blocks)
        return stack(parts)

    def checked(label: str, dense: torch.Tensor, blocks: Blocks) -> BlockWeight:
        if (tuple(dense.shape) != blocks.shape or dense.dtype != torch.float32
                or not torch.equal(dequantize(blocks), dense.detach().cpu())):
            raise ConfigError(f"linear_kernel=gguf-gemv: the model's {label} is not exactly the weight {path.name} "
                              "stores (another file, or another conversion); use linear_kernel=aten")
        return BlockWeight(dense, blocks)

    layers = []
    for index, weights in enumerate(transformer.layers):
        if weights.moe is not None:
            raise ConfigError("linear_kernel=gguf-gemv computes dense layers only; use linear_kernel=aten")
        fields = {field: checked(f"layer {index} {field}", getattr(weights, field),
                                 blocks_of([f"blk.{index}.{name}.weight" for name in names]))
                  for field, names in STACKS.items()}
        layers.append(dataclasses.replace(weights, **fields))
    stored = {tensor.name for tensor in reader.tensors}  # an untied head in a format not read is refused as such
    head_name = "output.weight" if "output.weight" in stored else "token_embd.weight"
    chosen = copy.copy(transformer)
    chosen.layers = layers
    chosen.lm_head = checked("head", transformer.lm_head, blocks_of([head_name]))
    return chosen
