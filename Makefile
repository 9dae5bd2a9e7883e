# The README's two commands: `make demo` and `make test`. Each creates .venv if missing and
# installs everything (idempotent: a second run only checks stamps), then runs its job.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PATH := $(abspath $(VENV))/bin:$(PATH)
# CUDA: tools/cuda_root.py finds a usable toolkit (headers + a working nvcc) whatever the layout
# (nvcc a symlink, a wrapper script, or absent from PATH) and honours CUDA_ROOT/CUDA_PATH/CUDA_HOME.
# JAXRING_CUDA=auto|on|off: jaxring's CUDA kernels. MPI4JAX_CUDA=off|auto|on: mpi4jax's CUDA
# bridge; off by default because jaxring hands MPI host buffers only (docs/install.md).
CUDA_ROOT := $(shell python3 tools/cuda_root.py)
JAXRING_CUDA ?= auto
MPI4JAX_CUDA ?= off
export JAXRING_CUDA
# Locally built packages never come from pip's wheel cache: a stale wheel would hide a broken build.
NO_CACHE := --no-cache-dir
DEPS_STAMP := $(VENV)/.deps-stamp
EXT_STAMP := $(VENV)/.ext-stamp
EXT_SOURCES := pyproject.toml CMakeLists.txt $(shell find xla_ext -type f 2>/dev/null)
# The editable install maps each Python module to its file: when one moves (a module becoming a
# package), the install is redone. The stamp is rewritten only when the list of files changes.
LAYOUT_STAMP := $(VENV)/.layout
LAYOUT := $(shell find jaxring -name '*.py' -not -path '*/__pycache__/*' 2>/dev/null | sort \
  | md5sum | cut -c1-32)
# One pytest worker per core, at most 4, each test module on one worker (its processes, ports and
# namespaces stay together): the whole suite in 14 to 16 minutes on 2 cores (docs/benchmarks.md).
PYTEST_ARGS ?= -n auto --maxprocesses 4 --dist loadfile

.PHONY: demo test test-quick install clean bench doctor tcmalloc gpu-check docs FORCE
FORCE:
demo: install
	$(PY) -m jaxring demo

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# The quick loop: every test not marked `slow` (each slow test or module says why where it is
# marked; multi-process and network-namespace tests are slow too): under 2 minutes on 2 cores.
test-quick: install
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile

install: $(EXT_STAMP)

$(PY):
	python3 -m venv $(VENV)

# Third-party dependencies. mpi4jax is an sdist that must be built against the venv's MPICH and
# mpi4py without build isolation (see docs/install.md).
$(DEPS_STAMP): requirements.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	root=$$(python3 tools/cuda_root.py --mpi4jax $(MPI4JAX_CUDA) --empty-dir $(VENV)/.no-cuda) && \
	  MPI4JAX_BUILD_MPICC=$(abspath $(VENV))/bin/mpicc CUDA_ROOT=$$root CUDA_PATH= \
	  $(PIP) install -q $(NO_CACHE) --no-build-isolation --force-reinstall --no-deps "mpi4jax>=0.9,<0.10"
	$(PY) -c "import mpi4jax; print('mpi4jax', mpi4jax.__version__, 'built with its CUDA bridge' \
	  if mpi4jax.has_cuda_support() else 'built CPU-only (MPI4JAX_CUDA=$(MPI4JAX_CUDA))')"
	touch $@

# jaxring itself, editable, with its C++/CUDA extension built by scikit-build-core.
$(LAYOUT_STAMP): FORCE | $(PY)
	@[ "$$(cat $@ 2>/dev/null)" = "$(LAYOUT)" ] || echo "$(LAYOUT)" > $@

$(EXT_STAMP): $(DEPS_STAMP) $(EXT_SOURCES) $(LAYOUT_STAMP)
	$(if $(filter-out off,$(JAXRING_CUDA)),$(if $(CUDA_ROOT),CUDACXX=$(CUDA_ROOT)/bin/nvcc)) \
	  $(PIP) install -q $(NO_CACHE) --no-build-isolation --no-deps -e .
	$(PY) -m jaxring doctor --brief
	touch $@

bench: install
	$(PY) -m jaxring bench collectives

# The docs site into docs/_build/html (Sphinx, MyST, the book theme; API pages from the
# docstrings, so jaxring is installed first), warnings as errors. The packages are pyproject's
# `docs` extra, installed into the venv without reinstalling jaxring.
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): pyproject.toml | $(PY)
	reqs=$$(python3 tools/extra_requirements.py docs) && $(PIP) install -q $$reqs
	touch $@

docs: install $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

doctor: install
	$(PY) -m jaxring doctor

# Opt-in: tcmalloc, which XLA:CPU collectives need to be fast (docs/install.md); the benchmarks
# preload it when present and print the allocator they ran with either way.
tcmalloc:
	@if ls /usr/lib/*/libtcmalloc_minimal.so* >/dev/null 2>&1; then echo "tcmalloc already installed"; \
	elif command -v apt-get >/dev/null; then $(if $(filter 0,$(shell id -u)),,sudo) apt-get install -y libtcmalloc-minimal4; \
	else echo "no apt-get: install gperftools' tcmalloc with your package manager" >&2; exit 1; fi

# The GPU half on a machine with an NVIDIA GPU: CUDA kernels built (JAXRING_CUDA=on), then
# doctor, pytest -m gpu, bench kernels and bench resnet50 in one JSON
# (jaxring/_src/tools/bench/gpu_check.py).
# Uses the venv when there is one, else python3 with its packages installed (e.g. a GPU image).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(if $(CUDA_ROOT),CUDACXX=$(CUDA_ROOT)/bin/nvcc) JAXRING_CUDA=on \
	  $(GPU_PY) -m pip install -q $(NO_CACHE) --no-build-isolation --no-deps -e .
	$(GPU_PY) -m jaxring._src.tools.bench.gpu_check

clean:
	rm -rf build $(VENV)
