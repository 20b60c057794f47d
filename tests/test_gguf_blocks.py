"""linear_kernel=gguf-gemv (engine/gguf_blocks.py): decode projections that read a GGUF model's stored blocks.

The weights it rebuilds must be bit for bit the loaded model's (never another model), its products the same
within float32 rounding, its tokens the same on the real SmolLM2, and every place it cannot run refused."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_line_exit_2

from evalrun.engine import gguf_blocks
from evalrun.engine.gguf_blocks import Blocks, BlockWeight
from evalrun.errors import ConfigError
from evalrun.models import smollm2_gguf_path


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> Blocks:
    generator = torch.Generator().manual_seed(seed)
    blocks = cols // gguf_blocks.BLOCK
    d = (torch.rand(rows, blocks, generator=generator) * 0.02 + 1e-4).half()
    if fmt == "Q8_0":
        return Blocks(fmt, torch.randint(-128, 128, (rows, blocks, 32), generator=generator, dtype=torch.int8), d)
    qs = torch.randint(0, 256, (rows, blocks, 16), generator=generator, dtype=torch.uint8)
    m = (-torch.rand(rows, blocks, generator=generator) * 0.1).half() if fmt == "Q4_1" else None
    return Blocks(fmt, qs, d, m)


def test_the_blocks_dequantize_to_ggufs_own_values_bit_for_bit():
    """Every block tensor of the shipped SmolLM2 file, read by read_blocks and rebuilt with the kernel's
    formulas, equals gguf's numpy dequantization (what transformers loads) exactly. The reader attach opens
    (over a plain array) reads every field and tensor as gguf's own reader does."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader, stock = gguf_blocks.open_gguf(smollm2_gguf_path()), GGUFReader(smollm2_gguf_path())
    assert type(reader.data) is np.ndarray and type(stock.data) is np.memmap
    assert [(f.name, f.types, f.contents()) for f in reader.fields.values()] == [
        (f.name, f.types, f.contents()) for f in stock.fields.values()] and len(reader.fields) > 30
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in reader.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in stock.tensors]
    found = gguf_blocks.read_blocks(reader)
    tensors = {t.name: t for t in stock.tensors}
    assert {b.format for b in found.values()} == {"Q4_1", "Q8_0"} and len(found) == 30 * 7 + 1
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "blk.7.attn_v.weight"):
        tensor = tensors[name]
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(found[name].shape)
        assert np.array_equal(gguf_blocks.dequantize(found[name]).numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_the_kernel_computes_the_product_of_the_rebuilt_weight_within_float32_rounding(fmt, rows):
    blocks = random_blocks(fmt, 96, 128)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ gguf_blocks.dequantize(blocks).double().T  # [rows, 96]
    got = gguf_blocks.gemv(x, blocks)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(gguf_blocks.gemv(x, blocks), got)  # repeatable


def test_the_kernels_bits_do_not_depend_on_the_thread_count():
    blocks, x = random_blocks("Q4_1", 256, 576), torch.randn(1, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_blocks.gemv(x, blocks)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(gguf_blocks.gemv(x, blocks), one)
    finally:
        torch.set_num_threads(threads)


def lane_order_reference(x: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """x [R, K] @ the blocks' weight [N, K]^T in the order engine/gguf_gemv.cpp's header fixes, by torch's elementwise
    float32 operations (each rounded on its own, on every instruction set) -> [R, N]."""
    low, high = (gguf_blocks.q4_values(blocks.qs, blocks.d, blocks.m) if blocks.format != "Q8_0" else
                 torch.split(gguf_blocks.q8_values(blocks.qs, blocks.d), 16, dim=-1))  # [N, B, 16] each
    lanes = torch.zeros(x.shape[0], blocks.shape[0], 16 if blocks.format != "Q8_0" else 32)  # [R, N, lanes]
    for b in range(blocks.shape[1] // gguf_blocks.BLOCK):
        x_low, x_high = x[:, None, 32 * b:32 * b + 16], x[:, None, 32 * b + 16:32 * b + 32]  # [R, 1, 16]
        if blocks.format == "Q8_0":
            lanes = lanes + torch.cat([low[None, :, b] * x_low, high[None, :, b] * x_high], dim=-1)
        else:
            lanes = lanes + (low[None, :, b] * x_low + high[None, :, b] * x_high)
    if blocks.format == "Q8_0":
        lanes = lanes[..., :16] + lanes[..., 16:]
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_the_kernel_sums_in_its_documented_order_on_every_instruction_set_this_machine_has(fmt, rows):
    """The native kernel's bits are its header's order of sums: the same from its portable, AVX2 and AVX-512 builds
    (each built where this machine runs it), and the bits of Inductor's loop over gguf_blocks' torch formulas under
    AVX-512 (what gguf-gemv computed before the native kernel: goldens made with it stay identical there)."""
    blocks = random_blocks(fmt, 80, 320, seed=rows)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(5))
    expected = lane_order_reference(x, blocks)
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    isas = ["DEFAULT"] + [isa for isa, flag in (("AVX2", " avx2 "), ("AVX512", " avx512bw ")) if flag in flags + " "]
    for isa in isas:
        assert torch.equal(gguf_blocks.native_gemv(x, blocks, isa), expected), isa
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        from torch.fx.experimental.proxy_tensor import make_fx

        args = (x, blocks.qs, blocks.d) + (() if blocks.m is None else (blocks.m,))
        out = torch._inductor.compile(make_fx(gguf_blocks._KERNELS[fmt])(*args), list(args))(*args)
        assert torch.equal(out[0] if isinstance(out, (tuple, list)) else out, expected)


def test_the_kernel_is_built_once_per_cache_and_its_build_counts_as_compile_time(tmp_path, monkeypatch):
    from evalrun.engine import native_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a run's: evalrun's compile cache (compile_cache)
    monkeypatch.setattr(native_build, "_LOADED", {})
    from evalrun.engine.modes import dynamo_snapshot

    before, run_before = native_build.build_seconds(), dynamo_snapshot()["compile_s"]
    blocks, x = random_blocks("Q4_0", 8, 64), torch.randn(2, 64)
    first = gguf_blocks.gemv(x, blocks)
    built = list(tmp_path.rglob("gguf_gemv-*.so"))
    assert len(built) == 1 and native_build.build_seconds() > before
    spent = native_build.build_seconds() - before
    assert dynamo_snapshot()["compile_s"] - run_before == pytest.approx(spent)  # a run's compile_s counts it
    assert built[0].parent == tmp_path / "evalrun-native" and not list(tmp_path.rglob("*.partial"))
    monkeypatch.setattr(native_build, "_LOADED", {})  # as a later process: loads the built library
    spent = native_build.build_seconds()
    assert torch.equal(gguf_blocks.gemv(x, blocks), first) and native_build.build_seconds() == spent


@pytest.mark.parametrize("damage", ["truncated", "one byte changed", "digest missing", "digest not text"])
def test_a_library_damaged_after_its_build_is_built_again_not_loaded(tmp_path, monkeypatch, damage):
    """A cache copied in part, or a disk error: a truncated library crashed the next process in dlopen (a bus error),
    one changed byte would have run other code. Its bytes no longer hash to the digest its build wrote beside it, so
    that process builds it again (as it does a library built before digests were written) and loads the new one."""
    from evalrun.engine import native_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int tiny() { return 7; }\n')
    built = native_build._built(source, "DEFAULT")  # built, not loaded: a later process loads it
    whole = built.read_bytes()
    if damage == "truncated":
        built.write_bytes(whole[: len(whole) // 2])
    elif damage == "one byte changed":
        built.write_bytes(whole[:4096] + bytes([whole[4096] ^ 1]) + whole[4097:])
    elif damage == "digest missing":
        built.with_name(built.name + ".sha256").unlink()
    else:  # a disk error in the digest: bytes that are not UTF-8 (read as text, they stopped the run)
        built.with_name(built.name + ".sha256").write_bytes(bytes(range(128, 256)))
    spent = native_build.build_seconds()
    assert native_build._built(source, "DEFAULT") == built and native_build.build_seconds() > spent
    assert native_build._intact(built) and ctypes.CDLL(str(built)).tiny() == 7
    spent = native_build.build_seconds()
    assert native_build._built(source, "DEFAULT") == built and native_build.build_seconds() == spent  # intact now
    assert sorted(path.name for path in built.parent.iterdir()) == [built.name, built.name + ".sha256"]


def test_a_cache_folder_that_cannot_take_the_library_is_one_line_naming_what_it_found_there(tmp_path, monkeypatch):
    """A digest that cannot be written (no room left for it after the library; here a folder in its place) was
    taken for a compiler without OpenMP: the library was built again without it, slower, in every process. A
    read-only cache holding a damaged library named a .partial file that never existed. Both are one line naming
    the folder and the variable now."""
    import os
    import subprocess
    import types

    from evalrun.engine import native_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int tiny() { return 7; }\n')
    built = native_build._built(source, "DEFAULT")
    built.with_name(built.name + ".sha256").unlink()
    built.with_name(built.name + ".sha256").mkdir()
    builds = []
    monkeypatch.setattr(native_build, "_build", lambda *args, build=native_build._build: builds.append(1) or
                        build(*args))
    with pytest.raises(ConfigError, match=r"tiny.cpp cannot be built into .*cache/evalrun-native \(Is a directory\): "
                       r"the tiny-default-\w+.so there does not match its digest .* point TORCHINDUCTOR_CACHE_DIR"):
        native_build._built(source, "DEFAULT")
    assert builds == [1] and sorted(p.name for p in built.parent.iterdir()) == [built.name, built.name + ".sha256"]
    built.with_name(built.name + ".sha256").rmdir()
    built.write_bytes(built.read_bytes()[:100])  # damaged, in a folder that cannot be written
    read_only = types.SimpleNamespace(SubprocessError=subprocess.SubprocessError, run=lambda command, **_:
                                      subprocess.CompletedProcess(command, 1, "", "ld: Read-only file system"))
    monkeypatch.setattr(native_build, "subprocess", read_only)  # the same compiler: the same library's name
    monkeypatch.setattr(native_build.os, "access", lambda path, mode, access=os.access: mode != os.W_OK and
                        access(path, mode))
    with pytest.raises(ConfigError, match=r"cannot be built into .*evalrun-native \(not writable\): the tiny-default-"
                       r"\w+.so there does not match its digest \(damaged, or built by an older evalrun\); point "
                       r"TORCHINDUCTOR_CACHE_DIR \(or EVALRUN_CACHE\) at a writable folder"):
        native_build._built(source, "DEFAULT")


def test_the_built_library_is_keyed_by_the_source_and_the_compilers_version(tmp_path, monkeypatch):
    """A cache folder the user chose is shared by every engine version and compiler: an edited source, or a compiler
    upgraded under the same name, builds a library of its own instead of loading the old one's bits."""
    from evalrun.engine import native_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int tiny() { return 1; }\n')
    first = native_build._built(source, "DEFAULT")
    assert native_build._built(source, "DEFAULT") == first  # built once
    source.write_text('extern "C" int tiny() { return 2; }\n')
    edited = native_build._built(source, "DEFAULT")
    monkeypatch.setattr(native_build, "compiler_version", lambda: "g++ (Debian 99.1.0-1) 99.1.0")
    upgraded = native_build._built(source, "DEFAULT")
    assert len({first, edited, upgraded}) == 3 and ctypes.CDLL(str(edited)).tiny() == 2


def test_a_cache_folder_the_kernel_cannot_be_written_into_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    from evalrun.engine import native_build

    (tmp_path / "evalrun-native").write_text("a file where the folder goes")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_LOADED", {})
    with pytest.raises(ConfigError, match="cannot be built into .*evalrun-native.*TORCHINDUCTOR_CACHE_DIR"):
        gguf_blocks.native_gemv(torch.randn(1, 64), random_blocks("Q8_0", 8, 64))


def test_a_cache_folder_that_cannot_be_searched_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    """A folder without search permission (another user's 0700 cache): looking for a library in it to name in the
    message raised PermissionError (pathlib's is_file ignores only a missing path), a traceback, not the one line."""
    import os

    from evalrun.engine import native_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int tiny() { return 7; }\n')

    def denied(real):  # what EACCES on the folder gives any process but root's
        def call(path, *args, **kwargs):
            if "evalrun-native" in os.fspath(path):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "mkdir", denied(os.mkdir))
    monkeypatch.setattr(os, "stat", denied(os.stat))
    with pytest.raises(ConfigError, match=r"tiny.cpp cannot be built into .*evalrun-native \(Permission denied\): "
                       r"point TORCHINDUCTOR_CACHE_DIR"):
        native_build._built(source, "DEFAULT")


def test_a_compiler_without_openmp_builds_the_kernel_without_it_with_the_same_bits(tmp_path, monkeypatch):
    """Apple's clang refuses -fopenmp: the kernel is built without it (each output is one thread's either way)."""
    import os
    import stat

    from evalrun.engine import native_build

    compiler = tmp_path / "no-openmp-c++"
    compiler.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "no -fopenmp here" >&2; exit 1; }; '
                        'done\nexec g++ "$@"\n')
    compiler.chmod(compiler.stat().st_mode | stat.S_IXUSR)
    blocks, x = random_blocks("Q4_1", 40, 128), torch.randn(3, 128)
    expected = lane_order_reference(x, blocks)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(native_build, "_LOADED", {})
    assert torch.equal(gguf_blocks.native_gemv(x, blocks), expected)
    assert len(list((tmp_path / "cache").rglob("gguf_gemv-*.so"))) == 1 and os.environ["CXX"] == str(compiler)


def test_a_kernel_that_cannot_be_built_is_one_line_naming_the_aten_kernel(tmp_path, monkeypatch):
    from evalrun.engine import native_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native_build, "_LOADED", {})
    with pytest.raises(ConfigError, match="could not be built with .*no-such-compiler.*use linear_kernel=aten"):
        gguf_blocks.native_gemv(torch.randn(1, 64), random_blocks("Q8_0", 8, 64))
    assert not list(tmp_path.rglob("*.partial")) and not list(tmp_path.rglob("*.so"))


def test_a_q_or_k_weight_gets_transformers_row_order():
    """transformers un-permutes llama.cpp's interleaved rotary halves: rows (h, i, 2) -> (h, 2, i)."""
    order = gguf_blocks._unpermute_rows(8, 2)
    assert order.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.slow
def test_attach_reads_every_projection_of_smollm2_and_refuses_a_weight_one_ulp_off():
    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    loaded = load_model("smollm2-135m", "cpu", "float32")
    transformer = Transformer(loaded.model, linear_kernel="gguf-gemv")
    attached = gguf_blocks.attach(transformer, loaded.gguf_path)
    weights = [w for layer in attached.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(w, BlockWeight) for w in weights) and isinstance(attached.lm_head, BlockWeight)
    assert {w.blocks.format for w in weights} == {"Q4_1"} and attached.lm_head.blocks.format == "Q8_0"
    x = torch.randn(1, 576)
    torch.testing.assert_close(gguf_blocks.gemv(x, attached.layers[3].qkv.blocks), x @ transformer.layers[3].qkv.T,
                               rtol=1e-5, atol=1e-5)
    weight = loaded.model.model.layers[5].mlp.up_proj.weight
    weight.data[7, 3] = torch.nextafter(weight.data[7, 3], torch.tensor(1.0))
    with pytest.raises(ConfigError, match="layer 5 gate_up is not exactly the weight"):
        gguf_blocks.attach(Transformer(loaded.model, linear_kernel="gguf-gemv"), loaded.gguf_path)


def test_a_projection_without_blocks_is_refused_not_computed_by_aten():
    from evalrun.engine.linear import linear

    with pytest.raises(ConfigError, match="needs the projections of a GGUF model"):
        linear(torch.randn(1, 64), torch.randn(32, 64), None, "gguf-gemv")
    weight = BlockWeight(gguf_blocks.dequantize(random_blocks("Q8_0", 32, 64)), random_blocks("Q8_0", 32, 64))
    prefill = torch.randn(1, 9, 64)  # more rows than a decode step: the dense tensor
    assert torch.equal(linear(prefill, weight, None, "gguf-gemv"), torch.nn.functional.linear(prefill, weight.dense))


@pytest.mark.slow
@pytest.mark.parametrize("level", ["0", "2"])
def test_smollm2_with_the_blocks_gives_the_same_tokens_under_another_hash(cli, store_path, write_prompts, level):
    # the smoke set's first prompt: -O2 compiles SmolLM2's pieces for one prefill shape per config, not three
    prompts = write_prompts([{"id": "capital", "prompt": "The capital of France is"}])
    common = ["run", "-O" + level, "--prompts", str(prompts), "--max-new-tokens", "8", "--store", str(store_path),
              "--json", "--quiet"]
    aten = json.loads(cli(*common)[1])
    code, out, err = cli(*common, "--set", "linear_kernel=gguf-gemv")
    assert code == 0, err
    blocks = json.loads(out)
    assert blocks["config"]["linear_kernel"] == "gguf-gemv" and blocks["config_hash"] != aten["config_hash"]
    assert blocks["logits_digest"] != aten["logits_digest"]
    assert [r["tokens"] for r in blocks["results"]] == [r["tokens"] for r in aten["results"]]


@pytest.mark.slow
def test_a_file_whose_blocks_the_kernel_cannot_read_is_refused_before_anything_is_stored(cli, store_path,
                                                                                        monkeypatch):
    import sqlite3

    monkeypatch.delitem(gguf_blocks.LAYOUTS, "Q8_0")  # as if the head were stored in a format it does not read
    one_line_exit_2(cli("run", "--prompts", "smoke", "--max-new-tokens", "2", "--store", str(store_path), "--set",
                        "linear_kernel=gguf-gemv"), "stores token_embd.weight in a format this kernel does not read")
    if store_path.exists():
        with sqlite3.connect(store_path) as db:
            assert db.execute("select count(*) from runs").fetchone() == (0,)


@pytest.mark.parametrize("args, message", [
    (["--model", "random:tiny"], "reads the weights of a GGUF file; model 'random:tiny' is not one"),
    (["--dtype", "bfloat16"], "rebuilds a GGUF model's float32 weights exactly; use --dtype float32"),
    (["--batch-size", "8"], "at batch_size 8 it would compute none: use --batch-size 4 or less"),
    (["--engine", "transformers"], "replaces evalrun's own projections; use --engine evalrun"),
    (["-O1", "--set", "batch_buckets=8"], "batch_buckets pad batch_size 1 to 8 rows, where it would compute none"),
])
def test_the_blocks_where_they_cannot_run_are_one_line_and_exit_2(cli, store_path, args, message):
    one_line_exit_2(cli("run", "--device", "cpu", "--prompts", "smoke", "--store", str(store_path), *args,
                        "--set", "linear_kernel=gguf-gemv"), message)


def test_the_built_library_is_readable_as_any_build_output_is(tmp_path, monkeypatch):
    """A cache shared by a group, or restored by another user, loads it: the mode the umask gives (mkstemp's 0600
    became 0711 after linking: nobody else could dlopen it)."""
    import os
    import stat

    from evalrun.engine import native_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_LOADED", {})
    previous = os.umask(0o022)
    try:
        gguf_blocks.native_gemv(torch.randn(1, 64), random_blocks("Q8_0", 8, 64))
    finally:
        os.umask(previous)
    [built] = tmp_path.rglob("gguf_gemv-*.so")
    assert stat.S_IMODE(built.stat().st_mode) == 0o755


@pytest.mark.parametrize("x", [torch.randn(1, 96), torch.randn(1, 32), torch.randn(1, 64, dtype=torch.float64),
                               torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(64)],
                         ids=["longer", "shorter", "float64", "bfloat16", "1-D"])
def test_operands_the_kernel_cannot_read_are_refused_not_read_as_raw_bytes(x):
    """The C code takes x's K as the blocks' row length and reads float32: another K read past the blocks (or
    skipped some), another dtype gave numbers of 1e36, with no error."""
    with pytest.raises(ValueError, match="gguf_gemv multiplies float32 CPU x"):
        gguf_blocks.gemv(x, random_blocks("Q8_0", 4, 64))
    q4_1, q8 = random_blocks("Q4_1", 4, 64), random_blocks("Q8_0", 4, 64)
    for fmt, qs, d, m in [("Q4_1", q4_1.qs, q4_1.d, None),  # Q4_1 without m: read as Q4_0
                          ("Q4_0", q4_1.qs, q4_1.d, q4_1.m),  # Q4_0 with m: read as Q4_1
                          ("Q8_0", q8.qs.to(torch.int16), q8.d, None), ("Q8_0", q8.qs, q8.d.float(), None)]:
        with pytest.raises(ValueError, match="blocks are CPU qs, d, m of"):
            gguf_blocks.gemv(torch.randn(1, 64), Blocks(fmt, qs, d, m))
