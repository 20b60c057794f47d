"""A local OpenAI-compatible completions server for tests: http.server in a thread on 127.0.0.1, port 0.

It answers like vLLM (token-id prompts, "token_id:N" keys under return_tokens_as_token_ids) with the
numbers of a model evalrun loads (`load_model`, float32 on the CPU): greedy, top-k log-probabilities
from log_softmax over the whole vocabulary. `behaviour` makes it misbehave the ways servers do:
  ok         answers every request
  slow       sleeps past the client's timeout before answering completions
  error500   answers completions with HTTP 500
  truncated  sends half of a valid completion body
  fewer      returns one log-probability per step whatever was asked
  noise      moves each logit by a few float32 ulps, seeded (another reduction order: drift)
  changed    scales the logits by 1.05 (a server computing another function)
  nan        answers NaN for the first step's log-probabilities (a broken kernel; JSON readers take NaN)
  sampling   draws each token from its log-probabilities (seeded), as a server that ignores temperature=0 does
  runner-up  chooses the second token wherever it is within `tie` nats of the first (0.4: inside the greedy slack,
             rounding in what a greedy server prints, a near tie)
/v1/models always answers, so a misbehaving server is found at the first completion; as vLLM's does, its model
entry holds a permission whose id is a new uuid each time. `calls` counts completion requests (retries included).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from evalrun.models import load_model


class StubServer:
    def __init__(self, model_ref: str = "random:tiny", behaviour: str = "ok", served: str = "stub-model",
                 delay: float = 3.0, dtype: str = "float32") -> None:
        self.loaded = load_model(model_ref, "cpu", dtype)  # bfloat16: a server that computes as most do
        self.behaviour, self.served, self.delay = behaviour, served, delay
        self.entry_extra: dict = {}  # more fields of its /v1/models entry (vLLM's root, max_model_len)
        self.tie = 0.4  # runner-up: how near the first two must be for the second to be chosen
        self.eos: int | None = None  # another end-of-sequence id than the tokenizer's (another generation config)
        self.rewrite: Callable[[dict], dict] | None = None  # edits each completion answer before it is sent
        self.calls = 0
        self.lock = threading.Lock()
        self.logprobs([0, 1])  # the first forward imports what it needs now, not inside a pytester snapshot
        self.httpd = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[V] float32 log-probabilities of the next token after `ids`."""
        logits = self.loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        if self.behaviour == "noise":
            generator = torch.Generator().manual_seed(len(ids))
            # a few float32 ulps at each logit: what another reduction order or thread count gives
            logits = logits + 4 * torch.finfo(torch.float32).eps * logits.abs() * torch.randn(logits.shape, generator=generator)
        elif self.behaviour == "changed":
            logits = logits * 1.05
        return torch.log_softmax(logits, dim=-1)

    def complete(self, body: dict) -> dict:
        tokenizer = self.loaded.tokenizer
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        key = (lambda i: f"token_id:{i}") if as_ids else (lambda i: tokenizer.decode([i]))
        asked = int(body.get("logprobs") or 0)
        tokens, chosen, tops, finish, generated = [], [], [], "length", []
        for _ in range(int(body.get("max_tokens", 16))):
            logprobs = self.logprobs(ids + generated)
            values, top_ids = torch.topk(logprobs, 1 if self.behaviour == "fewer" else max(asked, 2))
            token, value = int(top_ids[0]), float(values[0])
            if self.behaviour == "sampling":
                generator = torch.Generator().manual_seed(len(ids) + len(generated))
                token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
                value = float(logprobs[token])
            elif self.behaviour == "runner-up" and float(values[0] - values[1]) < self.tie:
                token, value = int(top_ids[1]), float(values[1])
            if token == (tokenizer.eos_token_id if self.eos is None else self.eos):
                finish = "stop"
                break
            generated.append(token)
            tokens.append(key(token))
            chosen.append(value)
            tops.append({key(int(i)): float(v) for i, v in zip(top_ids[:max(asked, 1)], values)})
        if self.behaviour == "nan" and chosen:
            chosen[0] = float("nan")
            tops[0] = {name: float("nan") for name in tops[0]}
        answer = {"id": "cmpl-stub", "object": "text_completion", "created": int(time.time()), "model": self.served,
                  "choices": [{"index": 0, "text": tokenizer.decode(generated), "finish_reason": finish,
                               "logprobs": {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops,
                                            "text_offset": [0] * len(tokens)}}],
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(generated)}}
        return self.rewrite(answer) if self.rewrite else answer


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that gave up (timeout) leaves a broken pipe: expected here, not printed."""


def _handler(stub: StubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Server", "evalrun-stub/1")
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": stub.served, "object": "model", "created": int(time.time()), "owned_by": "stub",
                     "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission"}],
                     **stub.entry_extra}]}).encode())
            elif self.path == "/version":
                self._send(200, b'{"version": "stub-1.0"}')
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            with stub.lock:
                stub.calls += 1
            if stub.behaviour == "slow":
                time.sleep(stub.delay)
            if stub.behaviour == "error500":
                self._send(500, b'{"error": "internal"}')
                return
            with stub.lock:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)  # the client waits meanwhile; OpenMP across busy cores costs 1 s a call
                try:
                    answer = json.dumps(stub.complete(body)).encode()
                finally:
                    torch.set_num_threads(threads)
            if stub.behaviour == "truncated":
                answer = answer[: len(answer) // 2]
            if stub.behaviour == "huge-number":  # Python's json refuses an integer past 4300 digits (ValueError)
                answer = answer[:-1] + b', "created": 1' + b"0" * 5000 + b"}"
            self._send(200, answer)

    return Handler
