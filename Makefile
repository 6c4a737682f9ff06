# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv (with the package, JAX and the test tools) when missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINT_PATHS := kdpemb tests examples benchmarks docs/tutorials
PYTEST_ARGS ?= -n 2

.PHONY: demo test lint test-tensorflow test-jax bench docs tutorials clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[jax,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_dp_fedemb.py --reference

test: lint test-tensorflow test-jax

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

test-tensorflow: $(STAMP)
	KERAS_BACKEND=tensorflow $(PY) -m pytest $(PYTEST_ARGS)

# JAX compiles on the CPU for most of its test time; the same programs
# (the example scripts, models built alike in several tests) are compiled
# once per run and then read from this cache. Programs that compile in
# 0.1 s or more are kept: at -O1 (below) many take 0.1-0.5 s, and keeping
# them took the JAX CPU time of tests/models/test_{dp_model,clipped_gradients,
# fedemb}.py, tests/callbacks and tests/test_docs.py from 171 to 153 s
# (0.5 s: 10 programs kept; 0.1 s: 105, 5 MB).
JAX_CACHE := build/jax-compilation-cache
JAX_CACHE_MIN_SECONDS := 0.1
# XLA's CPU code generation at LLVM -O1 rather than the default -O2. On the
# 2-core machine the compile-bound JAX tests took about 30% less CPU time
# (the main job 41 -> 31 s, docs/fedemb.md 40 -> 28 s), and initialising
# the weights of the 605k-parameter benchmark CNN (a threefry program per
# shape) 5.7 -> 1.7 s; the longest-running test (test_fedemb_after_
# pretraining) went 38 -> 25 s. Level 0 compiles a little faster still but
# runs programs several times slower (that test: 125 s). Only the machine
# code's optimisation changes, not the programs: results agree up to float
# round-off. LLVM's expensive passes are skipped too: the two most
# compile-bound tests (docs/fedemb.md, the DP-SGD fine-tuning example)
# took 7% less CPU time with a cold cache (62 -> 58 s). A given XLA_FLAGS
# comes after, so it wins.
JAX_XLA_FLAGS := --xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true $(XLA_FLAGS)

test-jax: $(STAMP)
	KERAS_BACKEND=jax JAX_COMPILATION_CACHE_DIR=$(CURDIR)/$(JAX_CACHE) \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=$(JAX_CACHE_MIN_SECONDS) XLA_FLAGS="$(JAX_XLA_FLAGS)" \
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks all

# The site, with the API reference from the docstrings (mkdocstrings reads
# the source; it does not import kdpemb). --strict turns every warning into
# an error: a link to a missing page or anchor (mkdocs.yml's `validation`),
# a page outside the nav, a reference to a name that does not exist. Not
# part of `make test`; .ci/run calls it after. The docs' code blocks and
# doctests run in `make test` (tests/test_docs.py).
docs: $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The tutorial notebooks (docs/tutorials), each executed headless at its
# small size under JAX in a fresh kernel whose first cell installs kdpemb
# from this tree, as on Colab. Not part of `make test`; CI runs it after.
# TUTORIALS=dp_sgd runs one; docs/tutorials/run_tutorials.py --full by hand.
tutorials: $(STAMP)
	$(PY) -m pip install --quiet -e ".[tutorials]"
	$(PY) docs/tutorials/run_tutorials.py $(TUTORIALS)

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache
