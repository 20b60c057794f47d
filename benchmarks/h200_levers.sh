# Issue #16's GPU figures in one lease of the nvidia-h200-x2 kind, as one background job under a
# deadline. On that machine, with the SmolLM2 GGUF joined at /root/g/smollm2.gguf (random shapes borrow
# its tokenizer) and the wheels in .whl:
#   setsid bash benchmarks/h200_levers.sh /root/lev > /root/lev.log 2>&1 < /dev/null &
#   (BENCH_ONLY=1 LEVERS=O2,O3,... : only the tests on GPU 0 and the bench of LEVERS on GPU 1;
#    with PROBES=1 too, GPU 0 then runs decode_breakdown.py and fusion_candidates.py;
#    with PROBES=1 FUSION=0 DISTRIBUTED=1 instead: GPU 1 runs decode_breakdown.py after the bench, and once
#    both GPUs are done, the two-GPU tests (tests/test_distributed.py, NCCL; pytest's output in
#    distributed-tests.json), timing nothing;
#    ONE_GPU=1 on the nvidia-h200 kind: the tests, the bench of LEVERS (not with BENCH=0) and, with PROBES=1,
#    decode_breakdown.py in turn)
# then poll /root/lev/stages.txt (`done` ends it). It first copies the repo to /root/repo, so a later
# call's working-tree sync cannot change the scripts under it.
#   GPU 0  every `pytest -m gpu` test but the NCCL ones; then `evalrun bench` of random:llama3-8b with the
#          decode levers side by side (-O2 alone, with the Triton GEMV, with GEMV + split-KV + combo kernels,
#          those with whole prefill graphs; -O3 with them),
#          beside transformers' eager and static-cache + compile generate
#   GPU 1  benchmarks/decode_breakdown.py (projection bandwidth by kernel, the -O2 step with and without
#          the GEMV); then benchmarks/h200_warm_compile.sh (cold and warm compile caches)
set -u
RES=${1:-/root/lev}
DEADLINE_S=${DEADLINE_S:-1080}
mkdir -p "$RES"
START=$(date +%s)
rm -rf /root/repo && cp -r . /root/repo && cd /root/repo || exit 1
source benchmarks/gpu_env.sh
source benchmarks/h200_steps.sh
export TORCHINDUCTOR_COMPILE_THREADS=8
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt" 2>&1
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> "$RES/gpu.txt" 2>&1
ALL=linear_kernel=triton-gemv+attention_kernel=triton-split-kv+combo_kernels=true  # the levers that won (stop 16)
LEVERS=${LEVERS:-O2,O2+linear_kernel=triton-gemv,O2+$ALL,O2+cudagraph_mode=full+$ALL,O3+$ALL}
BREAKDOWN_SKIP=${BREAKDOWN_SKIP:-projections,eager,residual,kv-write,pdl-inductor}  # the probe's rows left out

bench_levers() {
  step bench-levers python3 -m evalrun bench --model random:llama3-8b --dtype bfloat16 --device cuda --prompts smoke \
    --max-new-tokens 128 --config-timeout 300 --matrix "$LEVERS" --json
}
probe_breakdown() {
  step probe-breakdown timeout "${BREAKDOWN_TIMEOUT:-420}" python3 benchmarks/decode_breakdown.py --model random:llama3-8b \
    --skip "$BREAKDOWN_SKIP" --json "$RES/probe-breakdown-report.json"
}
gpu_tests() {
  stage "gpu0 tests"
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -p no:cacheprovider -q -m gpu -n "${TEST_WORKERS:-4}" tests \
    --ignore tests/test_distributed.py > "$RES/gpu-tests.txt" 2>&1
}
if [ "${ONE_GPU:-0}" = 1 ]; then  # the nvidia-h200 kind: the tests, the bench, then the probe breakdown, in turn
  gpu_tests
  [ "${BENCH:-1}" = 1 ] && bench_levers
  [ "${PROBES:-0}" = 1 ] && probe_breakdown
  stage done
  exit 0
fi
# BENCH_ONLY=1: GPU 0 runs the tests alone and GPU 1 the bench alone (no breakdown, no warm compile)
( export CUDA_VISIBLE_DEVICES=0
  gpu_tests
  [ "${BENCH_ONLY:-0}" = 1 ] || bench_levers
  if [ "${DISTRIBUTED:-0}" = 0 ] && [ "${BENCH_ONLY:-0}" = 1 ] && [ "${PROBES:-0}" = 1 ]; then
    probe_breakdown  # (otherwise GPU 1 runs the breakdown)
  fi
  [ "${BENCH_ONLY:-0}" = 1 ] && [ "${PROBES:-0}" = 1 ] && [ "${FUSION:-1}" = 1 ] && \
    step fusion timeout 300 python3 benchmarks/fusion_candidates.py --json "$RES/fusion-report.json"
  stage "gpu0 done" ) &
( export CUDA_VISIBLE_DEVICES=1
  if [ "${BENCH_ONLY:-0}" = 1 ]; then
    bench_levers
    [ "${DISTRIBUTED:-0}" = 1 ] && [ "${PROBES:-0}" = 1 ] && probe_breakdown
  else
    step breakdown timeout 300 python3 benchmarks/decode_breakdown.py --model random:llama3-8b --gemv-grid \
      --json "$RES/breakdown-report.json"
    DEADLINE_S=$(left) bash benchmarks/h200_warm_compile.sh "$RES/warm"
  fi
  stage "gpu1 done" ) &
wait
if [ "${DISTRIBUTED:-0}" = 1 ] && [ "$(left)" -lt 60 ]; then
  stage "distributed tests not run: under a minute to the deadline"
elif [ "${DISTRIBUTED:-0}" = 1 ]; then  # both GPUs, once neither is timed: NCCL's tests need two
  CUDA_VISIBLE_DEVICES=0,1 step distributed-tests python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_distributed.py
fi
stage done
