# The README's two commands: `make demo` and `make test`. Each creates .venv if missing and
# installs everything (idempotent: a second run only checks stamps), then runs its job.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PATH := $(abspath $(VENV))/bin:$(PATH)
# CUDA toolkit root (folder whose include/ has cuda_runtime.h); mpi4jax's build needs it when nvcc exists.
CUDA_ROOT ?= $(shell d=$$(dirname $$(dirname $$(readlink -f $$(command -v nvcc 2>/dev/null) 2>/dev/null) 2>/dev/null) 2>/dev/null); [ -f "$$d/include/cuda_runtime.h" ] && echo $$d)
DEPS_STAMP := $(VENV)/.deps-stamp
EXT_STAMP := $(VENV)/.ext-stamp
EXT_SOURCES := pyproject.toml CMakeLists.txt $(shell find xla_ext -type f 2>/dev/null)
PYTEST_ARGS ?=

.PHONY: demo test install clean bench
demo: install
	$(PY) -m jaxring demo

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

install: $(EXT_STAMP)

$(PY):
	python3 -m venv $(VENV)

# Third-party dependencies. mpi4jax is an sdist that must be built against the venv's MPICH and
# mpi4py without build isolation (see docs/install.md).
$(DEPS_STAMP): requirements.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	MPI4JAX_BUILD_MPICC=$(abspath $(VENV))/bin/mpicc CUDA_ROOT=$(CUDA_ROOT) \
	  $(PIP) install -q --no-build-isolation "mpi4jax>=0.9,<0.10"
	touch $@

# jaxring itself, editable, with its C++/CUDA extension built by scikit-build-core.
$(EXT_STAMP): $(DEPS_STAMP) $(EXT_SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

bench: install
	$(PY) -m jaxring bench collectives

clean:
	rm -rf build $(VENV)
