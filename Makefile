# The two README commands. Each one creates .venv when missing and installs the package.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test bench gpu-check timm-tests install clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,tensorboard]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/shortcutlab fit --config configs/digits_mae.yaml $(ARGS)

# one worker per core of the 2-core CI machine; a test file stays on one worker (its module fixtures),
# the slowest files first (tests/conftest.py SLOWEST_FIRST, in collection order)
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# The benchmark suite (README, Performance): writes benchmarks/results.md and .json.
bench: $(STAMP)
	$(BIN)/python -m benchmarks $(ARGS)

# timm's own tests/test_models.py (of the installed release, fetched from PyPI) on the registered
# decayed encoders, TorchScript aside: about 8 minutes on a 2-core CPU
timm-tests: $(STAMP)
	$(BIN)/python -m benchmarks.timm_model_tests $(ARGS)

# CUDA only: every family's quick config, the paper configs on generated data, DDP over every
# GPU and the benchmarks on CUDA; writes runs/gpu-check/<gpu>.md (ARGS=--update-docs: docs/results/gpu/;
# without CUDA: one line, exit 0)
gpu-check: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache
