"""Runs on an OpenAI-compatible server (`--engine openai:URL`): the candidate or the source of a golden.

The local model reference (`--model`) still supplies the tokenizer (prompts become the same token ids
a golden holds) and, for a golden, the float64 oracle; the server computes everything else. A server
run stores what the API exposes: per step the chosen token, its top-k log-probabilities (values are
log-probabilities, not logits) and a digest of exactly what the server answered. Steps end where the
server ends the sequence (end-of-sequence): the API does not continue past it.

Prompts go as token ids where the server takes them (vLLM), else as text decoded from the ids; then
the server's prompt token count is checked against ours and every mismatch is recorded (the server
tokenised the text differently: its numbers are for other ids).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .config import OPENAI_ENGINE_PREFIX, EffectiveConfig, RunConfig, is_server_engine
from .engine.openai_server import Completion, OpenAIClient, TokenIndex, identity_entry
from .engine.timing import latency_summary
from .errors import ServerError
from .fingerprint import environment_hash
from .hashing import hash_bytes, hash_value
from .runner import NullBar, Prepared, Run, effective_config, open_when_good, prepare, record, steps_for
from .store import PromptResult, Store

MAX_ASKED_LOGPROBS = 20  # vLLM's default max_logprobs; more is refused by most servers
# How far (in nats) below the server's own top log-probability its chosen token may be before the server is taken
# for not decoding greedily. A greedy server takes the arg-max of the logits it scores, so its choice is its own
# top-1 but for rounding in what it prints; a sampling one picks a token its numbers rank lower, 0.5 nats or more
# whenever the top token is 1.65 times as likely. Half a nat is four bfloat16 ulps of a logit near 20.
GREEDY_SLACK = 0.5
_INDEXES: dict[str, TokenIndex] = {}


def is_server(config: RunConfig | EffectiveConfig) -> bool:
    return is_server_engine(config.engine)


@dataclass
class ServerPrepared:
    """A server run's ingredients: the effective config, the local model (tokenizer, prompts), the client."""

    config: EffectiveConfig
    local: Prepared
    client: OpenAIClient
    identity: dict[str, Any]
    header: dict[str, Any]
    index: TokenIndex
    notes: list[str] = field(default_factory=list)  # what the report must say (tokenization, ambiguity)

    @property
    def prompt_set(self):
        return self.local.prompt_set

    def asked(self) -> int:
        return max(self.config.top_k, MAX_ASKED_LOGPROBS)


def local_config(config: EffectiveConfig) -> EffectiveConfig:
    """The config of the local model beside a server: evalrun's engine, eager, the same workload."""
    return config.replace(engine="evalrun", served_model="", server_config="")


def prepare_server(config: RunConfig | EffectiveConfig, local: Prepared | None = None) -> ServerPrepared:
    """Resolve, load the local tokenizer and prompts, ask the server who it is (ServerError when it cannot)."""
    effective = config if isinstance(config, EffectiveConfig) else effective_config(config)
    local = local or prepare(local_config(effective))
    client = OpenAIClient(effective.engine[len(OPENAI_ENGINE_PREFIX):], effective.served_model,
                          timeout=effective.server_timeout)
    identity = client.identity()
    tokenizer = local.loaded.tokenizer
    key = local.header["model"]["tokenizer"]
    if key not in _INDEXES:
        _INDEXES[key] = TokenIndex(tokenizer, local.loaded.vocab_size)
    index = _INDEXES[key]
    index.ambiguous = index.unknown = 0
    return ServerPrepared(effective, local, client, identity, server_header(effective, local, identity), index)


def server_header(config: EffectiveConfig, local: Prepared, identity: dict[str, Any]) -> dict[str, Any]:
    """The run header: the server's identity as its model and environment (what it exposes), the local
    tokenizer's identity (the ids every comparison uses)."""
    entry = identity_entry(identity["entry"])  # without serving settings: they are environment (named in a diff)
    served = {"model": identity["model"], "entry": entry}
    local_model = local.header["model"]
    model = {"ref": config.model, "served_model": identity["model"], "weights": "served:" + hash_value(served),
             "config": "served:" + hash_value(entry), "tokenizer": local_model["tokenizer"],
             "tokenizer_fields": local_model.get("tokenizer_fields"), "parameters": local_model["parameters"],
             "source": {"kind": "openai-server", "url": config.engine[len(OPENAI_ENGINE_PREFIX):]},
             "local_weights": local_model["weights"]}
    model["hash"] = hash_value([model["weights"], model["config"], model["tokenizer"]])
    env = {"server": {"version": identity["version"], "headers": identity["headers"], "entry": identity["entry"]}}
    return {"config": config.as_dict(), "config_hash": config.compute_hash(), "environment": env,
            "environment_hash": environment_hash(env), "model": model, "prompt_set": local.prompt_set.as_dict(),
            "applied_flags": {}}


# ---------------------------------------------------------------- one prompt on the server

@dataclass
class ServerSteps:
    """One prompt's steps as the server scored them: ids, chosen log-probs, top-k by id, raw digests."""

    tokens: list[int]
    top: list[dict[int, float]]  # per step: id -> log-probability (mapped ids only)
    digests: list[tuple[int, int]]
    ended: bool = False  # the server ended the sequence after the last step
    wall_ms: list[float] = field(default_factory=list)


def prompt_payload(sp: ServerPrepared, ids: list[int]) -> str | list[int]:
    """Token ids where the server takes them, else the text they decode to."""
    if sp.client.accepts_token_ids(ids):
        return [int(i) for i in ids]
    return sp.local.loaded.tokenizer.decode(ids, skip_special_tokens=False)


def step_digest(token: str, logprob: float, top: dict[str, float]) -> tuple[int, int]:
    """Two int64 words over exactly what the server answered for a step (strings and float bits)."""
    items = sorted(top.items())
    raw = hash_bytes(token.encode("utf-8", "surrogatepass"), np.float64(logprob).tobytes(),
                     *[k.encode("utf-8", "surrogatepass") + np.float64(v).tobytes() for k, v in items])
    value = int(raw[:32], 16)
    return _signed(value >> 64), _signed(value & ((1 << 64) - 1))


def _signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def check_prompt_tokens(sp: ServerPrepared, completion: Completion, expected: int, what: str) -> None:
    if completion.prompt_tokens is not None and completion.prompt_tokens != expected:
        note = (f"{what}: the server counted {completion.prompt_tokens} prompt tokens, evalrun's tokenizer "
                f"{expected}: the server tokenised the text differently")
        if note not in sp.notes:
            sp.notes.append(note)


def collect(sp: ServerPrepared, completion: Completion, where: str, into: ServerSteps, limit: int) -> None:
    """Append a completion's steps (up to `limit` in all) to `into`; the chosen token must map to one id."""
    for step in completion.steps:
        if len(into.tokens) >= limit:
            return
        chosen = sp.index.lookup(step.token)
        top = sp.index.top_ids(step.top)
        if chosen is None:
            best = max(top, key=top.get) if top else None  # greedy: the chosen token is the top one
            if best is None or abs(top[best] - step.logprob) > 0:
                raise ServerError(f"{where}: the server answered token {step.token!r}, which evalrun's tokenizer "
                                  "cannot map to one id; use a server that returns token ids (vLLM) or other prompts")
            chosen = best
        top.setdefault(chosen, step.logprob)
        note = greedy_note(step.logprob, step.top, step.token, f"{where}, token {len(into.tokens)}")
        if note and not any(n.startswith(GREEDY_NOTE) for n in sp.notes):
            sp.notes.append(note)
        if len(top) < sp.config.top_k:
            raise ServerError(f"{where}: the server returned {len(top)} log-probabilities at step {len(into.tokens)} "
                              f"where {sp.asked()} were asked and top_k={sp.config.top_k} are needed; lower "
                              "--set top_k or let the server return more (vLLM: --max-logprobs)")
        into.tokens.append(chosen)
        into.top.append(top)
        into.digests.append(step_digest(step.token, step.logprob, step.top))
    if len(completion.steps) == 0 or completion.finish_reason == "stop":
        into.ended = len(into.tokens) < limit
    elif len(into.tokens) < limit:  # stored, such a run made a golden no verify could read (incomparable)
        raise ServerError(f"{where}: the server answered {len(into.tokens)} of {limit} tokens without ending the "
                          f"sequence (finish_reason {completion.finish_reason!r}: a context limit?); raise the "
                          "server's context length or lower --max-new-tokens")


def greedy_note(chosen: float, top: dict[str, float], token: str, where: str) -> str | None:
    """A note when the chosen token's log-probability trails the server's own top by more than GREEDY_SLACK: the
    server samples, or applies a penalty (llama.cpp's default repeat_penalty 1.1 does, deterministically), so
    its tokens are not the arg-max of its numbers. Recorded, not refused: a penalty is a setting of the server
    like any other, and its goldens verify against it. The server's raw numbers (two of its tokens printing one
    string share a key)."""
    best = max(top.values(), default=chosen)
    if chosen >= best - GREEDY_SLACK:
        return None
    return (f"{GREEDY_NOTE} (first at {where}: {token!r} at log-probability {chosen:.4g}, its top {best:.4g}): it "
            "samples or applies a penalty; a flip against it may be the server's choice, not its numbers")


GREEDY_NOTE = "its chosen tokens are not the top of its own log-probabilities"


def free_steps(sp: ServerPrepared, index: int) -> ServerSteps:
    """A prompt's greedy completion in one request."""
    ids = sp.prompt_set.token_ids[index]
    steps = steps_for(sp.prompt_set, index, sp.config)
    record = sp.prompt_set.records[index]
    started = time.perf_counter()
    completion = sp.client.complete(prompt_payload(sp, ids), steps, sp.asked())
    check_prompt_tokens(sp, completion, len(ids), f"prompt {record.id!r}")
    out = ServerSteps([], [], [], wall_ms=[(time.perf_counter() - started) * 1000])
    collect(sp, completion, f"prompt {record.id!r}", out, steps)
    if not out.tokens:
        raise ServerError(f"prompt {record.id!r}: the server ended the sequence before its first token; "
                          "nothing to verify for it (use other prompts)")
    return out


def forced_step(sp: ServerPrepared, index: int, path: np.ndarray, step: int) -> dict[int, float] | None:
    """The server's top-k for `step` of prompt `index` along `path` (the golden's tokens): one request
    with the prompt and path[:step] as its prompt. None when the server ends the sequence there."""
    ids = list(sp.prompt_set.token_ids[index]) + [int(t) for t in path[:step]]
    record = sp.prompt_set.records[index]
    completion = sp.client.complete(prompt_payload(sp, ids), 1, sp.asked())
    check_prompt_tokens(sp, completion, len(ids), f"prompt {record.id!r} forced at step {step}")
    out = ServerSteps([], [], [])
    collect(sp, completion, f"prompt {record.id!r} forced at step {step}", out, 1)
    return {"token": out.tokens[0], "top": out.top[0]} if out.tokens else None


# ---------------------------------------------------------------- a server run as a stored Run

def probe_columns(top: list[dict[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Per step the ids by log-probability (the server's own top), cut to the fewest any step has:
    probe_ids [N, K'] int64, probe_values [N, K'] float64."""
    width = min(len(t) for t in top)
    ordered = [sorted(t.items(), key=lambda item: (-item[1], item[0]))[:width] for t in top]
    return (np.array([[i for i, _ in row] for row in ordered], dtype=np.int64),
            np.array([[v for _, v in row] for row in ordered], dtype=np.float64))


def to_result(sp: ServerPrepared, index: int, steps: ServerSteps) -> PromptResult:
    """One prompt's server steps as a PromptResult in the store's shapes (values: log-probabilities)."""
    k = sp.config.top_k
    probe_ids, probe_values = probe_columns(steps.top)
    tokens = np.array(steps.tokens, dtype=np.int64)
    digests = np.array(steps.digests, dtype=np.int64).reshape(-1, 2)
    arrays = {"input_ids": np.asarray(sp.prompt_set.token_ids[index], dtype=np.int64), "tokens": tokens,
              "digests": digests, "topk_ids": probe_ids[:, :k], "topk_values": probe_values[:, :k],
              "margins": probe_values[:, 0] - probe_values[:, 1], "probe_ids": probe_ids, "probe_values": probe_values}
    record = sp.prompt_set.records[index]
    text = sp.local.loaded.tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
    return PromptResult(index, record.id, record.as_dict(), index, 0, len(sp.prompt_set.token_ids[index]), len(tokens),
                        len(tokens) if steps.ended else -1, text, hash_bytes(tokens.astype("<i8").tobytes(), b"end" if steps.ended else b""),
                        hash_bytes(digests.astype("<i8").tobytes()), arrays)


def execute_server(sp: ServerPrepared, progress: Callable[[int], None] | None = None) -> Run:
    """Every prompt once, greedy, one request each (the server batches as it likes)."""
    started = time.perf_counter()
    results, wall = [], []
    for index in range(len(sp.prompt_set.records)):
        steps = free_steps(sp, index)
        results.append(to_result(sp, index, steps))
        wall += steps.wall_ms
        if progress:
            progress(1)
    seconds = time.perf_counter() - started
    generated = sum(len(r.arrays["tokens"]) for r in results)
    timings = {"load_s": sp.local.load_seconds, "compile_s": 0.0, "warmup_s": 0.0,
               "ttft_ms": {"mean": float(np.mean(wall)), "p50": float(np.median(wall)), "first_request": float(wall[0])},
               "step_latency": latency_summary(np.array([])), "generate_s": seconds,
               "tokens_per_s": generated / seconds if seconds > 0 else 0.0, "tokens_generated": generated,
               "peak_memory": {"bytes": 0, "kind": "server (not measured)"}, "request_ms": wall}
    evidence = {"server": sp.identity, "prompt_format": "token ids" if sp.client.token_ids_accepted else "text",
                "logprobs_asked": sp.asked(), "notes": list(sp.notes), "ambiguous_token_strings": sp.index.ambiguous,
                "unknown_token_strings": sp.index.unknown, "fallbacks": [], "config_adjustments": list(sp.config.adjustments),
                "compile_s": 0.0}
    plan = [{"batch": r.prompt_index, "prompt_ids": [r.prompt_id], "padded_length": r.input_tokens} for r in results]
    return Run(sp.header, results, timings, evidence, plan)


def execute_server_run(config: RunConfig, store: Store | Callable[[], Store] | None, label: str | None = None,
                       progress_factory: Callable[[int], Any] | None = None) -> Run:
    """`evalrun run --engine openai:URL`: ask the server who it is, run every prompt, record the run
    (`running`, then `complete`, or `failed` with the one-line error when the server fails midway). `store` may
    be a function that opens it once the server has answered who it is (runner.open_when_good)."""
    sp = prepare_server(config)
    store = open_when_good(store)

    def produce() -> Run:
        bar = progress_factory(len(sp.prompt_set.records)) if progress_factory else None
        with (bar if bar is not None else NullBar()) as active:
            return execute_server(sp, active.update)

    return record(store, sp.header, produce, label)
