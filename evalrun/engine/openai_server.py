"""A client for OpenAI-compatible completion servers (vLLM, SGLang, llama.cpp): what a server run needs.

Standard library only (urllib): one request at a time, bounded retries, every response validated.
A server speaks in token *strings*; `TokenIndex` maps them back to the local tokenizer's ids, and a
string several ids decode to is ambiguous and left out (vLLM's `return_tokens_as_token_ids` answers
with "token_id:N" keys, which need no mapping, so it is always asked for).

Errors: a connection that fails, a timeout, an HTTP 5xx or 429, or a body that is not the JSON a
completion server sends is retried `retries` times with a growing pause, then raised as ServerError
(exit 2, one line). Other HTTP 4xx are not retried: the request itself was refused.
"""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ..errors import ServerError

TOKEN_ID_PREFIX = "token_id:"
KEPT_HEADERS = ("server", "x-powered-by", "openai-version", "x-request-model")  # identity, never timestamps
MAX_RESPONSE_BYTES = 64 << 20
# A log-probability is <= 0; a server printing float32 may round the top one a little above 0. Far below the
# floor no server computes (vLLM clamps -inf to -9999): a value outside [LOGPROB_FLOOR, LOGPROB_CEILING] is a
# malformed answer. Stored, one such value made a golden's envelope infinite (every server verified as drift).
LOGPROB_CEILING = 1e-3
LOGPROB_FLOOR = -1e5


@dataclass
class Step:
    """One position a server scored: the chosen token's string and log-probability, and its top-k."""

    token: str
    logprob: float
    top: dict[str, float]


@dataclass
class Completion:
    """One completion choice with its per-token log-probabilities."""

    text: str
    steps: list[Step]
    finish_reason: str | None
    prompt_tokens: int | None
    headers: dict[str, str] = field(default_factory=dict)


class OpenAIClient:
    """`base_url` ends in /v1 (as users write it); `model` is the served model's name ('' = the only one)."""

    def __init__(self, base_url: str, model: str = "", timeout: float = 60.0, retries: int = 2,
                 backoff: float = 0.25) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.token_ids_accepted: bool | None = None  # learnt on the first completion

    # ------------------------------------------------------------ transport

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                url: str | None = None) -> tuple[Any, dict[str, str]]:
        """JSON in, (parsed JSON, kept headers) out; retried as the module docstring says."""
        target = url or f"{self.base_url}{path}"
        data = json.dumps(body).encode() if body is not None else None
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * attempt)
            try:
                return self._once(method, target, data)
            except _Retryable as error:
                last = str(error)
        raise ServerError(f"server {target}: {last} (after {self.retries + 1} attempts); check that the server "
                          "runs and answers, or raise --set server_timeout")

    def _once(self, method: str, target: str, data: bytes | None) -> tuple[Any, dict[str, str]]:
        request = urllib.request.Request(target, data=data, method=method,
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - the user's URL
                raw = response.read(MAX_RESPONSE_BYTES + 1)
                headers = {k.lower(): v for k, v in response.headers.items() if k.lower() in KEPT_HEADERS}
        except urllib.error.HTTPError as error:
            detail = _error_detail(error)
            if error.code >= 500 or error.code == 429:
                raise _Retryable(f"HTTP {error.code} {detail}", error.code) from None
            raise ServerError(f"server {target}: HTTP {error.code} {detail}; the server refused the request "
                              "(check --served-model and what the server supports)", error.code) from None
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise _Retryable(f"no answer ({'timed out' if 'timed out' in str(reason) else reason})") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise ServerError(f"server {target}: a response past {MAX_RESPONSE_BYTES:,} bytes; not a completion server?")
        try:
            return json.loads(raw.decode("utf-8")), headers
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise _Retryable(f"malformed JSON in the response ({str(error)[:80]})") from None
        except ValueError:  # an integer of more than 4300 digits (Python's limit on converting text to int)
            raise _Retryable("malformed JSON in the response (a number of over 4300 digits)") from None

    # ------------------------------------------------------------ endpoints

    def identity(self) -> dict[str, Any]:
        """What the server says about itself: its model list entry, /version where it has one, and the
        identifying response headers. Resolves `model` when the server serves exactly one."""
        listing, headers = self.request("GET", "/models")
        entries = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("id"), str) for e in entries):
            raise ServerError(f"server {self.base_url}/models: not an OpenAI model list; is this an OpenAI-compatible URL?")
        names = [e["id"] for e in entries]
        if not self.model:
            if len(names) != 1:
                raise ServerError(f"server {self.base_url} serves {len(names)} models ({', '.join(names[:5])}); "
                                  "pass --served-model NAME")
            self.model = names[0]
        entry = next((e for e in entries if e["id"] == self.model), None)
        if entry is None:
            raise ServerError(f"server {self.base_url} does not serve {self.model!r} (it serves "
                              f"{', '.join(names[:5]) or 'nothing'}); pass --served-model with one of those")
        return {"model": self.model, "entry": _stable(entry), "version": self._version(), "headers": headers}

    def _version(self) -> Any:
        """vLLM and SGLang answer GET /version at the root; others do not (None)."""
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        try:
            body, _ = self._once("GET", f"{root}/version", None)
            return _stable(body)
        except (ServerError, _Retryable):
            return None

    def complete(self, prompt: str | list[int], max_tokens: int, logprobs: int) -> Completion:
        """Greedy completion with top-`logprobs` log-probabilities per generated token."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "top_p": 1.0, "logprobs": logprobs, "echo": False, "stream": False, "seed": 0,
                "return_tokens_as_token_ids": True}
        answer, headers = self.request("POST", "/completions", body)
        return parse_completion(answer, f"{self.base_url}/completions", headers)

    def accepts_token_ids(self, ids: list[int]) -> bool:
        """Whether the server takes token ids as the prompt (vLLM does; llama-cpp-python refuses them with
        HTTP 500). One try: any HTTP error means no (a broken server then fails the text request, retried);
        no answer or a malformed one is retried as any request is."""
        if self.token_ids_accepted is None:
            body = {"model": self.model, "prompt": [int(i) for i in ids], "max_tokens": 1, "temperature": 0.0,
                    "logprobs": 1, "return_tokens_as_token_ids": True}
            target = f"{self.base_url}/completions"
            try:
                answer, headers = self._once("POST", target, json.dumps(body).encode())
                parse_completion(answer, target, headers)
                self.token_ids_accepted = True
            except ServerError as error:
                if error.status is None:
                    raise
                self.token_ids_accepted = False
            except _Retryable as error:
                if error.status is None:
                    self.complete(ids, 1, 1)  # retried; raises ServerError when the server stays silent
                    self.token_ids_accepted = True
                else:
                    self.token_ids_accepted = False
        return self.token_ids_accepted


class _Retryable(Exception):
    """A failure worth another attempt (transport, 5xx, 429, malformed body); `status` when HTTP said so."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _error_detail(error: urllib.error.HTTPError) -> str:
    try:
        text = error.read(2000).decode("utf-8", "replace")
    except OSError:
        text = ""
    return " ".join(text.split())[:160]


VOLATILE_FIELDS = ("created", "timestamp", "date", "permission")  # vLLM's permission holds a new uuid per request


# Model-list fields that are serving settings, not the model: vLLM's and SGLang's max_model_len follows
# --max-model-len (--context-length), so a restart with another context limit verified as `changed`. They stay in
# the server's environment record (named in every diff), out of its identity.
SERVING_FIELDS = ("max_model_len",)


def identity_entry(entry: Any) -> Any:
    """A model-list entry as the identity gate compares it: without the serving settings, nor what changes per
    request (`_stable`: a golden made before vLLM's permission was left out stores its uuid)."""
    return _stable({k: v for k, v in entry.items() if k not in SERVING_FIELDS}) if isinstance(entry, dict) else entry


def _stable(value: Any) -> Any:
    """A JSON value without the fields that change per request or restart (timestamps; vLLM's model permission,
    whose id is a new uuid each time /v1/models answers: every verify of its own golden was `changed`)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE_FIELDS}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def parse_completion(answer: Any, where: str, headers: dict[str, str] | None = None) -> Completion:
    """A /completions response -> Completion; ServerError when it is not what the API promises."""
    try:
        choice = answer["choices"][0]
        logprobs = choice["logprobs"]
        if logprobs is None:
            raise ServerError(f"server {where}: no log-probabilities in the answer; this server cannot be verified "
                              "(vLLM, SGLang and llama.cpp return them when asked)")
        tokens, chosen, tops = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
        if not (isinstance(tokens, list) and isinstance(chosen, list) and isinstance(tops, list)
                and len(tokens) == len(chosen) == len(tops)):
            raise TypeError("tokens, token_logprobs and top_logprobs of unequal lengths")
        steps = [Step(_text(token), _number(value), {_text(k): _number(v) for k, v in top.items()})
                 for token, value, top in zip(tokens, chosen, tops)]
        usage = answer.get("usage") or {}
        prompt_tokens = usage.get("prompt_tokens")
        return Completion(_text(choice.get("text", "")), steps, choice.get("finish_reason"),
                          int(prompt_tokens) if isinstance(prompt_tokens, int) else None, dict(headers or {}))
    except ServerError:
        raise
    except _OutOfRange as error:
        raise ServerError(f"server {where}: {error}, not a log-probability (vLLM with --logprobs-mode raw_logits or "
                          "processed_logits returns logits: start it with raw_logprobs)") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as error:
        raise ServerError(f"server {where}: malformed completion ({type(error).__name__}: {str(error)[:80]}); "
                          "not an OpenAI-compatible completions endpoint?") from None


class _OutOfRange(ValueError):
    """A finite number no log-probability takes (`_number`)."""


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return value


def _number(value: Any) -> float:
    """A log-probability as a finite float. JSON readers take NaN and Infinity; a NaN compared with a budget is
    never over it (a server answering NaN passed verify as drift), so a non-finite value is a malformed answer."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    number = float(value)  # OverflowError past 1e308 (an integer of 309-4300 digits): malformed too
    if not math.isfinite(number):
        raise ValueError(f"a log-probability that is not a finite number ({number})")
    if not LOGPROB_FLOOR <= number <= LOGPROB_CEILING:
        raise _OutOfRange(f"a log-probability of {number:.4g}, outside [{LOGPROB_FLOOR:g}, {LOGPROB_CEILING:g}]")
    return number


class TokenIndex:
    """Token strings as a server prints them -> the local tokenizer's ids.

    Each id's single-token decoding, with special tokens also under "" (llama.cpp prints them so). A
    string several ids share is ambiguous: `lookup` gives None and counts it."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.eos = tokenizer.eos_token_id
        self.vocab = vocab
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        by_text: dict[str, list[int]] = {}
        for index in range(vocab):
            by_text.setdefault(tokenizer.decode([index], skip_special_tokens=False), []).append(index)
            if index in special:
                by_text.setdefault("", []).append(index)
        self.by_text = by_text
        self.ambiguous = 0
        self.unknown = 0

    def lookup(self, text: str) -> int | None:
        if text.startswith(TOKEN_ID_PREFIX) and text[len(TOKEN_ID_PREFIX):].isdigit():
            index = int(text[len(TOKEN_ID_PREFIX):])
            if index >= self.vocab:  # stored, it crashed golden create and read as `changed` in verify
                raise ServerError(f"the server answered token id {index}, outside the {self.vocab} ids of evalrun's "
                                  "tokenizer: pass the --model the server serves")
            return index
        ids = self.by_text.get(text)
        if not ids:
            self.unknown += 1
            return None
        if len(ids) > 1:
            self.ambiguous += 1
            return None
        return ids[0]

    def top_ids(self, top: dict[str, float]) -> dict[int, float]:
        """A step's top-k, keyed by id; ambiguous and unknown strings left out."""
        mapped = {}
        for text, logprob in top.items():
            index = self.lookup(text)
            if index is not None:
                mapped[index] = logprob
        return mapped
