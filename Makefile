# flash3: build, test, benchmark.
#   make test    set up a venv (if needed), build the extension, run the tests (anywhere;
#                GPU tests skip without a Hopper GPU)
#   make bench   same set-up, then the benchmark grid (needs a Hopper GPU)
# PYTHON=python3 uses an existing interpreter (with torch) instead of the venv.
# FLASH3_HDIMS / FLASH3_DTYPES narrow the build, e.g. `make test FLASH3_HDIMS=128 FLASH3_DTYPES=bf16`.

VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
# Python 3.12 (the GPU machines' version, so a build made here loads there): pyenv's if present.
BOOTSTRAP_PYTHON ?= $(shell (PYENV_VERSION=$$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | head -1) pyenv which python3.12 2>/dev/null) || command -v python3.12 || command -v python3)
TORCH_VERSION ?= 2.11.0
MAX_JOBS ?= $(shell nproc)
BENCH_ARGS ?=
export MAX_JOBS

.PHONY: deps install test test-gpu bench sass clean bench-fp8 accuracy-fp8

# Rebuild only when a source changes (pip's editable build does not reuse objects).
# After changing FLASH3_HDIMS / FLASH3_DTYPES, run `make clean` first.
BUILD_STAMP := build/.flash3-built
SOURCES := setup.py $(shell find csrc -name '*.cu' -o -name '*.cpp' -o -name '*.h')

$(VENV)/.deps:
	$(BOOTSTRAP_PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) nvidia-cutlass ninja pybind11 pytest numpy matplotlib setuptools wheel "transformers>=5"
	touch $@

ifeq ($(PYTHON),$(VENV)/bin/python)
deps: $(VENV)/.deps
else
deps:
	@$(PYTHON) -c "import torch, ninja, pytest" || (echo "PYTHON=$(PYTHON) lacks torch/ninja/pytest" && false)
endif

$(BUILD_STAMP): $(SOURCES) | deps
	$(PYTHON) -m pip install --no-build-isolation -e .
	$(PYTHON) -c "import flash3; info = flash3.build_info(); assert info['kernels'], info; print(len(info['kernels']), 'kernels built')"
	mkdir -p build && touch $@

install: $(BUILD_STAMP)

test: install
	$(PYTHON) -m pytest -q tests

test-gpu: install
	$(PYTHON) -m pytest -q -m gpu tests

bench: install
	$(PYTHON) benchmarks/bench_attention.py $(BENCH_ARGS)

# FP8 forward: speed grid (with the fused quantiser's time, and cuDNN's FP8 SDPA in the same
# run through the cudnn-frontend wheel; its graph API needs none of the wheel's optional
# dependencies) and the Table 3 accuracy run.
$(VENV)/.cudnn-frontend: $(VENV)/.deps
	$(VENV)/bin/python -m pip install -q --no-deps nvidia-cudnn-frontend
	touch $@

ifeq ($(PYTHON),$(VENV)/bin/python)
bench-fp8: install $(VENV)/.cudnn-frontend
else
bench-fp8: install
endif
	$(PYTHON) benchmarks/bench_attention.py --fp8 $(BENCH_ARGS)

accuracy-fp8: install
	$(PYTHON) benchmarks/fp8_accuracy.py

sass: install
	$(PYTHON) scripts/check_sass.py --dump sass/flash3.sass

clean:
	rm -rf build dist *.egg-info flash3/_C*.so sass $(BUILD_STAMP)
