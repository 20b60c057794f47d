# The GPU half of Qwen3-MoE (issue #14), one stage per device call (after `source benchmarks/gpu_env.sh`):
#   bash benchmarks/h200_moe.sh tests     $OUT   # pytest -m gpu tests/test_moe.py: bf16 envelope, -O1/-O2 + verify
#   bash benchmarks/h200_moe.sh qwen3-8b  $OUT   # evalrun bench random:qwen3-8b  -O0,-O2 + transformers baselines
#   bash benchmarks/h200_moe.sh qwen3-moe $OUT   # evalrun bench random:qwen3-moe -O0,-O2 + transformers baselines
# Each stage stays under DEADLINE_S (default 540 s); every bench row is a fresh process (one model build each).
set -u
STAGE=${1:?tests, qwen3-8b or qwen3-moe}
RES=${2:-${OUT:-/root/res-moe}}
DEADLINE_S=${DEADLINE_S:-540}
mkdir -p "$RES"
BENCH="--dtype bfloat16 --device cuda --prompts smoke --max-new-tokens 128 --matrix O0,O2 --config-timeout 120"
case "$STAGE" in
  tests) timeout "$DEADLINE_S" python3 -m pytest -p no:cacheprovider -q -s -m gpu tests/test_moe.py \
           > "$RES/moe-gpu-tests.txt" 2>&1 ;;
  qwen3-8b|qwen3-moe) EVALRUN_STORE=$RES/bench-$STAGE.db timeout "$DEADLINE_S" python3 -m evalrun bench \
           --model "random:$STAGE" $BENCH --json > "$RES/bench-$STAGE.json" 2> "$RES/bench-$STAGE.err" ;;
  *) echo "unknown stage $STAGE; use tests, qwen3-8b or qwen3-moe" >&2; exit 2 ;;
esac
echo "rc=$?" >> "$RES/stages.txt"
