"""False `changed` at MoE routing ties, before and after forced routing (stop 20). For each seed, a random tiny
Qwen3-MoE checkpoint (--experts 32, --top-k 4, --layers 2 by default: bfloat16 router ties are common), a bfloat16
(--dtype) -O0 golden on the smoke prompts (16 tokens), verified at each level given, twice in one process: as verify
runs now (forced routing) and with forced routing switched off (verify's `Context.routing` answering None: the
forced run then routes freely, as before stop 20). A legitimate change of bits should never say changed. Under
forced routing each prompt's decisive flip is recorded as `flip_ratios`: the gap it needs / the golden's own router
error against the oracle (rules.ROUTING_FLIP_MULTIPLIER is calibrated on their maximum).

--golden-routing free makes the golden as before stop 21: its oracle, envelope and function runs route freely, and
verify measures its router error before the first flip only (the default, pinned: they follow the pinned run's
routing, and the error is measured at every entry).

--prompt-routing free makes golden and verify as before stop 24: the tokens of a prompt before its last route
freely in every run (pinned, the default: they follow the pinned run's prompt routing too); `both` verifies each
seed both ways, side by side (two goldens per seed).

    python benchmarks/moe_forced_routing.py OUT.json --device cuda --seeds 0-9 --levels 1,2 [--forced-only] [--dtype D]
        [--experts 128 --top-k 8 --layers 24 | --model random:qwen3-moe --seeds 0] [--golden-routing free|pinned]
        [--prompts default] [--prompt-routing pinned|free|both]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from evalrun import golden as golden_module  # noqa: E402
from evalrun import verify as verify_module  # noqa: E402
from evalrun.config import build_config  # noqa: E402
from evalrun.golden import create_golden, open_golden  # noqa: E402
from evalrun.routing import RoutingPath, routing_path  # noqa: E402
from evalrun.rules import ROUTING_FLIP_MULTIPLIER  # noqa: E402
from evalrun.verify import candidate_config, verify_golden  # noqa: E402
from test_moe import moe_checkpoint  # noqa: E402


LONG = {"max_position_embeddings": 8192}  # the default set's long-context prompt (byte tokens) and its decode


def seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--levels", default="1,2")
    parser.add_argument("--forced-only", action="store_true", help="skip the verification without forced routing")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (a real Qwen3-MoE has 48)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--prompts", default="smoke", help="default: 17 prompts, one of about 7,000 byte tokens")
    parser.add_argument("--golden-routing", choices=("pinned", "free"), default="pinned")
    parser.add_argument("--prompt-routing", choices=("pinned", "free", "both"), default="pinned")
    parser.add_argument("--model", help="this model instead of random checkpoints (random:qwen3-moe on the H200: "
                                        "Qwen3-30B-A3B's layer shape); --seeds 0 then")
    args = parser.parse_args()
    if args.golden_routing == "free":
        golden_module.pinned_routing = lambda pinned: None
    forced_routing = verify_module.Context.routing

    def candidate_free(context, config=None):  # the candidate's runs route freely (the golden's other configs do not)
        return None if config is None or config is context.candidate.config else forced_routing(context, config)

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in seeds(args.seeds):
            directory = args.model or moe_checkpoint(Path(folder) / f"moe{seed}", seed=seed, num_experts=args.experts,
                                                     num_experts_per_tok=args.top_k, num_hidden_layers=args.layers,
                                                     **({} if args.prompts == "smoke" else LONG))
            config = build_config(None, {"model": str(directory), "prompts": args.prompts,
                                         "max_new_tokens": args.max_new_tokens,
                                         "dtype": args.dtype, "device": args.device, "opt_level": 0}, ())
            for prompt_routing in ("pinned", "free") if args.prompt_routing == "both" else (args.prompt_routing,):
                along = routing_path if prompt_routing == "pinned" else steps_only
                golden_module.routing_path = verify_module.routing_path = along
                create_golden("g", config, Path(folder) / f"g{seed}-{prompt_routing}")
                golden = open_golden("g", Path(folder) / f"g{seed}-{prompt_routing}")
                rows += verify_levels(golden, seed, args, forced_routing, candidate_free, prompt_routing)
    summary = {}
    for row in rows:
        key = f"-O{row['level']}, {row['verify']}, prompt routing {row['prompt_routing']}"
        entry = summary.setdefault(key, {"verifications": 0, "changed": 0, "with_flips": 0, "max_distance": 0.0,
                                         "flips_judged": 0, "max_flip_ratio": 0.0})
        entry["verifications"] += 1
        entry["changed"] += row["verdict"] == "changed"
        entry["with_flips"] += row["prompts_with_flips"] > 0
        entry["max_distance"] = max(entry["max_distance"], row["distance"])
        ratios = [r if r is not None else float("inf") for r in row["flip_ratios"]]
        entry["flips_judged"] += len(ratios)
        entry["max_flip_ratio"] = max([entry["max_flip_ratio"], *ratios])
    Path(args.out).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "experts": args.experts,
                                         "top_k": args.top_k, "layers": args.layers,
                                         "golden_routing": args.golden_routing, "model": args.model,
                                         "prompt_routing": args.prompt_routing,
                                         "prompts": args.prompts,
                                         "summary": summary, "rows": rows},
                                         indent=1))
    print(json.dumps(summary, indent=1))


def steps_only(arrays) -> RoutingPath:
    """The path forced runs followed before stop 24: the steps' experts; the prompt's tokens route freely."""
    return RoutingPath(arrays["routing_experts"])


def verify_levels(golden, seed: int, args, forced_routing, candidate_free, prompt_routing: str) -> list[dict]:
    rows = []
    for level in [int(n) for n in args.levels.split(",")]:
        candidate = candidate_config(golden, None, {"opt_level": level}, ())
        variants = [("forced routing", forced_routing), ("free routing (before)", candidate_free)]
        for label, routing in variants[:1] if args.forced_only else variants:
            verify_module.Context.routing = routing
            verdict = verify_golden(golden, candidate)
            flips = [p.routing for p in verdict.prompts if p.routing is not None]
            rows.append({"seed": seed, "level": level, "verify": label, "prompt_routing": prompt_routing,
                         "verdict": verdict.verdict,
                         "distance": round(verdict.distance, 3), "prompts_with_flips": len(flips),
                         "near_ties": sum(f.near_tie for f in flips),
                         "flip_ratios": [round(f.needed * ROUTING_FLIP_MULTIPLIER / f.moved, 3)
                                         if f.moved else None for f in flips if f.forced],
                         "entries_flipped": [f"{f.flipped}/{f.compared}" for f in flips],
                         "verify_s": round(verdict.timings.get("total_s", 0.0), 1)})
            print(json.dumps(rows[-1]), flush=True)
        verify_module.Context.routing = forced_routing
    return rows


if __name__ == "__main__":
    main()
