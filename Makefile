# Two commands for a new machine with only Python 3: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(CURDIR)/$(VENV)/bin
# mpicc and mpiexec of the mpich wheel live in the venv's bin.
export PATH := $(BIN):$(PATH)

.PHONY: demo test docs install install-mpi clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The demo needs the train extra only: flax, scikit-learn, matplotlib, tqdm and orbax on top of the core.
$(VENV)/.installed-train: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[train]'
	touch $@

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[train,test,docs]'
	touch $@

# mpi4jax builds from source against the mpich wheel. On machines with nvcc but no CUDA
# headers its build tries the CUDA bridge and fails; an empty CUDA_PATH builds the CPU bridge only.
$(VENV)/.installed-mpi: $(VENV)/.installed
	$(BIN)/python -m pip install -q mpich 'mpi4py>=4.0'
	mkdir -p $(VENV)/no-cuda
	CUDA_PATH=$(CURDIR)/$(VENV)/no-cuda MPI4JAX_BUILD_MPICC=$(BIN)/mpicc $(BIN)/python -m pip install -q 'mpi4jax>=0.9'
	touch $@

install: $(VENV)/.installed
install-mpi: $(VENV)/.installed-mpi

demo: $(VENV)/.installed-train
	$(BIN)/gossipjax train

# Lint and types first (seconds), then the tests on PYTEST_WORKERS processes (pytest-xdist): most of a JAX
# test is single-threaded compiling, so 2 workers keep 2 cores busy. A module's tests stay on one worker (its
# fixtures are built once), the longest modules first (conftest.py). The MPI launches come after, in one
# process: their ranks busy-wait for each other and need the cores to themselves. PYTEST_WORKERS=0 runs the
# first part in one process too.
PYTEST_WORKERS ?= 2
test: install-mpi
	$(BIN)/ruff check .
	$(BIN)/basedpyright --project pyproject.toml
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not mpi"
	$(BIN)/python -m pytest -q -m mpi tests

# The documentation site (docs/_build/html/index.html): every guide and notebook is executed,
# and a warning fails the build (tests/test_docs.py runs the same build).
docs: install
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) runs docs/_build docs/api
