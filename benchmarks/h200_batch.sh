# The GPU halves of issues #14, #16 and #17 in one lease of the nvidia-h200-x2 kind, as one background
# job with a deadline per phase (device time is scarce: plan ~25 minutes). On that machine, with the
# SmolLM2 GGUF joined at /root/g/smollm2.gguf and the wheels in .whl:
#   setsid bash benchmarks/h200_batch.sh /root/res > /root/batch.log 2>&1 < /dev/null &
# then poll /root/res/batch-stages.txt (`done` ends it). It first copies the repo to /root/repo, so a
# later call's working-tree sync cannot change the scripts under it.
#   1  both GPUs: benchmarks/h200_tp.sh (#17), then `pytest -m gpu tests/test_distributed.py` (NCCL)
#   2  one GPU each: evalrun bench of random:qwen3-8b (GPU 0) and random:qwen3-moe (GPU 1) (#14)
#   3  GPU 0: every other `pytest -m gpu` test; GPU 1: benchmarks/capture_overhead.py at -O2 on
#      random:llama3-8b with both capture kernels, then benchmarks/h200_warm_compile.sh (#16)
set -u
RES=${1:-/root/res}
mkdir -p "$RES"
stage() { echo "$(date +%T) $1" >> "$RES/batch-stages.txt"; }
rm -rf /root/repo && cp -r . /root/repo && cd /root/repo || exit 1
source benchmarks/gpu_env.sh
export TORCHINDUCTOR_COMPILE_THREADS=8

stage tp
DEADLINE_S=${TP_DEADLINE_S:-480} bash benchmarks/h200_tp.sh "$RES/tp"
stage distributed-gpu-tests
timeout 110 python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_distributed.py > "$RES/tp/distributed-gpu-tests.txt" 2>&1

stage benches
( export CUDA_VISIBLE_DEVICES=0; DEADLINE_S=${BENCH_DEADLINE_S:-400} bash benchmarks/h200_moe.sh qwen3-8b "$RES/moe" ) &
( export CUDA_VISIBLE_DEVICES=1; DEADLINE_S=${BENCH_DEADLINE_S:-400} bash benchmarks/h200_moe.sh qwen3-moe "$RES/moe" ) &
wait

stage tests-capture-warm
( export CUDA_VISIBLE_DEVICES=0
  timeout ${TESTS_DEADLINE_S:-400} python3 -m pytest -p no:cacheprovider -q -m gpu -n 4 tests \
    --ignore tests/test_distributed.py > "$RES/gpu-tests.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 benchmarks/capture_overhead.py --model random:llama3-8b --device cuda --dtype bfloat16 \
    --opt-level 2 --compare-kernels --max-new-tokens 64 --repeats 3 > "$RES/capture-8b-o2.txt" 2>&1
  DEADLINE_S=${WARM_DEADLINE_S:-250} bash benchmarks/h200_warm_compile.sh "$RES/warm" ) &
wait
stage done
