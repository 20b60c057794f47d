"""A golden made from a server (`golden create NAME --engine openai:URL`), and the float64 oracle beside it.

Roles: `pinned` is the server's greedy run; the envelope members and the function role are that same
run (a server offers no second known-good implementation, nor a float32 eager run in its
environment); `oracle` is the local model (`--model`, which must be the model the server serves) in
float64, teacher-forced along the server's tokens in one forward pass, scored as log-probabilities
(log_softmax over the whole vocabulary, so they compare with what the server returns) at the ids the
server returned each step.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .engine.capture import digest_hex, logits_digest
from .golden import CreatedRuns, Golden, Hook, create_golden, oracle_config
from .hashing import hash_bytes
from .runner import Prepared, Run, prepare
from .server_run import ServerPrepared, execute_server, local_config, prepare_server
from .store import PromptResult


@torch.no_grad()
def oracle_logprobs(prepared: Prepared, prompt: list[int], tokens: np.ndarray) -> torch.Tensor:
    """[N, V] float64 log-probabilities of each step along `tokens` (teacher forcing, one pass)."""
    model = prepared.loaded.model
    sequence = torch.tensor([list(prompt) + tokens[:-1].tolist()], dtype=torch.long, device=model.device)
    logits = model(input_ids=sequence).logits[0, len(prompt) - 1:].to(torch.float64)  # [N, V]
    return torch.log_softmax(logits, dim=-1)


def oracle_result(prepared: Prepared, pinned: PromptResult, top_k: int) -> PromptResult:
    """The oracle's PromptResult along the pinned tokens, probed at the pinned run's probe ids."""
    tokens, probe_ids = pinned.arrays["tokens"], pinned.arrays["probe_ids"]
    logprobs = oracle_logprobs(prepared, pinned.arrays["input_ids"].tolist(), tokens)  # [N, V]
    values, ids = torch.topk(logprobs, top_k, dim=-1)
    digests = logits_digest(logprobs).numpy()  # [N, 2]
    arrays = {"input_ids": pinned.arrays["input_ids"], "tokens": tokens, "digests": digests,
              "topk_ids": ids.numpy(), "topk_values": values.numpy(), "margins": (values[:, 0] - values[:, 1]).numpy(),
              "probe_ids": probe_ids,
              "probe_values": torch.gather(logprobs, 1, torch.from_numpy(probe_ids)).numpy()}
    return PromptResult(pinned.prompt_index, pinned.prompt_id, pinned.record, pinned.batch_index, 0, pinned.input_tokens,
                        pinned.new_tokens, pinned.eos_step, pinned.output_text, pinned.tokens_digest,
                        hash_bytes(*[digest_hex(d).encode() for d in digests]), arrays)


def oracle_run(sp: ServerPrepared, pinned: Run, hook: Hook | None = None) -> Run:
    """The float64 oracle of the local model along the server's tokens."""
    config = oracle_config(local_config(sp.config), sp.local.header["model"]["parameters"])
    prepared = prepare(config, reuse=sp.local)
    if hook:
        hook(prepared)
    started = time.perf_counter()
    results = [oracle_result(prepared, r, sp.config.top_k) for r in pinned.results]
    timings = {"load_s": prepared.load_seconds, "generate_s": time.perf_counter() - started}
    return Run(prepared.header, results, timings, {"fallbacks": [], "teacher_forced": True})


def make_server_runs(config, progress=None, hook: Hook | None = None) -> CreatedRuns:
    """A server golden's runs: the server's greedy run, and the local float64 oracle along its tokens."""
    started = time.perf_counter()
    sp = prepare_server(config)
    if hook:
        hook(sp.local)
    pinned = execute_server(sp, progress("pinned", len(sp.prompt_set.records)) if progress else None)
    seconds = {"pinned_s": time.perf_counter() - started}
    started = time.perf_counter()
    oracle = oracle_run(sp, pinned, hook)
    seconds["oracle_s"] = time.perf_counter() - started
    runs = {"pinned": pinned, "oracle": oracle, "envelope:pinned": pinned, "envelope:reference": pinned, "function": pinned}
    meta = {"server": {"values": "log-probabilities", "logprobs_asked": sp.asked(), "notes": sp.notes,
                       "prompt_format": pinned.evidence["prompt_format"]}}
    return CreatedRuns(runs, seconds, meta)


def create_server_golden(name: str, config, directory, force: bool = False, progress=None,
                         cuda_available: bool | None = None) -> Golden:
    """`golden create NAME --engine openai:URL`: golden.create_golden with the server's runs."""
    return create_golden(name, config, directory, force, progress, cuda_available=cuda_available, make=make_server_runs)
