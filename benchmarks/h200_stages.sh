# The GEMVs' K loop pipelined (linear.GEMV_STAGES, issue #16) on one H200, as one background job under a deadline.
# On that machine, with the SmolLM2 GGUF joined at /root/g/smollm2.gguf and the wheels in .whl:
#   setsid bash benchmarks/h200_stages.sh /root/st > /root/st.log 2>&1 < /dev/null &
# then poll /root/st/stages.txt (`done` ends it). In turn, each a step under the deadline:
#   gemv-stages       benchmarks/gemv_stages.py: each projection's GEMV alone at 1-5 stages and other blocks
#   breakdown-stages  decode_breakdown.py rows levers-glu-stages1..4 (the -O2 step + levers-glu, one process)
#   tests-stagesS     the GEMV's GPU tests with GEMV_STAGES = S (STAGES, default 3) in a copy of the repo
#   bench-stagesS     with BENCH=1: `evalrun bench` of -O2 + levers-glu, full graphs, at GEMV_STAGES 1 then S
set -u
RES=${1:-/root/st}
DEADLINE_S=${DEADLINE_S:-900}
S=${STAGES:-3}
mkdir -p "$RES"
START=$(date +%s)
rm -rf /root/repo && cp -r . /root/repo && cd /root/repo || exit 1
source benchmarks/gpu_env.sh
source benchmarks/h200_steps.sh
export TORCHINDUCTOR_COMPILE_THREADS=8
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt" 2>&1
step gemv-stages python3 benchmarks/gemv_stages.py --json "$RES/gemv-stages-report.json"
step breakdown-stages python3 benchmarks/decode_breakdown.py --model random:llama3-8b --json "$RES/breakdown-stages-report.json" \
  --skip projections,eager,o2,gemv,split-kv,residual,kv-write,pdl-inductor,combo,levers,levers-glu,levers-combine-kernel,levers-o3,levers-o3-deterministic,levers-glu-o3,levers-glu-descent,levers-argmax,levers-torch-merge,levers-both,levers-copies
rm -rf /root/repo-s && cp -r /root/repo /root/repo-s && sed -i "s/^GEMV_STAGES = 1$/GEMV_STAGES = $S/" /root/repo-s/evalrun/engine/linear.py
grep -q "^GEMV_STAGES = $S$" /root/repo-s/evalrun/engine/linear.py || stage "GEMV_STAGES not set in the copy"
(cd /root/repo-s && PYTHONPATH=/root/site:/root/repo-s step "tests-stages$S" python3 -m pytest -p no:cacheprovider -q -m gpu \
  -n 4 tests/test_linear.py)
if [ "${BENCH:-0}" = 1 ]; then
  M="O2+cudagraph_mode=full+linear_kernel=triton-gemv-glu+attention_kernel=triton-split-kv+combo_kernels=true"
  step bench-stages1 python3 -m evalrun bench --model random:llama3-8b --dtype bfloat16 --device cuda --prompts smoke \
    --max-new-tokens 128 --config-timeout 300 --no-baselines --matrix "$M" --json
  (cd /root/repo-s && PYTHONPATH=/root/site:/root/repo-s step "bench-stages$S" python3 -m evalrun bench --model random:llama3-8b \
    --dtype bfloat16 --device cuda --prompts smoke --max-new-tokens 128 --config-timeout 300 --no-baselines --matrix "$M" --json)
fi
stage done
