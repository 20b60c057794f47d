# Issue #3's GPU work as one background job, since a device command may run 10 minutes at most.
# On the H200, after `source benchmarks/gpu_env.sh`:
#   setsid bash benchmarks/h200_session.sh /root/res > /root/res.log 2>&1 < /dev/null &
# then wait for /root/res/done in later calls and copy /root/res to $OUT. In order:
#   1. benchmarks/decode_breakdown.py: bandwidth ceiling, projection bandwidth, decode-step kernels by kind
#   2. evalrun bench on random:llama3-8b bf16, -O0..-O3 with both transformers baselines (README's table)
#   3. tests/test_gpu.py with EVALRUN_GPU_MODEL=random:smollm2: every compilation x graph mode twice, bf16
set -u
RES=${1:-/root/res}
mkdir -p "$RES"
stage() { echo "$(date +%T) $1" >> "$RES/stages.txt"; }
stage breakdown
timeout 300 python3 benchmarks/decode_breakdown.py --model random:llama3-8b --dtype bfloat16 \
  --json "$RES/breakdown.json" > "$RES/breakdown.txt" 2>&1
stage bench
timeout 1200 python3 -m evalrun bench --model random:llama3-8b --dtype bfloat16 --device cuda --prompts smoke \
  --max-new-tokens 128 --config-timeout 300 --json > "$RES/bench.json" 2> "$RES/bench.err"
stage gpu-tests
EVALRUN_GPU_MODEL=random:smollm2 timeout 900 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu.py -s -v \
  > "$RES/gpu-tests.txt" 2>&1
stage done
touch "$RES/done"
