"""Property-based fuzzing of the CLI contract (hypothesis).

Every generated input -- prompt files, TOML configs, flag values, damaged stores, forged goldens --
goes through the real command line, in-process through `evalrun.cli.main(argv)` (the forged-golden
memory cases in a child `python -m evalrun`), and the outcome must keep the contract of
DESIGN.md "CLI contract" and errors.py:

  C1  the exit code is allowed: 0; 1 only for a verdict `changed` (or drift under --strict); 2 for bad input,
      incomparable, damaged files (`store check` finding problems among them). 3 (evalrun crashed, an
      internal error) is never acceptable: every exit 3 here is a bug.
  C2  on exit 2 (or 3), stderr is exactly one line and holds no "Traceback".
  C3  `--json` / `--format json` output, when printed, is strict JSON (no NaN / Infinity).
  C4  no command changes a golden file's bytes or leaves `-wal` / `-shm` files beside it.
  C5  memory stays bounded: a child process given a forged golden peaks below PEAK_RSS_BOUND
      (1 GiB resident; an untouched golden's `verify` peaks near 0.4 GiB), under an address-space
      limit of CHILD_ADDRESS_SPACE (3 GiB) so that a runaway cannot take the machine down; an
      "out of memory" exit under that limit means the bound was exceeded too.

Example counts: each test has a modest default so the file runs in well under two minutes on two
cores; CI's examples are derandomized (the same inputs every run) and not shrunk (a failure shows
the input as drawn; EVALRUN_FUZZ_SHRINK=1 shrinks it). `EVALRUN_FUZZ_EXAMPLES=N` (`make fuzz`: 500)
sets every in-process test's `max_examples` to N, with fresh random inputs shrunk on failure to a
minimal reproducer, and the hypothesis subprocess test's to N // 50. Drawn models and prompt sets
are never the expensive ones (no SmolLM2, no 8B, no `default` prompt set), and drawn configs that
would compile run `fingerprint` instead of `run`, so that no example starts Inductor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import json
import os
import random
import re
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from hypothesis import strategies as st

from evalrun.cli import main
from evalrun.config import FIELD_NAMES

FUZZ_EXAMPLES = int(os.environ.get("EVALRUN_FUZZ_EXAMPLES", "0") or 0)
SHRINK = os.environ.get("EVALRUN_FUZZ_SHRINK", "") not in ("", "0")
PEAK_RSS_BOUND = 1 << 30  # bytes resident, for any forged golden (an untouched one: ~0.4 GiB)
CHILD_ADDRESS_SPACE = 3 << 30  # RLIMIT_AS of the child processes
EXPENSIVE_VALUES = ("smollm2-135m", "random:smollm2", "random:llama3-8b", "default")  # never drawn in-process
TINY = ("--model", "random:tiny")


def fuzz_settings(default_examples: int, scale: int = 1):
    """Modest, derandomized defaults for CI (no shrinking: a failure reports the first failing input as drawn);
    EVALRUN_FUZZ_EXAMPLES for a fuzzing session (fresh inputs, failures shrunk to minimal reproducers)."""
    examples = max(default_examples, FUZZ_EXAMPLES // scale) if FUZZ_EXAMPLES else default_examples
    phases = tuple(Phase) if FUZZ_EXAMPLES or SHRINK else tuple(p for p in Phase if p is not Phase.shrink)
    return settings(max_examples=examples, deadline=None, derandomize=not FUZZ_EXAMPLES, database=None,
                    print_blob=True, phases=phases, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def offline_hub():
    """A drawn model reference like `a/b` must not wait on the network."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
    if old is None:
        os.environ.pop("HF_HUB_OFFLINE", None)
    else:
        os.environ["HF_HUB_OFFLINE"] = old


# ---------------------------------------------------------------- running the CLI and checking the contract

@dataclasses.dataclass
class Outcome:
    argv: list[str]
    code: int
    out: str
    err: str


def invoke(*args: str) -> Outcome:
    """`evalrun ARGS` in-process; stdout and stderr are strict UTF-8 streams, as a real terminal's are."""
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(err_bytes, encoding="utf-8", errors="backslashreplace", write_through=True)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        else:
            code = 0
    return Outcome(list(args), code, out_bytes.getvalue().decode("utf-8", "replace"),
                   err_bytes.getvalue().decode("utf-8", "replace"))


def crash_details(err: str) -> str:
    """The last frames of the traceback file an exit 3 names."""
    match = re.search(r"traceback in (\S+?);", err)
    if not match or not os.path.exists(match.group(1)):
        return ""
    lines = Path(match.group(1)).read_text().rstrip().splitlines()
    return "\n".join(lines[-12:])


def _reject_constant(name: str):
    raise ValueError(f"non-strict JSON constant {name}")


def check_contract(result: Outcome, allowed: tuple[int, ...] = (0, 2), json_out: bool = True,
                   changed: bool = False) -> Any:
    """C1-C3 for one command; returns the parsed JSON output (or None). `changed`: exit 1 is allowed
    when the JSON output says verdict `changed` (golden verify)."""
    where = f"evalrun {' '.join(repr(a) if ' ' in a or not a else a for a in result.argv)}"
    assert result.code != 3, f"C1 crash (exit 3) in {where}\nstderr: {result.err.strip()}\n{crash_details(result.err)}"
    if result.code in (2, 3):
        lines = result.err.splitlines()
        assert len(lines) == 1 and "Traceback" not in result.err, \
            f"C2 exit {result.code} with {len(lines)} stderr lines in {where}:\n{result.err[:2000]}"
    parsed = None
    if json_out and result.out.strip():
        try:
            parsed = json.loads(result.out, parse_constant=_reject_constant)
        except ValueError as error:
            raise AssertionError(f"C3 stdout is not strict JSON ({error}) in {where}:\n{result.out[:1000]}") from None
    allowed_codes = set(allowed) | ({1} if changed else set())
    assert result.code in allowed_codes, f"C1 exit {result.code} not in {sorted(allowed_codes)} in {where}\n" \
                                         f"stderr: {result.err[:500]}"
    if result.code == 1 and changed:
        assert isinstance(parsed, dict) and parsed.get("verdict") == "changed", \
            f"C1 exit 1 without a `changed` verdict in {where}:\n{result.out[:1000]}"
    return parsed


# ---------------------------------------------------------------- value strategies

HUGE_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**30, -10**30,
                             10**400])
INTS = st.one_of(st.integers(-3, 9000), st.integers(), HUGE_INTS)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1e308, -0.0, 1e-320]))
WEIRD_TEXT = st.sampled_from([
    "", " ", "\x00", "a\x00b", "\n", "line one\nline two", "\r\n", "\t", "\ud800", "\udfff", "\ufeff", "\u202e",
    "nan", "NaN", "inf", "-inf", "1e999", "0x10", "1_000", "٣", "²", "-1",
    "0", "00", "9" * 40, "true", "null", "[]", "{}", "../../etc", "/", ".", "..", "/dev/null", "~", "$HOME",
    "%s%n", "'", '"', "\\", "`", "😀" * 3, "é" * 50, "a" * 600, "capital", "zh-short", "chat-hello",
])
TEXT = st.one_of(st.text(max_size=12), WEIRD_TEXT)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)), max_leaves=10)


def deep_json(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


class Lazy:
    """A large generated value that prints as the expression that makes it (short failure reports)."""

    def __init__(self, expression: str, make):
        self.expression, self.make = expression, make

    def __repr__(self) -> str:
        return self.expression

    def __str__(self) -> str:
        return self.make()

    def __bytes__(self) -> bytes:
        return self.make().encode()


def concrete(value: Any) -> Any:
    return str(value) if isinstance(value, Lazy) else value


DEEP_JSON = st.builds(lambda depth, kind: Lazy(f"deep_json({depth}, {kind!r})", lambda: deep_json(depth, kind)),
                      st.sampled_from([2000, 100_000]), st.sampled_from(["list", "object"]))


def dumps(value: Any, ensure_ascii: bool = True) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, allow_nan=True)


# ---------------------------------------------------------------- 1. prompt files

MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}),
    st.fixed_dictionaries({"role": JSON_VALUES, "content": JSON_VALUES}),
    st.dictionaries(TEXT, JSON_VALUES, max_size=3), JSON_VALUES)
RECORD = st.one_of(
    st.fixed_dictionaries({"id": st.text(min_size=1, max_size=8), "prompt": TEXT}),
    st.fixed_dictionaries({"id": st.text(min_size=1, max_size=8), "messages": st.lists(MESSAGE, max_size=3)}),
    st.fixed_dictionaries({}, optional={
        "id": st.one_of(TEXT, JSON_VALUES), "prompt": st.one_of(TEXT, JSON_VALUES),
        "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON_VALUES),
        "max_new_tokens": st.one_of(st.integers(-2, 6), st.sampled_from([8192, 8193]), HUGE_INTS, JSON_VALUES),
        "extra": JSON_VALUES}),
)

VALID_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT})
VALID_RECORD = st.one_of(
    st.fixed_dictionaries({"prompt": TEXT.filter(bool)}, optional={"max_new_tokens": st.integers(1, 6)}),
    st.fixed_dictionaries({"messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3)},
                          optional={"max_new_tokens": st.integers(1, 6)}))


def valid_line(draw, index: int) -> bytes:
    """A record evalrun should accept (ids unique by line), so that generation runs on it."""
    record = draw(VALID_RECORD)
    record["id"] = f"{index}{draw(st.sampled_from(['', '-x', ' ', 'é', '@1', ',', chr(10), chr(0)]))}"
    return dumps(record).encode()


@st.composite
def chaotic_line(draw) -> bytes | Lazy:
    kind = draw(st.sampled_from(["record", "record", "record", "unicode", "json", "text", "bytes", "deep"]))
    if kind in ("record", "unicode"):  # unicode: lone surrogates are written as invalid UTF-8
        return dumps(draw(RECORD), ensure_ascii=kind == "record").encode("utf-8", "surrogatepass")
    if kind == "json":
        return dumps(draw(JSON_VALUES)).encode()
    if kind == "text":
        return draw(TEXT).encode("utf-8", "surrogatepass")
    if kind == "deep":
        return draw(DEEP_JSON)
    return draw(st.binary(max_size=30))


@dataclasses.dataclass
class PromptFile:
    lines: list[bytes | Lazy]
    separator: bytes
    end: bytes

    def __bytes__(self) -> bytes:
        return self.separator.join(bytes(line) for line in self.lines) + self.end


@st.composite
def prompt_files(draw) -> PromptFile:
    lines = [valid_line(draw, index) for index in range(draw(st.integers(1, 4)))]
    if draw(st.booleans()):  # one chaotic line, anywhere
        lines.insert(draw(st.integers(0, len(lines))), draw(chaotic_line()))
    return PromptFile(lines, draw(st.sampled_from([b"\n", b"\r\n", b"\n\n"])), draw(st.sampled_from([b"", b"\n"])))


@fuzz_settings(30)
@given(content=prompt_files(), tokens=st.integers(1, 4), batch=st.integers(1, 3))
def test_fuzz_prompt_files(content, tokens, batch):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "prompts.jsonl"
        path.write_bytes(bytes(content))
        check_contract(invoke("run", *TINY, "--prompts", str(path), "--max-new-tokens", str(tokens),
                              "--batch-size", str(batch), "--store", f"{folder}/s.db", "--quiet", "--json"))


# ---------------------------------------------------------------- 2. TOML config files

def toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a TOML basic string (lone surrogates: invalid TOML, refused)


def toml_value(value: Any) -> str:
    import datetime

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if value != value else ("inf" if value > 0 else "-inf") if value in (float("inf"), float("-inf")) \
            else repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    return "[" + ", ".join(toml_value(v) for v in value) + "]"


TOML_SCALARS = st.one_of(st.booleans(), INTS, FLOATS, TEXT, st.datetimes(), st.dates(), st.times())
TOML_VALUES = st.recursive(TOML_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=8)
CONFIG_KEYS = st.one_of(st.sampled_from(FIELD_NAMES), st.sampled_from([name.replace("_", "-") for name in FIELD_NAMES]),
                        st.sampled_from(["description", "", " model", "Model", "opt-level"]), st.text(max_size=8))
VALID_FIELD_VALUES = {
    "opt_level": [0, 1, 2, 3, "O2", "-O3"], "compilation_mode": ["none", "eager", "stock", "trace-once", "piecewise"],
    "cudagraph_mode": ["none", "full", "piecewise"], "dtype": ["float32", "bf16", "float64", "float16"],
    "device": ["cpu", "auto", "cuda", "cuda:0"], "attn_implementation": ["sdpa", "eager"],
    "batch_size": [1, 2, 4096, 4097], "max_new_tokens": [1, 3, 8192], "top_k": [2, 8, 320, 321, 1024],
    "temperature": [0.0, 0.7, 100.0], "seed": [0, 2**63 - 1, 2**63], "warmup": [0, 1, 100, 101],
    "deterministic": [True, False], "tf32": [True, "yes"], "prefill_buckets": [[1], [1 << 20], []],
    "batch_buckets": [[1, 2], list(range(1, 70))], "keep_logits": ["all", "capital@0-1", "capital@5-2,zh-short"],
}
FIELD_VALUE = {name: st.one_of(*[st.sampled_from(values)] * 3, TOML_VALUES)  # mostly valid values
               for name, values in VALID_FIELD_VALUES.items()}


def deep_toml(depth: int, kind: str) -> str:
    return "x = " + ("[" * depth + "]" * depth if kind == "array" else "{a=" * depth + "1" + "}" * depth)


@st.composite
def toml_documents(draw) -> bytes | Lazy:
    entries = []
    for name in draw(st.lists(st.sampled_from(sorted(VALID_FIELD_VALUES)), max_size=4, unique=True)):
        entries.append((name.replace("_", "-") if draw(st.integers(0, 5)) == 0 else name, draw(FIELD_VALUE[name])))
    if draw(st.integers(0, 4)) == 0:  # any key, any value
        entries.append((draw(CONFIG_KEYS), draw(TOML_VALUES)))
    lines = [f"{toml_string(key)} = {toml_value(value)}" for key, value in entries]
    if draw(st.integers(0, 4)) == 0:
        table = draw(st.sampled_from(["model", "fuzz", "opt_level", "a.b"]))
        lines += [f"[{table}]", f"{toml_string(draw(st.text(max_size=4)))} = {toml_value(draw(TOML_SCALARS))}"]
    text = "\n".join(lines) + "\n"
    corruption = draw(st.sampled_from(["none"] * 8 + ["truncate", "raw", "deep", "duplicate"]))
    if corruption == "truncate":
        text = text[:draw(st.integers(0, len(text)))]
    elif corruption == "raw":
        return draw(st.one_of(st.binary(max_size=60), TEXT.map(lambda t: t.encode("utf-8", "surrogatepass"))))
    elif corruption == "deep":
        depth, kind = draw(st.sampled_from([2000, 50_000])), draw(st.sampled_from(["array", "table"]))
        return Lazy(f"deep_toml({depth}, {kind!r})", lambda: deep_toml(depth, kind))
    elif corruption == "duplicate" and lines:
        text += lines[0] + "\n"
    return text.encode("utf-8", "surrogatepass")


@fuzz_settings(50)
@given(document=toml_documents(), command=st.sampled_from(["fingerprint", "run"]))
def test_fuzz_toml_config_files(document, command):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.toml"
        path.write_bytes(bytes(document))
        if command == "run":  # eager: a drawn compilation mode or -O level must not start minutes of Inductor
            args = ["run", "--config", str(path), *TINY, "--prompts", "smoke", "--max-new-tokens", "2",
                    "--compilation-mode", "none", "--store", f"{folder}/s.db", "--quiet", "--json"]
        else:
            args = ["fingerprint", "--config", str(path), *TINY, "--prompts", "smoke", "--json"]
        check_contract(invoke(*args))


# ---------------------------------------------------------------- 3. flag values

FLAG_TEXT = st.one_of(TEXT, st.integers(-5, 10).map(str), HUGE_INTS.map(str), st.floats().map(str))
FLAG_CHOICES = {
    "-O": ["0", "1", "2", "3", "O0", "-O1", "4", "o2"], "--batch-size": ["1", "2", "3", "4096", "4097", "0", "-1"],
    "--max-new-tokens": ["1", "2", "4", "0", "8192", "8193"],
    "--dtype": ["float32", "bf16", "float64", "float16", "int8"],
    "--device": ["cpu", "auto", "cuda", "cuda:0", "cuda:²", "cpu:0", "mps"],
    "--compilation-mode": ["none", "eager", "NONE", "0", "stock"], "--cudagraph-mode": ["none", "NONE", "full"],
    "--keep-logits": ["none", "all", "capital@0-1", "capital@1", "capital@9-3", "zh-short@99999999999999999999",
                      "a@1,b@2-3", "@", "capital@-1"],
}
SET_VALUES = {name: st.sampled_from(["random:tiny", "random:tiny2", "random:", "x.gguf", ".", "a/b"])
              if name == "model" else st.sampled_from(["smoke", "missing.jsonl", "."]) if name == "prompts" else FLAG_TEXT
              for name in FIELD_NAMES}
SET_VALUES.update({name: st.sampled_from([str(v).lower() if isinstance(v, bool) else
                                          ",".join(map(str, v)) if isinstance(v, list) else str(v) for v in values])
                   for name, values in VALID_FIELD_VALUES.items()})


@st.composite
def flag_sets(draw) -> list[str]:
    """Flags with values drawn mostly from what evalrun accepts; at most one item is wild (any text, any key)."""
    flags = draw(st.lists(st.sampled_from(sorted(FLAG_CHOICES)), max_size=4, unique=True))
    sets = draw(st.lists(st.sampled_from(FIELD_NAMES), max_size=3))
    wild = draw(st.integers(-1, len(flags) + len(sets) - 1))  # -1: none
    args = []
    for index, flag in enumerate(flags):
        args += [flag, draw(FLAG_TEXT if index == wild else st.sampled_from(FLAG_CHOICES[flag]))]
    for index, key in enumerate(sets, len(flags)):
        if index != wild:
            value = draw(SET_VALUES[key])
            args += ["--set", f"{key.replace('_', '-') if draw(st.integers(0, 5)) == 0 else key}={value}"]
            continue
        key = draw(st.one_of(st.just(key), st.text(max_size=6)))
        value = draw(FLAG_TEXT)
        args += ["--set", draw(st.sampled_from([f"{key}={value}", f" {key} = {value} ", key, f"{key}=", "=" + value]))]
    joined = " ".join(args)
    assume(not any(value in joined for value in EXPENSIVE_VALUES))
    return args


def resolves_eager(args: list[str]) -> bool:
    """Whether these flags resolve to eager execution on this machine (else only `fingerprint` runs them)."""
    from evalrun.cli import cli as group

    try:
        context = group.commands["run"].make_context("run", [*args, *TINY], resilient_parsing=False)
        from evalrun.cli import config_from
        from evalrun.config import resolve

        return resolve(config_from(dict(context.params)), False).compilation_mode.value == "none"
    except Exception:  # noqa: BLE001 - invalid flags: the command refuses them before anything compiles
        return True


@fuzz_settings(60)
@given(args=flag_sets(), command=st.sampled_from(["fingerprint", "run"]))
def test_fuzz_flag_values(args, command):
    with tempfile.TemporaryDirectory() as folder:
        if command == "run" and resolves_eager(args):
            argv = ["run", *TINY, "--prompts", "smoke", "--max-new-tokens", "2", *args, "--store", f"{folder}/s.db",
                    "--quiet", "--json"]
        else:
            argv = ["fingerprint", *TINY, "--prompts", "smoke", *args, "--json"]
        check_contract(invoke(*argv))


# ---------------------------------------------------------------- shared: SQL mutations of a store or golden file

INTERESTING_CELLS = st.sampled_from([
    "", "null", "[]", "{}", "[1e999]", "NaN", "Infinity", "-1", "[-1]", "[3, 1e6]", "[1099511627775]", "[2,2,2,2,2]",
    "[3]", "[0]", "[3, 0]", "[true]", "[\"3\"]", "[3.0]", "object", "float64", "<f4", ">i8", "int8", "V8", "U4", "O",
    "complex64", "zlib", "raw", "gzip", "complete", "running", "failed", "0" * 40, "ffffffffffff", "%", "_",
    "99999999999999999999999", '{"model": null}', '{"config": []}', "a\nb",
])
SQL_VALUES = st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.sampled_from([0, 1, -1, 2**63 - 1, -2**63]),
                       st.floats(allow_nan=False), TEXT, st.binary(max_size=40), INTERESTING_CELLS, DEEP_JSON,
                       JSON_VALUES.map(dumps))
ARRAY_DTYPES = ("bool", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")


def schema_of(path: Path) -> dict[str, dict[str, Any]]:
    """Tables of a base file: columns and rowids (drawn from when mutating copies)."""
    conn = sqlite3.connect(path)
    tables = {}
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"):
        columns = [row[1] for row in conn.execute(f'PRAGMA table_info("{name}")')]
        rowids = [row[0] for row in conn.execute(f'SELECT rowid FROM "{name}"')]
        tables[name] = {"columns": columns, "rowids": rowids}
    conn.close()
    return tables


def json_paths(value: Any, prefix: tuple = (), depth: int = 3) -> list[tuple]:
    paths = [prefix]
    if depth and isinstance(value, dict):
        for key, item in value.items():
            paths += json_paths(item, prefix + (key,), depth - 1)
    elif depth and isinstance(value, list):
        for index, item in enumerate(value[:4]):
            paths += json_paths(item, prefix + (index,), depth - 1)
    return paths


def set_path(root: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return root


def array_values(draw, dtype: str, count: int) -> np.ndarray:
    kind = draw(st.sampled_from(["zeros", "max", "min", "random", "nan", "inf", "minus-one", "big"]))
    if count > 1 << 20:
        count = 0
    if kind == "random":
        raw = random.Random(draw(st.integers(0, 2**32))).randbytes(count * np.dtype(dtype).itemsize)
        return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).copy()
    if dtype == "bool":
        return np.full(count, kind != "zeros", dtype=bool)
    info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else np.iinfo(dtype)
    big = info.max // 2 if np.dtype(dtype).kind != "f" else 1e30
    value = {"zeros": 0, "max": info.max, "min": info.min, "big": big,
             "minus-one": -1 if np.dtype(dtype).kind != "u" else 0,
             "nan": np.nan if np.dtype(dtype).kind == "f" else info.max,
             "inf": np.inf if np.dtype(dtype).kind == "f" else info.min}[kind]
    with np.errstate(all="ignore"):
        return np.full(count, value, dtype=dtype)


def mutate_array(draw, conn: sqlite3.Connection, rowid: int, fix_digest: bool) -> str:
    from evalrun.hashing import hash_bytes

    row = conn.execute("SELECT dtype, shape, encoding, data FROM arrays WHERE rowid = ?", [rowid]).fetchone()
    if row is None:
        return "array row gone"
    dtype, shape_text, encoding, data = row
    try:
        shape = json.loads(shape_text)
        count = int(np.prod(shape))
    except Exception:  # noqa: BLE001 - an earlier mutation broke it
        shape, count = [0], 0
    kind = draw(st.sampled_from(["values", "values", "shape", "dtype", "zlib", "bomb", "bytes"]))
    if kind == "values" and dtype in ARRAY_DTYPES:
        data = array_values(draw, dtype, count).tobytes()
    elif kind == "shape":
        shape = draw(st.lists(st.one_of(st.integers(0, 70), st.sampled_from([1 << 20, 1 << 39, 1 << 40])), max_size=5))
        size = int(np.prod(shape, dtype=object)) * (np.dtype(dtype).itemsize if dtype in ARRAY_DTYPES else 1)
        data = bytes(size) if size <= 1 << 22 and draw(st.booleans()) else data
        shape_text, encoding = json.dumps(shape), "raw"
    elif kind == "dtype":
        dtype = concrete(draw(st.one_of(st.sampled_from(ARRAY_DTYPES), INTERESTING_CELLS, TEXT)))
        if dtype in ARRAY_DTYPES and isinstance(data, bytes) and len(data) % np.dtype(dtype).itemsize == 0 \
                and draw(st.booleans()):
            shape_text, encoding = json.dumps([len(data) // np.dtype(dtype).itemsize]), "raw"
    elif kind == "zlib" and isinstance(data, bytes):
        data, encoding = zlib.compress(data if encoding == "raw" else b""), "zlib"
    elif kind == "bomb":
        size = draw(st.sampled_from([1 << 16, 1 << 22, 1 << 26]))
        data, encoding = zlib.compress(bytes(size), 9), "zlib"
        if draw(st.booleans()):
            shape_text = json.dumps(draw(st.sampled_from([[1], [3], [3, 2], [size // 8]])))
    else:
        data = draw(st.binary(max_size=64))
    digest = hash_bytes(data) if fix_digest and isinstance(data, bytes) else concrete(draw(SQL_VALUES))
    conn.execute("UPDATE arrays SET dtype = ?, shape = ?, encoding = ?, data = ?, digest = ? WHERE rowid = ?",
                 [dtype, shape_text, encoding, data, digest, rowid])
    return f"array {rowid}: {kind}"


JSON_COLUMNS = {"runs": [c for c in ("config_json", "environment_json", "model_json", "prompt_set_json",
                                     "timings_json", "evidence_json", "batches_json", "applied_flags_json")],
                "results": ["record_json"], "golden": ["value"], "meta": ["value"]}


def mutate_json_cell(draw, conn: sqlite3.Connection, table: str, column: str, rowid: int) -> str:
    row = conn.execute(f'SELECT "{column}" FROM "{table}" WHERE rowid = ?', [rowid]).fetchone()
    if row is None:
        return "json row gone"
    try:
        value = json.loads(row[0])
    except Exception:  # noqa: BLE001
        value = None
    path = draw(st.sampled_from(json_paths(value)))
    new = draw(st.one_of(JSON_VALUES, st.sampled_from(["x\ny", "random:tiny",
                                                        "float64", "bfloat16", 0, -1, 2**63, [], {}, None])))
    value = set_path(value, path, new, draw(st.booleans()))
    conn.execute(f'UPDATE "{table}" SET "{column}" = ? WHERE rowid = ?', [dumps(value), rowid])
    return f"json {table}.{column}[{rowid}] {path!r} = {new!r:.60}"


def mutate_sql(draw, path: Path, schema: dict[str, dict[str, Any]]) -> list[str]:
    """Apply 1-3 drawn mutations to the SQLite file at `path`; returns what each did (for the report)."""
    weights = {"runs": 3, "results": 3, "arrays": 3, "golden": 2}
    tables = [name for name in sorted(schema) for _ in range(weights.get(name, 1))]
    done = []
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for _ in range(draw(st.integers(1, 3), label="mutation count")):
            kind = draw(st.sampled_from(["cell"] * 3 + ["json"] * 3 + ["array"] * 4 + ["delete", "drop", "duplicate"]),
                        label="mutation")
            try:
                done.append(_mutate(draw, conn, schema, tables, kind))
            except (sqlite3.Error, OverflowError, ValueError) as error:
                done.append(f"({kind} refused: {error})")
    finally:
        conn.close()
    return done


def _mutate(draw, conn: sqlite3.Connection, schema, tables, kind: str) -> str:
    table = draw(st.sampled_from(tables))
    rowid = draw(st.sampled_from(schema[table]["rowids"] or [1]))
    if kind == "json" and any(t in schema for t in JSON_COLUMNS):
        table = draw(st.sampled_from([t for t in JSON_COLUMNS if t in schema]))
        column = draw(st.sampled_from(JSON_COLUMNS[table]))
        return mutate_json_cell(draw, conn, table, column, draw(st.sampled_from(schema[table]["rowids"] or [1])))
    if kind == "array" and "arrays" in schema:
        rowid = draw(st.sampled_from(schema["arrays"]["rowids"]))
        return mutate_array(draw, conn, rowid, draw(st.booleans()) or draw(st.booleans()))
    if kind == "delete":
        every = draw(st.booleans()) and draw(st.booleans())
        conn.execute(f'DELETE FROM "{table}"' + ("" if every else " WHERE rowid = ?"), [] if every else [rowid])
        return f"DELETE FROM {table}" + ("" if every else f" WHERE rowid = {rowid}")
    if kind == "drop":
        conn.execute(f'DROP TABLE "{table}"')
        return f"DROP TABLE {table}"
    column = draw(st.sampled_from(schema[table]["columns"]))
    value = concrete(draw(SQL_VALUES))
    if kind == "duplicate":
        columns = [r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')]
        row = conn.execute(f'SELECT * FROM "{table}" WHERE rowid = ?', [rowid]).fetchone()
        if row is None:
            return "duplicate: row gone"
        row = [value if c == column else v for c, v in zip(columns, row)]
        conn.execute(f'INSERT INTO "{table}" VALUES ({", ".join("?" * len(row))})', row)
        return f"duplicate {table} rowid {rowid} with {column} = {value!r:.80}"
    every = draw(st.booleans()) and draw(st.booleans())
    conn.execute(f'UPDATE "{table}" SET "{column}" = ?' + ("" if every else " WHERE rowid = ?"),
                 [value] + ([] if every else [rowid]))
    return f"UPDATE {table} SET {column} = {value!r:.80}" + ("" if every else f" WHERE rowid = {rowid}")


# ---------------------------------------------------------------- 4. stores

@pytest.fixture(scope="module")
def base_store(tmp_path_factory) -> tuple[Path, list[str]]:
    """One store with three runs: float32 and bfloat16 with full logits kept, and a shorter one."""
    folder = tmp_path_factory.mktemp("fuzz-store")
    path = folder / "evalrun.db"
    ids = []
    for extra in (["--keep-logits", "all", "--max-new-tokens", "3"],
                  ["--keep-logits", "all", "--max-new-tokens", "3", "--dtype", "bfloat16"],
                  ["--max-new-tokens", "2", "--batch-size", "2"]):
        result = invoke("run", *TINY, "--prompts", "smoke", *extra, "--store", str(path), "--quiet", "--json")
        assert result.code == 0, result.err
        ids.append(json.loads(result.out)["run_id"])
    gc.collect()  # the in-process commands' connections close: nothing is left only in the -wal file
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path, ids


@st.composite
def file_damage(draw, size: int):
    kind = draw(st.sampled_from(["none"] * 6 + ["flip", "truncate", "header"]))
    if kind == "flip":
        return kind, draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(1, 255)), min_size=1, max_size=8))
    if kind == "header":
        return kind, draw(st.lists(st.tuples(st.integers(0, 99), st.integers(1, 255)), min_size=1, max_size=3))
    if kind == "truncate":
        return kind, draw(st.integers(0, size - 1))
    return kind, None


def damage_file(path: Path, damage) -> str:
    kind, detail = damage
    if kind in ("flip", "header"):
        data = bytearray(path.read_bytes())
        for offset, mask in detail:
            if offset < len(data):
                data[offset] ^= mask
        path.write_bytes(bytes(data))
        return f"xor {detail}"
    if kind == "truncate":
        with open(path, "r+b") as file:
            file.truncate(detail)
        return f"truncate to {detail}"
    return ""


@fuzz_settings(80)
@given(data=st.data())
def test_fuzz_damaged_stores(base_store, data):
    base, ids = base_store
    schema = schema_of(base)
    first, second = data.draw(st.sampled_from(ids), label="a"), data.draw(st.sampled_from(ids), label="b")
    prefix = data.draw(st.integers(1, 32), label="prefix length")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "evalrun.db"
        shutil.copy(base, path)
        done = mutate_sql(data.draw, path, schema)
        done.append(damage_file(path, data.draw(file_damage(path.stat().st_size), label="file damage")))
        note(f"mutations: {done}")
        store = ("--store", str(path))
        check_contract(invoke("store", "ls", *store, "--json"))
        check_contract(invoke("store", "show", first[:prefix], *store, "--json"))
        check_contract(invoke("store", "check", *store, "--json"))
        check_contract(invoke("diff", first[:prefix], second[:8], *store, "--json"))
        check_contract(invoke("diff", first[:prefix], second[:8], *store, "--format", "markdown"), json_out=False)


# ---------------------------------------------------------------- 5. forged goldens

@pytest.fixture(scope="module")
def base_golden(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz-golden")
    result = invoke("golden", "create", "g", *TINY, "--prompts", "smoke", "--max-new-tokens", "3", "--dir", str(folder),
                    "--quiet")
    assert result.code == 0, result.err
    return folder / "g.db"


def reseal(path: Path) -> None:
    """Recompute the content digest so the forgery passes the checksum (what any forger can do)."""
    from evalrun.golden import content_digest

    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("DELETE FROM golden WHERE key = 'content_digest'")
        conn.execute("INSERT INTO golden VALUES ('content_digest', ?)", [content_digest(conn)])
    except sqlite3.Error:
        pass  # no golden table left, or no usable file: refused as damaged
    finally:
        conn.close()


def golden_commands(folder: Path) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    d = str(folder)
    return [(("golden", "verify", "g", "--dir", d, "--quiet", "--json"), {"changed": True}),
            (("golden", "list", "--dir", d, "--json"), {}),
            (("golden", "show", "g", "--dir", d, "--json"), {}),
            (("golden", "show", "g", "--dir", d), {"json_out": False}),
            (("diff", "golden:g", "golden:g", "--golden-dir", d, "--json"), {})]


def check_golden_untouched(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before, "C4 a command changed the golden file's bytes"
    leftovers = [p.name for p in path.parent.iterdir() if p.name.endswith(("-wal", "-shm", "-journal"))]
    assert not leftovers, f"C4 files appeared beside the golden: {leftovers}"


@fuzz_settings(35)
@given(data=st.data())
def test_fuzz_forged_goldens(base_golden, data):
    schema = schema_of(base_golden)
    flips = data.draw(st.sampled_from([False] * 9 + [True]).flatmap(lambda flip: st.lists(
        st.tuples(st.integers(0, 99), st.integers(1, 255)), min_size=1, max_size=2) if flip else st.just([])),
        label="header flips after sealing")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "g.db"
        shutil.copy(base_golden, path)
        done = mutate_sql(data.draw, path, schema)
        reseal(path)
        done.append(damage_file(path, ("header", flips)) if flips else "")
        note(f"forgery: {done}")
        before = path.read_bytes()
        for args, options in golden_commands(Path(folder)):
            check_contract(invoke(*args), **options)
            check_golden_untouched(path, before)


@pytest.mark.parametrize("role", ["oracle", "function"])
def test_a_golden_whose_measured_values_hold_nan_is_refused_not_changed(base_golden, tmp_path, monkeypatch, role):
    """NaN in the oracle's (or function run's) probe values, resealed: every distance became NaN or infinite and
    verify said changed (exit 1, a red-team pass) of a golden that cannot measure anything: damaged, exit 2. Every
    role is read before the model loads, on the identical path too (the function run was read after the candidate
    ran, and never where the candidate was identical)."""
    from evalrun import verify
    from evalrun.hashing import hash_bytes

    path = tmp_path / "g.db"
    shutil.copy(base_golden, path)
    conn = sqlite3.connect(path, isolation_level=None)
    roles = json.loads(conn.execute("SELECT value FROM golden WHERE key = 'roles'").fetchone()[0])
    run = roles[role]  # float32: the function run is the reference envelope member too (one run, two roles)
    for rowid, dtype, data in conn.execute("SELECT rowid, dtype, data FROM arrays WHERE run_id = ? AND name = "
                                           "'probe_values' AND encoding = 'raw'", [run]).fetchall():
        spoiled = np.full(len(data) // np.dtype(dtype).itemsize, np.nan, dtype=dtype).tobytes()
        conn.execute("UPDATE arrays SET data = ?, digest = ? WHERE rowid = ?", [spoiled, hash_bytes(spoiled), rowid])
    conn.close()
    reseal(path)
    monkeypatch.setattr(verify, "prepare", lambda *args: pytest.fail("the model loaded before the golden was read"))
    result = invoke("golden", "verify", "g", "--dir", str(tmp_path), "--quiet", "--json")
    named = [name for name, run_id in roles.items() if run_id == run and f"the {name} run has NaN in its probe_values"
             in result.err]
    assert result.code == 2 and named, result.err
    assert len(result.err.strip().splitlines()) == 1


@pytest.mark.parametrize("table, column", [("runs", "config_json"), ("results", "record_json"), ("golden", "value")])
def test_stored_json_naming_a_key_twice_is_damaged_not_read_as_one_of_them(base_golden, tmp_path, table, column):
    """A forged golden whose JSON names a key twice (`{"dtype": "float64", ..., "dtype": "float32"}`): Python read
    the last, SQLite's json_extract and a reviewer's eye the first. Refused as damaged (exit 2), naming the key."""
    path = tmp_path / "g.db"
    shutil.copy(base_golden, path)
    conn = sqlite3.connect(path, isolation_level=None)
    key = {"config_json": "dtype", "record_json": "id", "value": "pinned"}[column]
    where = "key = 'roles'" if table == "golden" else "rowid = (SELECT min(rowid) FROM " + table + ")"
    (text,) = conn.execute(f"SELECT {column} FROM {table} WHERE {where}").fetchone()
    assert text.startswith("{") and f'"{key}"' in text
    conn.execute(f"UPDATE {table} SET {column} = ? WHERE {where}", ['{"' + key + '": "forged", ' + text[1:]])
    conn.close()
    reseal(path)
    for args in (("golden", "verify", "g", "--quiet"), ("golden", "show", "g")):
        result = invoke(*args, "--dir", str(tmp_path), "--json")
        assert result.code == 2 and f"names the key {key!r} twice" in result.err, (args, result.err)
        assert len(result.err.strip().splitlines()) == 1


@pytest.mark.parametrize("relative", [1e-2, 5e-3])
def test_a_golden_whose_function_run_is_no_float32_run_of_its_oracle_is_refused(tmp_path, relative):
    """The function run replaced by its oracle plus noise and resealed (a red-team pass): its error set the function
    check's budget, and a model 5% off verified as drift wherever the environment differed. A float32 run sits
    within a few hundred float32 epsilons of its float64 oracle; past 2^14 the golden is refused (exit 2)."""
    from evalrun.golden import open_golden
    from evalrun.hashing import hash_bytes
    from evalrun.store import array_to_bytes

    folder = tmp_path / "g"
    assert invoke("golden", "create", "g", *TINY, "--prompts", "smoke", "--max-new-tokens", "3", "--dir",
                  str(folder), "--quiet").code == 0
    golden = open_golden("g", folder)
    oracle = {r.prompt_index: r.arrays["probe_values"] for r in golden.results("oracle")}
    function_run = golden.run_id("function")
    golden.store.close()
    conn = sqlite3.connect(folder / "g.db", isolation_level=None)
    for rowid, index, dtype in conn.execute("SELECT rowid, prompt_index, dtype FROM arrays WHERE run_id = ? AND "
                                            "name = 'probe_values'", [function_run]).fetchall():
        noise = np.random.default_rng(index).standard_normal(oracle[index].shape) * relative
        forged = array_to_bytes((oracle[index] * (1 + noise)).astype(dtype))
        conn.execute("UPDATE arrays SET data = ?, encoding = 'raw', digest = ? WHERE rowid = ?",
                     [forged, hash_bytes(forged), rowid])
    conn.close()
    reseal(folder / "g.db")
    result = invoke("golden", "verify", "g", "--dir", str(folder), "--quiet", "--json")  # identical, were it read late
    assert result.code == 2 and "the function run sits" in result.err and "no float32 run" in result.err, result.err


@fuzz_settings(8)
@given(name=TEXT, record=RECORD)
def test_fuzz_incomparable_golden_names_untrusted_text(base_golden, name, record):
    """A forged golden whose prompt records differ (incomparable, exit 2) and whose pinned run names its prompt set
    with any text: the one stderr line must stay one line, and each cause of the text report one line, whatever
    the golden says (a name holding a line break printed a line of its own, such as `::error::`)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "g.db"
        shutil.copy(base_golden, path)
        conn = sqlite3.connect(path, isolation_level=None)
        pinned = json.loads(conn.execute("SELECT value FROM golden WHERE key = 'roles'").fetchone()[0])["pinned"]
        conn.execute("UPDATE runs SET prompt_set_json = json_set(prompt_set_json, '$.name', ?) WHERE id = ?",
                     [name.encode("utf-8", "surrogatepass").decode("utf-8", "replace"), pinned])
        conn.execute("UPDATE results SET record_json = ? WHERE run_id = ? AND prompt_index = 0",
                     [dumps({**record, "id": "capital"}), pinned])
        conn.close()
        reseal(path)
        before = path.read_bytes()
        check_contract(invoke("golden", "verify", "g", "--dir", folder, "--quiet", "--json"), changed=True)
        report = invoke("golden", "verify", "g", "--dir", folder, "--quiet")
        check_contract(report, changed=True, json_out=False)
        lines = report.out.splitlines()
        assert lines[0].startswith("golden g: ") and all(line.startswith("  ") for line in lines[1:]), report.out
        check_golden_untouched(path, before)


# ---------------------------------------------------------------- 5b. forged goldens in a child: bounded memory

def run_child(args: list[str], cwd: Path) -> tuple[Outcome, int]:
    """`python -m evalrun ARGS` under RLIMIT_AS; returns the outcome and the child's peak RSS in bytes."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen([sys.executable, "-m", "evalrun", *args], stdout=out, stderr=err, cwd=cwd, env=env,
                                 preexec_fn=limit)
        try:
            _, status, usage = os.wait4(child.pid, 0)
        finally:
            child.returncode = 0  # reaped here: Popen must not wait on it again
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        return (Outcome(args, code, out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")),
                usage.ru_maxrss * 1024)


def forge_arrays(path: Path, rows: str, shape: list[int] | None, payload: bytes, dtype: str = "int64") -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    from evalrun.hashing import hash_bytes

    shape_sql = ", shape = ?" if shape is not None else ""
    conn.execute(f"UPDATE arrays SET encoding = 'zlib', dtype = ?, data = ?, digest = ?{shape_sql} WHERE {rows}",
                 [dtype, payload, hash_bytes(payload)] + ([json.dumps(shape)] if shape is not None else []))
    conn.close()


def forge_golden_value(path: Path, key: str, text: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("UPDATE golden SET value = ? WHERE key = ?", [text, key])
    conn.close()


@functools.cache
def zeros_compressed(size: int) -> bytes:
    """zlib of `size` zero bytes (1 GiB: about 1 MB), made in 1 MiB chunks."""
    packer, chunk = zlib.compressobj(9), bytes(min(size, 1 << 20))
    parts = [packer.compress(chunk[:min(len(chunk), size - done)]) for done in range(0, size, len(chunk))]
    return b"".join(parts) + packer.flush()


MEMORY_FORGERIES = {
    # a zlib bomb (512 MiB of zeros in 0.5 MB) behind a small declared shape: inflating must stop at the declared size
    "bomb-small-shape": lambda p: forge_arrays(p, "name = 'tokens'", [3], zeros_compressed(1 << 29)),
    # one array declared 512 MiB, honestly compressed (0.5 MB), in a golden of 3 tokens per prompt
    "bomb-declared-512MiB": lambda p: forge_arrays(
        p, "rowid = (SELECT min(rowid) FROM arrays WHERE name = 'tokens')", [1 << 26], zeros_compressed(1 << 29)),
    # nine arrays (tokens, digests, margins of each prompt) declared 128 MiB each, none past any size limit:
    # are they all decoded and kept before any is checked?
    "bomb-nine-arrays": lambda p: forge_arrays(p, "name IN ('tokens', 'digests', 'margins')", [1 << 24],
                                               zeros_compressed(1 << 27)),
    # a 36 MB JSON value in the golden table (a column no size check covers): 12 M objects
    "json-amplification": lambda p: forge_golden_value(p, "probes", "[" + "{}," * 12_000_000 + "{}]"),
}


def check_memory(result: Outcome, peak: int, case: str) -> None:
    assert "out of memory" not in result.err, \
        f"C5 {case}: {' '.join(result.argv)} ran out of its {CHILD_ADDRESS_SPACE >> 30} GiB address space: {result.err}"
    assert peak < PEAK_RSS_BOUND, f"C5 {case}: {' '.join(result.argv)} peaked at {peak / 2**30:.2f} GiB resident " \
                                  f"(bound {PEAK_RSS_BOUND / 2**30:.2f} GiB)"


@pytest.mark.parametrize("case", sorted(MEMORY_FORGERIES))
def test_forged_golden_memory_is_bounded(base_golden, tmp_path, case):
    path = tmp_path / "g.db"
    shutil.copy(base_golden, path)
    MEMORY_FORGERIES[case](path)
    reseal(path)
    before = path.read_bytes()
    result, peak = run_child(["golden", "verify", "g", "--dir", str(tmp_path), "--quiet", "--json"], tmp_path)
    check_contract(result, changed=True)
    check_golden_untouched(path, before)
    check_memory(result, peak, case)


@fuzz_settings(1, scale=50)
@given(rows=st.sampled_from(["name = 'tokens'", "name = 'probe_values'", "1", "name = 'digests'"]),
       size=st.sampled_from([1 << 20, 1 << 26, 1 << 29]), declared=st.sampled_from(["small", "honest", "none"]),
       command=st.sampled_from([["golden", "show", "g"], ["golden", "list"], ["golden", "verify", "g", "--quiet"]]))
def test_fuzz_forged_golden_memory_in_a_child(base_golden, rows, size, declared, command):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "g.db"
        shutil.copy(base_golden, path)
        shape = {"small": [3], "honest": [size // 8], "none": None}[declared]
        forge_arrays(path, rows, shape, zeros_compressed(size))
        reseal(path)
        before = path.read_bytes()
        result, peak = run_child([*command, "--dir", folder, "--json"], Path(folder))
        check_contract(result, changed=True)
        check_golden_untouched(path, before)
        check_memory(result, peak, f"{rows} {size} {declared}")
