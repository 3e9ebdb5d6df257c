# Everyday commands. `make train` and `make test` each set up .venv first (once).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first and pinned: a bare `torch` requirement can pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# Where torch comes from: empty = PyPI's default build (CUDA on Linux x86_64); or the index URL that
# pytorch.org's install selector gives, e.g. https://download.pytorch.org/whl/cpu (CPU only, much smaller)
# or .../whl/cu128 (CUDA 12.8). See docs/REAL_MODEL.md.
TORCH_INDEX ?=
ARGS   ?=

.PHONY: setup train test test-slow test-all lint typecheck clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

train: setup          ## distill the pocket teacher into a student that draws its digits (~1 min on 2 quiet cores: docs/PERFORMANCE.md; ARGS="trainer.max_steps=50")
	$(PY) -m wandistiller.train +experiment=pocket $(ARGS)

# One thread per process: the tests' tiny models gain nothing from more, and their 2-3 rank runs share 2 cores.
TEST_ENV := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}

# The default lane on every core (pytest-xdist: one worker a core, its tests' own processes beside it), a module's
# tests on one worker (loadscope: a module's shared fixtures and fresh processes run once, not once a worker; the
# session's 2-rank jobs run once too, tests/conftest.once_per_session): 4 min 33 s on the 2-core VM, against 6 min
# 11 s to 6 min 46 s test by test, and 7 min 47 s in one process, all on 2026-11-30; 3 min 36 s on 2026-12-01
# (docs/PERFORMANCE.md, "Test lanes"). The slow lane
# stays in one: its runs time themselves against their own limits.
test: setup           ## the default lane: everything but the slow end-to-end runs (CI runs it first)
	$(TEST_ENV) $(PY) -m pytest -q -m "not slow" -n auto --dist loadscope $(ARGS)

test-slow: setup      ## the slow lane only: long CLI runs, calibration, multi-rank end-to-end (CI runs it second)
	$(TEST_ENV) $(PY) -m pytest -q -m slow $(ARGS)

test-all: setup       ## both lanes in one pytest run
	$(TEST_ENV) $(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check wandistiller tests scripts
	$(VENV)/bin/ruff format --check wandistiller tests scripts

typecheck: setup      ## mypy on the package, with pyproject.toml's [tool.mypy] settings (CI runs it after lint)
	$(VENV)/bin/mypy

clean:                ## the environment and caches; never outputs/ or multirun/ (your runs)
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
