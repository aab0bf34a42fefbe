#!/usr/bin/env bash
# GPU check for a bare single-GPU node without a package registry. Uses only what
# the image has (python3 with CuPy and mpi4py; pytest, pytest-mpi and torch if
# present) and this checkout through PYTHONPATH (nothing is installed).
#
# Stages, each with its own timeout, all within 8 minutes (a global deadline
# shortens the later ones):
#   environment   CuPy sees a GPU (else: a clear message and exit 2)
#   compile       every forward and backward kernel compiles on this device
#   tests P=1     tests/test_gpu.py: forward and backward tiles against the numpy
#                 tiles, every configuration that fits, rings on one process
#   ranks P=2     mpiexec -n 2 really gives COMM_WORLD size 2
#   tests P=2     the MPI tests of tests/test_gpu.py, staged ring (RINGMPI_CUDA_AWARE=0)
#   CUDA-aware    the same with CUDA-aware MPI (skipped if MPI does not report it)
#   benchmark     one table: TFLOP/s forward and backward beside torch SDPA
# Tests run under pytest when it imports, else under tests/gpu_runner.py.
# Prints one PASS/FAIL/SKIP line per stage; exits 1 if any stage failed.
#   usage: bash jobs/gpu_check.sh      (PYTHON=..., MPIEXEC=..., GPU_CHECK_BUDGET=seconds)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
# Open MPI refuses root and oversubscription unless told; MPICH ignores these
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# autotune choices of this run go to a private directory
RINGMPI_CACHE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
export RINGMPI_CACHE_DIR
trap 'rm -rf "$RINGMPI_CACHE_DIR"' EXIT

BUDGET=${GPU_CHECK_BUDGET:-470}
START=$SECONDS
summary=()
failed=0

# run_stage NAME LIMIT CMD...: run CMD under timeout min(LIMIT, time left), record the verdict
run_stage() {
    local name=$1 limit=$2 left rc t0
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    if ((left < 10)); then
        summary+=("FAIL  $name (no time left in the ${BUDGET}s budget)")
        failed=1
        return
    fi
    ((limit > left)) && limit=$left
    echo
    echo "=== $name (limit ${limit}s, $(date +%T)) ==="
    t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    if ((rc == 0)); then
        summary+=("PASS  $name ($((SECONDS - t0))s)")
    elif ((rc == 124 || rc == 137)); then
        summary+=("FAIL  $name (timed out after ${limit}s)")
        failed=1
    else
        summary+=("FAIL  $name (exit $rc, $((SECONDS - t0))s)")
        failed=1
    fi
}

skip_stage() {
    summary+=("SKIP  $1 ($2)")
    echo
    echo "=== $1: SKIPPED ($2) ==="
}

echo "=== environment ($(date +%T)) ==="
if ! "$PY" - <<'PYEOF'; then
import json
import sys

try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:
    print(f"gpu_check: no usable GPU: CuPy/CUDA unavailable ({type(exc).__name__}: {exc})")
    sys.exit(2)
if n < 1:
    print("gpu_check: no usable GPU: CuPy sees no CUDA device")
    sys.exit(2)
import ringmpi.gpu as g

print(json.dumps(g.info(), indent=1, default=str))
PYEOF
    echo "gpu_check: FAIL: no GPU/CuPy found (needs python3 with CuPy and a visible CUDA device)"
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true

# the tests: pytest when it imports, else the project's runner
if "$PY" -c "import pytest" 2>/dev/null; then
    tests=("$PY" -m pytest -q -p no:cacheprovider -rs)
    mpitests=(-m pytest -q -p no:cacheprovider -rs)
    if "$PY" -c "import pytest_mpi" 2>/dev/null; then
        mpitests+=(--with-mpi)
    fi
    echo "tests run under pytest"
else
    tests=("$PY" tests/gpu_runner.py --require-run)
    mpitests=(tests/gpu_runner.py --require-run)
    echo "pytest not found: tests run under tests/gpu_runner.py"
fi

run_stage "compile every kernel for this GPU (NVRTC, cached for the later stages)" 150 \
    "$PY" - <<'PYEOF'
import sys

import cupy

from ringmpi.gpu import backward, device, loader, tile

dev = device.current()
print(f"device {device.name(dev)}, sm_{device.check_arch(dev)}, "
      f"{device.smem_optin(dev)} B shared memory per block (opt-in)")
bad = 0
for files, names in ((tile.KERNEL_FILE, tile.kernel_names()),
                     (backward.KERNEL_FILES, backward.kernel_names())):
    try:
        res = loader.precompile(files, names, dev)
    except Exception as exc:  # no standalone libnvrtc: CuPy compiles each kernel instead
        print(f"precompile unavailable ({type(exc).__name__}: {exc}); loading through CuPy")
        res = {}
    for n in names:
        try:
            loader.get_function(files, n, names)
        except Exception as exc:
            bad += 1
            print(f"FAILED {n}: {res.get(n, '')} {type(exc).__name__}: {exc}")
    how = {}
    for n in names:
        key = loader.last_path.get(n, "?").split(":")[0]
        how[key] = how.get(key, 0) + 1
    print(f"{files}: {len(names)} kernels loaded ({how})")
    for n in names:
        if loader.last_path.get(n, "").startswith("cupy:"):
            print(f"  {n}: {loader.last_path[n]}")
            break
cupy.cuda.Device().synchronize()
sys.exit(1 if bad else 0)
PYEOF

run_stage "tests P=1 (forward, backward, every configuration, rings on one process)" 220 \
    "${tests[@]}" -m "not mpi" tests/test_gpu.py

MPIEXEC=${MPIEXEC:-$(command -v mpiexec || command -v mpirun || true)}
if [[ -z "$MPIEXEC" ]]; then
    skip_stage "ranks P=2" "no mpiexec on PATH"
    summary+=("FAIL  tests P=2 (no mpiexec: two-rank stages not run)")
    failed=1
else
    run_stage "ranks P=2: COMM_WORLD has size 2" 40 "$MPIEXEC" -n 2 "$PY" -c '
from mpi4py import MPI
size = MPI.COMM_WORLD.Get_size()
assert size == 2, f"mpiexec -n 2 gave COMM_WORLD size {size}: mpi4py and mpiexec do not match"
print(f"rank {MPI.COMM_WORLD.Get_rank()} of {size}: {MPI.Get_library_version().splitlines()[0]}")
'
    if [[ "${summary[-1]}" == PASS* ]]; then
        RINGMPI_CUDA_AWARE=0 run_stage "tests P=2, staged ring (RINGMPI_CUDA_AWARE=0)" 120 \
            "$MPIEXEC" -n 2 "$PY" -m mpi4py "${mpitests[@]}" -m mpi tests/test_gpu.py
        if "$PY" -c 'import sys; from ringmpi.gpu import cuda_aware; sys.exit(0 if cuda_aware() else 1)' 2>/dev/null; then
            RINGMPI_CUDA_AWARE=1 run_stage "tests P=2, CUDA-aware ring" 120 \
                "$MPIEXEC" -n 2 "$PY" -m mpi4py "${mpitests[@]}" -m mpi tests/test_gpu.py
        else
            skip_stage "tests P=2, CUDA-aware ring" "this MPI does not report CUDA support"
        fi
    else
        skip_stage "tests P=2" "mpiexec -n 2 did not give two ranks"
    fi
fi

run_stage "benchmark (forward and backward beside torch SDPA, every configuration)" 170 \
    "$PY" -m ringmpi.gpu.bench --configs --json gpu_bench.json

echo
echo "=== gpu_check summary ($((SECONDS - START))s) ==="
printf '%s\n' "${summary[@]}"
if ((failed)); then
    echo "gpu_check: FAILED"
    exit 1
fi
echo "gpu_check: PASS (every stage)"
