# smp — the two set-up commands are `make demo` and `make test`; both set up everything they need.
#
#   make demo    .venv + torch + build, then the demo training job on 4 CPU processes (pp 2 x tp 2),
#                saved at its end and resumed for 20 more steps at pp 2 x dp 2 (resharded)
#   make test    .venv + torch + build, then every test: C++ (ctest, with and without torch),
#                the core-include check, and the Python suites
#   make lint    ruff, clang-format (dry run) and the core-include check
#   make core    the torch-free core and its tests alone (build-core/)
#   make cuda-check  build against a CUDA torch (its own venv, .venv-cuda) with nvcc, then run the
#                CPU tests against that build (build-cuda/); no GPU needed (tools/cuda_check.sh)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
JOBS ?= $(shell nproc)
NPROC_DEMO ?= 4

.PHONY: demo test build core test-cpp test-python check-core lint sysdeps venv clean cuda-check

DEMO_CKPT := build/demo/checkpoints

demo: build
	@rm -rf $(DEMO_CKPT)
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC_DEMO) examples/gpt/train.py \
	    --checkpoint $(DEMO_CKPT)
	@echo "--- resumed from the checkpoint for 20 more steps, resharded to pp 2 x dp 2 ---"
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC_DEMO) examples/gpt/train.py \
	    --checkpoint $(DEMO_CKPT) --resume --steps 20 --tp 1

test: build check-core core test-cpp test-python

# --- set-up -----------------------------------------------------------------------------------
sysdeps:
	@bash tools/install_sysdeps.sh

$(VENV)/.ready: pyproject.toml setup.py tools/requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# Keep a torch that is already importable (e.g. a CUDA build); otherwise the CPU 2.13.0 build.
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "using installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
	    $(PIP) install --quiet "torch==$(TORCH_VERSION)"; \
	fi
	$(PIP) install --quiet -r tools/requirements-dev.txt
	@touch $@

venv: $(VENV)/.ready

build: sysdeps venv
	MAX_JOBS=$(JOBS) $(PIP) install --quiet --no-build-isolation --no-deps -e .

# --- tests --------------------------------------------------------------------------------------
core: sysdeps
	cmake -S . -B build-core -G Ninja -DSMP_BUILD_TORCH=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build-core -j $(JOBS)
	ctest --test-dir build-core --output-on-failure

cuda-check: sysdeps
	JOBS=$(JOBS) bash tools/cuda_check.sh

check-core:
	$(PY) tools/check_core_includes.py

test-cpp: build
	ctest --test-dir build --output-on-failure

test-python: build
	$(PY) -m pytest tests/python -q

lint: venv
	$(PY) tools/check_core_includes.py
	$(VENV)/bin/ruff check smp tests examples benchmarks tools setup.py
	@if command -v clang-format >/dev/null; then \
	    clang-format --dry-run --Werror $$(git ls-files '*.h' '*.cpp'); \
	else echo "clang-format not installed: skipped (apt-get install clang-format)"; fi

clean:
	rm -rf build build-core build-cuda smp/_C*.so *.egg-info
