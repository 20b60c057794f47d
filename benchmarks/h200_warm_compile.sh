# Warm compile caches (issue #16): `golden verify -O3` with a cold and a warm EVALRUN_CACHE, beside a
# warm -O2 verify, on one GPU. After `source benchmarks/gpu_env.sh`:
#   bash benchmarks/h200_warm_compile.sh /root/warm
# random:smollm2 (SmolLM2-135M's shape), bfloat16, smoke prompts, 32 tokens; the golden pinned at -O2.
# Steps, in order, each a fresh process: golden create (-O2: compiles -O2's graphs into the cache);
# verify -O3 (cold: max-autotune compiles and autotunes); verify -O3 again (warm); verify -O2 twice
# (warm). /root/warm/warm-compile.json is the summary: wall seconds, compile seconds, cache hits, the
# verdicts, the files in the cache after each step, and warm -O3 over warm -O2 (target <= 1.3).
set -u
RES=${1:-/root/warm}
DEADLINE_S=${DEADLINE_S:-420}
mkdir -p "$RES"
START=$(date +%s)
source "$(dirname "$0")/h200_steps.sh"
export EVALRUN_CACHE=$RES/cache
rm -rf "$EVALRUN_CACHE"
unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
MODEL=${WARM_MODEL:-"--model random:smollm2 --dtype bfloat16 --device cuda"}
step create python3 -m evalrun golden create warm $MODEL --prompts smoke --max-new-tokens 32 -O2 --dir "$RES/golden" --force --quiet --json
step o3-cold python3 -m evalrun golden verify warm -O3 --dir "$RES/golden" --quiet --json
step o3-warm python3 -m evalrun golden verify warm -O3 --dir "$RES/golden" --quiet --json
step o2-warm python3 -m evalrun golden verify warm -O2 --dir "$RES/golden" --quiet --json
step o2-warm-again python3 -m evalrun golden verify warm -O2 --dir "$RES/golden" --quiet --json
python3 - "$RES" > "$RES/warm-compile.json" 2> "$RES/summary.err" <<'PY'
import json, sys
from pathlib import Path

res = Path(sys.argv[1])


def row(name):
    out = {}
    try:
        out.update(json.loads((res / f"{name}.time").read_text()))
        data = json.loads((res / f"{name}.json").read_text())
    except (OSError, ValueError):
        err = res / f"{name}.err"
        return {**out, "error": err.read_text()[-600:] if err.exists() else "not run"}
    out["verdict"] = data.get("verdict")
    out["timings"] = data.get("timings") or data.get("create_seconds")
    return out


rows = {name: row(name) for name in ("create", "o3-cold", "o3-warm", "o2-warm", "o2-warm-again")}
done = {name: r.get("wall_s") if r.get("exit") == 0 else None for name, r in rows.items()}  # no ratio of a timeout
warm3, warm2, cold3 = done["o3-warm"], done["o2-warm-again"], done["o3-cold"]
print(json.dumps({"rows": rows,  "warm_o3_over_warm_o2": warm3 / warm2 if warm3 and warm2 else None,
                  "cold_o3_over_warm_o3": cold3 / warm3 if cold3 and warm3 else None}, indent=1, default=str))
PY
echo "$(date +%T) done" >> "$RES/stages.txt"
