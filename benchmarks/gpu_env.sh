# Source on the GPU machine: installs carried wheels (.whl) into /root/site once, points evalrun at the
# SmolLM2 GGUF joined under /root/g, and puts the repo on PYTHONPATH. Used for the H200 figures in README.
if [ ! -d /root/site/sqlite_utils ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl
fi
export PYTHONPATH=/root/site:$PWD EVALRUN_SMOLLM2_GGUF=/root/g/smollm2.gguf EVALRUN_CACHE=/root/cache PYTHONUNBUFFERED=1
evalrun() { python3 -m evalrun "$@"; }
