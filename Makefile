# ringmpi developer targets. Everything runs inside a virtual environment that
# `make venv` creates (or reuses) under .venv.
#   make install  ringmpi for users: runtime dependencies only (no pytest, ruff,
#                 shellcheck), a regular (not editable) install into $(VENV)
#   make venv     the development environment: editable, with the test tools
#   make test     lint + single-rank tests + multi-rank tests at P = 1, 2, 3
#   make test-p4  make test-p5  the multi-rank tests at P = 4 (all) and 5 (CI runs both)
#   make test-cuda  the CUDA compile checks for every GPU arch (make test: sm_90)
#   make run      sample data -> mpiexec -n 4 ringmpi run -> verify -> summary
#   make docs     the Sphinx pages of docs/ into $(DOCS_OUT) (warnings are errors)
#   make bench    CPU benchmark table (ringmpi bench)
#   make stress   faults, hostile input and soak checks (full version)
#   make test-site  the suites on a site-like stack (Debian Open MPI, older mpi4py/numpy/h5py)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without a system MPI the PyPI build of MPICH gives mpiexec; set
# EXTRAS=test (make venv) or INSTALL_EXTRAS= (make install) on a cluster to use the
# system MPI that mpi4py was built against (EXTRAS=test,docs keeps make docs).
EXTRAS ?= mpich,test,docs
INSTALL_EXTRAS ?= mpich
# the versions tested here (pip freeze, CPython 3.11); `make constraints` refreshes it
CONSTRAINTS ?= constraints.txt
NP ?= 4
MPIEXEC ?= $(VENV)/bin/mpiexec
# ranks of the multi-rank suites share two cores here: MPICH's waiting ranks sleep 1 us
# after 64 empty polls instead of spinning on the core a computing rank needs (25% less
# time at P = 3 on two cores; Open MPI ignores these)
MPI_TEST_ENV ?= MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=64
# one BLAS/OpenMP thread per rank: ranks share the cores
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
TEST_TIMEOUT ?= 1200
# P = 1 runs inside test-serial (--with-mpi: the multi-rank tests on a communicator of one);
# P = 4 is make test-p4, which CI runs after make test (2.5 minutes: make test stays
# under 15 minutes on two cores)
RANKS ?= 2 3
# built pages: inside the (private) virtual environment, not a shared /tmp
DOCS_OUT ?= $(VENV)/docs-html

.PHONY: venv install constraints lint docs test test-fast test-serial test-mpi test-cuda test-p4 test-p5 test-site test-cluster test-security run bench stress gpu-check clean

$(VENV)/.installed: setup.cfg pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	@# an editable install has no bytecode; where PYTHONDONTWRITEBYTECODE is set, every
	@# rank of every job would compile the sources again (measured ~0.15 s per process)
	$(PY) -m compileall -q ringmpi > /dev/null
	touch $@

venv: $(VENV)/.installed

# runtime only; the stamp of the development environment is dropped, so a later
# `make test` in the same $(VENV) installs the test tools again
install:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) "$(if $(INSTALL_EXTRAS),.[$(INSTALL_EXTRAS)],.)"
	rm -f $(VENV)/.installed

# pin what the development environment holds now (after a green `make test`)
constraints: $(VENV)/.installed
	pyv=$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	{ echo "# Versions ringmpi was tested with (pip freeze of make venv, CPython $$pyv,"; \
	  echo "# $$(uname -sm)). make venv and make install use them (pip -c); on another"; \
	  echo "# Python the markers leave the resolver free. Regenerate: make constraints"; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^#' \
	    | sed "s/\$$/; python_version == \"$$pyv\"/"; } > $(CONSTRAINTS).tmp
	mv $(CONSTRAINTS).tmp $(CONSTRAINTS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check ringmpi tests data jobs benchmarks
	$(VENV)/bin/ruff format --check ringmpi tests data jobs benchmarks
	$(VENV)/bin/shellcheck -x jobs/*.sh jobs/slurm.sbatch .ci/run tests/cluster/*.sh

# single-rank tests on every core (pytest-xdist; PYTEST_JOBS=0 runs them in this process),
# the multi-rank tests among them at P = 1 (each worker is an MPI singleton)
# (PYTEST_ARGS: more pytest arguments for every suite, e.g. --durations=20)
PYTEST_JOBS ?= auto
PYTEST_ARGS ?=
XDIST = $(if $(filter 0,$(PYTEST_JOBS)),,-n $(PYTEST_JOBS))
# NVRTC_ARCHS: the archs whose cubins the NVRTC checks build here (sm_90: H100/H200);
# make test-cuda builds every arch ringmpi.gpu.nvrtc.ARCHS lists (.ci/run runs it)
NVRTC_ARCHS ?= sm_90
test-serial: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_ARGS) --with-mpi \
	  --nvrtc-archs=$(NVRTC_ARCHS) tests

# the CUDA compile checks for every arch (sm_80 too: A100), no GPU needed; verdicts of
# make test's sm_90 builds are reused
test-cuda: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) --nvrtc-archs=all tests/gpu/test_nvrtc.py

# Each rank runs pytest under `python -m mpi4py`, so an exception on one rank
# aborts the whole job instead of leaving the others waiting; timeout bounds it.
# MPI_FILES: the test files that mark tests mpi (pytest.mark.mpi or pytestmark); every
# rank collects only those, not the whole tree (a third of the collection time)
MPI_FILES ?= $(shell grep -rlE 'mark\.mpi|pytestmark = .*mpi' --include='test_*.py' tests | sort)
test-mpi: $(VENV)/.installed
	for p in $(RANKS); do \
	  echo "=== multi-rank tests, P=$$p ==="; \
	  env $(MPI_TEST_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$p $(PY) -m mpi4py -m pytest -q -p no:cacheprovider \
	    $(PYTEST_ARGS) --with-mpi -m mpi $(MPI_FILES) || exit $$?; \
	done

# every multi-rank file at P = 4 (a power of two above the cores); CI runs it after make test
test-p4: $(VENV)/.installed
	$(MAKE) test-mpi RANKS=4

# P = 5 (odd, above the cores) for the files whose issues ask for P = 1..5: reproducible
# mode (forward, backward), masks of slices, the agreements; CI runs it after make test
P5_FILES ?= tests/test_reproducible_mpi.py tests/test_reproducible_backward_mpi.py \
	tests/test_slices_mpi.py tests/test_collective_mpi.py
test-p5: $(VENV)/.installed
	env $(MPI_TEST_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 5 $(PY) -m mpi4py -m pytest -q -p no:cacheprovider \
	  $(PYTEST_ARGS) --with-mpi -m mpi $(P5_FILES)

# docs/*.md (MyST) and the API reference from the numpydoc docstrings; a warning fails
docs: $(VENV)/.installed
	mkdir -p $(DOCS_OUT) && chmod 700 $(DOCS_OUT)
	$(VENV)/bin/sphinx-build -q -W --keep-going -b html docs $(DOCS_OUT)

test: lint docs test-serial test-mpi

# the inner loop (about a minute and a half here): lint, the tile/spec/mask unit tests and
# the conformance suite on every core, then the ring at P = 3 (odd, not a power of two,
# oversubscribed on 2 cores; make test runs P = 1, 2, 3, make test-p4 and test-p5 P = 4, 5)
FAST_TESTS ?= tests/test_backend_conformance.py tests/test_spec.py tests/test_spec_keywords.py \
	tests/test_mask.py tests/test_softmax.py tests/test_layout.py tests/test_package.py \
	tests/job/test_resources_batches.py tests/job/test_run_ring_sizes.py
FAST_MPI ?= tests/test_attention_mpi.py tests/test_mask_ring_mpi.py
FAST_RANKS ?= 3
test-fast: lint
	$(PY) -m pytest -q -p no:cacheprovider -x $(XDIST) $(FAST_TESTS)
	for p in $(FAST_RANKS); do \
	  env $(MPI_TEST_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$p $(PY) -m mpi4py -m pytest -q -p no:cacheprovider \
	    --with-mpi -m mpi $(FAST_MPI) || exit $$?; \
	done

# the suites on Debian's Open MPI + mpi4py 3.1 / numpy 1.24 / h5py-mpi 3.7 in .site-venv
# (apt-get installs what is missing); SITE_RANKS, SITE_STAGES: see the script
test-site:
	bash tests/cluster/site_stack.sh

run: $(VENV)/.installed
	$(PY) -m ringmpi make-data data/sample/sample.h5 --sequences 3
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py -m ringmpi run data/sample/sample.h5 -o data/sample/out.h5 --causal --verify --overwrite

bench: $(VENV)/.installed
	$(PY) -m ringmpi bench

# the batch job's throughput beside its kernel/I-O bounds and a torch loop (benchmarks/throughput.py;
# BENCH_JOB_ARGS, e.g. "--full --json throughput.json")
.PHONY: bench-job
BENCH_JOB_ARGS ?=
bench-job: $(VENV)/.installed
	$(PY) benchmarks/throughput.py $(BENCH_JOB_ARGS)

stress: $(VENV)/.installed
	$(PY) tests/stress.py

gpu-check:
	bash jobs/gpu_check.sh

# Real launchers (needs root; prints SKIP otherwise): a one-node Slurm running the shipped
# jobs/slurm.sbatch, then ranks on two hosts (network namespaces) over TCP.
test-cluster: $(VENV)/.installed
	PYTHON=$(abspath $(PY)) timeout 900 tests/cluster/slurm.sh
	PYTHON=$(abspath $(PY)) timeout 900 tests/cluster/two_hosts.sh

# Attacks by a second user (needs root; prints SKIP otherwise): two throwaway users, one
# plants kernels, cubins, symlinks and crafted inputs for the other's job, which must
# refuse each; then the hostile-input set (tests/security/hostile.py) as that user.
test-security: $(VENV)/.installed
	PYTHON=$(abspath $(PY)) timeout 1500 tests/security/run.sh

clean:
	rm -rf build dist *.egg-info data/sample .pytest_cache .ruff_cache
