"""Against a real server nobody on this project wrote: llama.cpp's OpenAI-compatible server (llama-cpp-python),
started here on 127.0.0.1 on the CPU, serving the SmolLM2 GGUF the default model ships. `make test-servers`.

Each verdict is also written to $EVALRUN_SERVER_REPORT (a folder) when set, for the numbers in the README.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from evalrun.models import smollm2_gguf_path

pytestmark = pytest.mark.servers
llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python[server]: make test-servers")

PROMPTS = [{"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
           {"id": "sky", "messages": [{"role": "user", "content": "Why is the sky blue? Answer briefly."}]},
           {"id": "count", "prompt": "One, two, three, four,"}]
TOKENS = "12"


@contextmanager
def llama_server(log: Path, threads: int, batch: int, flash_attn: bool):
    """llama-cpp-python's server on a free 127.0.0.1 port; yields its /v1 URL, stops it afterwards.

    A small context: with logits_all, llama-cpp-python turns its whole [n_ctx, vocab] score buffer into
    log-probabilities on every request (seconds at 2048)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf_path()), "--model_alias",
               "smollm2", "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "256", "--logits_all", "true",
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_batch", str(batch),
               "--n_ubatch", str(batch), "--flash_attn", str(flash_attn).lower(), "--verbose", "false"]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"llama.cpp's server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "server.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


def _keep(name: str, out: str) -> None:
    folder = os.environ.get("EVALRUN_SERVER_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.txt").write_text(out)


def test_a_server_golden_verifies_against_the_server_restarted_with_other_settings(cli, prompts, tmp_path):
    workload = ["--prompts", str(prompts), "--max-new-tokens", TOKENS, "--served-model", "smollm2", "-q"]
    with llama_server(tmp_path / "a.log", threads=2, batch=512, flash_attn=False) as url:
        code, out, err = cli("golden", "create", "llama", "--dir", str(tmp_path), "--engine", f"openai:{url}", *workload,
                             "--set", "server_config=llama.cpp threads 2, batch 512, flash attention off")
        assert code == 0, err
        code, out, err = cli("golden", "verify", "llama", "--dir", str(tmp_path), "--engine", f"openai:{url}", *workload,
                             "--set", "server_config=llama.cpp threads 2, batch 512, flash attention off")
        _keep("same-server", out + err)
        assert code == 0 and "IDENTICAL" in out, out + err  # one server, the same requests in the same order
    settings = [(1, 512, False), (2, 8, False), (2, 512, True)]
    for threads, batch, flash in settings:
        note = f"llama.cpp threads {threads}, batch {batch}, flash attention {'on' if flash else 'off'}"
        with llama_server(tmp_path / f"b{threads}{batch}{flash}.log", threads, batch, flash) as url:
            code, out, err = cli("golden", "verify", "llama", "--dir", str(tmp_path), "--engine", f"openai:{url}",
                                 *workload, "--set", f"server_config={note}")
        _keep(f"restarted-threads{threads}-batch{batch}-fa{int(flash)}", out + err)
        assert code == 0 and ("IDENTICAL" in out or "DRIFT" in out), out + err
        assert f"-> {note}" in out  # the notes are a hashed config factor: the verdict names them


def test_a_golden_made_by_evalrun_from_the_same_gguf_against_the_server(cli, prompts, tmp_path):
    """evalrun computes with the GGUF's weights dequantized to float32; llama.cpp with the Q4_1 blocks
    themselves and 8-bit quantized activations: another function of the same file. The execution check
    measures that distance against the float64 oracle of the dequantized weights."""
    workload = ["--prompts", str(prompts), "--max-new-tokens", TOKENS, "-q"]
    code, out, err = cli("golden", "create", "ours", "--dir", str(tmp_path), "--model", "smollm2-135m", *workload)
    assert code == 0, err
    with llama_server(tmp_path / "c.log", threads=2, batch=512, flash_attn=False) as url:
        code, out, err = cli("golden", "verify", "ours", "--dir", str(tmp_path), "--engine", f"openai:{url}",
                             "--served-model", "smollm2", *workload)
    _keep("evalrun-golden-vs-llama", out + err)
    assert code in (0, 1), out + err
    assert "model identity: not checkable through the API" in out and "over the whole vocabulary" in out
    if code == 1:
        assert "quantized weights and activations" in out
