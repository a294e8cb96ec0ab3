# The two commands of the README. Both create .venv and install the package into it first.
#   make demo   tiny Llama on the real 2-process DeepSpeed ZeRO-3 path, on the CPU (~3 min after the install)
#   make test   lint + the test suite (all but `slow`) on 2 pytest-xdist workers (~17 min on 2 cores: docs/testing.md)
#   make test-fast   lint + the tests that start no training launch (~2 min), before every commit
#   make gpu-check [DRY_RUN=1]   the recipe's CUDA path measured on one GPU (docs/gpu-results.md)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Without CUDA, pip would satisfy torch>=2.10 with a multi-GB CUDA build; 2.13.0 resolves to the
# CPU build these machines carry. With a GPU, leave TORCH empty and pip picks the CUDA build.
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,torch==2.13.0)
DEMO ?= outputs/demo
# bf16 where the CPU computes it natively (AVX512-BF16, AMX); elsewhere torch emulates bf16 matmuls ~100x
# slower than fp32, and the demo trains in fp32 (tests/conftest.py applies the same rule).
DEMO_BF16 ?= $(if $(shell grep -qsE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo y),true,false)
# DeepSpeed would otherwise look for CUDA; this Makefile's runs are CPU runs.
export DS_ACCELERATOR ?= cpu

.PHONY: install demo test test-fast lint clean gpu-check gpu-check-python

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install --quiet "$(TORCH)")
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(if $(TORCH),$(PREBUILD_CPU_OPS))
	touch $@

# DeepSpeed JIT-compiles its CPU Adam and shared-memory allreduce at the first launch (~70 s on 2 cores): done once
# here, with the venv's ninja first on PATH as every launch has it (another ninja would change the build's hash).
PREBUILD_CPU_OPS = PATH="$(abspath $(BIN)):$$PATH" DS_ACCELERATOR=cpu $(BIN)/python -c \
	"from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder; \
	CPUAdamBuilder().load(verbose=False); ShareMemCommBuilder().load(verbose=False)"

install: $(BIN)/.installed

demo: install
	$(BIN)/python -m data_prep.demo_corpus --output $(DEMO)/data --train-mb 6 --validation-mb 0.5
	$(BIN)/python -m data_prep.train_tokenizer --input $(DEMO)/data/train.jsonl --vocab-size 2048 \
		--output $(DEMO)/tokenizer --overwrite
	$(BIN)/python -m eval.fixtures --output $(DEMO)/eval_data
	rm -rf $(DEMO)/packed $(DEMO)/run
	$(BIN)/python -m data_prep.preprocess --tokenizer $(DEMO)/tokenizer --input $(DEMO)/data/train.jsonl \
		--output $(DEMO)/packed --seq-len 128 --num-workers 2 --dedup \
		--decontaminate-mmlu-dir $(DEMO)/eval_data/mmlu_release --decontaminate-gsm8k-dir $(DEMO)/eval_data/gsm8k_release
	$(BIN)/python -m recipes.launch --config_file accelerate_configs/zero3_cpu.yaml recipes/pretrain.py \
		--config recipes/configs/tiny_cpu.yaml --output_dir $(DEMO)/run --bf16 $(DEMO_BF16) --train_files $(DEMO)/packed
	$(BIN)/python -m recipes.summarize $(DEMO)/run

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest-xdist workers, each given a whole test file at a time (--dist loadfile), so that a file's fixtures (the
# Slurm cluster, a module's reference run) are built once; the session's shared runs are built once for both
# (tests/conftest.py: built_once). A launch spends much of its time waiting (process start and teardown, a hang
# timeout, Slurm's requeue delay), which the other worker fills: on 2 cores the suite took 15-17 minutes of tests
# on the last fresh clones (docs/testing.md). PYTEST_WORKERS=0 runs it in one process. The 25 slowest tests are listed at the end.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)
test: lint
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) --durations=25

# Before every commit: everything but the real multi-process launches (marked `multiprocess`), ~2 minutes.
test-fast: lint
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not multiprocess and not slow" --durations=10

# The GPU check (benchmarks/gpu_check.py, docs/gpu-results.md): on a machine with one GPU, one 8-minute call
# (--budget-s 480) and a second with GPU_CHECK_ARGS="--budget-s 240 --stages attention,end_to_end,training_tail";
# results are copied to $OUT (or --results-dir) after every stage. DRY_RUN=1
# rehearses it on the CPU with a tiny model. GPU_CHECK_PYTHON=python3 uses an environment that already holds the
# packages instead of .venv. flash-attn has no wheel on PyPI: FLASH_ATTN_WHEEL=path/to/flash_attn-*.whl installs one;
# without it the check runs sdpa and says so.
GPU_CHECK_PYTHON ?=
GPU_PY := $(or $(GPU_CHECK_PYTHON),$(BIN)/python)
gpu-check: export DS_ACCELERATOR := $(if $(DRY_RUN),cpu,cuda)
gpu-check: $(if $(or $(GPU_CHECK_PYTHON),$(DRY_RUN)),,gpu-check-python) $(if $(GPU_CHECK_PYTHON),,install)
	$(if $(FLASH_ATTN_WHEEL),$(GPU_PY) -m pip install --quiet "$(FLASH_ATTN_WHEEL)")
	$(GPU_PY) -m benchmarks.gpu_check $(if $(DRY_RUN),--dry-run) --output outputs/gpu_check$(if $(DRY_RUN),_dry_run) $(GPU_CHECK_ARGS)

# `make install` builds a CPU-only .venv (and a GPU machine may have no network for pip): on a GPU, say which
# Python has CUDA torch rather than install minutes of the wrong packages.
gpu-check-python:
	@echo "error: on a GPU, run make gpu-check GPU_CHECK_PYTHON=python3 (a Python with CUDA torch, DeepSpeed," \
		"transformers, accelerate and lm-eval; docs/gpu-results.md); make install builds a CPU-only .venv" >&2
	@exit 2

clean:
	rm -rf $(VENV) outputs .pytest_cache
