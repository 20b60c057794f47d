"""Baseline: transformers' own `generate` on the same model and prompts, for `evalrun bench`.

  python -m evalrun.hf_baseline --kind eager|static-compile [RUN OPTIONS subset]

`eager` is plain greedy `generate` with its dynamic cache; `static-compile` uses
`cache_implementation="static"`, for which `generate` compiles the decoding forward itself (its
`compile_config`). Compiling `model.forward` by hand with mode reduce-overhead broke on the H200
(CUDA-graph outputs overwritten between generate's steps), so the built-in path is the baseline.
Batch 1, one prompt at a time, exactly its own max_new_tokens each (the prompt's, else --max-new-tokens,
as evalrun's runs decode), after a warm-up of every prompt.
Prints the same timing JSON shape as `evalrun run --json`.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from .config import build_config
from .errors import EvalrunError
from .engine.timing import latency_summary, peak_memory_bytes, reset_peak_memory
from .models import load_model
from .prompts import load_prompt_set
from .runner import effective_config, steps_for


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StepTimes:
    """A logits processor that only records when each step's scores are ready (synchronised on GPU):
    the first is the time to first token, the gaps between them the decode steps of the same call."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def timed_generate(model, ids: list[int], new_tokens: int, kind: str, device: torch.device) -> tuple[float, np.ndarray]:
    """One greedy generate of `new_tokens`: (total seconds, [new_tokens] seconds from the start to each
    step's scores). `benchmarks/cpu_decode_floor.py` times transformers with it too."""
    from transformers import LogitsProcessorList

    inputs = torch.tensor([ids], device=device)
    options = {"cache_implementation": "static"} if kind == "static-compile" else {}
    clock = _StepTimes(device)
    _synchronize(device)
    started = time.perf_counter()
    model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]), **options)
    _synchronize(device)
    return time.perf_counter() - started, np.array(clock.times) - started


def main() -> None:
    """Only the options a baseline honours are accepted (batch 1, transformers' own execution);
    anything else is refused by the parser (exit 2), never silently ignored."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=("eager", "static-compile"), required=True)
    for name in ("--model", "--prompts", "--dtype", "--device", "--max-new-tokens"):
        parser.add_argument(name)
    args = parser.parse_args()
    flags = {"model": args.model, "prompts": args.prompts, "dtype": args.dtype, "device": args.device,
             "max_new_tokens": args.max_new_tokens}
    try:
        effective = effective_config(build_config(flags=flags))
    except EvalrunError as error:
        parser.exit(2, f"evalrun.hf_baseline: error: {error}\n")
    device = torch.device(effective.device)
    loaded = load_model(effective.model, effective.device, effective.dtype)
    model = loaded.model
    model.generation_config.pad_token_id = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id
    started = time.perf_counter()
    prompts = load_prompt_set(effective.prompts, loaded.tokenizer)
    # each prompt's own step count (its max_new_tokens, else the config's), as evalrun's rows decode it
    steps = [steps_for(prompts, index, effective) for index in range(len(prompts.token_ids))]
    first_request = timed_generate(model, prompts.token_ids[0], 1, args.kind, device)[0]
    # Warm-up, as evalrun warms each shape: a static cache is sized prompt + new tokens, so every
    # prompt length compiles its own decoding graph, and CUDA graphs record on a second call.
    for ids, new_tokens in zip(prompts.token_ids, steps):
        for _ in range(2):
            timed_generate(model, ids, new_tokens, args.kind, device)
    compile_s = time.perf_counter() - started
    reset_peak_memory(device)
    ttft, totals, decode_ms = [], [], []
    for ids, new_tokens in zip(prompts.token_ids, steps):  # one call per prompt: TTFT and each decode step within it
        total, ready = timed_generate(model, ids, new_tokens, args.kind, device)
        totals.append(total)
        ttft.append(ready[0])
        decode_ms.extend(np.diff(ready) * 1000)
    decode_ms = decode_ms or [0.0]  # one new token: no decode step
    from torch._dynamo.utils import counters

    print(json.dumps({"timings": {
        "compile_s": compile_s, "ttft_ms": {"p50": float(np.median(ttft)) * 1000, "first_request": first_request * 1000},
        "tokens_per_s": sum(steps) / sum(totals), "step_latency": latency_summary(np.array(decode_ms)),
        "peak_memory": peak_memory_bytes(device)},
        # transformers compiles a static cache's decoding only on accelerators: on CPU this kind runs eagerly
        "compiled_graphs": int(counters["stats"]["unique_graphs"])}))


if __name__ == "__main__":
    main()
