# Tensor parallelism and sharded verification on 2 H200s (the nvidia-h200-x2 kind), as one background
# job under a deadline. After `source benchmarks/gpu_env.sh` on that machine:
#   setsid bash benchmarks/h200_tp.sh /root/tp > /root/tp.log 2>&1 < /dev/null &
# then poll /root/tp/stages.txt in later calls (`stage done` ends it) and copy /root/tp to $OUT;
# /root/tp/h200-tp.json is the summary (commit it as benchmarks/results/h200-tp.json).
#
# random:llama3-8b, bfloat16, smoke prompts, 64 new tokens (the golden: default prompts, 16 tokens):
#   1  side by side: GPU 0 runs TP=1 at -O0 then -O2; GPU 1 creates the TP=1 golden (-O0, 17 prompts)
#   2  both GPUs: TP=2 at -O0 (torchrun), `golden verify` of TP=2 against the TP=1 golden, TP=2 at -O2
#   3  the same verify at TP=1 on one GPU, then split across the 2 GPUs by torchrun (data parallel):
#      wall seconds of each and the speed-up
# Every step stops by the deadline (DEADLINE_S from the start, default 540 s: the lead has ~10 minutes
# of device time); a step that fails or runs out of time leaves its .err file and a null in the summary.
# A step whose NAME.time in RES says exit 0 is kept (carry an earlier call's RES to finish what it left).
# Not run on more than 2 GPUs; the code takes any number of ranks that divides the heads (8B: 2, 4, 8).
set -u
RES=${1:-/root/tp}
DEADLINE_S=${DEADLINE_S:-540}
mkdir -p "$RES"
START=$(date +%s)
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
KEEP_DONE=1
source "$(dirname "$0")/h200_steps.sh"
MODEL=${TP_MODEL:-"--model random:llama3-8b --dtype bfloat16 --device cuda"}  # TP_MODEL: a dry run elsewhere
RUN="$MODEL --prompts smoke --max-new-tokens 64 --json --quiet"
GOLD="$MODEL --prompts ${TP_GOLD_PROMPTS:-default} --max-new-tokens 16"
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m evalrun"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt" 2>&1
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> "$RES/gpu.txt" 2>&1

( export CUDA_VISIBLE_DEVICES=0 EVALRUN_STORE=$RES/tp1.db
  step tp1-o0 python3 -m evalrun run $RUN -O0
  step tp1-o2 python3 -m evalrun run $RUN -O2 ) &
( export CUDA_VISIBLE_DEVICES=1
  step golden-tp1 python3 -m evalrun golden create llama-tp1 $GOLD -O0 --dir $RES/golden --force --quiet --json ) &
wait

export EVALRUN_STORE=$RES/tp2.db
step tp2-o0 $TORCHRUN run $RUN -O0 --tensor-parallel 2
step verify-tp2 $TORCHRUN golden verify llama-tp1 $GOLD -O0 --tensor-parallel 2 --dir $RES/golden --json --quiet
step tp2-o2 $TORCHRUN run $RUN -O2 --tensor-parallel 2
( export CUDA_VISIBLE_DEVICES=0; step verify-1gpu python3 -m evalrun golden verify llama-tp1 $GOLD -O0 --dir $RES/golden --json --quiet )
step verify-2gpu $TORCHRUN golden verify llama-tp1 $GOLD -O0 --dir $RES/golden --json --quiet

stage summary
python3 - "$RES" > "$RES/h200-tp.json" 2> "$RES/summary.err" <<'EOF'
import json, sys
from pathlib import Path

res = Path(sys.argv[1])


def load(name):
    try:
        return json.loads((res / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def timed(name):
    try:
        return json.loads((res / f"{name}.time").read_text())
    except (OSError, ValueError):
        return None


def run_row(name):
    run = load(name)
    if run is None:
        return {"error": (res / f"{name}.err").read_text()[-600:] if (res / f"{name}.err").exists() else "not run"}
    timings, evidence = run["timings"], run["evidence"]
    peaks = timings.get("ranks_peak_memory") or [timings["peak_memory"]]
    return {"tokens_per_s": timings["tokens_per_s"], "compile_s": timings["compile_s"],
            "step_p50_ms": timings["step_latency"].get("p50_ms"),
            "peak_memory_gib_per_gpu": [round(p["bytes"] / 2**30, 2) for p in peaks],
            "fallbacks": evidence.get("fallbacks"), "tensor_parallel": evidence.get("tensor_parallel"),
            "logits_digests": {r["prompt_id"]: r["logits_digest"] for r in run["results"]},
            "tokens": {r["prompt_id"]: r["tokens"] for r in run["results"]}, "wall_s": (timed(name) or {}).get("wall_s")}


rows = {name: run_row(name) for name in ("tp1-o0", "tp1-o2", "tp2-o0", "tp2-o2")}
for level in ("o0", "o2"):
    one, two = rows[f"tp1-{level}"], rows[f"tp2-{level}"]
    if "logits_digests" in one and "logits_digests" in two:
        two["bit_identical_to_tp1"] = one["logits_digests"] == two["logits_digests"]
        two["same_tokens_as_tp1"] = one["tokens"] == two["tokens"]
        two["speed_vs_tp1"] = two["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else None
for row in rows.values():
    row.pop("tokens", None)
verify = load("verify-tp2")
one_gpu, two_gpu = timed("verify-1gpu"), timed("verify-2gpu")
v1, v2 = load("verify-1gpu"), load("verify-2gpu")
summary = {
    "gpu": (res / "gpu.txt").read_text() if (res / "gpu.txt").exists() else None,
    "runs": rows,
    "verify_tp2_against_tp1_golden": None if verify is None else {
        "verdict": verify["verdict"], "causes": verify["causes"][:6], "distance": verify["distance"],
        "function_check": verify["function_check"], "execution_check": verify["execution_check"],
        "timings": verify["timings"]},
    "sharded_verify": {
        "one_gpu": {"wall_s": (one_gpu or {}).get("wall_s"), "verdict": v1 and v1["verdict"], "timings": v1 and v1["timings"]},
        "two_gpus": {"wall_s": (two_gpu or {}).get("wall_s"), "verdict": v2 and v2["verdict"], "timings": v2 and v2["timings"]},
        "speedup_wall": (one_gpu["wall_s"] / two_gpu["wall_s"]) if one_gpu and two_gpu and two_gpu["wall_s"] else None,
        "same_verdict": bool(v1 and v2 and v1["verdict"] == v2["verdict"]),
    },
    "golden_create": timed("golden-tp1"),
}
print(json.dumps(summary, indent=1, default=str))
EOF
stage done
