"""Verify a server (`golden verify NAME --engine openai:URL`) against a golden: what the API lets us claim.

1. Gates: the prompts must encode to the golden's ids (else incomparable). For a golden made from a
   server, the served model's identity (name and model-list entry) must match (else changed); for a
   golden made by evalrun's engine it cannot be checked (a server does not expose its weights), and
   the causes say so.
2. The server runs greedy, one request per prompt. A golden from a server: every token and every
   step's digest of exactly what the server answered equal -> identical (no other request).
3. Forced decoding through the API: for each step from the first divergence on, one request whose
   prompt is the prompt plus the golden's tokens so far, max_tokens 1: the server's top-k
   log-probabilities along the golden's path.
4. Execution check only, with the calibrated rule (rules.EXECUTION_RULE, float32 budgets: servers
   return float32 numbers): the candidate's error against the golden's float64 oracle, at most m x the
   golden's known-good implementations' error. The compared ids per step are the golden's probe ids
   the server can return (its top-k); an id the candidate's top-k lacks gets the candidate's lowest
   returned value (a bound, counted in the causes).
   Values: a golden from a server stores log-probabilities (its oracle too): compared as they are. A
   golden from evalrun's engine stores logits without the full-vocabulary logsumexp, so every member
   is renormalised over the compared ids (log-softmax over them): exact for the distribution among
   those ids, blind to probability mass moving to ids outside them.
   The function check does not run: it needs float32 eager in the candidate's environment, which a
   server does not offer.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from .compare import dict_diff, digest_mismatch_steps, environment_causes, first_divergence, worst_verdict
from .config import EffectiveConfig, RunConfig
from .engine.openai_server import identity_entry
from .golden import ENVELOPE_ROLES, Golden
from .hashing import hash_value
from .rules import EXECUTION_RULE, Evidence, aggregate, judge, judge_set, rule_for, step_errors, typical
from .runner import Run, steps_for
from .server_run import ServerPrepared, execute_server, forced_step, is_server, prepare_server
from .store import PromptResult
from .verify import CheckReport, FlipReport, PromptVerdict, Verdict, exit_code_for

FUNCTION_LINE = ("not run: it needs float32 eager in the candidate's environment, which a server does not offer; "
                 "the verdict rests on the execution check")


def verify_with_server(golden: Golden, config: RunConfig | EffectiveConfig, strict: bool = False,
                       progress: Callable[[str, int], Any] | None = None,
                       observe: Callable[[str, Run], None] | None = None) -> Verdict:
    """The verdict of the server `config` names against `golden` (module docstring). `observe(phase, run)`
    sees the candidate's run (phase "candidate"), as verify.verify_golden's observer does."""
    started = time.perf_counter()
    sp = prepare_server(config)
    pinned_config = golden.config("pinned")
    from_server = is_server(pinned_config)
    config_diff = dict_diff(pinned_config.factors(), sp.config.factors())
    golden_env = golden.pinned.json["environment"]
    env_diff = dict_diff(golden_env, sp.header["environment"])
    causes = [f"config: {k} {a} -> {b}" for k, a, b in config_diff]
    if from_server:
        causes += environment_causes(env_diff, golden_env, sp.header["environment"])
    else:  # evalrun's environment record against a server's identity: every key differs, name the server once
        causes.append(f"environment: the golden ran in evalrun's engine; the candidate is a server "
                      f"({hash_value(sp.header['environment'])[:12]}: {sp.identity['headers'] or 'no identifying headers'}, "
                      f"version {sp.identity['version']})")
    golden_results = golden.results("pinned")
    steps = {r.prompt_index: min(steps_for(sp.prompt_set, r.prompt_index, sp.config), len(r.arrays["tokens"]))
             for r in golden_results}
    timings: dict[str, float] = {}

    def verdict(name: str, prompts: list[PromptVerdict], execution: str, distance: float = 0.0, closest: str = "",
                envelope: list[str] | None = None, model_diff: list[str] | None = None) -> Verdict:
        timings["total_s"] = time.perf_counter() - started
        causes.extend(f"server: {note}" for note in sp.notes if f"server: {note}" not in causes)  # found in the runs
        return Verdict(golden.name, name, exit_code_for(name, strict), causes, prompts, config_diff, env_diff,
                       model_diff or [], FUNCTION_LINE if prompts else "skipped: " + name, execution, distance, closest,
                       envelope or [], max(steps.values()) if steps else None, sp.config.as_dict(), timings)

    gated = _gate(golden, sp, golden_results, steps, from_server)
    if gated is not None:
        name, cause, model_diff = gated
        causes.insert(0, cause)
        return verdict(name, [], "skipped: " + name, model_diff=model_diff)
    if not from_server:
        causes.append(f"model identity: not checkable through the API (the server names its model "
                      f"{sp.identity['model']!r}, not its weights); the numbers decide")
    causes += [f"server: {note}" for note in sp.notes]
    bar = progress("candidate", len(sp.prompt_set.records)) if progress else None
    free = execute_server(sp, bar)
    if observe:
        observe("candidate", free)
    timings["candidate_s"] = free.timings["generate_s"]
    by_index = free.by_index()
    prompts = [_free_verdict(g, by_index[g.prompt_index], steps[g.prompt_index], from_server) for g in golden_results]
    if from_server and all(p.verdict == "identical" for p in prompts):
        causes.append("every token and every step's answer (top-k log-probabilities, bit for bit) equal")
        return verdict("identical", prompts, "skipped: identical")
    started_forced = time.perf_counter()
    judged = _judge_all(golden, sp, golden_results, by_index, prompts, steps, from_server, causes, progress)
    timings["forced_s"] = time.perf_counter() - started_forced
    return _decide(golden, sp, golden_results, prompts, judged, from_server, causes, verdict, by_index)


def _gate(golden: Golden, sp: ServerPrepared, golden_results: list[PromptResult], steps: dict[int, int],
          from_server: bool) -> tuple[str, str, list[str]] | None:
    records = [r.record for r in golden_results]
    if hash_value(records) != hash_value([r.as_dict() for r in sp.prompt_set.records]):
        return ("incomparable", f"prompt set differs from the golden's ({golden.pinned.json['prompt_set']['name']}): "
                "verify with the golden's prompts", [])
    for result, ids in zip(golden_results, sp.prompt_set.token_ids):
        if not np.array_equal(result.arrays["input_ids"], np.asarray(ids, dtype=np.int64)):
            return ("incomparable", f"prompt {result.prompt_id!r} encodes to other token ids than in the golden: "
                    "pass the --model whose tokenizer the golden used", ["tokenizer"])
        vocab = sp.local.loaded.vocab_size
        if result.arrays["tokens"].max() >= vocab or result.arrays["tokens"].min() < 0:
            return ("incomparable", f"the golden's tokens for prompt {result.prompt_id!r} fall outside the local "
                    f"model's {vocab} ids: pass the --model the golden was made with", [])
    for result in golden_results:
        wanted = steps_for(sp.prompt_set, result.prompt_index, sp.config)
        if wanted > len(result.arrays["tokens"]) and result.eos_step < 0:
            return ("incomparable", f"prompt {result.prompt_id!r}: the golden holds {len(result.arrays['tokens'])} new "
                    f"tokens, the candidate asks {wanted}; verify with --max-new-tokens {len(result.arrays['tokens'])}", [])
    if from_server:
        theirs, ours = golden.pinned.json["model"], sp.header["model"]
        # by the entries themselves: a golden made before SERVING_FIELDS hashed its whole entry into its identity
        entry = ((golden.pinned.json.get("environment") or {}).get("server") or {}).get("entry")
        same = ((theirs.get("served_model"), identity_entry(entry)) ==
                (ours["served_model"], identity_entry(sp.identity["entry"])) if entry is not None else
                (theirs.get("weights"), theirs.get("config")) == (ours["weights"], ours["config"]))
        if not same:
            return ("changed", f"model identity: the server serves {ours.get('served_model')!r} "
                    f"({sp.identity['entry']}), the golden's served {theirs.get('served_model')!r}", ["weights"])
    return None


def _continued(golden_run: PromptResult, free: PromptResult, steps: int, from_server: bool) -> bool:
    """The golden's server ended the sequence after `steps` tokens, and the candidate, along the same tokens, went
    on: its end-of-sequence decision differs at step `steps`, where the golden holds no numbers (identical, unjudged,
    before). A candidate that left the golden's tokens earlier is at another context by then: its own step `steps`
    says nothing about where the golden ended (judged there, a flip within the budget read as `changed`)."""
    ended, tokens = len(golden_run.arrays["tokens"]), free.arrays["tokens"]
    return (from_server and golden_run.eos_step >= 0 and golden_run.eos_step == ended == steps
            and len(tokens) > steps and np.array_equal(tokens[:steps], golden_run.arrays["tokens"]))


def _free_verdict(golden_run: PromptResult, free: PromptResult, steps: int, from_server: bool) -> PromptVerdict:
    g_tokens, c_tokens = golden_run.arrays["tokens"][:steps], free.arrays["tokens"][:steps]
    mismatches = digest_mismatch_steps(golden_run.arrays["digests"][:steps], free.arrays["digests"][:steps])
    continued = _continued(golden_run, free, steps, from_server)
    same = from_server and mismatches.size == 0 and np.array_equal(g_tokens, c_tokens) and not continued and (
        (golden_run.eos_step >= 0) == (free.eos_step >= 0) or len(g_tokens) >= steps)
    digest_diffs = int(mismatches.size) if from_server else min(len(g_tokens), len(c_tokens))
    first = first_divergence(g_tokens, c_tokens)
    return PromptVerdict(golden_run.prompt_id, "identical" if same else "drift",
                         steps if continued and first < 0 else first, digest_diffs)


def _end_flip(sp: ServerPrepared, free: PromptResult, step: int, allowed: float) -> tuple[float | None, str]:
    """The golden's server ended at `step` and the candidate chose a token: how far below its choice the candidate
    put end-of-sequence (the golden holds no numbers there). Exact where end-of-sequence is among the candidate's
    ids at that step; where it is not, at least the choice's lead over the last id shown, when every string the
    server answered was read as an id (end-of-sequence left out as ambiguous, llama.cpp's "", could be anywhere:
    None, not judged)."""
    ids, values = free.arrays["probe_ids"][step].tolist(), free.arrays["probe_values"][step].tolist()
    chosen, eos = int(free.arrays["tokens"][step]), sp.index.eos
    text = f"step {step}: the golden's server ended the sequence, the candidate continued with " \
           f"{sp.local.loaded.tokenizer.decode([chosen])!r}"
    if chosen not in ids:
        return None, f"{text} (outside its own top-k: not judged)"
    if eos in ids:
        gap = values[ids.index(chosen)] - values[ids.index(eos)]
        return gap, f"{text} (its end-of-sequence {gap:.3g} below its choice, allowed {allowed:.3g})"
    if sp.index.ambiguous or sp.index.unknown:
        return None, (f"{text} (its end-of-sequence is not among the ids its answers were read as: "
                      f"{sp.index.ambiguous + sp.index.unknown} strings were ambiguous or unknown; not judged)")
    gap = values[ids.index(chosen)] - min(values)
    return gap, f"{text} (its end-of-sequence at least {gap:.3g} below its choice, allowed {allowed:.3g})"


# ---------------------------------------------------------------- the execution check's evidence

def _columns(golden: Golden, golden_run: PromptResult, steps: int, width: int, from_server: bool):
    """(probe ids [N, K], oracle [N, K], envelope members [(name, [N, K])], absolute) for one prompt.

    `absolute`: the values are log-probabilities over the whole vocabulary (a server golden's, or an
    evalrun golden that stores each step's logsumexp); else log-softmax over the K compared ids."""
    index = golden_run.prompt_index
    oracle = next(r for r in golden.results("oracle") if r.prompt_index == index)
    if from_server:
        ids = golden_run.arrays["probe_ids"][:steps]
        return (ids, oracle.arrays["probe_values"][:steps],
                [("the golden's server run", golden_run.arrays["probe_values"][:steps])], True)
    ids = oracle.arrays["probe_ids"][:steps, :width]
    results, seen = [("oracle", oracle)], set()
    for role in (*ENVELOPE_ROLES, "function"):
        run_id = golden.run_id(role)
        if run_id not in seen:
            seen.add(run_id)
            config = golden.config(role)
            results.append((f"{role} ({config.dtype} -O{config.opt_level} on {config.device})",
                            next(r for r in golden.results(role) if r.prompt_index == index)))
    absolute = [_logprobs(result, steps, width) for _, result in results]
    if any(values is None for values in absolute):  # a golden from before probe_logsumexp was stored
        absolute = [_renormalised(result.arrays["probe_values"][:steps, :width]) for _, result in results]
        return ids, absolute[0], list(zip([name for name, _ in results[1:]], absolute[1:])), False
    return ids, absolute[0], list(zip([name for name, _ in results[1:]], absolute[1:])), True


def _oracle_top(golden: Golden, index: int, steps: int, from_server: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """A server golden's oracle top-k (log-probabilities over the whole vocabulary, as its probe values): a flip to
    an id the server did not show (llama.cpp prints every special token as "", so its end-of-sequence is never
    among the probes) is judged at the oracle's gap, not as a flip across a clear margin."""
    if not from_server:
        return None
    oracle = next(r for r in golden.results("oracle") if r.prompt_index == index)
    return oracle.arrays["topk_ids"][:steps], oracle.arrays["topk_values"][:steps].astype(np.float64)


def _logprobs(result: PromptResult, steps: int, width: int) -> np.ndarray | None:
    """[N, K] log-probabilities at the probe ids from stored logits and logsumexp; None when not stored."""
    lse = result.arrays.get("probe_logsumexp")
    if lse is None or lse.shape != result.arrays["tokens"].shape or not np.all(np.isfinite(lse[:steps])):
        return None
    return result.arrays["probe_values"][:steps, :width].astype(np.float64) - lse[:steps, None]


def _renormalised(values: np.ndarray) -> np.ndarray:
    """[N, K] logits or log-probabilities -> log-softmax over those K ids, per step (float64)."""
    wide = values.astype(np.float64)
    top = wide.max(-1, keepdims=True)
    return wide - top - np.log(np.exp(wide - top).sum(-1, keepdims=True))


def _candidate_path(sp: ServerPrepared, golden_run: PromptResult, free: PromptResult, steps: int, first: int):
    """Per step along the golden's tokens: (own token, top dict or None when the server ended there)."""
    path = golden_run.arrays["tokens"]
    out = []
    free_ids, free_values = free.arrays["probe_ids"], free.arrays["probe_values"]
    for step in range(steps):
        if 0 <= first <= step or step >= len(free_ids):
            scored = forced_step(sp, golden_run.prompt_index, path, step)
            out.append((scored["token"], scored["top"]) if scored else (None, None))
        else:
            out.append((int(free.arrays["tokens"][step]), dict(zip(free_ids[step].tolist(), free_values[step].tolist()))))
    return out


def _judge_all(golden, sp, golden_results, by_index, prompts, steps, from_server, causes, progress):
    """Per prompt: (Judgement, envelope names), with the candidate scored along the golden's path."""
    evidence, bounded, ended, renormalised = {}, 0, [], False
    bar = progress("forced", len(golden_results)) if progress else None
    for golden_run, prompt in zip(golden_results, prompts):
        index, n = golden_run.prompt_index, steps[golden_run.prompt_index]
        first = prompt.first_divergent_step if prompt.verdict != "identical" else -1
        path = _candidate_path(sp, golden_run, by_index[index], n, first)
        width = min(len(top) for _, top in path if top) if any(top for _, top in path) else sp.config.top_k
        ids, oracle, members, absolute = _columns(golden, golden_run, n, min(width, 64), from_server)
        renormalised = renormalised or not absolute
        values = np.empty(ids.shape, dtype=np.float64)
        tokens = np.empty(n, dtype=np.int64)
        for step, (token, top) in enumerate(path):
            if top is None:  # the server ended the sequence here: no numbers; a flip unless the golden ended too
                values[step] = members[0][1][step]
                tokens[step] = sp.index.eos if sp.index.eos is not None else -1
                if tokens[step] != golden_run.arrays["tokens"][step]:
                    ended.append(f"{golden_run.prompt_id}@{step}")
                continue
            floor = min(top.values())
            row = [top.get(int(i)) for i in ids[step]]
            bounded += sum(v is None for v in row)
            values[step] = [floor if v is None else v for v in row]
            tokens[step] = token
        if not absolute:
            values = _renormalised(values)
        evidence[index] = (Evidence(values, tuple(m for _, m in members), oracle, ids, tokens,
                                    golden_run.arrays["tokens"][:n], _oracle_top(golden, index, n, from_server)),
                           [name for name, _ in members])
        if bar:
            bar(1)
    if bounded:
        causes.append(f"{bounded} compared values were outside the candidate's top-k and stand at its lowest "
                      "returned log-probability (a bound)")
    if ended:
        causes.append(f"the server ended the sequence where the golden continues ({', '.join(ended[:5])}): "
                      "judged as a greedy flip to end-of-sequence")
    causes.append("checks run: execution check on the top-k the server returns, as " + (
        "log-probabilities renormalised over the compared ids (the golden stores logits without each step's "
        "full-vocabulary logsumexp: made before evalrun stored it; mass moving outside those ids is not seen)"
        if renormalised else "log-probabilities over the whole vocabulary") + "; function check not run")
    return evidence


def _decide(golden, sp, golden_results, prompts, evidence, from_server, causes, verdict, by_index) -> Verdict:
    oracle_dtype = golden.config("oracle").dtype
    rule = rule_for(EXECUTION_RULE, "float32", oracle_dtype)
    envelope_errors = [max(aggregate(step_errors(m, e.oracle)) for m in e.envelope) for e, _ in evidence.values()]
    typical_error = typical(envelope_errors)
    tokenizer = sp.local.loaded.tokenizer
    judgements, failed, closest = [], [], []
    for golden_run, prompt in zip(golden_results, prompts):
        if prompt.verdict == "identical":
            continue
        item, _ = evidence[golden_run.prompt_index]
        judgement = judge(item, "float32", rule, typical_error)
        judgements.append(judgement)
        prompt.execution = CheckReport.of(judgement)
        prompt.distance = judgement.distance
        prompt.flips = [FlipReport(f.step, tokenizer.decode([f.reference_token]),
                                   tokenizer.decode([f.candidate_token]) if f.candidate_token >= 0 else "<end>",
                                   float(golden_run.arrays["margins"][f.step]), f.oracle_gap, f.allowed_gap, f.passed)
                        for f in judgement.flips]
        closest.append((judgement.distance, f"prompt {prompt.prompt_id}, execution check"))
        free, ended = by_index[golden_run.prompt_index], len(golden_run.arrays["tokens"])
        if not judgement.reason and _continued(golden_run, free, ended, from_server):
            allowed = rule.flip_multiplier * judgement.envelope_error + judgement.floor
            gap, line = _end_flip(sp, free, ended, allowed)
            causes.append("end of sequence: " + line)
            if gap is not None and gap > allowed:
                judgement.reason = "the sequence not ended where the golden's server ended it: " + line
                judgement.distance = max(judgement.distance, gap / max(allowed, np.finfo(np.float64).tiny))
        if judgement.reason:
            prompt.verdict, prompt.reason = "changed", "execution check: " + judgement.reason
            failed.append(prompt.prompt_id)
        else:
            prompt.reason = f"within the budget (at {judgement.distance:.2f})"
    set_distance = judge_set(judgements, rule)
    closest.append((set_distance, "the whole set, execution check"))
    if set_distance > 1 and not failed:
        failed.append("(the set)")
    if failed:
        causes.append(f"execution check failed on {', '.join(failed[:5])}: the server's numbers sit farther from the "
                      "golden's float64 oracle than its known-good implementations allow")
        if not from_server:
            causes.append("the golden was made by evalrun's engine, which computes with the weights as stored in "
                          "float (a GGUF dequantized); a server that computes with quantized weights and activations "
                          "(llama.cpp) is a different function, so this distance measures quantization, not drift")
    distance, where = max(closest, key=lambda item: item[0])
    first = next(iter(evidence.values()))[1]
    envelope = [f"{name}, against the float64 oracle ({oracle_dtype})" for name in first]
    overall = "changed" if failed else worst_verdict([p.verdict for p in prompts])
    line = f"server vs the envelope, against the {oracle_dtype} oracle: set at {set_distance:.2f} of the budget"
    return verdict(overall, prompts, line, distance, where, envelope)
